"""The device layer: the CPU storage counter is exact; counters share peaks correctly."""

from __future__ import annotations

import gc

import pytest
import torch

from pytorch_mem_profiler.measure.devices import (
    CpuCounter,
    MemoryCounter,
    Reading,
    make_counter,
    resolve_device,
)

from .helpers import nbytes


def test_cpu_counter_counts_new_storages_exactly(counter):
    before = counter.read().allocated
    a = torch.empty(1000, dtype=torch.float32)
    b = torch.empty(300, dtype=torch.float16)
    assert counter.read().allocated - before == nbytes(a) + nbytes(b) == 4000 + 600


def test_cpu_counter_ignores_views_and_frees_dead_storages(counter):
    before = counter.read().allocated
    a = torch.empty(64, 64)
    view, transposed = a[:10], a.t()
    assert counter.read().allocated - before == nbytes(a)
    del a, view, transposed
    gc.collect()
    assert counter.read().allocated == before


def test_cpu_counter_peak_and_mark(counter):
    base = counter.mark().allocated
    big = torch.empty(10_000)
    del big
    gc.collect()
    reading = counter.mark()
    assert reading.allocated == base
    assert reading.peak_allocated == base + 40_000
    # a new interval starts at the current level
    assert counter.read().peak_allocated == base


def test_cpu_counter_adopts_preexisting_tensors():
    old = torch.empty(250)
    c = CpuCounter()
    c.start()
    try:
        assert c.read().allocated == 0
        c.adopt([old, old, old[5:]])
        assert c.read().allocated == nbytes(old)
    finally:
        c.stop()


def test_cpu_counter_stop_removes_its_mode():
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    c = CpuCounter()
    c.start()
    c.stop()
    assert _get_current_dispatch_mode() is None
    before = c.read().allocated
    _ = torch.empty(100)
    assert c.read().allocated == before


class _FakeSharedCounter(MemoryCounter):
    """A device whose peak statistics are global, like CUDA's, driven by hand."""

    device_state = {"allocated": 0, "peak": 0}

    def _read_device(self) -> Reading:
        s = self.device_state
        return Reading(s["allocated"], s["peak"], s["allocated"], s["peak"])

    def reset_peak(self) -> None:
        self.device_state["peak"] = self.device_state["allocated"]


def _set(allocated: int) -> None:
    s = _FakeSharedCounter.device_state
    s["allocated"] = allocated
    s["peak"] = max(s["peak"], allocated)


def test_counters_of_one_device_keep_their_peaks_across_each_others_resets():
    device = torch.device("meta")  # any device no real counter uses
    outer = _FakeSharedCounter(device)
    _set(100)
    outer.mark()
    _set(900)  # the outer interval's peak
    _set(200)
    inner = _FakeSharedCounter(device)
    inner.mark()  # resets the device's peak: outer must not lose 900
    _set(400)
    _set(300)
    assert inner.mark().peak_allocated == 400
    assert outer.mark().peak_allocated == 900


def test_make_counter_rejects_missing_devices():
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            make_counter(torch.device("cuda"))
    assert isinstance(make_counter(torch.device("cpu")), CpuCounter)


def test_resolve_device():
    model = torch.nn.Linear(2, 2)
    assert resolve_device(model) == torch.device("cpu")
    assert resolve_device(torch.nn.ReLU()) == torch.device("cpu")
    assert resolve_device(model, "cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="device="):
        resolve_device(model, "not-a-device")
