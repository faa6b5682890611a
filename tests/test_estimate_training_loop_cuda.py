"""On a GPU: the training loop's settings (gradient accumulation, clipping, gradients kept between
steps) in the estimate, fake CUDA and emulated, against the caching allocator's peak of the same loop."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from pytorch_mem_profiler import estimate_memory

from .test_estimate_cuda import CUDA, _fresh, _warm_up
from .test_estimate_training_loop import SETTINGS as CPU_SETTINGS
from .test_estimate_training_loop import run_loop, run_scaled_loop

pytestmark = pytest.mark.cuda

SGD = functools.partial(torch.optim.SGD, lr=1e-3, momentum=0.9)
ADAMW = functools.partial(torch.optim.AdamW, lr=1e-3)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 2048), nn.GELU(), nn.Linear(2048, 2048), nn.GELU(), nn.Linear(2048, 256))


def _input(batch: int) -> torch.Tensor:
    return torch.randn(batch, 256, device=CUDA)


def _measured(optimizer, batch: int, **settings) -> int:
    """Bytes allocated at the peak of two optimizer steps of the loop, above what was allocated before."""
    _warm_up(_model, _input, optimizer, None)
    _fresh()
    base = torch.cuda.memory_allocated()
    model = _model().to(CUDA)
    opt = optimizer(model.parameters())
    x = _input(batch)
    run_loop(model, opt, x, **settings)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del model, opt, x
    _fresh()
    return peak


SETTINGS = [{}, *CPU_SETTINGS]


@pytest.mark.parametrize("optimizer", [SGD, ADAMW], ids=["sgd-momentum", "adamw"])
@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()) or "plain")
def test_the_estimate_matches_the_gpu_s_loop(settings, optimizer):
    batch = 512
    measured = _measured(optimizer, batch, **settings)
    fake = estimate_memory(_model, _input, batch_size=batch, optimizer=optimizer, device="cuda", fit=False, **settings)
    emulated = estimate_memory(
        _model, _input, batch_size=batch, optimizer=optimizer, device="cuda", emulate=True, fit=False, **settings
    )
    assert not fake.emulated and emulated.emulated
    detail = f"measured {measured:,}, fake CUDA {fake.peak:,}, emulated {emulated.peak:,}"
    print(detail)
    assert abs(fake.peak - measured) <= 0.01 * measured, detail
    assert abs(emulated.peak - measured) <= 0.02 * measured, detail


def test_accumulation_and_kept_gradients_move_the_gpu_s_peak_as_estimated():
    """With SGD and a batch whose feature maps hold the backward's peak, accumulation keeps every
    gradient through the second backward, and ``set_to_none=False`` keeps them through the next
    forward: on the GPU both peaks are above the plain loop's, and the estimate moves with them."""
    batch = 4096
    plain = _measured(SGD, batch)
    est_plain = estimate_memory(_model, _input, batch_size=batch, optimizer=SGD, device="cuda", fit=False).peak
    for settings in ({"accumulation_steps": 2}, {"set_to_none": False}):
        moved = _measured(SGD, batch, **settings)
        est = estimate_memory(_model, _input, batch_size=batch, optimizer=SGD, device="cuda", fit=False, **settings)
        assert moved > plain and est.peak > est_plain, settings
        assert abs((est.peak - est_plain) - (moved - plain)) <= 0.01 * moved, (settings, moved, plain, est.peak, est_plain)


def _fused_adamw(params):
    return torch.optim.AdamW(params, lr=1e-3, fused=True)


@pytest.mark.parametrize("optimizer", [SGD, ADAMW, _fused_adamw], ids=["sgd-momentum", "adamw", "fused-adamw"])
@pytest.mark.parametrize("accumulation_steps, max_grad_norm", [(1, None), (2, 1.0)])
def test_fp16_loss_scaling_matches_the_gpu_s_loop(optimizer, accumulation_steps, max_grad_norm):
    """fp16 autocast with ``torch.amp.GradScaler`` on the GPU (no step skipped: the scale stays
    65,536) against ``grad_scaler=True``, fake CUDA and emulated."""
    batch = 512
    _warm_up(_model, _input, optimizer, None)
    _fresh()
    base = torch.cuda.memory_allocated()
    model = _model().to(CUDA)
    opt = optimizer(model.parameters())
    scaler = torch.amp.GradScaler("cuda")
    x = _input(batch)
    run_scaled_loop(model, opt, x, scaler, accumulation_steps=accumulation_steps, max_grad_norm=max_grad_norm)
    torch.cuda.synchronize()
    measured = torch.cuda.max_memory_allocated() - base
    assert scaler.get_scale() == 65536.0
    del model, opt, x, scaler
    _fresh()
    settings = dict(batch_size=batch, optimizer=optimizer, fit=False, autocast=torch.float16, grad_scaler=True,
                    loss_fn=lambda out: out.float().mean(), accumulation_steps=accumulation_steps, max_grad_norm=max_grad_norm)  # fmt: skip
    fake = estimate_memory(_model, _input, device="cuda", **settings)
    emulated = estimate_memory(_model, _input, device="cuda", emulate=True, **settings)
    detail = f"measured {measured:,}, fake CUDA {fake.peak:,}, emulated {emulated.peak:,}"
    print(detail)
    assert abs(fake.peak - measured) <= 0.01 * measured, detail
    assert abs(emulated.peak - measured) <= 0.02 * measured, detail
