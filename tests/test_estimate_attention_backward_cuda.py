"""The efficient attention kernel's backward on the GPU: what it asks of the caching allocator beside
its three gradients, recorded call by call (``benchmarks/attention_backward_rules.py``), against
``estimate.scratch.efficient_attention_backward_scratch``.

    PYTHONPATH=. python3 -m pytest tests/test_estimate_attention_backward_cuda.py -m cuda -q
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from pytorch_mem_profiler.estimate.scratch import efficient_attention_backward_scratch  # noqa: E402

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
