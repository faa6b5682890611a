"""On a GPU: the estimate of a ``torch.compile``'d step against ``torch.cuda.max_memory_allocated()``.

The models and the measurement are benchmarks/compiled_estimate.py's (two steps of the compiled
model above what was allocated before the model was made, its weights counted as the estimate
counts them, a compiled model of the same class having run a step first). The goal: the peak within
2% on the fake CUDA path and emulated (fake CPU tensors standing in for CUDA); where the estimate runs a module uncompiled (a graph break) the compiled step lies
within its stated bound below it.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from compiled_estimate import cases, estimated, measure  # noqa: E402

pytestmark = pytest.mark.cuda

CUDA = torch.device("cuda")
GOAL = 0.02
COMPILED = ["compiled_mlp", "gpt2", "transformer", "transformer_bf16", "pooling_cnn"]


@pytest.fixture(scope="module")
def models():
    return cases(quick=False)


@pytest.fixture(autouse=True, scope="module")
def _reset_dynamo():
    yield
    torch._dynamo.reset()


#: Known gaps on the GPU, each to be removed when its fix lands (strict). None since the measured step counts the
#: model's weights, as the estimate does, and a GPU's unfused linear biases are read where their sums are.
KNOWN: dict[str, str] = {}


@pytest.mark.parametrize("name", COMPILED)
def test_a_compiled_step_is_estimated_within_two_percent(models, name, request):
    if name in KNOWN:
        request.applymarker(pytest.mark.xfail(strict=True, reason=KNOWN[name]))
    case = models[name]
    measured = measure(case, CUDA)
    fake = estimated(case, CUDA, emulate=False)
    emulated = estimated(case, CUDA, emulate=True)
    detail = f"{name}: measured {measured}; fake CUDA {fake}; emulated {emulated}"
    for est in (fake, emulated):
        assert "error" not in est, detail
        assert "estimated as compiled" in est["notes"][0], detail
        assert abs(est["peak"] - measured["step"]) <= GOAL * measured["step"], detail


def test_a_graph_break_is_estimated_uncompiled_within_its_bound(models):
    case = models["graph_break"]
    measured = measure(case, CUDA)["step"]
    est = estimated(case, CUDA, emulate=False)
    assert "graph break" in est["notes"][0] and est["error_bound"] > 0, est
    assert est["peak"] - est["error_bound"] - GOAL * measured <= measured <= est["peak"] + GOAL * measured, (measured, est)
