"""Several profilers in one process: one shared counting mode, closed in any order, nothing left behind."""

from __future__ import annotations

import io
import logging
import threading

import pytest
import torch
from torch.nn.modules.module import _global_forward_pre_hooks
from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack

from pytorch_mem_profiler import MemoryProfiler
from pytorch_mem_profiler.measure.storage_counting import _CountingMode

from .helpers import mlp, train_step


class OperatorLog(TorchDispatchMode):
    """The user's own dispatch mode: counts the operators it sees."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.calls += 1
        return func(*args, **(kwargs or {}))


def counting_modes() -> list[TorchDispatchMode]:
    return [m for m in _get_current_dispatch_mode_stack() if isinstance(m, _CountingMode)]


def handler_calls_in_a_probe_step(monkeypatch) -> int:
    """How many operators of a small training step reach a counting mode's handler."""
    calls = []
    original = _CountingMode.__torch_dispatch__

    def spy(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        calls.append(func)
        return original(self, func, types, args, kwargs)

    monkeypatch.setattr(_CountingMode, "__torch_dispatch__", spy)
    model = mlp()
    train_step(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(4, 32))
    monkeypatch.setattr(_CountingMode, "__torch_dispatch__", original)
    return len(calls)


@pytest.fixture
def installed_before():
    """What was installed before the test; the test must leave exactly that."""
    state = (
        _get_current_dispatch_mode_stack(),
        len(_global_optimizer_pre_hooks),
        len(_global_optimizer_post_hooks),
        len(_global_forward_pre_hooks),
    )
    yield state
    assert (
        _get_current_dispatch_mode_stack(),
        len(_global_optimizer_pre_hooks),
        len(_global_optimizer_post_hooks),
        len(_global_forward_pre_hooks),
    ) == state


def _two_models_train(first: MemoryProfiler, second: MemoryProfiler, a, b, batch: int) -> tuple:
    for model, profiler in ((a, first), (b, second)):
        train_step(model, None, torch.randn(batch, 32))
    return first.record_stats(), second.record_stats()


@pytest.mark.parametrize("close_first", ["first made", "second made"])
def test_two_profilers_share_one_mode_and_close_in_any_order(close_first, installed_before, monkeypatch):
    stack_before = installed_before[0]
    a, b = mlp(), mlp(32, 48, 10)
    first = MemoryProfiler(a, stream=io.StringIO(), strict=True)
    second = MemoryProfiler(b, stream=io.StringIO(), strict=True)
    assert len(counting_modes()) == 1  # one mode for both
    assert len(_get_current_dispatch_mode_stack()) == len(stack_before) + 1
    ra, rb = _two_models_train(first, second, a, b, batch=8)
    # Each profiler's figures stay exact with the other running: what forward keeps
    # for backward is ReLU's output and the model's output (see test_profiler.py).
    assert ra.feature_maps == 8 * 64 * 4 + 8 * 10 * 4
    assert rb.feature_maps == 8 * 48 * 4 + 8 * 10 * 4
    assert ra.weights == sum(p.nbytes for p in a.parameters())
    assert rb.weights == sum(p.nbytes for p in b.parameters())
    assert handler_calls_in_a_probe_step(monkeypatch) > 0

    order = (first, second) if close_first == "first made" else (second, first)
    order[0].close()
    assert len(counting_modes()) == 1  # the other still counts
    still_open = order[1]
    still_model = a if still_open is first else b
    train_step(still_model, None, torch.randn(8, 32))
    assert still_open.record_stats().feature_maps == (ra if still_open is first else rb).feature_maps
    order[1].close()
    assert _get_current_dispatch_mode_stack() == stack_before
    assert handler_calls_in_a_probe_step(monkeypatch) == 0  # no operator pays for a closed profiler


def test_a_users_mode_entered_after_the_profiler_keeps_working_and_ours_leaves_later(
    installed_before, caplog
):
    stack_before = installed_before[0]
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    profiler = MemoryProfiler(model, stream=io.StringIO(), strict=True)
    user = OperatorLog()
    with caplog.at_level(logging.WARNING, logger="pytorch_mem_profiler"):
        with user:
            train_step(model, opt, torch.randn(4, 32))
            record = profiler.record_stats()
            profiler.close()  # ours is below the user's: it cannot leave yet
            assert counting_modes() and not counting_modes()[0].tallies
            seen = user.calls
            train_step(model, opt, torch.randn(4, 32))
            assert user.calls > seen  # the user's mode still sees every operator
        # The user's mode has exited; ours is on top, switched off, until the next forward.
        assert len(counting_modes()) == 1
        model(torch.randn(4, 32))
    assert counting_modes() == []
    assert _get_current_dispatch_mode_stack() == stack_before
    assert record.feature_maps == 4 * 64 * 4 + 4 * 10 * 4
    assert any("switched off" in r.getMessage() for r in caplog.records)


def test_an_optimizer_step_is_a_chance_to_leave_too(installed_before):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    profiler = MemoryProfiler(model, stream=io.StringIO(), strict=True)
    with OperatorLog():
        profiler.close()
    assert len(counting_modes()) == 1
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    assert counting_modes() == []


def test_a_profiler_made_while_ours_waits_reuses_it(installed_before):
    stack_before = installed_before[0]
    a, b = mlp(), mlp()
    first = MemoryProfiler(a, stream=io.StringIO(), strict=True)
    user = OperatorLog()
    with user:
        first.close()
        second = MemoryProfiler(b, stream=io.StringIO(), strict=True)
        assert len(counting_modes()) == 1 and counting_modes()[0].tallies  # switched on again, not pushed
        assert len(_get_current_dispatch_mode_stack()) == len(stack_before) + 2
        train_step(b, None, torch.randn(4, 32))
        record = second.record_stats()
    second.close()
    assert record.feature_maps == 4 * 64 * 4 + 4 * 10 * 4
    assert _get_current_dispatch_mode_stack() == stack_before


def test_a_users_mode_entered_before_the_profiler_stays(installed_before):
    model = mlp()
    with OperatorLog() as user:
        profiler = MemoryProfiler(model, stream=io.StringIO(), strict=True)
        train_step(model, None, torch.randn(4, 32))
        profiler.record_stats()
        profiler.close()
        assert _get_current_dispatch_mode_stack()[-1] is user


def test_profilers_on_two_threads_each_leave_their_thread_clean(installed_before):
    results = {}

    def run(name: str) -> None:
        model = mlp()
        with MemoryProfiler(model, stream=io.StringIO(), strict=True) as profiler:
            train_step(model, None, torch.randn(4, 32))
            results[name] = (profiler.record_stats().feature_maps, len(counting_modes()))
        results[name + " after"] = len(_get_current_dispatch_mode_stack())

    model = mlp()
    with MemoryProfiler(model, stream=io.StringIO(), strict=True) as main_profiler:
        worker = threading.Thread(target=run, args=("worker",))
        worker.start()
        worker.join()
        train_step(model, None, torch.randn(4, 32))
        main_record = main_profiler.record_stats()
    assert results["worker"] == (4 * 64 * 4 + 4 * 10 * 4, 1)
    assert results["worker after"] == 0
    assert main_record.feature_maps == 4 * 64 * 4 + 4 * 10 * 4


def test_a_profiler_closed_from_another_thread_leaves_at_the_next_forward(installed_before):
    stack_before = installed_before[0]
    model = mlp()
    profiler = MemoryProfiler(model, stream=io.StringIO(), strict=True)
    closer = threading.Thread(target=profiler.close)
    closer.start()
    closer.join()
    assert len(counting_modes()) == 1 and not counting_modes()[0].tallies  # switched off, still here
    model(torch.randn(4, 32))
    assert _get_current_dispatch_mode_stack() == stack_before
