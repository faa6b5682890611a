"""Vision models held back from the zoo (``benchmarks/zoo/holdout_vision.py``), held to the zoo's bar.

The zoo's models are the ones the profiler and the estimate were tuned on; these are not. For each,
at its small size on the CPU (``benchmarks/zoo/checks.py``, as ``tests/test_zoo.py`` runs them):

- the profiler's record of three iterations against independent counts (unique storages'
  ``nbytes()``, what the user's own pack hook saw);
- ``estimate_memory(..., device="cpu")`` equal to the measured peak to the byte;
- ``estimate_memory(..., device="cuda", fit=False)`` on this GPU-less machine (the emulated CUDA
  step): an estimate whose peak breakdown sums to its peak, or ``EstimateUnsupported`` naming an
  aten operation, never another exception.

Known gaps are marked ``xfail(strict=True)`` with their figures.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.zoo import ZOO  # noqa: E402
from benchmarks.zoo.checks import check_cpu_estimate, check_emulated_estimate, check_record  # noqa: E402
from benchmarks.zoo.holdout_vision import HOLDOUT_VISION  # noqa: E402

from .zoo_cases import ProfiledRuns, cases  # noqa: E402

#: Where a check is known to fail, with its figures: each must fail until fixed.
RECORD_GAPS: dict[str, str] = {}
ESTIMATE_GAPS: dict[str, str] = {}
EMULATED_GAPS: dict[str, str] = {}

_runs = ProfiledRuns(HOLDOUT_VISION)


@pytest.fixture(autouse=True, scope="module")
def _drop_runs():
    yield
    _runs.clear()


@pytest.mark.parametrize("name", cases(HOLDOUT_VISION, RECORD_GAPS))
def test_the_profilers_record_equals_independent_counts(name):
    check_record(HOLDOUT_VISION[name], _runs(name))


@pytest.mark.parametrize("name", cases(HOLDOUT_VISION, ESTIMATE_GAPS))
def test_the_cpu_estimate_equals_the_measured_step(name):
    entry = HOLDOUT_VISION[name]
    check_cpu_estimate(entry, None if entry.unsupported else _runs(name))


@pytest.mark.parametrize("name", cases(HOLDOUT_VISION, EMULATED_GAPS))
def test_the_emulated_cuda_estimate_adds_up_or_names_the_operation_it_refuses(name):
    check_emulated_estimate(HOLDOUT_VISION[name])


def test_the_held_back_set_is_apart_from_the_zoo_and_covers_its_setups():
    from benchmarks.zoo import ADAMW, SGD_MOMENTUM

    assert len(HOLDOUT_VISION) >= 14 and not set(HOLDOUT_VISION) & set(ZOO)
    setups = {(entry.optimizer, entry.autocast) for entry in HOLDOUT_VISION.values()}
    assert setups == {(o, a) for o in (ADAMW, SGD_MOMENTUM) for a in (None, torch.bfloat16)}
    # some of them run with neither timm nor torchvision (CI's torch 2.13 CPU wheel)
    assert sum(not entry.needs for entry in HOLDOUT_VISION.values()) >= 3
