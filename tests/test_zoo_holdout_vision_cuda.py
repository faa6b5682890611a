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

from .zoo_cases import cases  # noqa: E402

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
#: up to +2.01%, -5.26% up to -4.28%, -7.30% up to +6.56%).
KNOWN: dict[str, str] = {
    "levit": "reserved -5.1% (peak -1.07%, stated bound 3.1%; H100, 2026-11-27: the predicted 363 fits, 400 does not)",
    "pvt_v2": "1.1x of the predicted 88 under 13.25 GiB still runs (stated bound 68% of the peak; peak -0.52%)",
    "channels_last": (
        "reserved +7.3% (H100, 2026-11-28; +17.2% with the segments ranked older first; peak +0.25%, stated bound 20%); "
        "1.1x of the predicted 143 under 7.75 GiB still runs (2026-11-26)"
    ),
    "resnext": (
        "reserved -7.3% (peak -1.06%, stated bound 12.9%) and 1.1x of the predicted 74 under 5 GiB still runs (H200, "
        "2026-11-28): its grouped 3x3 convolutions' workspaces differ from the rule's by a few MB each, and with the "
        "segments placed downward they take more segments than the rule's (it met every check with them ranked older "
        "first, H100, 2026-11-26)"
    ),
    "shufflenet_v2": (
        "1.1x of the predicted 310 under 4 GiB still runs (H100, 2026-11-27; peak -2.53%, reserved -0.31%): the stated "
        "bound is 15.9% of the peak since a 7x7 pointwise backward's bound covers the per-image partials (its last 1x1, "
        "1024 <- 464 at batch 128: 243 MB), which MNASNet's took and this one's did not"
    ),
}


#: At the edge of a goal: seen to miss it and to meet it on the same kind of GPU (not strict).
UNSTEADY: dict[str, str] = {
    "nf_resnet": (
        "1.1x of the predicted 67 under 5.25 GiB ran (H200, 2026-11-28; peak -0.79%, stated bound 10.6% of the "
        "peak, reserved -0.31% up to +8.49%) where it had run out of memory on an H100 (2026-11-26): the bound left "
        "free makes the prediction safe and, here, short"
    ),
}


@pytest.mark.parametrize("name", cases(HOLDOUT_VISION, KNOWN, on_cpu=False, unsteady=UNSTEADY, raises=AssertionError))
def test_the_held_back_model_conforms_on_the_gpu(name):
    import zoo_conformance

    zoo_conformance.assert_conforms(HOLDOUT_VISION[name], torch.device("cuda", torch.cuda.current_device()))
