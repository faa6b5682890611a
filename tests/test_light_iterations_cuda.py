"""Non-reported iterations on a CUDA GPU: one allocator read and one peak reset, figures the allocator's own."""

from __future__ import annotations

import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pytorch_mem_profiler import MemoryProfiler

pytestmark = pytest.mark.cuda

DEV = torch.device("cuda", 0)


def _setup():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 256)).to(DEV)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = torch.randn(64, 256, device=DEV), torch.randn(64, 256, device=DEV)

    def step() -> None:
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return model, step


def test_a_non_reported_iteration_reads_the_allocator_once_and_resets_its_peak_once(monkeypatch):
    calls = {"stats": 0, "reset": 0}
    stats, reset = torch._C._cuda_memoryStats, torch._C._cuda_resetPeakMemoryStats

    def counted_stats(index):
        calls["stats"] += 1
        return stats(index)

    def counted_reset(index):
        calls["reset"] += 1
        return reset(index)

    monkeypatch.setattr(torch._C, "_cuda_memoryStats", counted_stats)
    monkeypatch.setattr(torch._C, "_cuda_resetPeakMemoryStats", counted_reset)
    model, step = _setup()
    seen = []
    with MemoryProfiler(model, 5, stream=io.StringIO(), strict=True) as profiler:
        for _ in range(10):
            before = dict(calls)
            step()
            record = profiler.record_stats()
            seen.append((record.reported, calls["stats"] - before["stats"], calls["reset"] - before["reset"]))
    for reported, reads, resets in seen:
        if reported:
            assert reads >= 7 and resets >= 7
        else:
            assert (reads, resets) == (1, 1)


def test_a_non_reported_record_holds_the_allocators_figures():
    model, step = _setup()
    with MemoryProfiler(model, 1000, stream=io.StringIO(), strict=True) as profiler:
        for _ in range(3):
            step()
            profiler.record_stats()  # resets the allocator's peak: the next step's peak is its own
        step()
        torch.cuda.synchronize()
        peak, allocated = torch.cuda.max_memory_allocated(DEV), torch.cuda.memory_allocated(DEV)
        reserved = torch.cuda.memory_reserved(DEV)
        record = profiler.record_stats()
    assert not record.reported
    assert record.iteration_peak_allocated == peak
    assert record.allocated == allocated and record.current_cached == reserved
    # The hooks were off (nothing watched the step): its counts are unknown, not 0.
    assert (record.forward_passes, record.backward_passes, record.optimizer_steps) == (None, None, None)
    assert len(profiler.records) == 0 and record.gradients is None and record.feature_maps is None and dict(record.phases) == {}
