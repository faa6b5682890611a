"""On a GPU: cuDNN convolutions' scratch against the rule and its bound, and the estimate of conv nets
(benchmarks/zoo: a UNet, ResNet-18 under bf16, a VGG-style BatchNorm CNN) against a real step's
``max_memory_allocated()`` (within 2%) and ``max_memory_reserved()`` (within 5%), or within the
bound the estimate states."""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import pytest
import torch

from pytorch_mem_profiler import estimate_memory
from pytorch_mem_profiler.estimate.conv_workspace import convolution_backward_scratch, convolution_scratch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

pytestmark = pytest.mark.cuda

CUDA = torch.device("cuda")
GOAL_PEAK, GOAL_RESERVED = 0.02, 0.05


def _fresh() -> None:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


def _scratch(fn) -> int:  # type: ignore[no-untyped-def]
    """The allocator's peak inside ``fn()`` above both ends, after a first call (as op_scratch.py measures)."""
    fn()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    after = torch.cuda.memory_allocated()
    del out
    return torch.cuda.max_memory_allocated() - max(before, after)


#: (input, weight, stride, groups, dtype, channels_last): 3x3, 7x7 and 1x1, odd channels, depthwise.
CONVOLUTIONS = [
    ((8, 96, 128, 128), (32, 96, 3, 3), 1, 1, torch.float32, False),
    ((32, 3, 112, 112), (64, 3, 7, 7), 2, 1, torch.bfloat16, False),
    ((16, 64, 56, 56), (64, 64, 3, 3), 1, 1, torch.bfloat16, False),
    ((16, 64, 56, 56), (64, 64, 3, 3), 1, 1, torch.bfloat16, True),
    ((16, 24, 56, 56), (100, 24, 3, 3), 2, 1, torch.float32, False),
    ((16, 256, 28, 28), (512, 256, 1, 1), 1, 1, torch.float32, False),
    ((32, 64, 56, 56), (64, 1, 3, 3), 1, 64, torch.bfloat16, False),
    ((8, 256, 32, 32), (256, 256, 3, 3), 1, 1, torch.float32, False),
]  # fmt: skip


