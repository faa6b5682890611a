"""The training loop's settings in the estimate: gradient accumulation, gradient clipping,
``zero_grad(set_to_none=False)`` and fp16 loss scaling (``torch.amp.GradScaler``), each against the
CPU counter's measured peak of the same loop."""

from __future__ import annotations

import functools
import io

import pytest
import torch
from torch import nn

from pytorch_mem_profiler import MemoryProfiler, estimate_memory
from pytorch_mem_profiler.estimate import EstimateUnsupported


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
        ({"grad_scaler": 1}, "grad_scaler must be True or False"),
        ({"grad_scaler": True, "parallel": "ddp", "world_size": 2}, "grad_scaler are not estimated across ranks yet"),
    ],
)
def test_bad_settings_are_named(settings, message):
    with pytest.raises((ValueError, TypeError), match=message):
        estimate_memory(_model, torch.randn(4, 64), device="cpu", fit=False, **settings)


def _command_model(tmp_path, batch_size: int):
    """A model file for ``pytorch-mem-profiler estimate``, and the same model's builder."""
    path = tmp_path / "model.py"
    path.write_text(
        f"import torch\nfrom torch import nn\nbatch_size = {batch_size}\n"
        "def build_model():\n    return nn.Sequential(nn.Linear(64, 512), nn.GELU(), nn.Linear(512, 64))\n"
        "def example_inputs(batch_size):\n    return torch.randn(batch_size, 64)\n"
    )
    return path, lambda: nn.Sequential(nn.Linear(64, 512), nn.GELU(), nn.Linear(512, 64))


def test_the_command_takes_the_loop_s_settings(tmp_path, capsys):
    """``pytorch-mem-profiler estimate --accumulation-steps 2 --max-grad-norm 1 --keep-grads`` prints
    the peak the same settings give ``estimate_memory``."""
    from pytorch_mem_profiler.analysis.cli import main

    path, build = _command_model(tmp_path, 256)
    settings = {"accumulation_steps": 2, "max_grad_norm": 1.0, "set_to_none": False}
    expected = estimate_memory(build, lambda b: torch.zeros(b, 64), batch_size=256, device="cpu", fit=False, **settings)
    plain = estimate_memory(build, lambda b: torch.zeros(b, 64), batch_size=256, device="cpu", fit=False)
    assert expected.peak != plain.peak
    argv = ["estimate", str(path), "--device", "cpu", "--units", "B", "--accumulation-steps", "2", "--max-grad-norm", "1", "--keep-grads"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "Training loop: 2 micro-batches a step (gradient accumulation), gradients clipped to norm 1.0, zero_grad(set_to_none=False)" in out
    assert f".{expected.peak} B\n" in out and f".{plain.peak} B\n" not in out


def run_scaled_loop(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, scaler: torch.amp.GradScaler, *,
                    accumulation_steps: int = 1, max_grad_norm: float | None = None, after_step=None) -> None:  # fmt: skip
    """Two optimizer steps of fp16 autocast with ``scaler``, as the estimate runs them with
    ``grad_scaler=True`` (``unscale_`` before clipping; ``after_step()`` after each step)."""
    for _ in range(2):
        for micro_step in range(accumulation_steps):
            if micro_step:
                del out, loss  # noqa: F821 - the previous micro-step's
            with torch.autocast(x.device.type, dtype=torch.float16):
                out = model(x)
            loss = out.float().mean()
            scaler.scale(loss).backward()
        if max_grad_norm is not None:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(list(model.parameters()), max_grad_norm)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        del out, loss
        if after_step is not None:
            after_step()


def _scaled_loop_peak(optimizer, *, batch: int, accumulation_steps: int, max_grad_norm: float | None) -> tuple[int, float]:
    """The CPU counter's peak over :func:`run_scaled_loop`, and the scale after it."""
    model = _model()
    opt = optimizer(model.parameters())
    scaler = torch.amp.GradScaler("cpu")
    peaks = []
    with MemoryProfiler(model, print_period=1, stream=io.StringIO(), strict=True, optimizer=opt) as profiler:
        run_scaled_loop(model, opt, torch.randn(batch, 64), scaler, accumulation_steps=accumulation_steps, max_grad_norm=max_grad_norm,
                        after_step=lambda: peaks.append(profiler.record_stats().iteration_peak_allocated))  # fmt: skip
    return max(peaks), scaler.get_scale()


def _fused_adamw(params):
    return torch.optim.AdamW(params, lr=1e-3, fused=True)


@pytest.mark.parametrize("optimizer", [ADAMW, SGD, _fused_adamw], ids=["adamw", "sgd", "fused_adamw"])
@pytest.mark.parametrize("accumulation_steps, max_grad_norm", [(1, None), (1, 1.0), (2, 0.5)])
def test_fp16_loss_scaling_is_estimated_to_the_byte(optimizer, accumulation_steps, max_grad_norm):
    """``grad_scaler=True``: the scale and growth counter made at the first ``scale``, the scaled loss,
    the unscaling's found-inf flags and inverse scale, and the optimizer's step that the real scaler
    runs where no gradient is infinite (the scale stays 65,536 here: no step was skipped, which the
    estimate assumes). A fused AdamW is handed the scale and unscales in its own kernel."""
    if optimizer is _fused_adamw:
        try:
            _fused_adamw([nn.Parameter(torch.zeros(2))]).step()
        except RuntimeError as err:  # torch 2.4 has no fused AdamW on the CPU
            pytest.skip(f"no fused AdamW on the CPU here: {err}")
    measured, scale = _scaled_loop_peak(optimizer, batch=32, accumulation_steps=accumulation_steps, max_grad_norm=max_grad_norm)
    assert scale == 65536.0  # the real steps ran the optimizer
    est = estimate_memory(_model, lambda b: torch.randn(b, 64), batch_size=32, optimizer=optimizer, device="cpu", fit=False,
                          autocast=torch.float16, grad_scaler=True, loss_fn=lambda out: out.float().mean(),
                          accumulation_steps=accumulation_steps, max_grad_norm=max_grad_norm)  # fmt: skip
    assert est.peak == measured
    assert est.training_loop.startswith("fp16 loss scaling (torch.amp.GradScaler)")
    if optimizer is not _fused_adamw:  # a fused optimizer's step reads no flag
        assert any("taken as finite" in note for note in est.step_notes)


def test_the_scaler_s_own_tensors_are_counted():
    """Without the scaler the same loop holds its scale, growth counter and flags less: the estimate
    with ``grad_scaler=True`` is above the one without by what the measured loops differ by."""
    with_scaler, _ = _scaled_loop_peak(SGD, batch=8, accumulation_steps=1, max_grad_norm=None)
    kwargs = dict(batch_size=8, optimizer=SGD, device="cpu", fit=False, autocast=torch.float16, loss_fn=lambda out: out.float().mean())
    scaled = estimate_memory(_model, lambda b: torch.randn(b, 64), grad_scaler=True, **kwargs)
    plain = estimate_memory(_model, lambda b: torch.randn(b, 64), **kwargs)
    assert scaled.peak == with_scaler and scaled.peak > plain.peak


def test_the_command_takes_the_scaler(tmp_path, capsys):
    """``--autocast fp16 --grad-scaler`` prints what ``estimate_memory(..., grad_scaler=True)`` gives."""
    from pytorch_mem_profiler.analysis.cli import main

    path, build = _command_model(tmp_path, 16)
    expected = estimate_memory(build, lambda b: torch.zeros(b, 64), batch_size=16, device="cpu", fit=False, autocast="fp16", grad_scaler=True)
    assert main(["estimate", str(path), "--device", "cpu", "--units", "B", "--autocast", "fp16", "--grad-scaler"]) == 0
    out = capsys.readouterr().out
    assert "Training loop: fp16 loss scaling (torch.amp.GradScaler)" in out and f".{expected.peak} B\n" in out


def _convolutions() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 8, 3))


