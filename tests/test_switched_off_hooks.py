"""A fault in the forward, backward or optimizer-step hooks switches that part off and takes its hooks away;
one in ``record_stats()`` stops all measuring; a fault's log record keeps no tensor alive.

A switched-off hook returns at once, but the fault interrupted it: a forward
entered and never left, a step begun and never ended, a backward whose end was
never seen. Left open, any of them kept the hooks awake on every later
iteration (and, with no forward found, hooked every module of the model again):
each non-reported iteration then paid a reported one's hooks. Checked here
against the same run without the fault: the hooks sleep through the same
iterations, the part's hooks are gone from the faulted iteration's end, every
figure that does not need the part is the same, and so are the weights.
"""

from __future__ import annotations

import io
import logging
import weakref
from typing import Any, Callable

import pytest
import torch
import torch.optim.optimizer as optimizer_hooks
from torch import nn

from pytorch_mem_profiler import MemoryProfiler
from pytorch_mem_profiler.measure.entries import FORWARD_PART
from pytorch_mem_profiler.measure.hooks import BACKWARD_PART, OPTIMIZER_PART
from pytorch_mem_profiler.measure.meter import Meter

from .helpers import SavedBytes, nbytes

PRINT_PERIOD, ITERATIONS, FAULTED = 3, 10, 6  # iteration 6 is reported: every hook is on


def _raise(*args: Any, **kwargs: Any) -> None:
    raise RuntimeError("injected")


def _in_forward(meter: Meter) -> None:
    meter._hooks._entries.on_enter = _raise  # raised entering the model: the forward is never left


def _in_backward(meter: Meter) -> None:
    meter._hooks._backward_end_callbacks = _raise  # raised after backward began: its end is never seen


def _in_step(meter: Meter) -> None:
    meter._machine.step_ended = _raise  # raised in the step's post-hook: the step never ends


FAULTS: dict[str, tuple[str, Callable[[Meter], None]]] = {
    "forward": (FORWARD_PART, _in_forward),
    "backward": (BACKWARD_PART, _in_backward),
    "optimizer": (OPTIMIZER_PART, _in_step),
}


def profiler_hooks_left(model: nn.Module) -> tuple[int, int]:
    """(module hooks on the model, optimizer-step hooks in the process)."""
    on_modules = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())
    on_steps = len(optimizer_hooks._global_optimizer_pre_hooks) + len(optimizer_hooks._global_optimizer_post_hooks)
    return on_modules, on_steps


def run_with_fault(device: str, fault: str | None) -> tuple[list[torch.Tensor], list[tuple[Any, bool, tuple[int, int]]]]:
    """Train under the profiler, ``fault`` (a key of ``FAULTS``) injected before iteration ``FAULTED``.

    Returns the final weights and, per iteration, (its record, whether the hooks
    sleep after it, the profiler's hooks left installed after it).
    """
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.Tanh(), nn.Linear(128, 8)).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    data = torch.Generator().manual_seed(1)
    before = profiler_hooks_left(model)
    seen = []
    with MemoryProfiler(model, PRINT_PERIOD, stream=io.StringIO()) as profiler:
        hooks = profiler._meter._hooks
        for i in range(1, ITERATIONS + 1):
            if i == FAULTED and fault is not None:
                FAULTS[fault][1](profiler._meter)
            x = torch.randn(16, 64, generator=data).to(device)
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            record = profiler.record_stats()
            on_modules, on_steps = profiler_hooks_left(model)
            seen.append((record, hooks.asleep, (on_modules - before[0], on_steps - before[1])))
    assert profiler_hooks_left(model) == before
    # on the host: the first run's weights must not count in the second run's device figures
    return [p.detach().to("cpu", copy=True) for p in model.parameters()], seen


def check_switched_off(device: str, fault: str, caplog: pytest.LogCaptureFixture) -> None:
    part = FAULTS[fault][0]
    weights, clean = run_with_fault(device, None)
    faulted_weights, faulted = run_with_fault(device, fault)
    assert f"{part} failed and is switched off" in caplog.text
    for a, b in zip(weights, faulted_weights):
        assert torch.equal(a, b)
    # The hooks sleep through the same iterations as without the fault (before the fix: never
    # again after it).
    assert [asleep for _, asleep, _ in faulted] == [asleep for _, asleep, _ in clean]
    assert [asleep for _, asleep, _ in clean] == [(i + 1) % PRINT_PERIOD != 0 for i in range(1, ITERATIONS + 1)]
    for (ours, _, left), (theirs, _, clean_left) in zip(faulted[FAULTED - 1 :], clean[FAULTED - 1 :]):
        # The part's hooks are gone from the faulted iteration's end on, awake or asleep.
        if part == FORWARD_PART:
            assert left == (0, clean_left[1]), ours.iteration
        elif part == OPTIMIZER_PART:
            assert left == (clean_left[0], 0), ours.iteration
        else:
            assert left == clean_left, ours.iteration
        # What the allocator and the model's tensors give needs none of the three parts.
        for name in ("allocated", "iteration_peak_allocated", "weights", "optimizer_state", "reported"):
            assert getattr(ours, name) == getattr(theirs, name), (name, ours.iteration)
        if ours.reported and part == OPTIMIZER_PART:
            # Measured at backward's end, which the forward and backward hooks find.
            assert ours.gradients == theirs.gradients == sum(p.numel() * p.element_size() for p in weights)


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_a_fault_in_a_phase_hook_takes_its_hooks_away_and_the_others_still_sleep(fault, caplog):
    check_switched_off("cpu", fault, caplog)


