"""The text, audio and plain-torch models held back from the zoo (``benchmarks/zoo/holdout_text.py``)
under the zoo's CPU checks (``benchmarks/zoo/checks.py``), and ``estimate_memory`` for CUDA on this
machine without a GPU (the emulated path).

Per model:

- the profiler's record of three CPU iterations against independent counts (unique storages,
  the user's own pack hook): :func:`~benchmarks.zoo.checks.check_record`;
- ``estimate_memory(device="cpu")`` equal to the measured peak to the byte, or refusing the
  operation the entry names: :func:`~benchmarks.zoo.checks.check_cpu_estimate`;
- ``estimate_memory(device="cuda")`` with no GPU here: an estimate whose peak breakdown sums to
  its peak, or ``EstimateUnsupported`` naming an ``aten`` operation, never another exception.

Known gaps are ``xfail(strict=True)`` with their figures.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.zoo import ZOO  # noqa: E402
from benchmarks.zoo.checks import check_cpu_estimate, check_emulated_estimate, check_record  # noqa: E402
from benchmarks.zoo.holdout_text import HOLDOUT_TEXT  # noqa: E402

from .zoo_cases import ProfiledRuns, cases  # noqa: E402

#: Where a check is known to fail, with its figures: each must fail until fixed.
RECORD_GAPS: dict[str, str] = {}
ESTIMATE_GAPS: dict[str, str] = {}
if not torch._C._dispatch_has_kernel_for_dispatch_key("aten::_transformer_encoder_layer_fwd", "Meta"):
    ESTIMATE_GAPS["frozen_fastpath"] = (
        f"torch {torch.__version__} has no fake kernel for the encoder's fused fast path: refused, naming "
        "aten._transformer_encoder_layer_fwd (torch 2.13 and 2.14 have one, and are exact)"
    )
EMULATED_GAPS: dict[str, str] = {}

_runs = ProfiledRuns(HOLDOUT_TEXT)


@pytest.fixture(autouse=True, scope="module")
def _drop_runs():
    yield
    _runs.clear()


@pytest.mark.parametrize("name", cases(HOLDOUT_TEXT, RECORD_GAPS))
def test_the_profilers_record_equals_independent_counts(name):
    check_record(HOLDOUT_TEXT[name], _runs(name))


@pytest.mark.parametrize("name", cases(HOLDOUT_TEXT, ESTIMATE_GAPS))
def test_the_cpu_estimate_equals_the_measured_step(name):
    entry = HOLDOUT_TEXT[name]
    check_cpu_estimate(entry, None if entry.unsupported else _runs(name))


@pytest.mark.parametrize("name", cases(HOLDOUT_TEXT, EMULATED_GAPS))
def test_the_cuda_estimate_without_a_gpu_is_consistent_or_names_the_operation(name):
    check_emulated_estimate(HOLDOUT_TEXT[name])


def test_the_held_back_set_is_apart_from_the_zoo_and_covers_its_setups():
    from benchmarks.zoo import ADAMW, SGD_MOMENTUM

    assert len(HOLDOUT_TEXT) >= 14 and not set(HOLDOUT_TEXT) & set(ZOO)
    setups = {(entry.optimizer, entry.autocast) for entry in HOLDOUT_TEXT.values()}
    assert setups == {(o, a) for o in (ADAMW, SGD_MOMENTUM) for a in (None, torch.bfloat16)}
    assert sum(1 for entry in HOLDOUT_TEXT.values() if not entry.needs) >= 6  # plain torch, run on torch alone
