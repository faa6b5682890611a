"""Losses ATen's CUDA code writes as composites: their temporaries in a CUDA estimate, in ATen's order, on a CPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pytorch_mem_profiler import estimate_memory
from pytorch_mem_profiler.estimate.allocator import block_size

N = 50_000


def _loss_events(loss_fn, device="cuda", autocast=None):
    """The loss phase's and the backward's first events of step 1, by size (the model: one Linear to a logit)."""
    est = estimate_memory(
        nn.Linear(16, 1), torch.zeros(N, 16), targets=torch.zeros(N), loss_fn=loss_fn, device=device, emulate=True,
        autocast=autocast, fit=False,
    )  # fmt: skip
    events = est.step_events
    by_phase: dict[str, list[tuple[int, int]]] = {}
    for i, (key, nbytes) in enumerate(events.events):
        step, phase = events.phase_at(i)
        if step == 1:
            by_phase.setdefault(phase, []).append((key, nbytes))
    return est, by_phase


def _sizes(pairs):
    return [n for _, n in pairs]


def test_bce_with_logits_forward_makes_the_log_sigmoid_and_the_loss_then_reduces():
    _, phases = _loss_events(lambda out, t: F.binary_cross_entropy_with_logits(out.squeeze(1), t))
    full = block_size(N * 4)
    # ATen: log_sigmoid(input), (1 - target) multiplied and subtracted in place, its mean;
    # then, as the function returns, the loss and the log-sigmoid freed
    loss_phase = phases["other"]
    assert _sizes(loss_phase[:5]) == [full, full, 512, -full, -full]
    (a, _), (b, _), _, (freed_first, _), (freed_second, _) = loss_phase[:5]
    assert (freed_first, freed_second) == (b, a)


def test_bce_with_logits_backward_makes_one_gradient_in_place():
    _, phases = _loss_events(lambda out, t: F.binary_cross_entropy_with_logits(out.squeeze(1), t))
    full = block_size(N * 4)
    backward = phases["backward"]
    # the loss's gradient (a 0-dim one), then input.sigmoid() written in place: one input-sized block,
    # not the sigmoid, sub and mul the out-of-place branch makes for tensor subclasses
    assert _sizes(backward[:2]) == [512, full]
    assert _sizes(backward).count(full) == 1


def test_bce_with_logits_without_reduction_returns_its_loss_and_frees_the_log_sigmoid():
    _, phases = _loss_events(lambda out, t: F.binary_cross_entropy_with_logits(out.squeeze(1), t, reduction="none").sum())
    full = block_size(N * 4)
    assert _sizes(phases["other"][:3]) == [full, full, -full]  # the log-sigmoid, the loss (kept), the log-sigmoid freed


def test_bce_with_logits_with_pos_weight_makes_its_weights_in_forward_and_backward():
    def loss(out, t):
        return nn.BCEWithLogitsLoss(pos_weight=torch.full((1,), 3.0, device=out.device))(out.squeeze(1), t)

    _, phases = _loss_events(loss)
    full = block_size(N * 4)
    forward = [n for n in _sizes(phases["other"]) if n != 512 and n != -512]
    # log_sigmoid, (pos_weight - 1) and its .mul(target) freed, (1 - target); the mean; both freed
    assert forward[:6] == [full, full, -full, full, -full, -full]
    backward = [n for n in _sizes(phases["backward"]) if abs(n) != 512]
    # pos_weight.mul(target), its add(1) (the gradient), a sigmoid freed at once, then the product freed
    assert backward[:5] == [full, full, full, -full, -full]


def test_under_autocast_the_loss_runs_in_float32_from_cast_logits():
    def loss(out, t):
        with torch.autocast(out.device.type, dtype=torch.bfloat16):  # the device the fake tensors are on
            return F.binary_cross_entropy_with_logits(out.squeeze(1).to(torch.bfloat16), t)

    _, phases = _loss_events(loss)
    full, half = block_size(N * 4), block_size(N * 2)
    # the bfloat16 logits, autocast's float32 copy of them, then the float32 log-sigmoid and loss, the mean
    assert _sizes(phases["other"][:5]) == [half, full, full, full, 512]


def test_without_autocast_bfloat16_logits_keep_their_dtype_in_the_log_sigmoid():
    _, phases = _loss_events(lambda out, t: F.binary_cross_entropy_with_logits(out.squeeze(1), t), autocast=torch.bfloat16)
    # the model ran under autocast, the loss outside it: log_sigmoid of the bfloat16 logits, (1 - target) in float32
    assert _sizes(phases["other"][:3]) == [block_size(N * 2), block_size(N * 4), 512]


def test_a_cpu_estimate_runs_the_loss_as_torch_does():
    seen = []

    def loss(out, t):
        value = F.binary_cross_entropy_with_logits(out.squeeze(1), t)
        seen.append(type(value.grad_fn).__name__)
        return value

    estimate_memory(nn.Linear(16, 1), torch.zeros(64, 16), targets=torch.zeros(64), loss_fn=loss, device="cpu", fit=False)
    assert set(seen) == {"BinaryCrossEntropyWithLogitsBackward0"}  # the CPU's kernels: no CUDA rule