@pytest.mark.parametrize("x_shape, w_shape, stride, groups, dtype, channels_last", CONVOLUTIONS)
def test_the_rule_is_within_its_bound_of_this_gpus_convolutions(x_shape, w_shape, stride, groups, dtype, channels_last):
    _fresh()
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    x = torch.randn(x_shape, device=CUDA, dtype=dtype).contiguous(memory_format=fmt)
    w = torch.randn(w_shape, device=CUDA, dtype=dtype).contiguous(memory_format=fmt)
    k = w_shape[-1]
    geometry = {"stride": [stride] * 2, "padding": [k // 2] * 2, "dilation": [1, 1], "transposed": False, "groups": groups}
    aten = torch.ops.aten
    out = aten.convolution.default(x, w, None, geometry["stride"], geometry["padding"], [1, 1], False, [0, 0], groups)
    go = torch.randn_like(out)
    measured = _scratch(lambda: aten.convolution.default(x, w, None, geometry["stride"], geometry["padding"], [1, 1], False, [0, 0], groups))
    rule = convolution_scratch(x, w, **geometry)
    assert abs(sum(rule.blocks) - measured) <= rule.bound, f"forward: rule {sum(rule.blocks):,} measured {measured:,} bound {rule.bound:,}"
    for mask in ([True, True, False], [False, True, False]):
        measured = _scratch(lambda: aten.convolution_backward.default(
            go, x, w, None, geometry["stride"], geometry["padding"], [1, 1], False, [0, 0], groups, mask))  # fmt: skip
        rule = convolution_backward_scratch(go, x, w, output_mask=mask, **geometry)
        assert abs(sum(rule.blocks) - measured) <= rule.bound, f"backward {mask}: rule {sum(rule.blocks):,} measured {measured:,} bound {rule.bound:,}"


#: 1-D convolutions over a channels-innermost input: (batch, channels, length, kernel, groups, dtype).
CHANNELS_INNERMOST = [
    (16, 256, 512, 3, 1, torch.float32),
    (16, 256, 512, 5, 1, torch.bfloat16),
    (16, 256, 512, 7, 256, torch.float32),  # depthwise
]  # fmt: skip


@pytest.mark.parametrize("n, c, length, k, groups, dtype", CHANNELS_INNERMOST)
def test_the_rule_holds_for_1d_convolutions_over_channels_innermost_input(n, c, length, k, groups, dtype):
    # embed(ids).transpose(1, 2): the device runs them channels_last; every output mask autograd passes
    _fresh()
    x = torch.randn(n, length, c, device=CUDA, dtype=dtype).transpose(1, 2)
    w = torch.randn(c, c // groups, k, device=CUDA, dtype=dtype)
    b = torch.randn(c, device=CUDA, dtype=dtype)
    geometry = {"stride": [1], "padding": [k // 2], "dilation": [1], "transposed": False, "groups": groups}
    aten = torch.ops.aten
    measured = _scratch(lambda: aten.convolution.default(x, w, b, [1], [k // 2], [1], False, [0], groups))
    rule = convolution_scratch(x, w, **geometry)
    assert rule.channels_innermost and not any(rule.fallback)
    assert abs(sum(rule.blocks) - measured) <= rule.bound, f"forward: rule {sum(rule.blocks):,} measured {measured:,} bound {rule.bound:,}"
    go = torch.randn(n, length, c, device=CUDA, dtype=dtype).transpose(1, 2)  # the gradient of a transpose back
    for mask in ([True, True, True], [True, True, False], [False, True, True], [True, False, False], [False, False, True]):
        measured = _scratch(lambda: aten.convolution_backward.default(
            go, x, w, [c], [1], [k // 2], [1], False, [0], groups, mask))  # fmt: skip
        rule = convolution_backward_scratch(go, x, w, output_mask=mask, **geometry)
        # the bias's sum alone is sized to the byte on an H200 (its partial sums within a few KiB elsewhere)
        allowed = max(rule.bound, 64 << 10)
        assert abs(sum(rule.blocks) - measured) <= allowed, f"backward {mask}: rule {sum(rule.blocks):,} measured {measured:,} bound {rule.bound:,}"


def test_the_probe_measures_what_this_process_measures():
    from pytorch_mem_profiler.estimate.kernel_probe import MEASURED, convolution_key, measure_convolutions

    _fresh()
    x = torch.randn(8, 96, 64, 64, device=CUDA)
    w = torch.randn(32, 96, 3, 3, device=CUDA)
    args = (x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)
    here = _scratch(lambda: torch.ops.aten.convolution.default(*args))
    key = convolution_key(torch.ops.aten.convolution.default, args, {})
    MEASURED.pop(key, None)
    assert measure_convolutions([key], CUDA) == {key: here}


#: Known gaps on the GPU (an H200, torch 2.11): reserved with measured workspaces, each measured as
#: one block where cuDNN's passes take theirs in turn (strict). The rule's estimates state an upper
#: reserved figure (``reserved_bound``: the filter passes' split-K partial sums at their bound) and
#: the measured lies within the goal of the range up to it.
CONV_KNOWN = {
    ("resnet18_bf16", "measured"): "reserved 2,604.7 MB estimated against 2,791.3 MB measured (-6.7%)",
    ("unet", "measured"): "with measured workspaces, reserved 2,235.6 MB against 2,487.2 MB measured (-10.1%)",
}

#: Reserved that moves with the process's history, so not strict: the BatchNorm CNN's measured reserved
#: was 6,868 MB and 7,281 MB on two H100 runs of the zoo and 7,265 MB on an H200 inside this suite, for
#: the same estimate (6,642 MB with measured workspaces); its peak stays within 0.1%. The rule's
#: estimates state an upper reserved figure that covers both (6,310 MB up to 7,982 MB).
CONV_VARIES = {("batchnorm_cnn", "measured"): "reserved moves with the process's history (from -8.8% to -3.3% of the measured)"}


@pytest.mark.parametrize("name", ["unet", "resnet18_bf16", "batchnorm_cnn"])
@pytest.mark.parametrize("emulate, measure", [(False, False), (True, False), (False, True)], ids=["fake_cuda", "emulated", "measured"])
def test_conv_nets_estimate_within_the_goals_or_the_stated_bound(name, emulate, measure, request):
    known = CONV_KNOWN.get((name, "measured" if measure else "emulated" if emulate else "fake_cuda"))
    if known:
        request.applymarker(pytest.mark.xfail(strict=True, reason=known))
    from zoo import ZOO

    entry = ZOO[name]
    reason = entry.unavailable()
    if reason:
        pytest.skip(reason)
    batch = entry.batch["real"]
    from zoo_conformance import measure_step

    measured = measure_step(entry, batch, CUDA)  # as the conformance table measures
    allocated, reserved = measured["allocated"], measured["reserved"]
    est = estimate_memory(**entry.estimate_kwargs("real"), batch_size=batch, device=CUDA, fit=False, emulate=emulate,
                          measure_kernels=measure)  # fmt: skip
    if measure:  # every convolution measured: nothing left to bound
        assert not any("convolution" in op for op in est.error_bounds)
    detail = (f"{name}: measured {allocated:,} / reserved {reserved:,}; estimated {est.peak:,} / {est.reserved:,} "
              f"(kernel scratch {est.kernel_scratch:,}, bound {est.error_bound:,}: {dict(est.error_bounds)})")  # fmt: skip
    print(detail)
    assert abs(est.peak - allocated) <= max(GOAL_PEAK * allocated, est.error_bound), detail
    assert est.reserved is not None
    # within the goal of the range from the estimate's reserved to its stated upper figure
    slack = max(GOAL_RESERVED * reserved, est.error_bound)
    within = est.reserved - slack <= reserved <= est.reserved + est.reserved_bound + slack
    varies = CONV_VARIES.get((name, "measured" if measure else "emulated" if emulate else "fake_cuda"))
    if varies and not within:
        pytest.xfail(f"{varies}: {detail}")  # the peak was checked above
    assert within, f"{detail}; upper reserved {est.reserved + est.reserved_bound:,}"


def test_cudnn_runs_another_plan_when_the_allocator_refuses_its_workspace():
    """The premise of ``ConvScratch.fallback``: under a memory limit, a convolution whose plan's workspace
    does not fit still runs (``run_single_conv`` catches the allocator's ``OutOfMemoryError`` and tries
    the next plan), taking less, and the allocator counts the refusal."""
    from pytorch_mem_profiler.estimate.allocator import segment_size

    _fresh()
    x = torch.randn(8, 96, 128, 128, device=CUDA)
    w = torch.randn(32, 96, 3, 3, device=CUDA)
    conv = lambda: torch.nn.functional.conv2d(x, w, padding=1)  # noqa: E731
    workspace = _scratch(conv)  # the first plan's, with room for it
    assert workspace > 64 << 20
    expected = conv()
    out_bytes = expected.numel() * expected.element_size()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(CUDA).total_memory
    room = segment_size(out_bytes) + workspace // 2  # the output's segment and half the workspace
    refused = torch.cuda.memory_stats()["num_ooms"]
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_reserved() + room) / total)
    try:
        out = conv()
        torch.cuda.synchronize()
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    assert torch.cuda.memory_stats()["num_ooms"] > refused  # the first plan's workspace was refused
    assert torch.cuda.max_memory_allocated() - before < out_bytes + workspace // 2  # another plan, within the room
    # the same convolution: TF32 plans differ by about 1e-3 of the output's scale (0.041 of about 100 seen on an H200)
    torch.testing.assert_close(out, expected, rtol=0, atol=2e-3 * expected.abs().max().item())
