"""Fault injection: a fault in any function of the package never breaks or changes the training run.

A short CPU training loop (an MLP with Adam, two epochs of three iterations,
``by_layer=True``, the CSV files, ``print_period=2`` so that reported and
non-reported iterations both run, ``epoch_end`` and ``close``) runs once under
``sys.setprofile`` to learn every code object of ``pytorch_mem_profiler`` that
it calls, found by the file it was compiled from (so a renamed function is
still found). Then, for each of them, the loop runs again with a
``sys.settrace`` injector that makes that function raise once, at its first
call. Every run must finish its training, let no exception reach the loop,
end with the same weights as the run without the profiler, and leave nothing
installed after ``close()``.

Where a fault is raised: at the first statement the function executes (a bare
``try:`` line, which cannot fail, is skipped). A trace function that raises on
the ``call`` event fails the frame before its first instruction, outside any
``try`` of its own: for a function called by torch or the user (a hook, the
dispatch mode, ``record_stats``) that is a fault of the caller, which no code
in the function could contain. Raised at its first statement, the fault is
one of the function itself: a hook that begins with its guard's ``try`` keeps
it, a function without one passes it to its caller in the package.
"""

from __future__ import annotations

import io
import linecache
import logging
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import CodeType, FrameType
from typing import Any, Callable

import pytest
import torch
import torch.nn.modules.module as module_hooks
import torch.optim.optimizer as optimizer_hooks
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

import pytorch_mem_profiler
from pytorch_mem_profiler import MemoryProfiler
from pytorch_mem_profiler.measure.saved_tensors import can_chain, top_saved_tensors_hooks
from pytorch_mem_profiler.measure.storage_counting import shared_registry

PACKAGE = str(Path(pytorch_mem_profiler.__file__).resolve().parent)
EPOCHS, ITERATIONS, PRINT_PERIOD = 2, 3, 2


class InjectedFault(Exception):
    """The fault the injector raises: it must never reach the training loop."""


def in_package(code: CodeType) -> bool:
    return code.co_filename.startswith(PACKAGE)


def name_of(code: CodeType) -> str:
    where = Path(code.co_filename).relative_to(PACKAGE)
    return f"{where}:{code.co_firstlineno}:{code.co_qualname}"


def train(
    profile: bool, tmp_path: Path | None = None, around: Callable[[], Any] | None = None, check: bool = True
) -> list[torch.Tensor]:
    """Train the MLP; with ``profile`` under the profiler, the loop run inside ``around``'s tracing.

    Returns the final weights. ``around`` is a context-manager factory entered
    just after the profiler is made (its construction is not part of the loop)
    and left after ``close()``.
    """
    before = global_state()
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4)
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    data = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 16, generator=data), torch.randn(8, 4, generator=data)) for _ in range(ITERATIONS)]
    profiler = None
    if profile:
        assert tmp_path is not None
        profiler = MemoryProfiler(
            model, PRINT_PERIOD, True, csv_dir=tmp_path, by_layer=True, stream=io.StringIO()
        )
    context = around() if around is not None else _Nothing()
    try:
        with context:
            for _ in range(EPOCHS):
                for x, target in batches:
                    loss = torch.nn.functional.mse_loss(model(x), target)
                    loss.backward()
                    optimizer.step()
                    optimizer.zero_grad()
                    if profiler is not None:
                        profiler.record_stats()
                if profiler is not None:
                    profiler.epoch_end()
            if profiler is not None:
                profiler.close()
    except BaseException:
        if profiler is not None:  # a broken run: leave the next one a clean process
            try:
                if profiler.closed:  # close() once more, its steps repeated
                    profiler._state = "stopped"
                profiler.close()
            except Exception:  # noqa: BLE001 - the fault reported is the first one
                pass
        raise
    leftovers = installed_on(model, optimizer, before)
    assert not check or not leftovers, leftovers
    return [p.detach().clone() for p in model.parameters()]


