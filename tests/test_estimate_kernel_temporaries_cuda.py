"""On a GPU: the temporaries CUDA kernels take inside an operator, against the allocator.

A softmax's backward computes ``grad * output`` first and reads contiguous tensors; its forward
reads a contiguous input (``estimate.layout_copies``). An attention backward with grouped-query
attention makes the key's and value's gradients at every query head before summing them down
(``estimate.scratch.grouped_query_gradients``). Each rule against the allocator's peak inside the
operator, and estimates of steps where they decide the peak against ``max_memory_allocated()``."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pytorch_mem_profiler import estimate_memory
from pytorch_mem_profiler.estimate.scratch import KernelScratch
from pytorch_mem_profiler.torch_versions import SDPA_ENABLE_GQA

from .test_estimate_conv_cuda import _scratch
from .test_estimate_rnn_cuda import SGD, _measured

pytestmark = pytest.mark.cuda

CUDA = torch.device("cuda")


def _tensor(shape: tuple[int, ...], dtype: torch.dtype, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """A tensor of ``shape``, laid out in memory by ``order`` (a permutation) when given."""
    if order is None:
        return torch.rand(shape, device=CUDA, dtype=dtype)
    stored = torch.rand([shape[i] for i in order], device=CUDA, dtype=dtype)
    return stored.permute([order.index(i) for i in range(len(shape))])


SHAPE = (64, 512, 512)
#: (operator, gradient or input layout, output layout, dtype)
CASES = [
    ("softmax_backward", None, None, torch.float32),
    ("softmax_backward", (1, 0, 2), None, torch.float32),
    ("softmax_backward", None, (1, 0, 2), torch.float32),
    ("softmax_backward", None, None, torch.bfloat16),
    ("log_softmax_backward", (1, 0, 2), None, torch.float32),
    ("log_softmax_backward", None, None, torch.float32),
    ("softmax", (1, 0, 2), None, torch.float32),
    ("log_softmax", None, None, torch.bfloat16),
]


@pytest.mark.parametrize("op, first, second, dtype", CASES)
def test_the_softmax_rules_are_the_allocators_peak_inside_the_operator(op, first, second, dtype):
    aten = torch.ops.aten
    rules = KernelScratch(torch.cuda.get_device_properties(CUDA).multi_processor_count)
    if op.endswith("backward"):
        func = aten._softmax_backward_data.default if op == "softmax_backward" else aten._log_softmax_backward_data.default
        args = (_tensor(SHAPE, dtype, first), _tensor(SHAPE, dtype, second), -1, dtype)
    else:
        func = aten._softmax.default if op == "softmax" else aten._log_softmax.default
        args = (_tensor(SHAPE, dtype, first), -1, False)
    measured = _scratch(lambda: func(*args))
    assert measured == sum(rules(func, args, {})), (measured, rules(func, args, {}))


class GroupedQueryAttention(nn.Module):
    """Token embeddings, one attention layer of 16 query heads over 2 key-value heads, and a head."""

    def __init__(self, vocab: int = 1024, dim: int = 1024, heads: int = 16, groups: int = 2) -> None:
        super().__init__()
        self.heads, self.groups, self.head_dim = heads, groups, dim // heads
        self.embed = nn.Embedding(vocab, dim)
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(dim, 2 * groups * self.head_dim)
        self.out = nn.Linear(dim, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k, v = self.kv(x).view(b, s, 2, self.groups, self.head_dim).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.out(y.transpose(1, 2).reshape(b, s, -1))


@pytest.mark.skipif(not SDPA_ENABLE_GQA, reason="scaled_dot_product_attention(enable_gqa=True) needs torch 2.5")
@pytest.mark.parametrize("emulate", [False, True], ids=["fake_cuda", "emulated"])
def test_grouped_query_attention_is_estimated_with_its_backwards_expanded_gradients(emulate, monkeypatch):
    """The step's peak is cuDNN's backward block (270,532,864 bytes on an H200 here): with the key's
    and value's gradients at all 16 query heads in it, and 2 x 67,108,864 bytes short without them."""
    estimate = functools.partial(
        estimate_memory, GroupedQueryAttention, lambda b: torch.zeros(b, 2048, dtype=torch.long), batch_size=16,
        autocast=torch.bfloat16, loss_fn=lambda out: out.float().sum(), optimizer=SGD, device=CUDA, workspace=0, fit=False,
        emulate=emulate,
    )  # fmt: skip
    est = estimate()
    measured = _measured(GroupedQueryAttention, 16, 2048, torch.bfloat16, loss=lambda out: out.float().sum())
    assert abs(est.peak_allocated - measured) <= 0.01 * measured, (est.peak_allocated, measured)
    monkeypatch.setattr("pytorch_mem_profiler.estimate.scratch.grouped_query_gradients", lambda *tensors: ())
    assert est.peak_allocated - estimate().peak_allocated == 2 * 16 * 16 * 2048 * 64 * 2


class WeightsUsed(nn.Module):
    """``nn.MultiheadAttention`` (batch first, key and value widths of their own) whose per-head
    weights the output uses: its projections' biases, the explicit softmax's backward."""

    def __init__(self, vocab: int = 1024, dim: int = 512, heads: int = 8, memory: int = 384) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.memory = nn.Linear(dim, memory)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True, kdim=memory, vdim=memory)
        self.head = nn.Linear(dim, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        memory = torch.tanh(self.memory(x))
        y, weights = self.attn(x, memory, memory, need_weights=True, average_attn_weights=False)
        return self.head(y * weights.mean((1, 3)).unsqueeze(-1))


@pytest.mark.parametrize("emulate", [False, True], ids=["fake_cuda", "emulated"])
def test_multihead_attention_with_its_weights_used_is_estimated_within_one_percent(emulate):
    est = estimate_memory(
        WeightsUsed, lambda b: torch.zeros(b, 512, dtype=torch.long), batch_size=32, loss_fn=lambda out: out.float().sum(), optimizer=SGD,
        device=CUDA, workspace=0, fit=False, emulate=emulate,
    )  # fmt: skip
    measured = _measured(WeightsUsed, 32, 512, None, loss=lambda out: out.float().sum())
    assert abs(est.peak_allocated - measured) <= 0.01 * measured, (est.peak_allocated, measured)
