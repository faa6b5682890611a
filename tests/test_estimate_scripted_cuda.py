"""On a GPU: a model calling a TorchScript function, trained for real first (the profiling
executor fuses its graph into a CUDA kernel), then estimated on fake CUDA tensors: the fake step
runs the Python function, the CUDA context stays sound, and the peak is the real step's."""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
from torch import nn

from pytorch_mem_profiler import estimate_memory

pytestmark = pytest.mark.cuda

with warnings.catch_warnings():
    warnings.simplefilter("ignore")

    @torch.jit.script
    def relative_buckets(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        a = torch.arange(q.size(1), device=q.device)
        b = torch.arange(k.size(1), device=k.device)
        rel = (a[:, None] - b[None, :]).to(q.dtype)
        return torch.sign(rel) * torch.log1p(rel.abs()) * 0.5 + rel * 0.01


class RelativeBias(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        scores = h @ h.transpose(1, 2) + relative_buckets(h, h)
        return scores.softmax(-1) @ h


def test_a_scripted_function_fused_on_the_gpu_is_estimated_without_breaking_cuda():
    cuda = torch.device("cuda")
    sgd = functools.partial(torch.optim.SGD, lr=0.1)
    model = RelativeBias().to(cuda)
    opt = sgd(model.parameters())
    x = torch.randn(8, 256, 64, device=cuda)
    torch.cuda.synchronize()
    for _ in range(6):  # the profiling executor specializes, then fuses, after a few calls
        model(x).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    est = estimate_memory(RelativeBias, lambda b: torch.randn(b, 256, 64), batch_size=8, optimizer=sgd, device=cuda,
                          workspace=0, fit=False)  # fmt: skip
    torch.cuda.synchronize()  # a fused kernel on fake memory would fail here, and every CUDA call after
    out = model(x)
    assert torch.isfinite(out).all()
    assert est.peak > 8 * 256 * 256 * 4  # the scores, at least
