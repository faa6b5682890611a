"""On a GPU: a linear head over a transposed activation, estimated on fake CUDA tensors and emulated,
against the real step (the bias added in place: ``estimate.linear_rules``)."""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

from pytorch_mem_profiler import estimate_memory

pytestmark = pytest.mark.cuda

CUDA = torch.device("cuda")


class TransposedHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(256, 256)
        self.head = nn.Linear(256, 16_384)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x).transpose(0, 1))


def _measured(batch: int) -> tuple[int, int]:
    """Peak allocated and reserved over two SGD steps, above what was there before the model."""
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base, base_reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    model = TransposedHead().to(CUDA)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(batch, 64, 256, device=CUDA)
    for _ in range(2):
        loss = model(x).float().square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        del loss
    torch.cuda.synchronize()
    peak, reserved = torch.cuda.max_memory_allocated() - base, torch.cuda.max_memory_reserved() - base_reserved
    del model, opt, x
    return peak, reserved


@pytest.mark.parametrize("emulate", [False, True], ids=["fake_cuda", "emulated"])
def test_a_head_over_a_transposed_activation_is_estimated_within_the_goals(emulate):
    _measured(1)  # the libraries' workspaces
    peak, reserved = _measured(32)
    est = estimate_memory(TransposedHead, lambda b: torch.randn(b, 64, 256), batch_size=32, device=CUDA, workspace=0,
                          fit=False, emulate=emulate, optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                          loss_fn=lambda out: out.float().square().mean())  # fmt: skip
    detail = f"measured {peak:,} / {reserved:,}; estimated {est.peak_allocated:,} / {est.reserved:,}"
    assert abs(est.peak_allocated - peak) <= 0.02 * peak, detail
    if not emulate:
        assert abs(est.reserved - est.workspace - reserved) <= 0.05 * reserved, detail
