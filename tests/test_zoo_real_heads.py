"""The registries' real sizes are run only on the GPU machine, where a label past a model's last
class is a device-side assert that breaks every later test of the process. Here every classifier
of every registry is built at its ``real`` size on the meta device (no memory, no arithmetic) and
run once: its logits must have a column for each class its targets draw.

A model whose constructor reads a tensor's value is built on the CPU and moved to the meta device.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.zoo import ZOO  # noqa: E402
from benchmarks.zoo.holdout_text import HOLDOUT_TEXT  # noqa: E402
from benchmarks.zoo.holdout_vision import HOLDOUT_VISION  # noqa: E402
from benchmarks.zoo.registry import ZooModel, _class_targets, _logits, _num_classes  # noqa: E402
from benchmarks.zoo.sweep import SWEEP  # noqa: E402

from .zoo_cases import cases  # noqa: E402

REGISTRIES = {"zoo": ZOO, "holdout_text": HOLDOUT_TEXT, "holdout_vision": HOLDOUT_VISION, "sweep": SWEEP}
CLASSIFIERS = {
    f"{registry}:{name}": entry
    for registry, models in REGISTRIES.items()
    for name, entry in models.items()
    if entry.make_targets is _class_targets
}


def _build_on_meta(entry: ZooModel) -> torch.nn.Module:
    try:
        with torch.device("meta"):
            return entry.build("real")
    except (NotImplementedError, RuntimeError):  # the constructor reads a value: build it for real
        return entry.build("real").to("meta")


def _class_columns(output: Any) -> list[int]:
    outputs = output if isinstance(output, tuple) else (output,)  # a distilled model's two heads
    return [_logits(o).shape[-1] for o in outputs]


def test_the_classifiers_are_found():
    assert len(CLASSIFIERS) >= 20


@pytest.mark.parametrize("key", cases(CLASSIFIERS, on_cpu=False))
def test_each_class_label_has_a_logit_at_the_real_size(key):
    entry = CLASSIFIERS[key]
    model = _build_on_meta(entry)
    inputs = entry.make_inputs("real", 2)
    inputs = inputs.to("meta") if isinstance(inputs, torch.Tensor) else inputs
    with torch.no_grad():
        output = model(inputs)
    assert _class_columns(output) and all(c == _num_classes("real") for c in _class_columns(output)), (key, _class_columns(output))
