"""The CPU sweep's models (``benchmarks/zoo/sweep.py``) on the GPU, at the sizes the CPU checks them:
``benchmarks/zoo_conformance.conform``'s checks without the largest-batch runs, one test per model
(the profiler exact against the allocator and the unique storages, feature maps by layer within 1%
of a pack hook, ``estimate_memory``'s peak within 2% on fake CUDA and emulated, plus any error
bound it states, reserved within 5%). Most steps here are a few MB: a check of what the fake CUDA
step does on the device's kernels (its masks, attention, convolutions), less of its sizes.

    PYTHONPATH=. python3 -m pytest tests/test_zoo_sweep_cuda.py -m cuda -q     # about 17 minutes on one H200
    ZOO_CONFORMANCE_OUT=$OUT/sweep PYTHONPATH=. python3 -m pytest tests/test_zoo_sweep_cuda.py -m cuda -q
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from benchmarks.zoo.sweep import SWEEP  # noqa: E402

from .zoo_cases import cases, listed_goals  # noqa: E402

pytestmark = pytest.mark.cuda

_SMALL_RESERVED = "reserved {:+.1f}% of {:.0f} MB at the sweep's size (peak {:+.2f}%, stated bound {:.0f}%)"

#: Known misses on the GPU (strict), from two H200s, torch 2.11, transformers 5.17, 2026-11-27
#: (``zoo_conformance.py --registry sweep --quick``): reserved of small CNNs, a convolution
#: workspace's segment or two more or less than the estimate's replay, their peaks within bounds. The
#: same again on four H100s, 2026-11-28, with the replay's segments placed downward: the same misses
#: (RexNet and SelecSLS a point or two closer). The figures below as on one H200 on 2026-11-29, once the
#: peak counted the allocator's whole blocks.
KNOWN: dict[str, str] = {
    "timm_efficientnetv2_rw_t": _SMALL_RESERVED.format(-8.33, 251.7, -0.72, 11.8),
    "timm_mobileone_s0": _SMALL_RESERVED.format(-15.28, 151.0, -0.13, 31.9),
    "timm_convnextv2_atto": _SMALL_RESERVED.format(-16.67, 138.4, -5.83, 36.4),
    "timm_hrnet_w18_small": _SMALL_RESERVED.format(10.43, 241.2, 5.18, 24.2),
    "tv_mnasnet0_5": _SMALL_RESERVED.format(-19.23, 109.1, 0.0, 94.5),
    "timm_rexnet_100": _SMALL_RESERVED.format(-14.10, 163.6, 0.0, 26.2),
    "timm_selecsls42b": _SMALL_RESERVED.format(5.70, 736.1, 0.06, 4.3),
    "tv_shufflenet_v2_x0_5": _SMALL_RESERVED.format(-23.91, 96.5, -18.85, 253.1),
    "timm_starnet_s1": _SMALL_RESERVED.format(-14.49, 144.7, 0.0, 33.3),
    "tv_regnet_y_400mf": _SMALL_RESERVED.format(-16.18, 142.6, 0.22, 36.2),
    # joined 2026-11-29 (one H200, torch 2.11, transformers 5.17)
    "dpt": _SMALL_RESERVED.format(-20.83, 100.7, -22.40, 134.1),
}

#: At the edge of a goal (one run each, just past it): not to be read as fixed when they pass.
UNSTEADY: dict[str, str] = {
    # convolutions alone: +5.31% of 750.8 MB when the measurement held an earlier model's cuBLAS
    # workspaces (H200), +6.15% of 681.6 MB measured as in a fresh process (H100, twice)
    "tv_fcn": _SMALL_RESERVED.format(6.15, 681.6, -0.28, 19.4),
    "timm_cspdarknet53": _SMALL_RESERVED.format(5.94, 423.6, 0.28, 7.4),
}


#: the goal every entry listed above is listed for (``listed_goals``)
LISTED_GOALS = ("reserved",)


@pytest.mark.parametrize("name", cases(SWEEP, KNOWN, on_cpu=False, unsteady=UNSTEADY, raises=AssertionError))
def test_the_sweeps_model_conforms_on_the_gpu(name):
    import zoo_conformance

    device = torch.device("cuda", torch.cuda.current_device())
    listed = listed_goals(name, LISTED_GOALS, KNOWN, UNSTEADY)
    zoo_conformance.assert_conforms(SWEEP[name], device, quick=True, known_misses=listed)
