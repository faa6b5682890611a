"""On a GPU: values a step reads from tensors it makes on the GPU's device (a mask of ones, a
LayerDrop draw) are read in the fake CUDA step as the real step reads them (kept on the CPU, see
``pytorch_mem_profiler.estimate.draws``), so the estimate takes the real step's branches: checked
against ``torch.cuda.max_memory_allocated()`` of the same two steps."""

from __future__ import annotations

import functools
import gc

import pytest
import torch
from torch import nn

from pytorch_mem_profiler import estimate_memory
from pytorch_mem_profiler.estimate.draws import Draws

from .helpers import cuda_measured_peak, transformers_or_skip

pytestmark = pytest.mark.cuda

ADAMW = functools.partial(torch.optim.AdamW, lr=1e-4)
BATCH, SEQ, VOCAB = 8, 512, 32_000


def _opt():
    transformers = transformers_or_skip()
    config = transformers.OPTConfig(
        hidden_size=512, num_hidden_layers=4, num_attention_heads=8, ffn_dim=2048, vocab_size=VOCAB,
        max_position_embeddings=SEQ, word_embed_proj_dim=512,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.OPTForCausalLM(config)


def _logits_loss(out) -> torch.Tensor:
    return out.logits.float().mean()


def test_a_mask_of_ones_made_on_the_gpu_is_skipped_as_the_real_step_skips_it(monkeypatch):
    """OPT given no attention mask makes ``torch.ones(batch, length)`` on the GPU; transformers reads
    it and, all ones, skips the causal mask for scaled dot-product attention's ``is_causal``. The fake
    CUDA step reads it the same way; without the values it builds a (batch, 1, length, length) mask
    the real step does not."""
    inputs = {"input_ids": torch.randint(0, VOCAB, (BATCH, SEQ))}
    measured = cuda_measured_peak(_opt, inputs, _logits_loss)
    estimate = estimate_memory(_opt, inputs, optimizer=ADAMW, loss_fn=_logits_loss, device="cuda", fit=False)
    assert abs(estimate.peak - measured) <= 0.005 * measured, (estimate.peak, measured)
    assert _masks_built(estimate) == 0
    monkeypatch.setattr(Draws, "_keep_value", lambda self, mode, fake, real: None)  # no values on the GPU's device
    without = estimate_memory(_opt, inputs, optimizer=ADAMW, loss_fn=_logits_loss, device="cuda", fit=False)
    assert _masks_built(without) > 0
    assert without.peak > estimate.peak


def _masks_built(estimate) -> int:
    """Float (batch, 1, length, length) masks transformers' mask functions made (``torch.where``)."""
    events = estimate.step_events
    size = BATCH * SEQ * SEQ * 4
    return sum(1 for key, n in events.events if n == size and events.sources.get(key, "").startswith("aten.where"))


class DeviceLayerDrop(nn.Module):
    """Layers skipped when a draw on the input's device falls below ``p``."""

    def __init__(self, p: float, width: int = 1024, layers: int = 4) -> None:
        super().__init__()
        self.p = p
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            if self.training and torch.rand([], device=x.device) < self.p:
                continue
            x = x + layer(x)
        return x


def test_a_draw_on_the_gpu_is_taken_in_the_fake_step_and_its_read_noted():
    """With ``p = 0`` no layer is skipped whatever the draw: the estimate is of the real step, and the
    line that read the draw is named (it was refused before values lived beside fake CUDA tensors)."""
    x = torch.randn(512, 1024)
    build = functools.partial(DeviceLayerDrop, 0.0)
    loss = lambda out: out.float().pow(2).mean()  # noqa: E731
    measured = cuda_measured_peak(build, x, loss)
    estimate = estimate_memory(build, x, optimizer=ADAMW, loss_fn=loss, device="cuda", fit=False)
    assert abs(estimate.peak - measured) <= 0.005 * measured, (estimate.peak, measured)
    assert any("torch.rand([], device=x.device)" in line for line in estimate.random_reads)
    # at p = 0.5, by default the step that skips no layer (the draw on the device at the top of its range)
    half = estimate_memory(functools.partial(DeviceLayerDrop, 0.5), x, optimizer=ADAMW, loss_fn=loss, device="cuda", fit=False)
    assert half.peak == estimate.peak and half.random_draws == "top"
    seeded = estimate_memory(functools.partial(DeviceLayerDrop, 0.5), x, optimizer=ADAMW, loss_fn=loss, device="cuda", fit=False,
                             random_draws="seeded")  # fmt: skip
    assert seeded.peak < half.peak


def _ones_batch(batch: int) -> dict[str, torch.Tensor]:
    return {"input_ids": torch.randint(0, VOCAB, (batch, SEQ)), "attention_mask": torch.ones(batch, SEQ, dtype=torch.long)}


def test_a_mask_of_ones_sent_from_the_cpu_is_skipped_as_the_real_step_skips_it(monkeypatch):
    """A user's batch is made on the CPU (a tokenizer's attention mask, all ones without padding) and
    sent to the GPU. transformers reads the mask and skips it; the fake CUDA step reads the value
    the user gave, whether the inputs are a template on the CPU, on the GPU or a function. Without
    the value it builds (batch, 1, length, length) masks the real step does not."""
    inputs = _ones_batch(BATCH)
    measured = cuda_measured_peak(_opt, inputs, _logits_loss)
    on_gpu = {k: v.cuda() for k, v in inputs.items()}
    for given in (inputs, on_gpu, _ones_batch):
        estimate = estimate_memory(_opt, given, batch_size=BATCH, optimizer=ADAMW, loss_fn=_logits_loss, device="cuda", fit=False)
        assert abs(estimate.peak - measured) <= 0.005 * measured, (estimate.peak, measured)
        assert _masks_built(estimate) == 0
    monkeypatch.setattr(Draws, "placed", lambda self, mode, fake, value: fake)
    without = estimate_memory(_opt, inputs, optimizer=ADAMW, loss_fn=_logits_loss, device="cuda", fit=False)
    assert _masks_built(without) > 0
    assert without.peak > estimate.peak


def test_a_model_that_fails_on_a_built_mask_is_estimated_as_it_runs():
    """Nystromformer adds the mask to its landmarks' scores, which a built (batch, 1, length, length)
    mask does not fit: the real step runs, as the mask of ones is skipped, and so must the estimate
    (it raised before the mask's value went to the GPU with it)."""
    transformers = transformers_or_skip()

    def build():
        config = transformers.NystromformerConfig(
            vocab_size=VOCAB, hidden_size=256, num_hidden_layers=2, num_attention_heads=4, intermediate_size=1024,
            max_position_embeddings=SEQ + 2, segment_means_seq_len=SEQ, num_landmarks=64, num_labels=4,
        )  # fmt: skip
        torch.manual_seed(0)
        return transformers.NystromformerForSequenceClassification(config)

    inputs = _ones_batch(BATCH)
    loss = lambda out: out.logits.float().mean()  # noqa: E731
    measured = cuda_measured_peak(build, inputs, loss)
    estimate = estimate_memory(build, inputs, optimizer=ADAMW, loss_fn=loss, device="cuda", fit=False)
    assert abs(estimate.peak - measured) <= 0.02 * measured, (estimate.peak, measured)


class KeptPatches(nn.Module):
    """Only the patches a mask keeps go through the network, found by ``nonzero`` on the GPU (as
    ViLT's visual embedding finds its image's patches from the pixel mask)."""

    def __init__(self, patch: int = 48, width: int = 1024) -> None:
        super().__init__()
        self.proj = nn.Linear(patch, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, patches: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        kept = mask.nonzero()
        x = self.proj(patches[kept[:, 0], kept[:, 1]])
        return x + self.mlp(x)


def _half_masked(batch: int = 64, patches: int = 1024) -> dict[str, torch.Tensor]:
    mask = torch.ones(batch, patches, dtype=torch.long)
    mask[::2, patches // 4 :] = 0  # every other image keeps a quarter of its patches
    return {"patches": torch.randn(batch, patches, 48), "mask": mask}


def test_nonzero_of_a_mask_the_user_gave_sizes_the_step_as_the_real_one():
    """``mask.nonzero()`` on the GPU: its shape is the mask's value, which the estimate keeps beside
    the fake CUDA tensor (it refused with ``aten.nonzero`` before); the kept patches' activations
    are sized by it, 62.5% of the patches here."""
    inputs = _half_masked()
    loss = lambda out: out.float().pow(2).mean()  # noqa: E731
    measured = cuda_measured_peak(KeptPatches, inputs, loss)
    estimate = estimate_memory(KeptPatches, inputs, optimizer=ADAMW, loss_fn=loss, device="cuda", fit=False)
    assert abs(estimate.peak - measured) <= 0.005 * measured, (estimate.peak, measured)
    every_patch = estimate_memory(KeptPatches, {**inputs, "mask": torch.ones_like(inputs["mask"])}, optimizer=ADAMW, loss_fn=loss, device="cuda", fit=False)
    assert every_patch.peak > estimate.peak * 1.2


def test_vilt_is_estimated_with_the_patches_its_pixel_mask_keeps():
    transformers = transformers_or_skip()

    def build():
        config = transformers.ViltConfig(
            vocab_size=VOCAB, hidden_size=256, num_hidden_layers=2, num_attention_heads=4, intermediate_size=1024,
            max_position_embeddings=40, image_size=128, patch_size=16, num_labels=10, max_image_length=-1,
        )  # fmt: skip
        torch.manual_seed(0)
        return transformers.ViltForQuestionAnswering(config)

    inputs = {
        "input_ids": torch.randint(1, VOCAB, (BATCH, 32)), "pixel_values": torch.randn(BATCH, 3, 128, 128),
        "pixel_mask": torch.ones(BATCH, 128, 128, dtype=torch.long),
    }  # fmt: skip
    loss = lambda out: out.logits.float().pow(2).mean()  # noqa: E731
    measured = cuda_measured_peak(build, inputs, loss)
    estimate = estimate_memory(build, inputs, optimizer=ADAMW, loss_fn=loss, device="cuda", fit=False)
    assert abs(estimate.peak - measured) <= 0.02 * measured, (estimate.peak, measured)
