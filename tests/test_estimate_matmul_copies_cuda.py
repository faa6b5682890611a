"""On a GPU: a ``sum()`` or ``mean()`` loss's gradient reaches the last linear layer expanded from one
number; cuBLAS cannot read it, and ATen copies it whole inside ``mm`` (the input's gradient, then the
weight's). The fake CUDA estimate makes those copies (``estimate.layout_copies``): checked against
``torch.cuda.max_memory_allocated()`` of the same steps, where the copy is the step's peak."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from pytorch_mem_profiler import estimate_memory
from pytorch_mem_profiler.estimate.layout_copies import COPYING_OPERATORS

from .test_estimate_rnn_cuda import _measured

pytestmark = pytest.mark.cuda

CUDA = torch.device("cuda")
VOCAB, WIDTH, BATCH, SEQ = 16_000, 256, 32, 256


class TokenHead(nn.Module):
    """An embedding, a hidden layer and a wide head: the head's output is the step's largest tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.hidden = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.hidden(self.embed(x))))


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_a_sum_losss_expanded_gradient_is_copied_inside_the_heads_mm(reduction, monkeypatch):
    """A ``sum()`` loss's gradient is copied (the step's peak rises by about the logits' size); a
    ``mean()`` loss's is not (its backward divides, which makes a dense tensor)."""
    loss = (lambda out: out.sum()) if reduction == "sum" else (lambda out: out.mean())
    measured = _measured(TokenHead, BATCH, SEQ, None, optimizer=torch.optim.AdamW, loss=loss)
    estimate = functools.partial(
        estimate_memory, TokenHead, lambda b: torch.zeros(b, SEQ, dtype=torch.long), batch_size=BATCH,
        optimizer=torch.optim.AdamW, loss_fn=loss, device=CUDA, workspace=0, fit=False,
    )  # fmt: skip
    est = estimate()
    assert abs(est.peak_allocated - measured) <= 0.01 * measured, (est.peak_allocated, measured)
    logits = BATCH * SEQ * VOCAB * 4
    for op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
        monkeypatch.delitem(COPYING_OPERATORS, op)  # the scratch rules are made from it for each estimate
    without = estimate()
    if reduction == "sum":  # expanded from one number: copied, at the step's peak
        assert est.peak_allocated - without.peak_allocated >= logits // 2, (est.peak_allocated, without.peak_allocated)
    else:  # mean's backward divides the expanded gradient: a dense tensor, read in place
        assert est.peak_allocated == without.peak_allocated