class _Nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def global_state() -> dict[str, Any]:
    """What torch holds process-wide that a profiler could leave installed."""
    state: dict[str, Any] = {
        "dispatch modes": torch._C._len_torch_dispatch_stack(),
        "counting registry installed": shared_registry().installed(),
    }
    if can_chain():
        state["saved-tensor hooks on top"] = top_saved_tensors_hooks()
    for mod, names in (
        (optimizer_hooks, ("_global_optimizer_pre_hooks", "_global_optimizer_post_hooks")),
        (
            module_hooks,
            (
                "_global_forward_pre_hooks",
                "_global_forward_hooks",
                "_global_forward_hooks_always_called",
                "_global_backward_pre_hooks",
                "_global_backward_hooks",
                "_global_buffer_registration_hooks",
                "_global_module_registration_hooks",
                "_global_parameter_registration_hooks",
            ),
        ),
    ):
        for name in names:
            if hasattr(mod, name):
                state[name] = len(getattr(mod, name))
    return state


def installed_on(model: torch.nn.Module, optimizer: torch.optim.Optimizer, before: dict[str, Any]) -> list[str]:
    """Everything left installed on the model, the optimizer or torch's globals (``before``: as it was)."""
    left = [f"{k}: {v!r} (was {before[k]!r})" for k, v in global_state().items() if v != before[k]]
    for name, module in model.named_modules():
        for attr in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks"):
            if getattr(module, attr):
                left.append(f"module {name!r}.{attr}")
    for attr in ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks"):
        if getattr(optimizer, attr):
            left.append(f"optimizer.{attr}")
    return left


# -- learning what the loop calls -------------------------------------------------


class CallLog:
    """``sys.setprofile`` for the loop: every package code object called, in first-call order."""

    def __init__(self) -> None:
        self.codes: dict[CodeType, None] = {}

    def _profile(self, frame: FrameType, event: str, arg: Any) -> None:
        if event == "call":
            code = frame.f_code
            if code not in self.codes and in_package(code):
                self.codes[code] = None

    def __enter__(self) -> CallLog:
        sys.setprofile(self._profile)
        threading.setprofile(self._profile)
        return self

    def __exit__(self, *exc: object) -> None:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]


# -- the injector --------------------------------------------------------------------


@dataclass
class Injector:
    """``sys.settrace`` that makes ``target`` raise once, at the first statement of its first call."""

    target: CodeType
    fired: str | None = None
    unraisable: list[str] = field(default_factory=list)

    def _global(self, frame: FrameType, event: str, arg: Any) -> Any:
        if self.fired is None and frame.f_code is self.target:
            return self._local
        return None

    def _local(self, frame: FrameType, event: str, arg: Any) -> Any:
        if self.fired is not None or event != "line":
            return self._local if self.fired is None else None
        line = linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()
        if line.split("#")[0].strip() == "try:":
            return self._local
        self.fired = f"line {frame.f_lineno}: {line}"
        # Nothing else to trace: the rest of the run goes at full speed.
        sys.settrace(None)
        raise InjectedFault(f"injected into {name_of(self.target)} at {self.fired}")

    def __enter__(self) -> Injector:
        self._hook = sys.unraisablehook
        sys.unraisablehook = lambda u: self.unraisable.append(f"{u.exc_type.__name__}: {u.exc_value}")
        sys.settrace(self._global)
        return self

    def __exit__(self, *exc: object) -> None:
        sys.settrace(None)
        sys.unraisablehook = self._hook


# -- the tests -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reference() -> list[torch.Tensor]:
    return train(profile=False)


@pytest.fixture(scope="module")
def called(tmp_path_factory, reference) -> list[CodeType]:
    log = CallLog()
    weights = train(True, tmp_path_factory.mktemp("learn"), around=lambda: log)
    assert all(torch.equal(a, b) for a, b in zip(weights, reference))
    return list(log.codes)


def test_the_loop_calls_many_functions_of_the_package(called):
    # the hook set, the phase machine, each observer, the dispatch mode, the record, each output,
    # close(): a loop that reached only a few would make the test below say little
    files = {Path(code.co_filename).name for code in called}
    assert len(called) > 100, len(called)
    for expected in ("hooks.py", "entries.py", "phases.py", "intervals.py", "peak_breakdown.py", "layers.py",
                     "meter.py", "storage_counting.py", "saved_tensors.py", "export.py", "report.py",
                     "sinks.py", "profiler.py", "faults.py"):  # fmt: skip
        assert expected in files, sorted(files)


