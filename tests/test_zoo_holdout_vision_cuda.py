"""The vision models held back from the zoo (``benchmarks/zoo/holdout_vision.py``) on the GPU at their
real sizes, by the zoo's conformance checks (``benchmarks/zoo_conformance.py``, as
``tests/test_zoo_cuda.py`` runs them on the zoo): the profiler exact against the allocator and the
unique storages, feature maps by layer within 1% of a pack hook, ``estimate_memory``'s peak within
2% of ``max_memory_allocated()`` on fake CUDA and emulated, its reserved within 5% of
``max_memory_reserved()`` (of the range up to its stated upper figure), the predicted largest batch running under the allocator limit and 1.1x
of it running out of memory.

    PYTHONPATH=. python3 -m pytest tests/test_zoo_holdout_vision_cuda.py -m cuda -q
    ZOO_CONFORMANCE_OUT=$OUT/holdout_vision PYTHONPATH=. python3 -m pytest tests/test_zoo_holdout_vision_cuda.py -m cuda -q
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from benchmarks.zoo.holdout_vision import HOLDOUT_VISION  # noqa: E402

from .zoo_cases import cases, listed_goals  # noqa: E402

pytestmark = pytest.mark.cuda

#: Known misses on the GPU, each with its figures, to be removed when its fix lands (strict). From an
#: H100, torch 2.11, 2026-11-26, the whole check (largest batch included), each model's process shared
#: with no more than one other. The pointwise convolutions' GEMM class (``conv_workspace``) brought
#: RegNet, MnasNet, MobileNetV3, PoolFormer, NF-ResNet and FastViT within 5% of reserved (from up to
#: +31%) and they left this list; SqueezeNet left it when a 2-D fp32 first layer's backward got the
#: forward's bound (its stated bound 17.3% of the peak to 4.0%: 1.1x of the predicted 342 now runs out),
#: and RAFT with it (its fp32 3-channel first layers: 1.1x of its prediction now runs out, one H100 run).
#: GoogLeNet left it when the allocator replay placed each new segment below the others (reserved -10.3%
#: to -3.9%; every check met on an H200, 2026-11-28). DeepLabV3, MobileViT and the Conv3d net left it
#: with the upper reserved figure (``MemoryEstimate.reserved_bound``; H200, 2026-11-28: reserved -5.71%
#: up to +2.01%, -5.26% up to -4.28%, -7.30% up to +6.56%). PVT-v2 and ShuffleNetV2 left it, and
#: NF-ResNet its unsteady list, when the batch search let cuDNN's workspaces give way under the limit
#: instead of leaving their bound free (H200, 2026-11-28: 150 fits and 165 runs out under 13.25 GiB, 356
#: and 392 under 4 GiB, 75 and 83 under 5.25 GiB); ResNeXt's and the channels-last CNN's largest batches
#: met their goal the same day (84 and 93 under 5 GiB, 170 and 188 under 7.75 GiB).
KNOWN: dict[str, str] = {
    "levit": "reserved -5.1% (peak -1.07%, stated bound 3.1%; H100, 2026-11-27: the predicted 363 fits, 400 does not)",
    "channels_last": (
        "reserved +6.5% (H200, 2026-11-30; +7.3% on an H100, 2026-11-28, and +17.2% there with the segments ranked "
        "older first; peak +0.02%, stated bound 20%)"
    ),
    "resnext": (
        "reserved -7.3% (peak -1.06%, stated bound 12.9%; H200, 2026-11-28): its grouped 3x3 convolutions' workspaces "
        "differ from the rule's by a few MB each, and with the segments placed downward they take more segments than "
        "the rule's (it met every check with them ranked older first, H100, 2026-11-26)"
    ),
}


#: At the edge of a goal: seen to miss it and to meet it on the same kind of GPU (not strict).
UNSTEADY: dict[str, str] = {}


#: the goal every entry listed above is listed for (``listed_goals``)
LISTED_GOALS = ("reserved",)


@pytest.mark.parametrize("name", cases(HOLDOUT_VISION, KNOWN, on_cpu=False, unsteady=UNSTEADY, raises=AssertionError))
def test_the_held_back_model_conforms_on_the_gpu(name):
    import zoo_conformance

    device = torch.device("cuda", torch.cuda.current_device())
    listed = listed_goals(name, LISTED_GOALS, KNOWN, UNSTEADY)
    zoo_conformance.assert_conforms(HOLDOUT_VISION[name], device, known_misses=listed)
