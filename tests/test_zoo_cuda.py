"""The model zoo on the GPU at real sizes (``benchmarks/zoo_conformance.py``'s checks, one test per
model): the profiler exact against the allocator and the unique storages, feature maps by layer
within 1% of a pack hook, ``estimate_memory``'s peak within 2% of ``max_memory_allocated()`` on
fake CUDA and emulated, its reserved within 5% of ``max_memory_reserved()`` (of the range up to its
stated upper figure, ``reserved_bound``), the predicted largest
batch running under the allocator limit and 1.1x of it running out of memory.

    PYTHONPATH=. python3 -m pytest tests/test_zoo_cuda.py -m cuda -q
    ZOO_CONFORMANCE_OUT=$OUT/zoo PYTHONPATH=. python3 -m pytest tests/test_zoo_cuda.py -m cuda -q   # rows for --publish too
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from benchmarks.zoo import ZOO  # noqa: E402

from .zoo_cases import cases, listed_goals  # noqa: E402

pytestmark = pytest.mark.cuda

#: Known misses on the GPU (an H100, torch 2.11, 2026-11-26: the table in docs/benchmarks.md), each to be
#: removed when its fix lands (strict). ResNet-18 under bf16 left it with the upper reserved figure (its
#: bf16 filter passes' split-K partial sums at their bound: -17.4% to +0.4% of the measured). EfficientNet
#: and MobileNet left it with the pointwise convolutions' GEMM class (``conv_workspace.POINTWISE_GEMM_POSITIONS``); the checkpointed decoder with the layout
#: allowance of the batch search (its predicted 34 under 21.25 GiB ran out of memory by 14 MB, the replay
#: fitting it with 0.26% of the limit left; 33 fits and 37 runs out, H200, 2026-11-28). UNet left it when
#: the batch search let cuDNN's workspaces give way under the limit instead of leaving their bound free
#: (predicted 17, 1.1x running, to 21 fitting and 24 running out; H200, 2026-11-28).
KNOWN: dict[str, str] = {}

#: At the edge of a goal: seen to miss it and to meet it on the same H100, torch 2.11, 2026-11-26.
UNSTEADY: dict[str, str] = {
    "gru_lm": (
        "the predicted 90 under 3 GiB fits and 100 runs out on an H200 (2026-11-28, the segments placed downward; peak "
        "+0.38%, reserved -0.82%); on an H100 (2026-11-27, ranked older first) 90 ran out by one request, where the "
        "warm-up leaves cuDNN's dropout state and the cuBLAS workspaces"
    ),
    "sparse_recommender": (
        "the predicted 44,353 under 6.5 GiB ran out of memory in one process and fit (1.1x out) in the next, the "
        "estimate the same (peak -0.08%): under deterministic algorithms dense += sparse takes buffers it leaves out; "
        "on an H200 (2026-11-27) the predicted 41,304 under 6.25 GiB ran out"
    ),
    "neumf": (
        "the predicted batch under 2.25 GiB fits (1.1x out) on H100s (2026-11-26, 2026-11-27) and runs out of memory "
        "on an H200 (327,372, 2026-11-27), the estimate the same (peak -0.10%, reserved -2.5%)"
    ),
    "lstm_lm": (
        "the predicted 98 under 3.25 GiB fit (108 out) in one fresh process and ran out in another, on an H100 the "
        "same day (2026-11-27), the estimate the same (peak +0.34%, reserved -0.97%): like the GRU's, by where the "
        "warm-up leaves cuDNN's dropout state and the cuBLAS workspaces"
    ),
    "compiled_mlp": (
        "the predicted 142 under 12.5 GiB ran out of memory in one fresh process and fit (157 out) in the next, on "
        "H100s the same day (2026-11-27), the estimate the same (peak +0.00%, reserved -2.83% and -2.90%). The H200's "
        "allocator history at 141 (2026-11-28, replay_against_real.py): a process that compiles for that batch times "
        "candidate kernels on the device (Inductor's benchmarking: eleven 60 MiB buffers and 516 trial tensors, 1,066 "
        "requests in two steps) and reserves 803 MB more than the estimate by its second step; with the compiled "
        "code in Inductor's cache the same batch ran under the card (538 requests, 149 MB above the estimate)"
    ),
}


#: the goal every entry listed above is listed for (``listed_goals``)
LISTED_GOALS = ("largest batch",)


@pytest.mark.parametrize("name", cases(ZOO, KNOWN, on_cpu=False, unsteady=UNSTEADY, raises=AssertionError))
def test_the_zoo_model_conforms_on_the_gpu(name):
    import zoo_conformance

    device = torch.device("cuda", torch.cuda.current_device())
    listed = listed_goals(name, LISTED_GOALS, KNOWN, UNSTEADY)
    zoo_conformance.assert_conforms(ZOO[name], device, known_misses=listed)
