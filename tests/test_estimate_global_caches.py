"""A process-wide ``functools`` cache the fake step fills keeps no fake tensor after the estimate.

The truth: the real model, built and run after the estimate in the same process, computes on real
tensors (values equal to a run without the estimate before it); the estimate equals the profiler's
CPU peak to the byte, the cache's tensor included (made by the step, alive after it).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from pytorch_mem_profiler import estimate_memory

from .helpers import measured_peak, transformers_or_skip

SIDE = 13  # a size no other test caches under


@functools.lru_cache(maxsize=8)
def _pair_index(side: int) -> torch.Tensor:
    """Relative positions of a ``side`` x ``side`` window, memoized by size, as vision transformers do."""
    coords = torch.stack(torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij")).flatten(1)
    relative = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0) + side - 1
    return relative[..., 0] * (2 * side - 1) + relative[..., 1]


@functools.cache
def _registry() -> dict:
    """A memoized singleton: its identity matters to whoever holds it."""
    return {"made": object()}


class RelativeBias(nn.Module):
    def __init__(self, side: int = SIDE, dim: int = 32) -> None:
        super().__init__()
        self.side = side
        self.table = nn.Parameter(torch.randn((2 * side - 1) ** 2))
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (batch, side * side, dim)
        _registry()
        bias = self.table[_pair_index(self.side).view(-1)].view(self.side**2, self.side**2)
        attn = torch.softmax(self.proj(x) @ x.transpose(1, 2) + bias, dim=-1)
        return attn @ x


def _input() -> torch.Tensor:
    return torch.randn(4, SIDE * SIDE, 32)


def test_after_an_estimate_the_real_model_computes_on_real_tensors():
    _pair_index.cache_clear()
    singleton = _registry()
    estimate_memory(RelativeBias(), _input(), device="cpu", fit=False)
    estimate_memory(RelativeBias(), _input(), device="cuda", fit=False)  # fake CUDA (emulated without a GPU)
    assert _pair_index.cache_info().currsize == 0  # emptied: it held a fake tensor
    assert _registry() is singleton  # a cache holding no tensor keeps its entries
    torch.manual_seed(0)
    model, x = RelativeBias(), _input()
    out = model(x)
    assert type(out) is torch.Tensor
    assert torch.equal(_pair_index(SIDE), _pair_index.__wrapped__(SIDE))


def test_a_tensor_an_earlier_real_step_cached_is_made_again_as_in_a_fresh_process():
    """Measured first (the cache then holds the real index), estimated after: the estimate is of a
    fresh process's first step, which makes the index, and equals the measurement to the byte;
    the real model after it is handed a real index."""
    _pair_index.cache_clear()
    measured = measured_peak(RelativeBias, _input, torch.optim.AdamW)
    assert _pair_index.cache_info().currsize == 1
    est = estimate_memory(RelativeBias(), _input(), device="cpu", optimizer=torch.optim.AdamW, fit=False)
    assert est.peak_allocated == measured
    assert type(_pair_index(SIDE)) is torch.Tensor


def test_the_estimate_counts_the_cached_tensor_as_the_real_first_step_makes_it():
    """With the cache cold, the real step makes the index and the cache keeps it: the estimate,
    which empties the cache after its step, makes it too, and equals the profiler to the byte."""
    _pair_index.cache_clear()
    est = estimate_memory(RelativeBias(), _input(), device="cpu", optimizer=torch.optim.AdamW, fit=False)
    _pair_index.cache_clear()
    measured = measured_peak(RelativeBias, _input, torch.optim.AdamW)
    assert est.peak_allocated == measured


def test_transformers_beit_after_an_estimate():
    """BEiT memoizes its relative position index in a cache shared by every instance
    (``compile_compatible_method_lru_cache``): the model built after the estimate is real."""
    transformers = transformers_or_skip()
    config = transformers.BeitConfig(
        image_size=40, patch_size=8, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=64, use_relative_position_bias=True, num_labels=3,
    )
    pixels = torch.randn(2, 3, 40, 40)
    estimate_memory(lambda: transformers.BeitForImageClassification(config), {"pixel_values": pixels}, device="cpu", fit=False,
                    loss_fn=lambda out: out.logits.sum())
    torch.manual_seed(0)
    logits = transformers.BeitForImageClassification(config)(pixel_values=pixels).logits
    assert type(logits) is torch.Tensor
    assert torch.isfinite(logits).all()
