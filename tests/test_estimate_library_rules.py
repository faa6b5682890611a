"""Libraries' choices from values, made for fake tensors as the real step makes them
(``estimate/library_rules.py``): transformers' packed-sequence check without a cache."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from pytorch_mem_profiler import estimate_memory
from pytorch_mem_profiler.estimate.library_rules import library_rules

from .helpers import KeywordInputs, measured_peak, transformers_or_skip

VOCAB, SEQ = 128, 32
SGD = functools.partial(torch.optim.SGD, lr=0.1)


def _decoder(kind: str, checkpointing: bool | None):
    transformers = transformers_or_skip()
    config_class, model_class = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    }[kind]

    def build():
        torch.manual_seed(0)
        config = config_class(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=2, intermediate_size=64, max_position_embeddings=64, use_cache=False)  # fmt: skip
        model = model_class(config)
        if checkpointing is not None:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": checkpointing})
        return model

    return build


def _loss(out, labels):
    return F.cross_entropy(out.logits.reshape(-1, VOCAB), labels.reshape(-1))


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("checkpointing", [None, False, True], ids=["no_cache", "non_reentrant", "reentrant"])
def test_a_decoder_trained_without_a_cache_is_estimated_to_the_byte(kind, checkpointing):
    """Without a cache and an attention mask transformers checks the position ids for packed
    sequences; the model's own ids are a range, so the real step builds no mask, nor may the estimate."""
    build = _decoder(kind, checkpointing)
    ids = lambda batch=2: torch.randint(0, VOCAB, (batch, SEQ))  # noqa: E731
    measured = measured_peak(build, ids, SGD, loss_fn=_loss, make_targets=ids)
    est = estimate_memory(build, lambda b: ids(b), batch_size=2, optimizer=SGD, targets=lambda b: ids(b), loss_fn=_loss,
                          device="cpu", fit=False)  # fmt: skip
    assert est.peak == measured


