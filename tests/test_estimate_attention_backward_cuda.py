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
def test_a_step_with_head_dims_above_128_is_estimated_to_the_byte(head, autocast):
    """The whole step on fake CUDA and emulated: the estimate's requests, replayed from the device's own
    segments with each new one where the device put it, give the device's peak to the byte, and the
    estimate itself is within 2%.

    The estimate places each new segment below the others, as ``cudaMalloc`` does in a fresh process
    (``tests/test_segment_order_cuda.py``); in this one, where earlier tests gave segments back, it
    places them elsewhere and blocks those tests left hold free room, and which free block a request
    takes can then hold a remainder of 1 MiB or not (on the H200, 2026-11-29: at head dim 256 in
    float32, 1 MiB under the estimate in this process and to the byte in a fresh one)."""
    from pytorch_mem_profiler import estimate_memory

    from .test_estimate_cuda import peak_from_the_devices_segments, step_peak

    cuda = torch.device("cuda")
    build = functools.partial(WideHeads, head=head)
    segments: dict = {}
    measured = step_peak(build, lambda b: torch.randn(b or 8, 128, 256, device=cuda), torch.optim.AdamW, autocast=autocast,
                         segments=segments)  # fmt: skip
    for emulate in (False, True):
        estimate = estimate_memory(build, torch.zeros(8, 128, 256), optimizer=torch.optim.AdamW, autocast=autocast,
                                   device="cuda", fit=False, emulate=emulate)  # fmt: skip
        assert abs(estimate.peak - measured) <= 0.02 * measured, (emulate, estimate.peak, measured)
        assert peak_from_the_devices_segments(estimate, segments) == measured, (emulate, estimate.peak, measured, segments)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(
    "batch, heads, length, head, value_head, dtype",
    [
        (8, 4, 128, 512, 512, torch.bfloat16),
        (6, 4, 200, 320, 320, torch.float16),
        (4, 8, 256, 160, 160, torch.bfloat16),
        (4, 8, 256, 128, 256, torch.bfloat16),  # the value's head dim alone above 128
        (4, 8, 256, 256, 128, torch.float16),  # the query's alone
        (8, 4, 128, 512, 512, torch.float32),
        (8, 12, 384, 128, 128, torch.bfloat16),
        (8, 12, 384, 64, 64, torch.float16),
    ],
)
def test_the_forward_takes_the_rules_block_beside_its_outputs(batch, heads, length, head, value_head, dtype):
    """What the efficient kernel's forward asks of the caching allocator, from its history: the output
    and the row sums it returns, then exactly the rule's block, given back inside the call."""
    from pytorch_mem_profiler.estimate.scratch import efficient_attention_forward_scratch

    cuda = torch.device("cuda", torch.cuda.current_device())
    q = torch.randn(batch, heads, length, head, device=cuda, dtype=dtype, requires_grad=True)
    k = torch.randn(batch, heads, length, head, device=cuda, dtype=dtype, requires_grad=True)
    v = torch.randn(batch, heads, length, value_head, device=cuda, dtype=dtype, requires_grad=True)
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(enabled="all", context=None, stacks="python", max_entries=100_000)
    try:
        out = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True)
        torch.cuda.synchronize()
        trace = torch.cuda.memory._snapshot()["device_traces"][cuda.index]
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    taken = [entry for entry in trace if entry["action"] == "alloc"]
    given = {entry["addr"] for entry in trace if entry["action"] == "free_completed"}
    kept = [entry["size"] for entry in taken if entry["addr"] not in given]
    transient = [entry["size"] for entry in taken if entry["addr"] in given]
    # the output and the row sums (log-sum-exp) are the operator's own, kept
    assert kept[: 2] == [out[0].untyped_storage().nbytes(), out[1].untyped_storage().nbytes()]
    assert transient == list(efficient_attention_forward_scratch(batch, length, heads, head, value_head, q.element_size()))
