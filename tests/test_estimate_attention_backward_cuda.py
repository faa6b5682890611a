"""The efficient attention kernel's backward on the GPU: what it asks of the caching allocator beside
its three gradients, recorded call by call (``benchmarks/attention_backward_rules.py``), against
``estimate.scratch.efficient_attention_backward_scratch``.

    PYTHONPATH=. python3 -m pytest tests/test_estimate_attention_backward_cuda.py -m cuda -q
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from pytorch_mem_profiler.estimate.scratch import (  # noqa: E402
    efficient_attention_backward_scratch,
    efficient_attention_backward_steps,
)

pytestmark = pytest.mark.cuda


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(
    "batch, heads, length, head, dtype, layout, masked, causal",
    [
        (24, 12, 384, 64, torch.float32, "packed", False, False),
        (24, 12, 384, 64, torch.bfloat16, "apart", True, False),
        (4, 16, 640, 128, torch.float16, "contiguous", False, True),
        (6, 6, 200, 48, torch.float32, "apart", False, True),
        (10, 8, 256, 96, torch.bfloat16, "packed", False, False),
        (6, 4, 300, 320, torch.float32, "contiguous", False, True),  # above 128: the kernel for any head dim
        (6, 4, 304, 320, torch.bfloat16, "contiguous", True, False),  # a mask: rows a multiple of 8
        (40, 8, 96, 256, torch.float16, "contiguous", False, False),  # 320 pairs over 96 keys: one split
    ],
)
def test_the_backward_takes_the_rules_blocks_after_its_gradients(batch, heads, length, head, dtype, layout, masked, causal):
    """Shapes, dtypes and layouts the rule was not read from (fp16, head dims 48 and 96, odd lengths):
    the three gradients kept, then exactly the rule's blocks, each given back inside the call."""
    import attention_backward_rules

    device = torch.device("cuda", torch.cuda.current_device())
    row = attention_backward_rules.one_call(batch, heads, length, head, dtype, layout, masked, causal, device)
    asked = row["asked"]
    gradient = batch * heads * length * head * torch.empty((), dtype=dtype).element_size()
    assert [(a["bytes"], a["given_back"]) for a in asked[:3]] == [(gradient, False)] * 3
    itemsize = torch.empty((), dtype=dtype).element_size()
    # the history gives each request's own bytes (the allocator's blocks round them up to 512)
    assert [a["bytes"] for a in asked[3:]] == list(efficient_attention_backward_scratch((batch, heads, length, head), itemsize))
    assert all(a["given_back"] for a in asked[3:])
    # the order: the largest moment of the blocks after the gradients is the steps' (in float32 the
    # product and a row sum given back before the workspace is taken)
    alive, largest = {}, 0
    for action, number in row["order"][3:]:
        if action == "take":
            alive[number] = -(-asked[number]["bytes"] // 512) * 512
            largest = max(largest, sum(alive.values()))
        else:
            alive.pop(number, None)
    steps = efficient_attention_backward_steps((batch, heads, length, head), itemsize)
    assert largest == sum(-(-nbytes // 512) * 512 for nbytes in steps)


class WideHeads(torch.nn.Module):
    """Self-attention with head dims above 128 (Gemma 4's global layers take 512): the efficient
    kernel built for any head dim, its float32 row sums given back before its workspace is taken."""

    def __init__(self, width: int = 256, heads: int = 4, head: int = 512) -> None:
        super().__init__()
        self.heads, self.head = heads, head
        self.qkv = torch.nn.Linear(width, 3 * heads * head, bias=False)
        self.out = torch.nn.Linear(heads * head, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, self.head).permute(2, 0, 3, 1, 4)
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, n, -1))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("head, autocast", [(512, None), (256, None), (320, torch.bfloat16), (512, torch.bfloat16)])
def test_a_step_with_head_dims_above_128_is_estimated_within_the_goal(head, autocast):
    """The whole step within 2% on fake CUDA and emulated, and to the byte at head dim 512 in float32
    (the H200, 2026-11-29): at 256 in float32 and 512 in bf16 the estimate was 1 MiB over the device,
    at 320 in bf16 390,656 bytes under, outside the attention call (its blocks and their order are the
    device's, above), not yet traced."""
    from pytorch_mem_profiler import estimate_memory

    from .test_estimate_cuda import step_peak

    cuda = torch.device("cuda")
    build = functools.partial(WideHeads, head=head)
    estimate = estimate_memory(build, torch.zeros(8, 128, 256), optimizer=torch.optim.AdamW, autocast=autocast, device="cuda", fit=False)
    measured = step_peak(build, lambda b: torch.randn(b or 8, 128, 256, device=cuda), torch.optim.AdamW, autocast=autocast)
    assert abs(estimate.peak - measured) <= 0.02 * measured, (estimate.peak, measured)
    if head == 512 and autocast is None:
        assert estimate.peak == measured
    emulated = estimate_memory(build, torch.zeros(8, 128, 256), optimizer=torch.optim.AdamW, autocast=autocast, device="cuda",
                               fit=False, emulate=True)  # fmt: skip
    assert abs(emulated.peak - measured) <= 0.02 * measured, (emulated.peak, measured)
