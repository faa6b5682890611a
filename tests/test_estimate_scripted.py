"""TorchScript functions a model calls run as Python during the estimate's fake step (a fused
TorchScript kernel would read fake tensors' memory: on CUDA, a broken context)."""

from __future__ import annotations

import sys
import types
import warnings

import pytest
import torch
from torch import nn

from pytorch_mem_profiler import estimate_memory
from pytorch_mem_profiler.estimate.scripted import scripted_as_python

from .helpers import measured_peak

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # torch.jit.script is deprecated on recent releases

    def relative_positions(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        a = torch.arange(q.size(1), device=q.device)
        b = torch.arange(k.size(1), device=k.device)
        return (a[:, None] - b[None, :]).abs()

    SCRIPTED = torch.jit.script(relative_positions)


@pytest.fixture()
def space():
    """A module of the user's, defining a layer that calls a scripted function of its own."""
    module = types.ModuleType("user_model_with_script")
    module.relative_positions = SCRIPTED
    calls = []

    def forward(self, x):
        h = self.proj(x)
        calls.append(type(module.relative_positions).__name__)
        return h * module.relative_positions(h, h).to(h.dtype).mean()

    def init(self):
        nn.Module.__init__(self)
        self.proj = nn.Linear(8, 8)

    module.Layer = type("Layer", (nn.Module,), {"__module__": module.__name__, "__init__": init, "forward": forward})
    sys.modules[module.__name__] = module
    yield module, calls
    del sys.modules[module.__name__]


def test_inside_the_block_the_layers_module_calls_the_python_function_and_the_script_is_put_back(space):
    module, calls = space
    model = module.Layer()
    with scripted_as_python(model):
        model(torch.randn(2, 40, 8))
    assert calls == ["function"]  # the Python original ran
    assert module.relative_positions is SCRIPTED  # and the script is back after the block
    with scripted_as_python(model, enabled=False):
        model(torch.randn(2, 40, 8))
    assert calls == ["function", "ScriptFunction"]


def test_the_cpu_estimate_runs_the_script_itself(space):
    module, calls = space
    estimate_memory(module.Layer, torch.randn(2, 40, 8), device="cpu", fit=False)
    assert calls and set(calls) == {"ScriptFunction"}  # nothing fuses on the CPU: the script, as it runs


def test_the_estimate_is_the_same_step_as_the_scripted_model_runs(space):
    module, _ = space
    model = module.Layer()
    x = torch.randn(2, 40, 8)
    scripted_out = model(x)
    with scripted_as_python(model):
        assert torch.equal(model(x), scripted_out)
    # the CPU estimate (the script itself under the fake mode) is the measured step to the byte
    sgd = lambda params: torch.optim.SGD(params, lr=0.1)  # noqa: E731
    measured = measured_peak(module.Layer, lambda: torch.randn(2, 40, 8), sgd)  # the batch made while profiled
    assert estimate_memory(module.Layer, x, optimizer=sgd, device="cpu", fit=False).peak == measured


def test_the_fuser_is_restored_after_the_step(space):
    enabled = getattr(torch._C, "_jit_texpr_fuser_enabled", None)
    if enabled is None:
        pytest.skip("no TensorExpr fuser switch in this torch")
    module, _ = space
    before = enabled()
    with scripted_as_python(module.Layer()):
        assert enabled() is False
    assert enabled() == before