def test_a_forward_marked_by_hand_is_still_measured_once_the_forward_hooks_are_off(caplog):
    """The forward hooks switched off, a framework's ``phase("forward")`` blocks still measure
    forward: its phase, its pass count and the feature maps it leaves (what a pack hook saw
    autograd save, and the output)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    records = []
    with MemoryProfiler(model, 1, stream=io.StringIO()) as profiler:
        for i in range(3):
            if i == 1:
                _in_forward(profiler._meter)
            x = torch.randn(16, 64)
            saved = SavedBytes(model, (x,))
            with profiler.phase("forward"), saved.hooks():
                out = model(x)
            out.square().mean().backward()
            kept = saved.total + nbytes(out)
            del out  # not alive when the next forward starts
            opt.step()
            opt.zero_grad(set_to_none=True)
            records.append(profiler.record_stats())
            assert records[-1].feature_maps == kept == (16 * 128 + 16 * 8) * 4
    assert f"{FORWARD_PART} failed and is switched off" in caplog.text
    assert profiler_hooks_left(model)[0] == 0
    for record in records:
        assert record.forward_passes == 1 and record.phases["forward"].occurrences == 1


def test_a_faults_log_record_keeps_none_of_the_iterations_tensors():
    """A fault is logged as text (its message and traceback), never as the exception, whose
    frames hold the tensors the hook was given: a handler that keeps its records (here a list;
    a ``MemoryHandler``, a test's log capture) must not keep the forward's output alive, which
    would hold its whole autograd graph."""
    kept: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            kept.append(record)

    logger = logging.getLogger("pytorch_mem_profiler")
    handler = Keep()
    logger.addHandler(handler)
    try:
        model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 8))
        with MemoryProfiler(model, 1, stream=io.StringIO()) as profiler:
            profiler._meter._hooks._entries.on_exit = _raise  # given the model's output
            out = model(torch.randn(16, 64))
            alive = weakref.ref(out)
            out.sum().backward()
            profiler.record_stats()
            del out
    finally:
        logger.removeHandler(handler)
    assert alive() is None
    (record,) = [r for r in kept if "switched off" in r.getMessage()]
    assert record.exc_info is None and all(isinstance(a, str) for a in record.args)
    text = logging.Formatter().format(record)  # what a handler prints: the message, then the traceback
    assert f"{FORWARD_PART} failed" in text and "Traceback" in text and text.endswith("RuntimeError: injected")


def train_until_measuring_stops(
    tmp_path: Any, inject: Callable[[MemoryProfiler], Callable[[], None] | None] | None, **options: Any
) -> tuple[list[torch.Tensor], list[tuple[int, Any, int, bool, str | None]], Any]:
    """Seven iterations of an MLP with Adam; with ``inject``, under a profiler (``print_period=2``,
    CSV files in ``tmp_path``, ``options``) on which ``inject`` is called before iteration 4's
    forward (what it returns, if anything, is called after that forward). Iteration 6's forward is
    marked with ``phase("forward")``, ``epoch_end()`` follows iteration 5, and one more forward
    follows each ``record_stats()``.

    Returns the final weights, per iteration (its number, its record, the module hooks on the
    model, whether torch's process-wide state is as before the profiler, the current phase), and
    the CSV file's path.
    """
    from .test_fault_injection import global_state

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 8))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    before = global_state()
    seen = []
    profiler = None
    if inject is not None:
        profiler = MemoryProfiler(model, 2, True, csv_dir=tmp_path, stream=io.StringIO(), **options)
    for i in range(1, 8):
        x = torch.randn(16, 64)
        undo = inject(profiler) if profiler is not None and inject is not None and i == 4 else None
        if profiler is not None and i == 6:
            with profiler.phase("forward"):
                out = model(x)
        else:
            out = model(x)
        if undo is not None:
            undo()
        out.square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if profiler is not None:
            record = profiler.record_stats()
            if i == 5:
                profiler.epoch_end()
            model(x)  # a forward without backward: a mode waiting to leave torch's stack leaves here
            hooked = profiler_hooks_left(model)[0]
            seen.append((i, record, hooked, global_state() == before, profiler.current_phase))
    if profiler is not None:
        profiler.close()
        assert global_state() == before
    return [p.detach().clone() for p in model.parameters()], seen, profiler and profiler.csv_path


def check_measuring_stopped(tmp_path: Any, inject: Callable[[MemoryProfiler], Any], **options: Any) -> None:
    """From iteration 4 on (the fault's): no record, nothing of the profiler installed (module
    hooks, or anything torch holds process-wide), no phase; the row of iteration 2 on disk; the
    weights those of the run without the profiler."""
    import pandas

    weights, _, _ = train_until_measuring_stops(tmp_path, None)
    profiled_weights, seen, csv_path = train_until_measuring_stops(tmp_path, inject, **options)
    for a, b in zip(weights, profiled_weights):
        assert torch.equal(a, b)
    for i, record, hooked, clean, phase in seen:
        if i >= 4:
            assert (record, hooked, clean, phase) == (None, 0, True, None), i
        else:  # measuring: the CPU counter's dispatch mode is on torch's stack
            assert record is not None and not clean, i
    assert list(pandas.read_csv(csv_path)["iteration"]) == [2]


def test_record_stats_switched_off_by_a_fault_stops_all_measuring(tmp_path, caplog):
    """``record_stats()`` is the profiler's door: once a fault switches it off nothing is recorded,
    so nothing is measured either. From the end of the call that failed, nothing of the profiler is
    installed (module, optimizer and saved-tensor hooks, the CPU counter's dispatch mode; before,
    per-layer mode's hooks ran on every later forward), ``epoch_end()`` and ``phase()`` install
    nothing again, the rows reported before are on disk, and the weights are those of the run
    without the profiler."""

    def fail_the_record(profiler: MemoryProfiler) -> None:
        profiler._meter.finish = _raise  # iteration 4 is reported: every hook is on, per-layer ones too

    check_measuring_stopped(tmp_path, fail_the_record, by_layer=True)
    assert "record_stats failed and is switched off" in caplog.text


def test_a_fault_in_the_cpu_counter_stops_all_measuring(tmp_path, caplog):
    """On the CPU every figure comes from the storage counter: once a fault stops it, its figures
    would stay frozen (allocated as it was, the peak equal to it), so ``record_stats()`` gives
    ``None`` from that iteration on and the profiler measures nothing more: its dispatch mode
    leaves torch's stack by the next forward and no hook is left. The rows reported before are on
    disk, and the weights are those of the run without the profiler."""
    from pytorch_mem_profiler.measure.storage_counting import shared_registry

    def fail_the_counting(profiler: MemoryProfiler) -> Callable[[], None]:
        registry = shared_registry()
        registry.add = _raise  # where the counting mode counts a new storage, during the forward

        def undo() -> None:
            del registry.add

        return undo

    check_measuring_stopped(tmp_path, fail_the_counting)
    assert "CPU storage counter failed and is switched off" in caplog.text


class _FrozenEncoderStudent(nn.Module):
    """A frozen ``nn.TransformerEncoder`` (eval, no gradients: torch's fused fast path) feeding a head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(100, 64)
        layer = nn.TransformerEncoderLayer(64, 4, 128, batch_first=True)
        self.teacher = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval().requires_grad_(False)
        self.head = nn.Linear(64, 4)

    def train(self, mode: bool = True) -> "_FrozenEncoderStudent":
        super().train(mode)
        self.teacher.eval()
        return self

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        with torch.no_grad():
            features = self.teacher(x.detach())
        return self.head((x + features).mean(1))


def _fast_path_steps(monkeypatch, profiled: bool) -> tuple[int, list[int]]:
    calls = []
    fused = torch._transformer_encoder_layer_fwd
    monkeypatch.setattr(torch, "_transformer_encoder_layer_fwd", lambda *a, **k: calls.append(1) or fused(*a, **k))
    torch.manual_seed(0)
    model = _FrozenEncoderStudent()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ids, labels = torch.randint(0, 100, (2, 16)), torch.randint(0, 4, (2,))
    peaks = []
    profiler = MemoryProfiler(model, print_period=1, by_layer=True, stream=io.StringIO(), strict=True, optimizer=opt) if profiled else None
    for _ in range(3):
        nn.functional.cross_entropy(model(ids), labels).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if profiler is not None:
            peaks.append(profiler.record_stats().iteration_peak_allocated)
    if profiler is not None:
        profiler.close()
    return len(calls), peaks


def test_a_frozen_encoder_takes_torchs_fast_path_in_every_profiled_iteration(monkeypatch):
    # the learning iteration hooked every module, and nn.TransformerEncoderLayer takes its fused
    # kernel only without hooks: the first iteration ran another computation (22,472 B more)
    unprofiled, _ = _fast_path_steps(monkeypatch, profiled=False)
    profiled, peaks = _fast_path_steps(monkeypatch, profiled=True)
    assert profiled == unprofiled == 2 * 3
    assert peaks[0] == peaks[1] == peaks[2] > 0
