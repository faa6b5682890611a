"""On a GPU: the training loop's settings (gradient accumulation, clipping, gradients kept between
steps) in the estimate, fake CUDA and emulated, against the caching allocator's peak of the same loop."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from pytorch_mem_profiler import estimate_memory

from .test_estimate_cuda import CUDA, _fresh, _warm_up

pytestmark = pytest.mark.cuda

SGD = functools.partial(torch.optim.SGD, lr=1e-3, momentum=0.9)
ADAMW = functools.partial(torch.optim.AdamW, lr=1e-3)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 2048), nn.GELU(), nn.Linear(2048, 2048), nn.GELU(), nn.Linear(2048, 256))


def _input(batch: int) -> torch.Tensor:
    return torch.randn(batch, 256, device=CUDA)


def _measured(optimizer, batch: int, *, accumulation_steps: int = 1, max_grad_norm: float | None = None,
              set_to_none: bool = True) -> int:  # fmt: skip
    """Bytes allocated at the peak of two optimizer steps of the loop, above what was allocated before."""
    _warm_up(_model, _input, optimizer, None)
    _fresh()
    base = torch.cuda.memory_allocated()
    model = _model().to(CUDA)
    opt = optimizer(model.parameters())
    x = _input(batch)
    for _ in range(2):
        for micro_step in range(accumulation_steps):
            if micro_step:
                del out, loss  # noqa: F821 - the previous micro-step's
            out = model(x)
            loss = out.float().sum()
            loss.backward()
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(list(model.parameters()), max_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
        del out, loss
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del model, opt, x
    _fresh()
    return peak


SETTINGS = [
    {},
    {"accumulation_steps": 2},
    {"accumulation_steps": 3, "max_grad_norm": 1.0},
    {"max_grad_norm": 0.5},
    {"set_to_none": False},
    {"accumulation_steps": 2, "set_to_none": False},
]


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
