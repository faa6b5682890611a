"""Backward formulas that scatter into their zeros in place on the device: one input-sized gradient, not two.

``gather``, ``index_select`` and advanced indexing take their gradient as zeros of the input's
shape with the output's gradient added in, in place on the device and out of place for fake
tensors (``areAnyTensorSubclassLike``). A CUDA estimate's step runs the device's branch
(:mod:`pytorch_mem_profiler.estimate.backward_formulas`); a CPU estimate keeps the fake branch,
which the CPU counter it is checked against takes too. The figures are counted from the shapes.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pytorch_mem_profiler import estimate_memory
from pytorch_mem_profiler.estimate.allocator import block_size
from pytorch_mem_profiler.estimate.backward_formulas import InPlaceFormulas

from .helpers import measured_peak

BATCH, WIDTH, PICKED = 512, 4096, 1024


class Picks(nn.Module):
    """A linear layer, then ``PICKED`` of its ``WIDTH`` columns picked by ``how``."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.linear, self.how = nn.Linear(256, WIDTH), how

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        idx = torch.arange(PICKED, device=x.device)
        if self.how == "gather":
            return torch.gather(y, 1, idx.expand(x.shape[0], -1)) * 2
        if self.how == "index_select":
            return y.index_select(1, idx) * 2
        return y[:, idx] * 2


def _backward_births(est, nbytes: int) -> list[str]:
    events = est.step_events
    return [events.sources[key] for i, (key, n) in enumerate(events.events) if n == nbytes and events.phase_at(i) == (1, "backward")]


@pytest.mark.parametrize("how", ["gather", "index_select", "index"])
def test_a_cuda_estimate_makes_one_input_sized_gradient_as_the_device_does(how):
    est = estimate_memory(lambda: Picks(how), torch.zeros(BATCH, 256), device="cuda", emulate=True, fit=False)
    picked_from = block_size(BATCH * WIDTH * 4)  # the gradient of the linear layer's output
    made = _backward_births(est, picked_from)
    assert len(made) == 1 and made[0].startswith("aten.new_zeros"), made


@pytest.mark.parametrize("how", ["gather", "index_select", "index"])
def test_a_cpu_estimate_keeps_the_out_of_place_branch_its_counter_takes(how):
    # the profiler's CPU counter is a dispatch mode: the formulas take their out-of-place branch under it
    est = estimate_memory(lambda: Picks(how), torch.zeros(BATCH, 256), device="cpu", fit=False)
    measured = measured_peak(lambda: Picks(how), lambda: torch.randn(BATCH, 256), torch.optim.Adam)
    assert est.peak == measured


def test_only_the_zeros_made_just_before_are_written_in_place():
    formulas = InPlaceFormulas()
    aten = torch.ops.aten
    zeros, other = torch.zeros(4, 3), torch.zeros(4, 3)
    index, grad = torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 3)
    formulas.made(aten.new_zeros.default, zeros, tick=5)
    with torch.no_grad():
        assert formulas.in_place(aten.scatter_add.default, (zeros, 0, index, grad), {}, tick=5) is aten.scatter_add_.default
        assert formulas.in_place(aten.scatter_add.default, (other, 0, index, grad), {}, tick=5) is aten.scatter_add.default
        assert formulas.in_place(aten.scatter_add.default, (zeros, 0, index, grad), {}, tick=6) is aten.scatter_add.default
        # index_backward accumulates; an index_put that does not is not a formula's
        assert formulas.in_place(aten.index_put.default, (zeros, [index], grad, True), {}, tick=5) is aten.index_put_.default
        assert formulas.in_place(aten.index_put.default, (zeros, [index], grad), {}, tick=5) is aten.index_put.default
    # a backward that builds a graph (create_graph=True) keeps the formula's own branch
    assert formulas.in_place(aten.scatter_add.default, (zeros, 0, index, grad), {}, tick=5) is aten.scatter_add.default
