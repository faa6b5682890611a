"""The training loop's settings in the estimate: gradient accumulation, gradient clipping and
``zero_grad(set_to_none=False)``, each against the CPU counter's measured peak of the same loop."""

from __future__ import annotations

import functools
import io

import pytest
import torch
from torch import nn

from pytorch_mem_profiler import MemoryProfiler, estimate_memory


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 512), nn.GELU(), nn.Linear(512, 512), nn.GELU(), nn.Linear(512, 64))


ADAMW = functools.partial(torch.optim.AdamW, lr=1e-3)
SGD = functools.partial(torch.optim.SGD, lr=1e-3)


def run_loop(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, *, accumulation_steps: int = 1,
             max_grad_norm: float | None = None, set_to_none: bool = True, after_step=None) -> None:  # fmt: skip
    """Two optimizer steps of the loop the estimate runs with these settings (``after_step()`` after each)."""
    for _ in range(2):
        for micro_step in range(accumulation_steps):
            if micro_step:
                del out, loss  # noqa: F821 - the previous micro-step's
            out = model(x)
            loss = out.float().sum()
            loss.backward()
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(list(model.parameters()), max_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
        del out, loss
        if after_step is not None:
            after_step()


def _measured(*, optimizer=ADAMW, batch: int = 32, **settings) -> int:
    """The CPU counter's peak over two optimizer steps of the loop the estimate runs."""
    model = _model()
    opt = optimizer(model.parameters())
    peaks = []
    with MemoryProfiler(model, print_period=1, stream=io.StringIO(), strict=True, optimizer=opt) as profiler:
        run_loop(model, opt, torch.randn(batch, 64), after_step=lambda: peaks.append(profiler.record_stats().iteration_peak_allocated),
                 **settings)  # fmt: skip
    return max(peaks)


def _estimated(*, optimizer=ADAMW, batch: int = 32, **settings) -> int:
    est = estimate_memory(_model, lambda b: torch.randn(b, 64), batch_size=batch, optimizer=optimizer, device="cpu", fit=False, **settings)
    return est.peak


SETTINGS = [
    {"accumulation_steps": 2},
    {"accumulation_steps": 3, "max_grad_norm": 1.0},
    {"max_grad_norm": 0.5},
    {"set_to_none": False},
    {"accumulation_steps": 2, "set_to_none": False},
]


@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
def test_the_estimate_equals_the_measured_loop_to_the_byte(settings):
    assert _estimated(**settings) == _measured(**settings)


def test_the_settings_move_the_peak_where_the_loop_holds_more():
    """With SGD (no state) and a batch whose feature maps hold the backward's peak, accumulation keeps
    every gradient through the second backward and ``set_to_none=False`` through the next forward:
    both peaks above the plain loop's, as measured (so the equalities above are not the plain
    loop's by accident)."""
    plain = _estimated(optimizer=SGD, batch=256)
    assert plain == _measured(optimizer=SGD, batch=256)
    for settings in ({"accumulation_steps": 2}, {"set_to_none": False}):
        moved = _estimated(optimizer=SGD, batch=256, **settings)
        assert moved > plain and moved == _measured(optimizer=SGD, batch=256, **settings), settings


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"accumulation_steps": 0}, "accumulation_steps must be an integer >= 1"),
        ({"accumulation_steps": 2.0}, "accumulation_steps must be an integer >= 1"),
        ({"max_grad_norm": 0}, "max_grad_norm must be a number > 0 or None"),
        ({"max_grad_norm": True}, "max_grad_norm must be a number > 0 or None"),
        ({"set_to_none": "no"}, "set_to_none must be True or False"),
        ({"accumulation_steps": 2, "parallel": "ddp", "world_size": 2}, "not estimated across ranks yet"),
    ],
)
def test_bad_settings_are_named(settings, message):
    with pytest.raises((ValueError, TypeError), match=message):
        estimate_memory(_model, torch.randn(4, 64), device="cpu", fit=False, **settings)


def test_the_command_takes_the_loop_s_settings(tmp_path, capsys):
    """``pytorch-mem-profiler estimate --accumulation-steps 2 --max-grad-norm 1 --keep-grads`` prints
    the peak the same settings give ``estimate_memory``."""
    from pytorch_mem_profiler.analysis.cli import main

    path = tmp_path / "model.py"
    path.write_text(
        "import torch\nfrom torch import nn\nbatch_size = 256\n"
        "def build_model():\n    return nn.Sequential(nn.Linear(64, 512), nn.GELU(), nn.Linear(512, 64))\n"
        "def example_inputs(batch_size):\n    return torch.randn(batch_size, 64)\n"
    )
    build = lambda: nn.Sequential(nn.Linear(64, 512), nn.GELU(), nn.Linear(512, 64))  # noqa: E731
    settings = {"accumulation_steps": 2, "max_grad_norm": 1.0, "set_to_none": False}
    expected = estimate_memory(build, lambda b: torch.zeros(b, 64), batch_size=256, device="cpu", fit=False, **settings)
    plain = estimate_memory(build, lambda b: torch.zeros(b, 64), batch_size=256, device="cpu", fit=False)
    assert expected.peak != plain.peak
    argv = ["estimate", str(path), "--device", "cpu", "--units", "B", "--accumulation-steps", "2", "--max-grad-norm", "1", "--keep-grads"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "Training loop: 2 micro-batches a step (gradient accumulation), gradients clipped to norm 1.0, zero_grad(set_to_none=False)" in out
    assert f".{expected.peak} B\n" in out and f".{plain.peak} B\n" not in out
