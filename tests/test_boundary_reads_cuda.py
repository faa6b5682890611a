"""On a CUDA GPU: a reported per-layer iteration reads the allocator at every boundary and resets its
peaks only where the phase changes and at ``record_stats()``; the figures are those of a run whose
every boundary resets them (what the profiler did before), byte for byte."""

from __future__ import annotations

import dataclasses
import gc
import io

import pytest
import torch
from torch import nn

import pytorch_mem_profiler.measure.meter as meter_module
from pytorch_mem_profiler import MemoryProfiler
from pytorch_mem_profiler.measure.devices import CudaCounter

pytestmark = pytest.mark.cuda

DEV = torch.device("cuda", 0)

#: The figures that come from the allocated bytes (the cache's, the driver's and the times differ
#: between two runs of one process: the first run warms the cache the second finds)
ALLOCATED_FIGURES = (
    "allocated",
    "iteration_peak_allocated",
    "peak_phase",
    "phases",
    "feature_maps",
    "intermediate_gradients",
    "gradients",
    "optimizer_state",
    "peak_location",
    "layers",
    "peak_breakdown",
    "peak_layers",
    "peak_transient",
    "peak_transient_in",
    "peak_other_before",
    "peak_step_temporaries",
)


class Counting(CudaCounter):
    """The CUDA counter, counting its calls into the allocator: reads and peak resets."""

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self.reads = self.resets = 0
        nested, reset = self._nested, self._reset
        assert nested is not None and reset is not None

        def read(index):
            self.reads += 1
            return nested(index)

        def reset_peaks(index):
            self.resets += 1
            return reset(index)

        self._nested, self._reset = read, reset_peaks


class ResetEverywhere(Counting):
    def read(self):
        return self.mark()


def _mlp() -> tuple[nn.Module, torch.optim.Optimizer, torch.Tensor]:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(4):
        layers += [nn.Linear(512, 512), nn.ReLU()]
    model = nn.Sequential(*layers).to(DEV)
    return model, torch.optim.Adam(model.parameters(), lr=1e-3), torch.randn(256, 512, device=DEV)


def _run(counter_type: type, iterations: int = 4):
    model, opt, x = _mlp()

    def step():
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(2):
        step()  # warm-up: cuBLAS workspaces, optimizer state
    gc.collect()
    torch.cuda.synchronize()
    made: list[Counting] = []
    real = meter_module.make_counter
    meter_module.make_counter = lambda device: made.append(counter_type(device)) or made[-1]
    figures, calls = [], []
    try:
        with MemoryProfiler(model, 1, by_layer=True, stream=io.StringIO(), strict=True, overhead=None) as profiler:
            counter = made[0]
            profiler.record_stats()  # the iterations start here
            for _ in range(iterations):
                before = (counter.reads, counter.resets)
                step()
                record = profiler.record_stats()
                figures.append({name: getattr(record, name) for name in ALLOCATED_FIGURES})
                calls.append((counter.reads - before[0], counter.resets - before[1]))
    finally:
        meter_module.make_counter = real
    del model, opt, x
    gc.collect()
    return figures, calls


def test_boundaries_within_a_phase_give_the_figures_of_a_reset_at_each():
    figures, calls = _run(Counting)
    before, before_calls = _run(ResetEverywhere)
    assert figures == before
    last = figures[-1]
    assert last["layers"] is not None and last["peak_breakdown"] is not None
    assert sum(last["peak_breakdown"].values()) == last["iteration_peak_allocated"]
    for (reads, resets), (reads_before, resets_before) in zip(calls[1:], before_calls[1:]):
        # forward start and end, backward start and end, the step's start and end, record_stats()
        assert resets == 7
        assert reads == reads_before == resets_before > 7  # and one where backward reaches each module


def test_a_running_peak_read_without_a_reset_is_the_allocators():
    """``CudaCounter.read`` gives the peak since the last ``mark`` and leaves it running."""
    gc.collect()
    counter = CudaCounter(DEV)
    counter.mark()
    base = torch.cuda.memory_allocated(DEV)
    big = torch.empty(4_000_000, device=DEV)
    del big
    first = counter.read()
    assert first.allocated == base and first.peak_allocated == torch.cuda.max_memory_allocated(DEV) >= base + 16_000_000
    small = torch.empty(1_000_000, device=DEV)
    del small
    second = counter.read()
    assert second.peak_allocated == first.peak_allocated  # still the interval's, not reset
    assert counter.mark().peak_allocated == first.peak_allocated
    assert torch.cuda.max_memory_allocated(DEV) == base  # the mark started a new interval
    counter.stop()
