"""The text, audio and plain-torch models held back from the zoo (``benchmarks/zoo/holdout_text.py``) on
the GPU at their real sizes: ``benchmarks/zoo_conformance.conform``'s checks, one test per model, as
``tests/test_zoo_cuda.py`` runs them on the zoo (the profiler exact against the allocator and the unique
storages, feature maps by layer within 1% of a pack hook, ``estimate_memory``'s peak within 2% on fake
CUDA and emulated, reserved within 5%, the predicted largest batch fitting and 1.1x of it not).

    PYTHONPATH=. python3 -m pytest tests/test_zoo_holdout_text_cuda.py -m cuda -q
    ZOO_CONFORMANCE_OUT=$OUT/holdout_text PYTHONPATH=. python3 -m pytest tests/test_zoo_holdout_text_cuda.py -m cuda -q
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from benchmarks.zoo.holdout_text import HOLDOUT_TEXT  # noqa: E402

from .zoo_cases import cases  # noqa: E402

pytestmark = pytest.mark.cuda

#: Known misses on the GPU (strict), each to be removed when its fix lands. From an H100, torch 2.11,
#: 2026-11-26, the whole check (largest batch included), each model alone on the card, of the tree that
#: makes gradient sums in place (docs/estimate.md, "Gradient sums": none of these moved by it).
KNOWN: dict[str, str] = {
    "wav2vec2": "reserved -14.7% (peak +5.1%, inside its stated bound of 4.6% plus 2%)",
    "frozen_fastpath": "reserved -13.2% (peak -0.02%); the predicted 112 under 3.5 GiB runs out of memory",
    "normalized_cnn": "reserved -9.1% (peak -0.10%, stated bound 3.1%); the predicted 204 under 2.75 GiB runs out of memory",
    "mixed_checkpoint": "reserved +15.3% (peak -0.06%); cause not found yet",
    "qwen2_checkpointed": (
        "reserved -14.2% (peak -0.02%; H100, 2026-11-27): the segments' placement, not the requests: the real "
        "run's own requests replayed with the segments in creation order reserve 14% less than with the device's "
        "addresses (replay_against_real.py)"
    ),
    "electra": (
        "the predicted 160 under 9 GiB runs out of memory (peak -1.0%, reserved 0.0% at batch 64): its backward's "
        "786 requests are now the device's (23.154 GB against 23.148 GB), but the real allocator takes 3 more segments "
        "there, which the real requests replayed with the segments in creation order do not reproduce either"
    ),
    "gru_seq2seq": "reserved -12.4% (peak -0.5%, inside its stated cuDNN bound of 4.3%)",
}


#: At the edge of a goal: seen to miss it and to meet it on the same GPU (none now: Mixtral, listed here
#: before, missed where the fake CUDA step built the attention mask its inputs' mask of ones lets the real
#: step skip, docs/estimate.md; every check met on an H200, torch 2.11, 2026-11-27).
UNSTEADY: dict[str, str] = {}


@pytest.mark.parametrize("name", cases(HOLDOUT_TEXT, KNOWN, on_cpu=False, unsteady=UNSTEADY))
def test_the_held_back_model_conforms_on_the_gpu(name):
    import zoo_conformance

    zoo_conformance.assert_conforms(HOLDOUT_TEXT[name], torch.device("cuda", torch.cuda.current_device()))
