"""The text, audio and plain-torch models held back from the zoo (``benchmarks/zoo/holdout_text.py``) on
the GPU at their real sizes: ``benchmarks/zoo_conformance.conform``'s checks, one test per model, as
``tests/test_zoo_cuda.py`` runs them on the zoo (the profiler exact against the allocator and the unique
storages, feature maps by layer within 1% of a pack hook, ``estimate_memory``'s peak within 2% on fake
CUDA and emulated, reserved within 5% (of the range up to its stated upper figure), the predicted largest
batch fitting and 1.1x of it not).

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

from .zoo_cases import cases, listed_goals  # noqa: E402

pytestmark = pytest.mark.cuda

#: Known misses on the GPU (strict), each to be removed when its fix lands. From an H100, torch 2.11,
#: 2026-11-26, the whole check (largest batch included), each model alone on the card; the figures
#: again from four H100s and two H200s, 2026-11-28, after the allocator replay placed each new segment
#: below the others (as ``cudaMalloc`` was seen to): Qwen2 with reentrant checkpointing (reserved
#: -14.2% to +0.14%), ELECTRA (its largest batch), the mixed-checkpointing model and the GRU
#: encoder-decoder then met every check on an H200 and left this list; DistilBERT's largest batch
#: (160 under 7.25 GiB ran out, the replay fitting it with 0.03% of the limit left) once the batch search
#: left ``LAYOUT_ALLOWANCE`` free (157 fits and 173 runs out, H200, 2026-11-28); Qwen2's largest batch once
#: the search answered for a fresh process (workspaces made after the first matmul's output) and math
#: attention added its mask in place as the device does (16 fits and 18 runs out, H200, 2026-11-28); the frozen
#: encoder on its fused fast path once the estimate ran it as ATen does and asked for the efficient attention
#: backward's own blocks (reserved -2.7%, peak -0.08%, 111 fits under 3.5 GiB and 123 runs out, H200,
#: 2026-11-29).
KNOWN: dict[str, str] = {
    "wav2vec2": (
        "reserved -11.4% (up to -10.7% stated; peak -0.05%, stated bound 4.2%; H200, 2026-11-30, the estimate and "
        "the measured step both skipping no layer under its LayerDrop of 0.1): the feature extractor's and the "
        "positional convolution's cuDNN workspaces, a few MB above the rules' in each pass (325.6 MB where the rule "
        "gives 317.7 MB for the first forward, the H200's allocator history), take segments of their own"
    ),
    "normalized_cnn": (
        "largest batch (H200, 2026-11-30): at its batch of 64 the peak and reserved are the device's to the byte since a "
        "sum to another dtype took its copy (amax's backward sums the boolean mask of the maxima as int64, 256 MiB a "
        "convolution; reserved was -8.7%), but under 2.75 GiB the predicted 181 fits and 1.1x of it, 200, fits too "
        "(reserved 2,730.5 MB there; the estimate's replay reserves 2,900.4 MB at 181): the search is conservative here"
    ),
}


#: At the edge of a goal: seen to miss it and to meet it on the same GPU. (Mixtral, listed here before,
#: missed where the fake CUDA step built the attention mask its inputs' mask of ones lets the real step
#: skip, docs/estimate.md; every check met on an H200, torch 2.11, 2026-11-27.)
UNSTEADY: dict[str, str] = {
    "qwen2_checkpointed": (
        "the device's own reserved differs by a gigabyte between processes for the same step: 7,304.4 MB after "
        "Qwen2 in one process (estimate 7,335.8 MB, +0.4%; H200, 2026-11-28) and 6,276.8 MB after Mistral in "
        "another (+16.9%; H200, 2026-11-29), the peak allocated the same (estimate -0.02%); in the second the predicted 34 "
        "under 11.75 GiB fit and 38 ran out. The replay of the device's own requests gives its reserved to the byte "
        "with the device's addresses and parts from it at the loss's 1 GB request with each new segment placed below "
        "the others: where the driver placed the segments decided it"
    ),
    "frozen_fastpath": (
        "the same step measured two ways in fresh processes of one H200 (2026-11-29): 1,355.9 MB allocated and "
        "1,879.0 MB reserved in one (estimate 1,828.7 MB, -2.68%; the predicted 111 under 3.5 GiB fit, 123 ran out), "
        "1,355.1 MB and 1,728.1 MB in the next (+5.83%; the peak estimate to the byte); run after CLIP and the "
        "torch encoder in a third, 1,728.1 MB again (the predicted 102 under 3.25 GiB fit, 113 ran out): the device's step "
        "differs by 768 KiB of requests between processes, and its reserved by 151 MB"
    ),
}


#: the goals an entry listed above is listed for (``listed_goals``): its text says which it misses
LISTED_GOALS = ("reserved", "largest batch")


@pytest.mark.parametrize("name", cases(HOLDOUT_TEXT, KNOWN, on_cpu=False, unsteady=UNSTEADY, raises=AssertionError))
def test_the_held_back_model_conforms_on_the_gpu(name):
    import zoo_conformance

    device = torch.device("cuda", torch.cuda.current_device())
    listed = listed_goals(name, LISTED_GOALS, KNOWN, UNSTEADY)
    zoo_conformance.assert_conforms(HOLDOUT_TEXT[name], device, known_misses=listed)