def test_a_fault_in_any_function_is_contained(called, reference, tmp_path, caplog):
    caplog.set_level(logging.CRITICAL, logger="pytorch_mem_profiler")
    broken: list[str] = []
    fired = 0
    started = time.perf_counter()
    for index, code in enumerate(called):
        injector = Injector(code)
        try:
            weights = train(True, tmp_path / str(index), around=lambda: injector)
        except BaseException as exc:  # noqa: BLE001 - what escaped is the finding
            broken.append(f"{name_of(code)} [{injector.fired}]: escaped {type(exc).__name__}: {exc}")
            continue
        if injector.fired is None:
            continue  # not reached this time (a path taken only once per process)
        fired += 1
        if not all(torch.equal(a, b) for a, b in zip(weights, reference)):
            broken.append(f"{name_of(code)} [{injector.fired}]: the weights changed")
        if injector.unraisable:
            broken.append(f"{name_of(code)} [{injector.fired}]: unraisable {injector.unraisable}")
    elapsed = time.perf_counter() - started
    print(f"{len(called)} functions, {fired} faults injected, {len(broken)} broken runs, {elapsed:.1f} s")
    assert not broken, "\n".join(broken)
    # nearly every function is reached again in a fresh run (those that are not ran once per process)
    assert fired >= 0.9 * len(called), (fired, len(called))


# -- faults inside the fault handling itself, with two profilers -------------------------------------
#
# The guard's own code (switching a part off, logging its fault once, the traceback filter, the
# clean-up's loop and its retry) runs only after a fault, so the runs above never fault there.
# Here a first fault is injected into a function the loop calls, and a second one into a
# function of the guard at its first call after that: the guard must still switch the part off,
# contain both, and remove everything, with two profilers closed in either order.


def _guard_codes() -> dict[str, CodeType]:
    from pytorch_mem_profiler import faults

    wrap_inner = next(c for c in faults.FaultGuard.wrap.__code__.co_consts if isinstance(c, CodeType))
    return {
        "FaultGuard.fault": faults.FaultGuard.fault.__code__,
        "_log_fault (once-only logging)": faults._log_fault.__code__,
        "TracebacksAsText.filter": faults.TracebacksAsText.filter.__code__,
        "FaultGuard.clean_up": faults.FaultGuard.clean_up.__code__,
        "FaultGuard._clean_up": faults.FaultGuard._clean_up.__code__,
        "twice": faults.twice.__code__,
        "FaultGuard.call": faults.FaultGuard.call.__code__,
        "FaultGuard.wrap (guarded)": wrap_inner,
    }


@dataclass
class ChainedInjector:
    """Raises once at ``target``'s first statement, then once at ``then``'s first statement after it.

    A trace function that raises is taken off the thread (Python unsets it), so the arming is done
    by a profile function, which never raises: at the ``call`` of the function to fail it turns
    line tracing on for that frame alone, and the trace raises at its first statement.
    """

    target: CodeType
    then: CodeType
    fired: str | None = None
    second: str | None = None
    unraisable: list[str] = field(default_factory=list)

    def _profile(self, frame: FrameType, event: str, arg: Any) -> None:
        if event != "call":
            return
        wanted = self.target if self.fired is None else self.then if self.second is None else None
        if wanted is not None and frame.f_code is wanted:
            sys.settrace(_no_trace)
            frame.f_trace = self._local
            frame.f_trace_lines = True

    def _local(self, frame: FrameType, event: str, arg: Any) -> Any:
        if event != "line":
            return self._local
        line = linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()
        if line.split("#")[0].strip() == "try:":
            return self._local
        where = f"line {frame.f_lineno}: {line}"
        sys.settrace(None)
        if self.fired is None:
            self.fired = where
            raise InjectedFault(f"injected into {name_of(self.target)} at {where}")
        self.second = where
        raise InjectedFault(f"injected into the guard's {name_of(self.then)} at {where}")

    def __enter__(self) -> ChainedInjector:
        self._hook = sys.unraisablehook
        sys.unraisablehook = lambda u: self.unraisable.append(f"{u.exc_type.__name__}: {u.exc_value}")
        sys.setprofile(self._profile)
        return self

    def __exit__(self, *exc: object) -> None:
        sys.setprofile(None)
        sys.settrace(None)
        sys.unraisablehook = self._hook


