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


def test_parts_switched_off_by_faults_take_their_hooks_away_and_training_is_unchanged(caplog):
    """On the GPU, where backward and its boundaries run on autograd's device thread: a fault in
    the per-layer attribution (iteration 1) and one where the peak breakdown tracks a gradient
    backward made (iteration 3) each switch their part off, its hooks are gone by that iteration's
    end (no module hook or saved-tensor pair left; no gradient hook ever), the other figures go
    on, and the weights end equal to those of the same run without the profiler."""
    import torch.nn.modules.module as module_hooks

    from pytorch_mem_profiler.measure.peak_breakdown import BoundaryPeakBreakdown
    from pytorch_mem_profiler.measure.saved_tensors import top_saved_tensors_hooks

    def run(profiled: bool):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 8)).to(DEV)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        x = torch.randn(64, 256, device=DEV)
        params = list(model.parameters())
        seen = []
        profiler = MemoryProfiler(model, 1, by_layer=True, stream=io.StringIO()) if profiled else None
        for i in range(5):
            if profiled and i == 1:
                def fails(ended_in, now_in):
                    raise RuntimeError("injected into the attribution")

                profiler._meter._observers.attribution.on_exit = fails
            if profiled and i == 3:
                tracker = profiler._meter._observers.peak
                assert isinstance(tracker, BoundaryPeakBreakdown)
                real_add, failed = tracker._alive.add_storage, []

                def add_storage(storage, category, module=None):
                    if category == "gradients" and not failed:
                        failed.append(True)
                        raise RuntimeError("injected into the breakdown")
                    return real_add(storage, category, module)

                tracker._alive.add_storage = add_storage
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if profiled:
                record = profiler.record_stats()
                left = (
                    len(module_hooks._global_forward_pre_hooks) + len(module_hooks._global_forward_hooks),
                    top_saved_tensors_hooks(),
                    sum(len(p._post_accumulate_grad_hooks or {}) for p in params),
                )
                seen.append((record, left))
        if profiled:
            profiler.close()
        return [p.detach().clone() for p in params], seen

    reference, _ = run(False)
    weights, seen = run(True)
    assert all(torch.equal(a, b) for a, b in zip(weights, reference))
    assert "per-layer attribution failed" in caplog.text and "peak breakdown failed" in caplog.text
    records = [record for record, _ in seen]
    assert records[0].layers is not None and records[0].peak_breakdown is not None
    for record, (module_hooks_left, saved_pair, gradient_hooks) in seen[1:]:
        assert module_hooks_left == 0 and saved_pair is None, record.iteration
        assert record.layers is None and record.peak_location is None and record.peak_layers is None
    for record, _ in seen[1:3]:  # the breakdown still works without module names
        assert sum(record.peak_breakdown.values()) == record.iteration_peak_allocated
    for record, _ in seen[3:]:
        assert record.peak_breakdown is None, record.iteration
    assert all(gradient_hooks == 0 for _, (_, _, gradient_hooks) in seen)
