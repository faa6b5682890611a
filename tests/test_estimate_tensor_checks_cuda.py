"""On a GPU: a vision-language model whose library checks its image tokens against the image features
(``torch._check`` on values the fake step lacks, taken as passing: ``estimate.tensor_checks``) is
estimated for CUDA, on fake CUDA tensors, within the zoo's 2% of ``torch.cuda.max_memory_allocated()``."""

from __future__ import annotations

import functools

import pytest
import torch

from pytorch_mem_profiler import estimate_memory

from .helpers import cuda_measured_peak, transformers_or_skip
from .test_estimate_tensor_checks import Llava, llava_inputs

pytestmark = pytest.mark.cuda


def _logits_loss(out: torch.Tensor) -> torch.Tensor:
    return out.float().mean()


@pytest.mark.parametrize("autocast", [None, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_vision_language_model_is_estimated_for_cuda_within_the_zoo_goal(autocast):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    transformers_or_skip()
    build = functools.partial(Llava, image=224, width=512, layers=4)
    # a function of the batch, as users hand one over: the token ids drawn at random have no values in the
    # fake step, so transformers' check of the image tokens is taken as passing (noted)
    inputs = functools.partial(llava_inputs, image=224, text=256)

    class Autocast(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = build()

        def forward(self, batch: list[torch.Tensor]) -> torch.Tensor:
            with torch.autocast("cuda", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
                return self.inner(batch)

    measured = cuda_measured_peak(Autocast, inputs(8), _logits_loss)
    estimate = estimate_memory(Autocast, inputs, optimizer=functools.partial(torch.optim.AdamW, lr=1e-4),
                               loss_fn=_logits_loss, batch_size=8, device="cuda", fit=False)  # fmt: skip
    assert abs(estimate.peak - measured) <= 0.02 * measured, (estimate.peak, measured)
    assert any("taken as passing" in note for note in estimate.notes), estimate.notes
