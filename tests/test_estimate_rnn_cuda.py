"""On a GPU: recurrent layers estimated on fake CUDA tensors against the real step (cuDNN's RNN kernels)."""

from __future__ import annotations

import functools
import gc

import pytest
import torch
from torch import nn

from pytorch_mem_profiler import estimate_memory

pytestmark = pytest.mark.cuda

CUDA = torch.device("cuda")
SGD = functools.partial(torch.optim.SGD, lr=0.1)


class LanguageModel(nn.Module):
    def __init__(self, kind: type[nn.Module], **kwargs) -> None:
        super().__init__()
        self.embed = nn.Embedding(10_000, 256)
        self.rnn = kind(256, 512, num_layers=2, batch_first=True, **kwargs)
        self.head = nn.Linear(512 * (2 if kwargs.get("bidirectional") else 1), 10_000)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(self.embed(x))[0])


def _measured(build, batch: int, seq: int, autocast) -> int:
    """max_memory_allocated over two SGD steps above what was allocated before the model (after a warm-up)."""
    for size in (1, batch):
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        model = build().to(CUDA)
        opt = SGD(model.parameters())
        x = torch.zeros(size, seq, dtype=torch.long, device=CUDA)
        for _ in range(2):
            with torch.autocast("cuda", dtype=autocast, enabled=autocast is not None):
                out = model(x)
            out.float().sum().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            del out
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        del model, opt, x
    return peak


@pytest.mark.parametrize("kind", [nn.LSTM, nn.GRU, nn.RNN])
@pytest.mark.parametrize("autocast", [None, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_recurrent_language_model_on_fake_cuda_is_within_its_bound_of_the_real_step(kind, autocast):
    build = functools.partial(LanguageModel, kind)
    est = estimate_memory(
        build, lambda b: torch.zeros(b, 64, dtype=torch.long), batch_size=32, optimizer=SGD, autocast=autocast,
        device=CUDA, workspace=0, fit=False,
    )  # fmt: skip
    assert not est.emulated
    measured = _measured(build, 32, 64, autocast)
    # the warm-up's cuBLAS workspaces stay allocated: both sides are the tensors and cuDNN's buffers
    assert abs(est.peak_allocated - measured) <= est.error_bound + 0.02 * measured, (est.peak_allocated, measured, est.error_bound)