def test_clipping_takes_no_cublas_workspace():
    """``clip_grad_norm_``'s norms are reductions, not cuBLAS calls: a step of convolutions alone takes no
    cuBLAS workspace with clipping or without (an H200: clipping allocated nothing)."""
    x = torch.randn(2, 3, 16, 16)
    plain = estimate_memory(_convolutions, x, optimizer=torch.optim.SGD, device="cuda", fit=False)
    clipped = estimate_memory(_convolutions, x, optimizer=torch.optim.SGD, device="cuda", fit=False, max_grad_norm=1.0)
    assert plain.workspace == clipped.workspace == 0


@pytest.mark.skipif(not hasattr(torch.optim, "Adafactor"), reason="torch.optim.Adafactor is in torch 2.5 and later")
def test_each_what_if_works_out_its_own_cublas_workspace():
    """Adafactor's update runs a matmul (its row and column statistics), SGD's none: as a what-if of the
    other each takes the workspace it takes estimated alone, in either direction."""
    x = torch.randn(2, 3, 16, 16)
    sgd, ada = torch.optim.SGD, torch.optim.Adafactor
    alone = {name: estimate_memory(_convolutions, x, optimizer=opt, device="cuda", fit=False) for name, opt in (("sgd", sgd), ("ada", ada))}
    assert alone["sgd"].workspace == 0 < alone["ada"].workspace
    as_what_if = {
        "ada": estimate_memory(_convolutions, x, optimizer=sgd, device="cuda", fit=False, compare={"w": {"optimizer": ada}}).alternatives["w"],
        "sgd": estimate_memory(_convolutions, x, optimizer=ada, device="cuda", fit=False, compare={"w": {"optimizer": sgd}}).alternatives["w"],
    }
    for name in alone:
        assert as_what_if[name].workspace == alone[name].workspace and as_what_if[name].reserved == alone[name].reserved, name



def _bags() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.EmbeddingBag(1000, 8, mode="sum", sparse=True), nn.Linear(8, 1))


def test_clipping_sparse_gradients_is_refused_naming_the_operator_and_sparse_tensors():
    """``clip_grad_norm_`` over an ``EmbeddingBag(sparse=True)``'s gradient: the fake mode has no sparse
    kernel for the norm; the refusal names it and says so, not a custom operator's missing kernel."""
    x = torch.randint(0, 1000, (16, 4))
    with pytest.raises(EstimateUnsupported, match="linalg_vector_norm.* no fake .meta. kernel for sparse tensors") as caught:
        estimate_memory(_bags, x, optimizer=SGD, device="cpu", fit=False, max_grad_norm=1.0)
    assert "custom operator" not in str(caught.value)
