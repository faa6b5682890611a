"""The core profiler on a CUDA GPU, against the caching allocator's own figures."""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn

from pytorch_mem_profiler import MemoryProfiler

from .helpers import BackwardScratch
from .test_neumf import check_neumf_report

pytestmark = pytest.mark.cuda

DEV = torch.device("cuda", 0)


class Block(nn.Module):
    """Activations much larger than weights, and a known transient in backward."""

    def __init__(self, width: int = 1024) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = nn.Linear(width, 4 * width)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(4 * width, width)
        self.norm = nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = BackwardScratch.apply(self.act(self.fc1(x)))
        return self.norm(x + self.fc2(h))


def _independent_step(model: nn.Module, x: torch.Tensor) -> tuple[int, int]:
    """Feature maps and intermediate gradients measured by hand with torch.cuda calls."""
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    out = model(x)
    feature_maps = torch.cuda.memory_allocated() - start
    loss = out.float().pow(2).mean()
    grads_before = sum(p.grad.nbytes for p in model.parameters() if p.grad is not None)
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    loss.backward()
    peak = torch.cuda.max_memory_allocated()
    created = sum(p.grad.nbytes for p in model.parameters() if p.grad is not None) - grads_before
    del out, loss
    return feature_maps, peak - before - created


def _profiled_step(profiler: MemoryProfiler, model: nn.Module, x: torch.Tensor):
    out = model(x)
    out.float().pow(2).mean().backward()
    del out
    return profiler.record_stats()


def test_feature_maps_and_intermediate_gradients_match_an_independent_measurement():
    model = Block().to(DEV)
    x = torch.randn(64, 256, 1024, device=DEV)
    _independent_step(model, x)  # warm-up: cuBLAS workspaces, allocator pools
    model.zero_grad(set_to_none=True)
    fmaps, inter = _independent_step(model, x)
    model.zero_grad(set_to_none=True)
    assert inter > BackwardScratch.SCRATCH_ELEMS * 4

    with MemoryProfiler(model, 1, stream=io.StringIO(), strict=True, by_layer=True) as profiler:
        record = _profiled_step(profiler, model, x)
    assert record.feature_maps == pytest.approx(fmaps, rel=0.05)
    # Intermediate gradients (per-layer mode) are the activation gradients at backward's peak.
    # The bracket measured above (backward's peak - allocated when it starts - every weight
    # gradient it made) is a lower bound of them: backward frees saved activations before its
    # peak, and some weight gradients are made after it. (On the CPU, where the counter sees
    # every storage, tests/test_peak_breakdown.py checks the exact figure.)
    assert record.intermediate_gradients >= inter
    if record.peak_phase == "backward":
        assert record.peak_breakdown["activation_gradients"] == record.intermediate_gradients
    assert sum(record.peak_breakdown.values()) == record.iteration_peak_allocated
    assert record.weights == sum(p.numel() * p.element_size() for p in model.parameters())
    assert record.gradients == record.weights


def test_cached_figures_equal_the_allocator():
    model = Block(512).to(DEV)
    opt = torch.optim.Adam(model.parameters())
    x = torch.randn(32, 128, 512, device=DEV)
    with MemoryProfiler(model, 1, stream=io.StringIO(), strict=True) as profiler:
        for _ in range(3):
            out = model(x)
            out.pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            del out
            record = profiler.record_stats()
            # The caching allocator only grows without empty_cache(): its peak is its size.
            assert record.current_cached == torch.cuda.memory_reserved(DEV)
            assert record.peak_cached == torch.cuda.memory_reserved(DEV)
            assert record.allocated == torch.cuda.memory_allocated(DEV)
        held = torch.cuda.memory_reserved(DEV)
        torch.cuda.empty_cache()
        record = profiler.record_stats()
        assert record.current_cached == torch.cuda.memory_reserved(DEV) < held
        assert record.peak_cached == held  # the peak since the profiler started stays


def test_iteration_peak_equals_max_memory_allocated_of_the_same_iteration():
    model = Block(512).to(DEV)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(32, 128, 512, device=DEV)

    def step():
        out = model(x)
        out.pow(2).mean().backward()
        opt.step()
        opt.zero_grad()

    for _ in range(2):
        step()  # warm-up: momentum buffers exist, workspaces allocated
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    step()
    expected = torch.cuda.max_memory_allocated()
    with MemoryProfiler(model, 1, stream=io.StringIO(), strict=True) as profiler:
        profiler.record_stats()  # start the iteration here
        step()
        record = profiler.record_stats()
    assert record.iteration_peak_allocated == expected
    assert record.peak_phase == "backward"


def test_neumf_report_on_gpu():
    check_neumf_report(DEV, batch=65_536)


def test_both_ways_of_reading_the_allocator_agree():
    """The nested-stats binding and the public torch.cuda functions give the same numbers."""
    from pytorch_mem_profiler.measure.devices import CudaCounter

    keep = torch.empty(3_000_000, device=DEV)
    fast, public = CudaCounter(DEV), CudaCounter(DEV)
    public._nested = None  # what a torch without torch._C._cuda_memoryStats would use
    public._reset = None
    a, b = fast.read(), public.read()
    assert a.allocated == b.allocated == torch.cuda.memory_allocated(DEV)
    assert a.reserved == b.reserved == torch.cuda.memory_reserved(DEV)
    public.mark()
    del keep
    assert public.read().peak_allocated == torch.cuda.max_memory_allocated(DEV)


def test_a_lone_counters_mark_reads_then_starts_a_new_interval():
    """CudaCounter.mark's short path (the device's only counter): the reading is the allocator's
    own, taken before the reset; with a second counter the peaks are folded as before."""
    import gc

    from pytorch_mem_profiler.measure.devices import CudaCounter

    gc.collect()
    counter = CudaCounter(DEV)
    counter.mark()
    base = torch.cuda.memory_allocated(DEV)
    big = torch.empty(4_000_000, device=DEV)
    del big
    expected_peak = torch.cuda.max_memory_allocated(DEV)
    reading = counter.mark()
    assert reading.allocated == torch.cuda.memory_allocated(DEV) == base
    assert reading.peak_allocated == expected_peak >= base + 16_000_000
    assert reading.reserved == torch.cuda.memory_reserved(DEV)
    assert torch.cuda.max_memory_allocated(DEV) == base  # a new interval
    other = CudaCounter(DEV)
    big = torch.empty(2_000_000, device=DEV)
    del big
    assert counter.mark().peak_allocated >= base + 8_000_000
    assert other.read().peak_allocated >= base + 8_000_000  # folded into the other counter
    other.stop()
    counter.stop()
