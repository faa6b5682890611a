"""The registries' real sizes are run only on the GPU machine, where a label past a model's last
class (or a token id past its vocabulary) is a device-side assert that breaks every later test of
the process. Here every model of every registry trained with a class or token loss is built at its
``real`` size on the meta device (no memory, no arithmetic) and run once at a batch of two: each
label its targets draw must have a logit, and each token id its inputs draw an embedding row.

A model whose constructor reads a tensor's value is built on the CPU and moved to the meta device.
Where the forward itself reads values (transformers' mask checks, packed sequences), the logits'
width is the model's output embedding's or its configured number of labels.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.zoo import registries  # noqa: E402
from benchmarks.zoo.registry import ZooModel, _logits, class_loss, token_loss  # noqa: E402
from benchmarks.zoo.training import call, tensors_of, to_device  # noqa: E402

from .zoo_cases import cases  # noqa: E402

META = torch.device("meta")
LABELLED = {
    f"{registry}:{name}": entry
    for registry, models in registries().items()
    for name, entry in models.items()
    if entry.loss in (class_loss, token_loss)
}


def _build_on_meta(entry: ZooModel) -> torch.nn.Module:
    try:
        with META:
            return entry.build("real")
    except (NotImplementedError, RuntimeError):  # the constructor reads a value: build it for real
        return entry.build("real").to(META)


def _embeddings(model: torch.nn.Module, which: str) -> torch.nn.Module | None:
    """``model.get_input_embeddings()`` (``which="input"``) or the output's, where the model has them."""
    try:
        return getattr(model, f"get_{which}_embeddings")()
    except (AttributeError, NotImplementedError):  # not a transformers model, or one without them
        return None


def _configured_width(model: torch.nn.Module, tokens: bool) -> int | None:
    """The logits' width a transformers model declares: its output embedding's, else, for a token
    loss, its vocabulary's (Perceiver decodes tokens without an output embedding), else its labels'."""
    out = _embeddings(model, "output")
    if out is not None and hasattr(out, "out_features"):
        return int(out.out_features)
    config = getattr(model, "config", None)
    if config is None:
        return None
    if tokens and getattr(config, "vocab_size", None):
        return int(config.vocab_size)
    return int(config.num_labels) if hasattr(config, "num_labels") else None


def _logit_widths(entry: ZooModel, model: torch.nn.Module, inputs: Any) -> list[int]:
    try:
        with torch.no_grad():
            output = call(model, to_device(inputs, META))
    except (NotImplementedError, RuntimeError, AttributeError):  # the forward reads values (or, on torch 2.4,
        # checkpointing looks for a `torch.meta` device module)
        width = _configured_width(model, tokens=entry.loss is token_loss)
        if width is not None:
            return [width]
        # a model of torch's own (packed sequences, routing by nonzero): one real forward on the CPU
        with torch.no_grad():
            output = call(entry.build("real"), inputs)
    outputs = output if isinstance(output, tuple) and not hasattr(output, "logits") else (output,)
    return [_logits(o).shape[-1] for o in outputs]  # a distilled model's two heads


def test_the_labelled_models_are_found():
    assert len(LABELLED) >= 80


@pytest.mark.parametrize("key", cases(LABELLED, on_cpu=False))
def test_each_label_has_a_logit_and_each_token_an_embedding_at_the_real_size(key):
    entry = LABELLED[key]
    model = _build_on_meta(entry)
    inputs, targets = entry.make_inputs("real", 2), entry.make_targets("real", 2)
    widths = _logit_widths(entry, model, inputs)
    labels = [t for t in tensors_of(targets) if not t.is_floating_point() and t.dtype != torch.bool]
    largest_label = max(int(t.max()) for t in labels)
    assert largest_label < min(widths), (key, largest_label, widths)
    embeddings = _embeddings(model, "input")
    if isinstance(inputs, dict) and isinstance(embeddings, torch.nn.Embedding):
        for name, ids in inputs.items():
            if name.endswith("input_ids"):
                assert int(ids.max()) < embeddings.num_embeddings, (key, name, int(ids.max()), embeddings.num_embeddings)
