"""A branch backward never reaches is freed with the profiler on, as without it.

Autograd hands a pack hook an operator's saved *output* with its ``grad_fn`` (the node saving it);
a pack hook that keeps it as it is makes node and tensor hold each other through C++, where no
garbage collection sees them. Backward frees what it runs through; a branch it never reaches (a
pooler's output the loss does not use, a metric computed with gradients on) then stays alive for
good, one copy per iteration. The truth here: the tensors with an autograd node still alive after
the iterations (none, without the profiler), the CPU allocator's own events (``torch.profiler``'s
``profile_memory``, no dispatch mode), and the estimate against the profiler to the byte.
"""

from __future__ import annotations

import gc
import io

import pytest
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

from pytorch_mem_profiler import MemoryProfiler, estimate_memory
from pytorch_mem_profiler.measure.saved_tensors import can_chain

from .helpers import measured_peak


class WithUnusedHead(nn.Module):
    """An encoder whose output feeds the loss, and a pooler (first position, linear, tanh: tanh saves
    its output) whose output the loss never uses, as transformers' models with a pooling layer."""

    def __init__(self, dim: int = 64) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(dim, dim), nn.GELU(), nn.LayerNorm(dim))
        self.pooler = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.encoder(x)
        pooled = torch.tanh(self.pooler(hidden[:, 0]))  # computed, never used by the loss
        del pooled
        return self.head(hidden)


def _graph_tensors() -> int:
    gc.collect()
    return sum(1 for obj in gc.get_objects() if type(obj) is torch.Tensor and obj.grad_fn is not None)


def _step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    model(x).sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


@pytest.mark.parametrize("settings", [{}, {"overhead": None}, {"by_layer": True, "overhead": None}])
def test_nothing_of_an_unreached_branch_outlives_its_iteration(settings):
    before = _graph_tensors()
    torch.manual_seed(0)
    model, x = WithUnusedHead(), torch.randn(4, 16, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with MemoryProfiler(model, print_period=1, stream=io.StringIO(), strict=True, optimizer=opt, **settings) as profiler:
        allocated = []
        for _ in range(4):
            _step(model, opt, x)
            record = profiler.record_stats()
            allocated.append(record.allocated)
        details = {record.detail}
    assert _graph_tensors() == before
    assert len(set(allocated[1:])) == 1, allocated  # nothing grows from one iteration to the next
    if settings:
        assert details != {"light"}  # the watched levels ran (where the leak was)


def _net_bytes(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> int:
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        _step(model, opt, x)
    return sum(e.nbytes() for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")


def test_the_allocator_keeps_nothing_more_per_iteration_with_the_profiler_watching():
    torch.manual_seed(0)
    model, x = WithUnusedHead(), torch.randn(4, 16, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _step(model, opt, x)
    unwatched = _net_bytes(model, opt, x)
    with MemoryProfiler(model, print_period=1, stream=io.StringIO(), strict=True, optimizer=opt, overhead=None):
        _step(model, opt, x)
        watched = _net_bytes(model, opt, x)
    assert unwatched == 0
    assert watched == unwatched


@pytest.mark.skipif(not can_chain(), reason="torch < 2.8 pushes no saved-tensor hooks of the profiler's")
def test_a_saved_output_is_kept_without_its_node_and_still_checked():
    """The alias kept shares the storage and the version counter: modifying the output in place
    after it was saved still fails backward, as without the profiler."""
    model = nn.Linear(8, 8)
    with MemoryProfiler(model, print_period=1, stream=io.StringIO(), strict=True, overhead=None) as profiler:
        for _ in range(2):
            y = torch.tanh(model(torch.randn(2, 8)))
            y.sum().backward()
            profiler.record_stats()
        y = torch.tanh(model(torch.randn(2, 8)))
        y.add_(1.0)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            y.sum().backward()


def test_the_estimate_frees_the_branch_too():
    """The estimate's own pack hook keeps no node either: it equals the profiler's peak."""
    make = lambda: torch.randn(4, 16, 64)  # noqa: E731
    est = estimate_memory(WithUnusedHead(), make(), device="cpu", optimizer=torch.optim.AdamW, fit=False)
    assert est.peak_allocated == measured_peak(WithUnusedHead, make, torch.optim.AdamW)
