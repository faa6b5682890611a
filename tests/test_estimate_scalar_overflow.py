"""A fill whose number overflows its tensor's dtype: the real step raises, and so does the estimate.

Each fill is run for real and in the estimate's fake mode on the same arguments: the fake mode
refuses exactly where the real kernel does (this torch's own behaviour, whatever its version).
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from pytorch_mem_profiler import estimate_memory
from pytorch_mem_profiler.estimate.fake import fake_mode
from pytorch_mem_profiler.estimate.scalar_overflow import ScalarOverflow

from .helpers import measured_peak

FP32_MIN = torch.finfo(torch.float32).min

FILLS = {
    "fill_": lambda t, m, v: t.fill_(v),
    "masked_fill": lambda t, m, v: t.masked_fill(m, v),
    "masked_fill_": lambda t, m, v: t.masked_fill_(m, v),
    "masked_fill_tensor": lambda t, m, v: t.masked_fill(m, torch.tensor(v)),
    "index_fill": lambda t, m, v: t.index_fill(0, torch.tensor([1]), v),
    "scatter_value": lambda t, m, v: t.scatter(0, torch.tensor([[1, 0, 0, 0]]), v),
    "full": lambda t, m, v: torch.full((2, 4), v, dtype=t.dtype),
    "new_full": lambda t, m, v: t.new_full((2, 4), v),
    "full_like": lambda t, m, v: torch.full_like(t, v),
}
CASES = [
    (torch.bfloat16, FP32_MIN),
    (torch.float16, -1e5),
    (torch.float16, -65504.0),  # float16's own lowest: fits
    (torch.float32, -1e39),
    (torch.bfloat16, float("-inf")),  # infinities convert
    (torch.bfloat16, torch.finfo(torch.bfloat16).min),
]


def _real_raises(fill, dtype, value) -> bool:
    t, m = torch.zeros(2, 4, dtype=dtype), torch.zeros(2, 4, dtype=torch.bool)
    try:
        fill(t, m, value)
    except RuntimeError as err:
        assert "without overflow" in str(err)
        return True
    return False


@pytest.mark.parametrize("dtype,value", CASES, ids=lambda v: str(v))
@pytest.mark.parametrize("name", sorted(FILLS))
def test_the_fake_mode_refuses_a_fill_where_the_real_kernel_does(name, dtype, value):
    fill = FILLS[name]
    expected = _real_raises(fill, dtype, value)
    mode = fake_mode()
    with mode:
        t, m = torch.zeros(2, 4, dtype=dtype), torch.zeros(2, 4, dtype=torch.bool)
        try:
            fill(t, m, value)
            refused = None
        except ScalarOverflow as err:
            refused = str(err)
    assert (refused is not None) == expected, (name, dtype, value, refused)
    if refused:
        assert refused.startswith("value cannot be converted to type") and "the real step raises this too" in refused


def test_arithmetic_with_a_large_number_is_not_refused():
    """A Python number in arithmetic is a wrapped tensor, converted without a check, on the device too."""
    mode = fake_mode()
    with mode:
        scores = torch.empty(2, 4, dtype=torch.bfloat16)
        added = scores + FP32_MIN
        chosen = torch.where(torch.empty(2, 4, dtype=torch.bool), scores, FP32_MIN)
    assert added.dtype == chosen.dtype == torch.bfloat16


class MaskedScores(nn.Module):
    """Attention scores masked with a floating-point type's lowest number: under bf16 autocast the
    scores are bfloat16, and float32's lowest does not fit them (DeBERTa v1 masks so)."""

    def __init__(self, lowest_of_scores: bool) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 16)
        self.lowest_of_scores = lowest_of_scores

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        scores = h @ h.transpose(-1, -2)
        mask = torch.ones(scores.shape, dtype=torch.bool, device=x.device).triu(1)
        lowest = torch.finfo(scores.dtype if self.lowest_of_scores else torch.float32).min
        return scores.masked_fill(mask, lowest).softmax(-1) @ h


def _inputs(batch: int) -> torch.Tensor:
    return torch.randn(batch, 8, 16)


@pytest.mark.parametrize("on_gpu", [False, True], ids=["cpu", "gpu_emulated_or_fake"])
def test_a_step_that_overflows_a_fill_is_refused_as_the_real_step_fails(on_gpu):
    """On the CPU, and for CUDA (emulated without a GPU): the estimate raises the real kernel's error."""
    device = "cuda" if on_gpu else "cpu"
    build = functools.partial(MaskedScores, False)
    with pytest.raises(RuntimeError, match="without overflow"):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            build()(_inputs(2))
    with pytest.raises(ScalarOverflow, match=r"value cannot be converted to type c10::BFloat16 without overflow \(aten\.masked_fill"):
        estimate_memory(build, _inputs, batch_size=2, device=device, autocast=torch.bfloat16, fit=False)


def test_the_same_step_masked_with_its_own_dtypes_lowest_is_estimated_to_the_byte():
    build = functools.partial(MaskedScores, True)
    sgd = functools.partial(torch.optim.SGD, lr=0.1)
    measured = measured_peak(build, lambda: _inputs(4), sgd, autocast=torch.bfloat16)
    estimate = estimate_memory(build, _inputs, optimizer=sgd, batch_size=4, device="cpu", autocast=torch.bfloat16, fit=False)
    assert estimate.peak == measured