def _no_trace(frame: FrameType, event: str, arg: Any) -> None:
    return None


def train_two(tmp_path: Path, close_first: int, around: Callable[[], Any]) -> list[torch.Tensor]:
    """Two models, each with its optimizer and its profiler, trained in one loop; the profilers
    closed in the order ``close_first`` says (0: the first made closes first). Returns both
    models' weights; asserts nothing is left installed on either or on torch's globals."""
    before = global_state()
    models, optimizers, profilers = [], [], []
    for seed in (0, 1):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
        models.append(model)
        optimizers.append(torch.optim.Adam(model.parameters(), lr=1e-2))
    data = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 16, generator=data), torch.randn(8, 4, generator=data)) for _ in range(ITERATIONS)]
    if tmp_path is not None:
        for index, model in enumerate(models):
            profilers.append(
                MemoryProfiler(model, PRINT_PERIOD, True, csv_dir=tmp_path / str(index), by_layer=True,
                               stream=io.StringIO())
            )
    order = profilers if close_first == 0 else profilers[::-1]
    try:
        with around():
            for _ in range(EPOCHS):
                for x, target in batches:
                    for model, optimizer in zip(models, optimizers):
                        torch.nn.functional.mse_loss(model(x), target).backward()
                        optimizer.step()
                        optimizer.zero_grad()
                    for profiler in profilers:
                        profiler.record_stats()
                for profiler in profilers:
                    profiler.epoch_end()
            for profiler in order:
                profiler.close()
    except BaseException:
        for profiler in order:  # a broken run: leave the next one a clean process
            try:
                if profiler.closed:  # close() once more, its steps repeated
                    profiler._state = "stopped"
                profiler.close()
            except Exception:  # noqa: BLE001 - the fault reported is the first one
                pass
        raise
    left = [f"model {i}: {item}" for i, (m, o) in enumerate(zip(models, optimizers)) for item in installed_on(m, o, before)]
    assert not left, left
    return [p.detach().clone() for m in models for p in m.parameters()]


#: the first faults: functions called by torch or the user, and the clean-up's own steps
_FIRST_FAULT_FILES = ("hooks.py", "phases.py", "intervals.py", "storage_counting.py", "saved_tensors.py",
                      "meter.py", "profiler.py", "sinks.py", "layers.py", "peak_breakdown.py",
                      "entries.py")  # fmt: skip


def test_a_fault_in_the_guards_own_handling_leaves_nothing_installed(called, tmp_path, caplog):
    # WARNING: the fault's log record is made, so the logging path (the traceback filter) runs
    caplog.set_level(logging.WARNING, logger="pytorch_mem_profiler")
    reference = train_two(None, 0, _Nothing)  # type: ignore[arg-type]
    firsts = [c for c in called if Path(c.co_filename).name in _FIRST_FAULT_FILES]
    firsts = firsts[:: max(1, len(firsts) // 24)]  # about two dozen, spread over the files
    broken: list[str] = []
    seconds: dict[str, int] = {}
    runs = 0
    for gname, gcode in _guard_codes().items():
        for f_index, first in enumerate(firsts):
            for close_first in (0, 1):
                injector = ChainedInjector(first, then=gcode)
                runs += 1
                try:
                    weights = train_two(tmp_path / f"{runs}", close_first, lambda: injector)
                except BaseException as exc:  # noqa: BLE001 - what escaped (or was left) is the finding
                    broken.append(f"{name_of(first)} then {gname} [{injector.fired} / {injector.second}], "
                                  f"close order {close_first}: {type(exc).__name__}: {exc}")
                    continue
                if injector.second is not None:
                    seconds[gname] = seconds.get(gname, 0) + 1
                if not all(torch.equal(a, b) for a, b in zip(weights, reference)):
                    broken.append(f"{name_of(first)} then {gname}, close order {close_first}: the weights changed")
                if injector.unraisable:
                    broken.append(f"{name_of(first)} then {gname}: unraisable {injector.unraisable}")
    print(f"{runs} runs, second faults fired in the guard: {seconds}, {len(broken)} broken")
    assert not broken, "\n".join(broken)
    # each of the guard's functions was really made to fail after a first fault, in many runs
    for gname in _guard_codes():
        assert seconds.get(gname, 0) >= 2, (gname, seconds)
