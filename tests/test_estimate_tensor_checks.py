"""A library's check on values the fake step does not have is taken as passing, and noted; one on
values it has is checked, failing as the real step fails (``estimate.tensor_checks``)."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from pytorch_mem_profiler import estimate_memory

from .helpers import measured_peak, transformers_or_skip


class MarkedTokens(nn.Module):
    """Scatters a learned vector into the positions of a marker token, after checking, as
    vision-language models check their image tokens, that as many markers as expected are there."""

    def __init__(self, marker: int = 7, expected: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 32)
        self.fill = nn.Parameter(torch.zeros(32))
        self.head = nn.Linear(32, 4)
        self.marker, self.expected = marker, expected

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mask = ids == self.marker
        torch._check_tensor_all_with(ValueError, mask.sum(1) == self.expected, lambda: "marker count")
        h = self.embed(ids)
        h = h.masked_scatter(mask.unsqueeze(-1), self.fill.expand(int(ids.shape[0]) * self.expected, 32))
        return self.head(h)


def _ids(batch: int) -> torch.Tensor:
    ids = torch.randint(0, 7, (batch, 12))
    ids[:, :3] = 7  # three markers a row: what the check expects
    return ids


def test_a_check_on_data_is_taken_as_passing_noted_and_the_step_exact():
    sgd = functools.partial(torch.optim.SGD, lr=0.1)
    original = torch._check_tensor_all_with
    measured = measured_peak(MarkedTokens, lambda: _ids(4), sgd)
    estimate = estimate_memory(MarkedTokens, _ids, optimizer=sgd, batch_size=4, device="cpu", fit=False)
    assert estimate.peak == measured
    assert any("taken as passing" in note and "test_estimate_tensor_checks.py" in note for note in estimate.notes), estimate.notes
    assert torch._check_tensor_all_with is original  # nothing left installed


def test_a_check_on_values_the_step_has_fails_as_the_real_step_fails():
    """Markers the inputs fix (a fill), counted against the wrong number: the real step raises, so does the estimate."""
    build = functools.partial(MarkedTokens, 7, 4)
    fixed = lambda b: torch.full((b, 12), 7, dtype=torch.long)  # noqa: E731 - twelve markers a row, four expected
    with pytest.raises(ValueError, match="marker count"):
        build()(fixed(2))
    with pytest.raises(ValueError, match="marker count"):
        estimate_memory(build, fixed, batch_size=2, device="cpu", fit=False)


class Llava(nn.Module):
    """transformers' Llava (a CLIP vision tower, a Llama decoder), its batch ``[token ids, pixels]`` as
    one list; ``image`` pixels a side in patches of 8 (or 16 from 64 up), ``width`` the decoder's width."""

    def __init__(self, image: int = 32, width: int = 64, layers: int = 2) -> None:
        super().__init__()
        transformers = transformers_or_skip()
        torch.manual_seed(0)
        patch = 16 if image >= 64 else 8
        vision = transformers.CLIPVisionConfig(image_size=image, patch_size=patch, hidden_size=width // 2,
                                               intermediate_size=width, num_hidden_layers=layers, num_attention_heads=4)  # fmt: skip
        text = transformers.LlamaConfig(vocab_size=256, hidden_size=width, intermediate_size=2 * width, num_hidden_layers=layers,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048)  # fmt: skip
        config = transformers.LlavaConfig(vision_config=vision, text_config=text, image_token_id=255, vision_feature_layer=-1,
                                          vision_feature_select_strategy="full")  # fmt: skip
        self.model = transformers.LlavaForConditionalGeneration(config)
        self.image_tokens = (image // patch) ** 2 + 1  # the patches and the class token

    def forward(self, batch: list[torch.Tensor]) -> torch.Tensor:
        ids, pixels = batch
        return self.model(input_ids=ids, pixel_values=pixels).logits


def llava_inputs(batch: int, image: int = 32, text: int = 20) -> list[torch.Tensor]:
    """A Llava batch: as many image tokens as the vision tower gives features, then ``text`` tokens."""
    patch = 16 if image >= 64 else 8
    image_ids = torch.full((batch, (image // patch) ** 2 + 1), 255, dtype=torch.long)
    return [torch.cat([image_ids, torch.randint(1, 255, (batch, text))], 1), torch.randn(batch, 3, image, image)]


def test_a_vision_language_model_is_estimated_to_the_byte_on_the_cpu():
    """transformers' Llava checks that its image tokens match the image features it scatters into them."""
    transformers_or_skip()
    adamw = functools.partial(torch.optim.AdamW, lr=1e-4)
    measured = measured_peak(Llava, lambda: llava_inputs(2), adamw)
    estimate = estimate_memory(Llava, llava_inputs, optimizer=adamw, batch_size=2, device="cpu", fit=False)
    assert estimate.peak == measured


class GaussianHead(nn.Module):
    """A regressor with a Normal (or Student-t) head, trained by its negative log-likelihood, as a
    probabilistic forecaster or an actor's policy is: ``torch.distributions`` validates the scale
    (positive) and the sample (in the support) from values at each call."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 2 * 8))
        self.kind = kind

    def forward(self, batch: list[torch.Tensor]) -> torch.Tensor:
        x, y = batch
        loc, raw = self.body(x).chunk(2, -1)
        scale = nn.functional.softplus(raw) + 1e-3
        if self.kind == "normal":
            dist = torch.distributions.Normal(loc, scale, validate_args=True)
        else:
            dist = torch.distributions.StudentT(3.0 + scale.detach(), loc, scale, validate_args=True)
        return -dist.log_prob(y).mean(-1)


def _regression(batch: int) -> list[torch.Tensor]:
    return [torch.randn(batch, 16), torch.randn(batch, 8)]


@pytest.mark.parametrize("kind", ["normal", "student_t"])
def test_a_distribution_s_validation_is_taken_as_passing_and_the_step_exact(kind):
    """``torch.distributions`` checks its arguments and the sample (``torch._is_all_true``), refused
    before at the distribution's line (transformers' Informer and time-series heads build one)."""
    adamw = functools.partial(torch.optim.AdamW, lr=1e-4)
    build = functools.partial(GaussianHead, kind)
    measured = measured_peak(build, lambda: _regression(4), adamw)
    estimate = estimate_memory(build, _regression, optimizer=adamw, batch_size=4, device="cpu", fit=False)
    assert estimate.peak == measured
    assert any("taken as passing" in note and "test_estimate_tensor_checks.py" in note for note in estimate.notes), estimate.notes


def test_a_distribution_s_validation_on_known_values_still_fails_as_the_real_step():
    """A scale with values (a real tensor) that is not positive fails as torch fails it; one without
    values (a fake tensor the step made) is taken as passing."""
    from pytorch_mem_profiler.estimate.fake import fake_mode
    from pytorch_mem_profiler.estimate.tensor_checks import checks_taken_as_passing

    with checks_taken_as_passing() as taken, pytest.raises(ValueError, match="scale"):
        torch.distributions.Normal(torch.zeros(3), torch.full((3,), -1.0), validate_args=True)
    assert taken == {}
    with fake_mode(), checks_taken_as_passing() as taken:
        torch.distributions.Normal(torch.zeros(3), torch.empty(3), validate_args=True)
    assert sum(taken.values()) == 2  # the location and the scale: neither has values


class DelayAggregation(nn.Module):
    """Autoformer's time-delay aggregation: the delays ``topk`` picks from the data, each read back as a
    0-d index (``x[:, delays[i]]``: a view whichever delay) and used to roll the values."""

    def __init__(self, width: int = 16, top: int = 3) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj, self.out = nn.Linear(width, width), nn.Linear(width, width)
        self.top = top

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        v = self.proj(x)  # (batch, length, width)
        scores = (v * x).mean(-1)  # (batch, length)
        _, delays = torch.topk(scores.mean(0), self.top)
        weights = torch.softmax(torch.stack([scores[:, delays[i]] for i in range(self.top)], -1), -1)
        mixed = sum(weights[:, i, None, None] * torch.roll(v, -int(i), 1) for i in range(self.top))
        return self.out(mixed)


def test_indexing_by_a_position_the_data_picks_is_taken_as_zero_noted_and_exact():
    """A 0-d integer index is a ``select`` (a view) whichever position it holds: refused before, exact now."""
    adamw = functools.partial(torch.optim.AdamW, lr=1e-4)
    measured = measured_peak(DelayAggregation, lambda: torch.randn(4, 24, 16), adamw)
    estimate = estimate_memory(DelayAggregation, lambda b: torch.randn(b, 24, 16), optimizer=adamw, batch_size=4, device="cpu", fit=False)
    assert estimate.peak == measured
    # three positions a step, over the two steps the estimate runs
    assert any("indexed by 6 positions" in note and "test_estimate_tensor_checks.py" in note for note in estimate.notes), estimate.notes
