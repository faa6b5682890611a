"""A forward that replaces a buffer (a positional table cast to autocast's dtype at its first call,
``self.pe = self.pe.to(x.dtype)``) frees the old one with the profiler on as without it, and the
estimate counts the step so: the peak breakdown keeps the buffers' counted storages, not the
buffers, and the estimate their bytes."""

from __future__ import annotations

import functools
import gc
import io
import weakref

import pytest
import torch
from torch import nn

from pytorch_mem_profiler import MemoryProfiler, estimate_memory

from .helpers import measured_peak


class CastsItsTable(nn.Module):
    """Keeps a positional table as a buffer (or a plain attribute) and casts it at its first call
    to the dtype its input reaches it in, as Wav2Vec2-Conformer's relative positions do."""

    def __init__(self, registered: bool = True, positions: int = 999, width: int = 64) -> None:
        super().__init__()
        self.proj = nn.Linear(width, width)
        table = torch.randn(1, positions, width)
        if registered:
            self.register_buffer("table", table, persistent=False)
        else:
            self.table = table

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        if self.table.dtype != h.dtype:
            self.table = self.table.to(dtype=h.dtype)
        return h + self.table[:, : x.shape[1]]


def _first_step_frees_the_old_table(profiler_kwargs: dict | None, device: str = "cpu") -> bool:
    model = CastsItsTable().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    old = weakref.ref(model.table)
    profiler = None
    if profiler_kwargs is not None:
        profiler = MemoryProfiler(model, print_period=1, stream=io.StringIO(), optimizer=optimizer, **profiler_kwargs)
    try:
        with torch.autocast(device, dtype=torch.bfloat16):
            out = model(torch.randn(2, 10, 64, device=device))
        gc.collect()
        freed_in_forward = old() is None
        out.float().sum().backward()
        optimizer.step()
        if profiler is not None:
            profiler.record_stats()
    finally:
        if profiler is not None:
            profiler.close()
    return freed_in_forward


@pytest.mark.parametrize("profiler_kwargs", [None, {}, {"by_layer": True}, {"overhead": None}], ids=["off", "default", "by_layer", "no_budget"])
def test_a_replaced_buffer_is_freed_with_the_profiler_as_without_it(profiler_kwargs):
    assert _first_step_frees_the_old_table(profiler_kwargs)


@pytest.mark.parametrize("registered", [True, False], ids=["buffer", "attribute"])
@pytest.mark.parametrize("autocast", [None, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("by_function", [True, False], ids=["function", "built"])
def test_the_estimate_of_a_step_that_replaces_its_table_equals_the_measured_peak(registered, autocast, by_function):
    """Both steps: the first casts the table (the old one freed), the second finds it cast. Handed
    over built, a table kept as a plain attribute stays a tensor of its own device (estimated
    before as a raw refusal of ``aten.set_``)."""
    build = functools.partial(CastsItsTable, registered)
    sgd = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)
    measured = measured_peak(build, lambda: torch.randn(2, 100, 64), sgd, autocast=autocast)
    model = build if by_function else build()
    estimate = estimate_memory(model, lambda b: torch.randn(b, 100, 64), optimizer=sgd, autocast=autocast, batch_size=2, device="cpu", fit=False)
    assert estimate.peak == measured
