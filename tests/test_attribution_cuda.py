"""Per-layer attribution, iteration peak and memory outside PyTorch on a CUDA GPU."""

from __future__ import annotations

import gc
import io

import pytest
import torch
from torch import nn

from pytorch_mem_profiler import MemoryProfiler

pytestmark = pytest.mark.cuda

DEV = torch.device("cuda", 0)


def small_transformer() -> nn.Module:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(d_model=256, nhead=8, dim_feedforward=1024, batch_first=True)
    return nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False).to(DEV)


def small_cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1),
        nn.BatchNorm2d(32),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1),
        nn.BatchNorm2d(64),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(64, 10),
    ).to(DEV)


CASES = {
    "transformer": (small_transformer, lambda: torch.randn(16, 128, 256, device=DEV)),
    "cnn": (small_cnn, lambda: torch.randn(32, 3, 64, 64, device=DEV)),
}


def saved_storages_by_hand(model: nn.Module, x: torch.Tensor) -> tuple[int, int, int]:
    """Bytes of the distinct storages autograd saves in one forward (parameters, buffers
    and the input left out), the bytes of the output, and the forward's allocator delta:
    an independent count."""
    skip = {p.untyped_storage().data_ptr() for p in model.parameters()}
    skip |= {b.untyped_storage().data_ptr() for b in model.buffers()}
    skip.add(x.untyped_storage().data_ptr())
    seen: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if t.device.type == "cuda" and ptr not in skip:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    gc.collect()
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated(DEV)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(x)
    delta = torch.cuda.memory_allocated(DEV) - start
    total, out_bytes = sum(seen.values()), out.untyped_storage().nbytes()
    out.float().mean().backward()
    model.zero_grad(set_to_none=True)
    del out
    # Leave nothing for Python's cycle collector to free during the next forward:
    # that would lower the next forward's allocator delta.
    gc.collect()
    torch.cuda.synchronize()
    return total, out_bytes, delta


@pytest.mark.parametrize("case", list(CASES))
def test_per_layer_bytes_sum_to_the_saved_storages(case):
    make_model, make_input = CASES[case]
    model, x = make_model(), make_input()
    # warm-up: cuBLAS workspaces and cuDNN plans are allocated by the first forward only
    saved_storages_by_hand(model, x)
    torch.manual_seed(1)
    saved, out_bytes, delta = saved_storages_by_hand(model, x)
    torch.manual_seed(1)  # same dropout masks' sizes either way; same seed for good measure
    with MemoryProfiler(model, 1, by_layer=True, stream=io.StringIO(), strict=True) as profiler:
        out = model(x)
        out.float().mean().backward()
        del out
        record = profiler.record_stats()
    layers = record.layers
    assert layers is not None
    assert layers.total == saved
    # the allocator's view: what forward left allocated is what modules saved plus the output
    assert record.feature_maps == pytest.approx(layers.total + out_bytes, rel=0.05)
    assert record.feature_maps == pytest.approx(delta, rel=0.05)
    assert record.peak_location is not None


@pytest.mark.parametrize("case", list(CASES))
def test_iteration_peak_equals_max_memory_allocated_with_per_layer_marks(case):
    make_model, make_input = CASES[case]
    model, x = make_model(), make_input()
    opt = torch.optim.Adam(model.parameters())

    def step():
        out = model(x)
        out.float().mean().backward()
        opt.step()
        opt.zero_grad()

    for _ in range(2):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    step()
    expected = torch.cuda.max_memory_allocated()
    with MemoryProfiler(model, 1, by_layer=True, stream=io.StringIO(), strict=True) as profiler:
        profiler.record_stats()
        step()
        record = profiler.record_stats()
    assert record.iteration_peak_allocated == expected
    assert record.peak_allocated >= expected


def test_outside_pytorch_matches_nvml():
    pynvml = pytest.importorskip("pynvml")
    model = small_cnn()
    x = torch.randn(32, 3, 64, 64, device=DEV)
    with MemoryProfiler(model, 1, stream=io.StringIO(), strict=True) as profiler:
        model(x).float().mean().backward()
        record = profiler.record_stats()
        pynvml.nvmlInit()
        uuid = str(torch.cuda.get_device_properties(0).uuid)
        handle = pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else "GPU-" + uuid)
        used = pynvml.nvmlDeviceGetMemoryInfo(handle).used
        reserved = torch.cuda.memory_reserved(DEV)
    expected = used - reserved
    assert record.outside_pytorch == pytest.approx(expected, rel=0.01)
    assert record.device_used == pytest.approx(used, rel=0.01)
    assert record.outside_pytorch > 100 * 2**20  # at least the CUDA context
    assert record.fragmentation == record.current_cached - record.allocated
