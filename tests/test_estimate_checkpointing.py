"""``estimate_memory(..., checkpointing=True)`` on transformers models: they checkpoint their own layers,
as their users turn it on, and the estimate equals the CPU measurement of that step to the byte.

A wrapper of ``torch.utils.checkpoint`` around each layer leaves the model's key-value cache on, and
each layer fills it in forward and again in recomputation: an encoder-decoder (T5, Marian) saves
other tensors the second time, and checkpoint refuses the step ("a different number of tensors was
saved"); Gemma2 recomputes attention over its keys stored twice (64 keys for 32 tokens) and fails.
transformers' own checkpointing turns the cache off.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from pytorch_mem_profiler import estimate_memory

from .helpers import KeywordInputs, measured_peak, transformers_or_skip

VOCAB, SEQ = 128, 16
ADAMW = functools.partial(torch.optim.AdamW, lr=1e-4)


def _model(kind: str):
    transformers = transformers_or_skip()
    if kind == "t5":
        config = transformers.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, decoder_start_token_id=0)
        return transformers.T5ForConditionalGeneration(config)
    if kind == "marian":
        config = transformers.MarianConfig(vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                                           decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
                                           pad_token_id=0, decoder_start_token_id=0)  # fmt: skip
        return transformers.MarianMTModel(config)
    config = transformers.Gemma2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=2, head_dim=8, sliding_window=8, max_position_embeddings=64)  # fmt: skip
    return transformers.Gemma2ForCausalLM(config)


def _inputs(kind: str, batch: int) -> dict[str, torch.Tensor]:
    made = {"input_ids": torch.randint(1, VOCAB, (batch, SEQ)), "attention_mask": torch.ones(batch, SEQ, dtype=torch.long)}
    if kind != "gemma2":
        made["decoder_input_ids"] = torch.randint(1, VOCAB, (batch, SEQ // 2))
    return made


def _loss(out, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.logits.reshape(-1, VOCAB), labels.reshape(-1))


@pytest.mark.parametrize("kind", ["t5", "marian", "gemma2"])
def test_a_transformers_model_checkpoints_its_own_layers_and_is_estimated_to_the_byte(kind):
    def build(checkpointing: bool):
        torch.manual_seed(0)
        model = _model(kind)
        if checkpointing:  # what the model's users do
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return KeywordInputs(model)

    width = SEQ if kind == "gemma2" else SEQ // 2
    labels = lambda batch=2: torch.randint(0, VOCAB, (batch, width))  # noqa: E731
    measured = measured_peak(lambda: build(True), lambda: _inputs(kind, 2), ADAMW, loss_fn=_loss, make_targets=labels)
    plain = measured_peak(lambda: build(False), lambda: _inputs(kind, 2), ADAMW, loss_fn=_loss, make_targets=labels)
    est = estimate_memory(lambda: build(False), lambda b: _inputs(kind, b), batch_size=2, optimizer=ADAMW, targets=lambda b: labels(b),
                          loss_fn=_loss, device="cpu", fit=False, checkpointing=True)  # fmt: skip
    assert est.peak == measured != plain
    layers = [name for name in est.checkpointed if name.rsplit(".", 1)[-1].isdigit()]
    assert len(layers) == (2 if kind == "gemma2" else 4), est.checkpointed
