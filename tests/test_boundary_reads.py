"""A reported iteration reads the counters at every boundary, and resets the peaks only where the
phase changes and where the iteration ends.

Within a phase (where per-layer mode splits forward and backward at its modules' boundaries) the
running peak since the phase began serves every figure: an interval whose running peak passes the
one read before it reached exactly that value, and one whose does not can set no maximum. So a run
whose every boundary resets (what the profiler did before) and one that resets at phase changes
only give the same records, byte for byte, with the same reads and fewer resets: on CUDA each read
and each reset is a call into the allocator.

The counters here are the exact CPU counter's figures; :class:`Delegate` hides that it is one, so
the peak breakdown CUDA uses (read at boundaries) runs, as it does on a GPU.
"""

from __future__ import annotations

import dataclasses
import io

import pytest
import torch
from torch import nn

import pytorch_mem_profiler.measure.meter as meter_module
from pytorch_mem_profiler import MemoryProfiler
from pytorch_mem_profiler.measure.devices import CpuCounter, MemoryCounter
from pytorch_mem_profiler.measure.peak_breakdown import BoundaryPeakBreakdown

from .helpers import needs_saved_tensor_watch


class Delegate(MemoryCounter):
    """The exact CPU counter's figures through the generic counter (reads and resets counted)."""

    shares_peaks = False

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self.inner = CpuCounter(device)
        self.reads = self.resets = 0

    def start(self) -> None:
        self.inner.start()

    def stop(self) -> None:
        super().stop()
        self.inner.stop()

    def adopt(self, tensors) -> None:
        self.inner.adopt(tensors)

    def _read_device(self):
        self.reads += 1
        return self.inner._read_device()

    def reset_peak(self) -> None:
        self.resets += 1
        self.inner.reset_peak()


class ResetEverywhere(Delegate):
    """Every boundary resets the peaks, those within a phase too."""

    def read(self):
        return self.mark()


class CpuResetEverywhere(CpuCounter):
    """The CPU counter itself (the CPU's exact breakdown runs), every boundary resetting the peaks."""

    def read(self):
        return self.mark()


class Spike(nn.Module):
    """A large temporary inside forward: the iteration peaks in forward, in this module."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.repeat(1, 128).view(x.shape[0], 128, -1).mean(1)


def _model(peak: str) -> tuple[nn.Module, torch.optim.Optimizer, tuple[int, int]]:
    torch.manual_seed(0)
    if peak == "forward":
        model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Sequential(nn.Linear(16, 16), Spike()), nn.Linear(16, 4))
        return model, torch.optim.SGD(model.parameters(), lr=0.01), (32, 16)
    if peak == "backward":
        model = nn.Sequential(nn.Linear(8, 256), nn.Tanh(), nn.Linear(256, 256), nn.Sigmoid(), nn.Linear(256, 2))
        return model, torch.optim.SGD(model.parameters(), lr=0.01), (64, 8)
    layers: list[nn.Module] = []
    for _ in range(4):
        layers += [nn.Linear(16, 16), nn.ReLU()]
    model = nn.Sequential(*layers)
    return model, torch.optim.Adam(model.parameters(), lr=1e-3), (4, 16)  # peaks in the step


def _run(counter_type: type, peak: str, by_layer: bool, iterations: int = 5, accumulate: int = 1):
    """Records of a run (times left out) and the reads and resets of each iteration."""
    model, opt, shape = _model(peak)
    made: list = []
    real = meter_module.make_counter
    meter_module.make_counter = lambda device: made.append(counter_type(device)) or made[-1]
    records, calls = [], []
    try:
        with MemoryProfiler(model, 1, stream=io.StringIO(), by_layer=by_layer, strict=True, overhead=None) as profiler:
            counter = made[0]
            for i in range(iterations):
                before = (getattr(counter, "reads", 0), getattr(counter, "resets", 0))
                torch.manual_seed(i)
                x = torch.randn(*shape)
                for _ in range(accumulate):
                    model(x).pow(2).mean().backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                record = profiler.record_stats()
                records.append(dataclasses.replace(record, iteration_time_s=None))
                calls.append((getattr(counter, "reads", 0) - before[0], getattr(counter, "resets", 0) - before[1]))
            if counter_type is not CpuCounter and issubclass(counter_type, Delegate):
                assert isinstance(profiler._meter._peak, BoundaryPeakBreakdown)
    finally:
        meter_module.make_counter = real
    return records, calls


@needs_saved_tensor_watch
@pytest.mark.parametrize("accumulate", [1, 2], ids=["one pass", "two passes"])
@pytest.mark.parametrize("peak", ["forward", "backward", "optimizer"])
@pytest.mark.parametrize("by_layer", [True, False], ids=["by_layer", "phases"])
def test_boundaries_within_a_phase_give_the_same_figures_without_a_reset(by_layer, peak, accumulate):
    records, calls = _run(Delegate, peak, by_layer, accumulate=accumulate)
    before, before_calls = _run(ResetEverywhere, peak, by_layer, accumulate=accumulate)
    assert records == before
    if accumulate == 1:  # (a second pass moves the step's peak into backward: gradients accumulate)
        assert records[-1].peak_phase == peak
    if by_layer:
        assert records[-1].peak_breakdown is not None and records[-1].layers is not None
        if records[-1].peak_phase != "optimizer":  # the step has no modules
            assert records[-1].peak_location is not None
            assert records[-1].peak_transient_in not in (None, "forward", "backward")  # a module
    # one reset where each phase begins or ends, one at record_stats(); every boundary read
    phases = 1 + accumulate * 4 + 2  # start, then each pass's forward start and end, backward start and end, the step's two
    for (reads, resets), (reads_before, resets_before) in zip(calls, before_calls):
        assert reads == reads_before and resets_before == reads_before
        assert resets == phases
        if by_layer:
            assert reads > resets  # the module boundaries: read, not reset
        else:
            assert reads == resets


@pytest.mark.parametrize("by_layer", [True, False], ids=["by_layer", "phases"])
def test_the_cpu_counters_figures_do_not_move_either(by_layer):
    """The CPU's exact breakdown and its intervals, read without a reset within a phase."""
    records, _ = _run(CpuCounter, "forward", by_layer)
    before, _ = _run(CpuResetEverywhere, "forward", by_layer)
    assert records == before
    assert records[-1].peak_phase == "forward"