def test_packed_position_ids_given_as_inputs_are_left_to_transformers():
    """Position ids in the step's inputs carry the user's values, which the fake step does not keep:
    transformers builds the packed sequences' mask, as the real step does for packed rows."""
    build = _decoder("llama", None)
    positions = torch.cat([torch.arange(SEQ // 2), torch.arange(SEQ // 2)]).repeat(2, 1)  # two sequences a row
    inputs = lambda batch=2: {"input_ids": torch.randint(0, VOCAB, (batch, SEQ)), "position_ids": positions[:batch].clone()}  # noqa: E731
    ids = lambda batch=2: torch.randint(0, VOCAB, (batch, SEQ))  # noqa: E731
    sgd_step = measured_peak(lambda: KeywordInputs(build()), inputs, SGD, loss_fn=_loss, make_targets=ids)
    est = estimate_memory(lambda: KeywordInputs(build()), lambda b: inputs(b), batch_size=2, optimizer=SGD,
                          targets=lambda b: ids(b), loss_fn=_loss, device="cpu", fit=False)  # fmt: skip
    assert est.peak == sgd_step


def test_without_transformers_loaded_the_rules_change_nothing(monkeypatch):
    import sys

    monkeypatch.delitem(sys.modules, "transformers.masking_utils", raising=False)
    with library_rules([torch.zeros(2)]):
        assert "transformers.masking_utils" not in sys.modules


def _language_model(kind: str):
    """A small transformers model built from its config: a decoder (Llama, GPT-2) or an encoder (BERT)."""
    if kind == "llama":
        return _decoder("llama", None)
    transformers = transformers_or_skip()

    def build():
        torch.manual_seed(0)
        if kind == "gpt2":
            config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64)
            return transformers.GPT2LMHeadModel(config)
        config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                         intermediate_size=64, max_position_embeddings=64)  # fmt: skip
        return transformers.BertForMaskedLM(config)

    return build


def _mask(batch: int, padded: bool) -> torch.Tensor:
    """An attention mask: all ones, or the first row's last quarter padding (zeros)."""
    mask = torch.ones(batch, SEQ, dtype=torch.long)
    if padded:
        mask[0, -SEQ // 4 :] = 0
    return mask


@pytest.mark.parametrize("kind", ["llama", "gpt2", "bert"])
@pytest.mark.parametrize("padded", [False, True], ids=["ones", "padded"])
def test_an_attention_mask_made_by_the_inputs_function_is_read_as_the_real_step_reads_it(kind, padded):
    """transformers skips a mask without padding (scaled dot-product attention's ``is_causal``, or no mask
    for an encoder) and builds one with padding: the mask the inputs' function makes keeps its values, so
    the fake step decides as the real one, to the byte (the unpadded step is the smaller)."""
    build = _language_model(kind)
    inputs = lambda batch=2: {"input_ids": torch.randint(0, VOCAB, (batch, SEQ)), "attention_mask": _mask(batch, padded)}  # noqa: E731
    ids = lambda batch=2: torch.randint(0, VOCAB, (batch, SEQ))  # noqa: E731
    measured = measured_peak(lambda: KeywordInputs(build()), inputs, SGD, loss_fn=_loss, make_targets=ids)
    est = estimate_memory(lambda: KeywordInputs(build()), lambda b: inputs(b), batch_size=2, optimizer=SGD,
                          targets=lambda b: ids(b), loss_fn=_loss, device="cpu", fit=False)  # fmt: skip
    assert est.peak == measured


@pytest.mark.parametrize("padded", [False, True], ids=["ones", "padded"])
def test_a_templates_mask_keeps_its_values_row_after_row_at_another_batch(padded):
    """Inputs given as real tensors (a template of batch 2) estimated at batch 3: the mask's rows repeat
    (row 0, row 1, row 0), as the step measured on those rows has them."""
    build = _language_model("llama")
    template = {"input_ids": torch.randint(0, VOCAB, (2, SEQ)), "attention_mask": _mask(2, padded)}
    rows = torch.tensor([0, 1, 0])
    at_three = lambda: {"input_ids": torch.randint(0, VOCAB, (3, SEQ)), "attention_mask": template["attention_mask"][rows].clone()}  # noqa: E731
    ids = lambda: torch.randint(0, VOCAB, (3, SEQ))  # noqa: E731
    measured = measured_peak(lambda: KeywordInputs(build()), at_three, SGD, loss_fn=_loss, make_targets=ids)
    est = estimate_memory(lambda: KeywordInputs(build()), template, batch_size=3, optimizer=SGD,
                          targets=lambda b: torch.randint(0, VOCAB, (b, SEQ)), loss_fn=_loss, device="cpu", fit=False)  # fmt: skip
    assert est.peak == measured
    assert template["attention_mask"].sum() == 2 * SEQ - (SEQ // 4 if padded else 0)  # the user's tensor untouched


def test_the_unpadded_mask_is_skipped_and_the_padded_one_built():
    """The two estimates differ as the two real steps do: the exactness above is not two equal wrong figures."""
    build = _language_model("llama")
    figures = []
    for padded in (False, True):
        inputs = lambda b, padded=padded: {"input_ids": torch.randint(0, VOCAB, (b, SEQ)), "attention_mask": _mask(b, padded)}  # noqa: E731
        figures.append(estimate_memory(lambda: KeywordInputs(build()), inputs, batch_size=2, optimizer=SGD,
                                       targets=lambda b: torch.randint(0, VOCAB, (b, SEQ)), loss_fn=_loss, device="cpu", fit=False).peak)  # fmt: skip
    assert figures[0] < figures[1]


@pytest.mark.parametrize("kind", ["pegasus", "bart"])
def test_a_decoder_given_no_attention_mask_makes_one_of_ones_that_transformers_skips(kind):
    """An encoder-decoder's decoder given no mask makes one of ones itself (``torch.ones(batch,
    length)``, floating point); transformers reads it (``fast_all``) and builds no causal mask, as
    the real step does: the fill factory's values are kept in the fake step."""
    transformers = transformers_or_skip()
    config_class, model_class = {
        "pegasus": (transformers.PegasusConfig, transformers.PegasusForConditionalGeneration),
        "bart": (transformers.BartConfig, transformers.BartForConditionalGeneration),
    }[kind]

    def build():
        torch.manual_seed(0)
        config = config_class(vocab_size=VOCAB, d_model=64, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
                              decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, max_position_embeddings=64)  # fmt: skip
        return KeywordInputs(model_class(config))

    def batch(size: int = 2) -> dict[str, torch.Tensor]:
        return {"input_ids": torch.randint(3, VOCAB, (size, SEQ)), "decoder_input_ids": torch.randint(3, VOCAB, (size, SEQ))}

    loss = lambda out: out.logits.float().sum()  # noqa: E731
    measured = measured_peak(build, batch, SGD, loss_fn=loss)
    est = estimate_memory(build, batch(), optimizer=SGD, loss_fn=loss, device="cpu", fit=False)
    assert est.peak == measured
