"""Observe, never change: the CPU counter's dispatch mode keeps autograd's in-place gradient sums.

Autograd's engine adds a tensor's gradient pieces into the first one where it holds the last
reference to it, and makes ``old + new`` under any dispatch mode (``measure/engine_sums.py``). The
CPU counter counts through a mode, so without care a profiled CPU step holds one piece more at each
sum than the same step unprofiled. The truth here is independent of the counter: the data pointers
of the pieces and of the sum (a real step, no mode), and the CPU allocator's own events as
``torch.profiler`` records them (``profile_memory=True``: not a dispatch mode), for the same step
with and without the profiler.
"""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

from pytorch_mem_profiler import memory_profiler
from pytorch_mem_profiler.measure import engine_sums
from pytorch_mem_profiler.measure.storage_counting import Tally, shared_registry

from .test_estimate_accumulation import Tap


def _summed_into_a_piece() -> bool:
    """One backward where ``h``'s two gradient pieces are summed: whether the sum is one of them."""
    x = torch.randn(8, 16, requires_grad=True)
    log: list[int] = []
    summed: list[int] = []
    h = torch.relu(x)
    h.register_hook(lambda g: summed.append(g.data_ptr()))
    (Tap.apply(h, log) * 2.0 + Tap.apply(h, log) * 3.0).sum().backward()
    assert len(log) == 2 and len(summed) == 1
    return summed[0] in log


class Fan(nn.Module):
    """A wide hidden state read by ``width`` narrow heads: backward sums ``width`` pieces of
    ``batch x hidden`` into ``h``'s gradient, and the sums hold the step's peak."""

    def __init__(self, width: int = 4, dim: int = 64, hidden: int = 2048) -> None:
        super().__init__()
        self.stem = nn.Linear(dim, hidden)
        self.heads = nn.ModuleList(nn.Linear(hidden, 4) for _ in range(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.stem(x))
        return sum(head(h).pow(2).mean() for head in self.heads)


def _allocator_events(prof) -> list[int]:  # type: ignore[no-untyped-def]
    """The CPU allocator's allocations (+bytes) and frees (-bytes) in the order they happened."""
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    events.sort(key=lambda e: e.start_ns())
    return [e.nbytes() for e in events]


def _rise(events: list[int]) -> int:
    """The highest the bytes allocated rose above where they started."""
    total = highest = 0
    for nbytes in events:
        total += nbytes
        highest = max(highest, total)
    return highest


def _step_events(model: nn.Module, x: torch.Tensor) -> list[int]:
    for p in model.parameters():
        p.grad = None
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        model(x).backward()
    return _allocator_events(prof)


def _fan() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model, x = Fan(), torch.randn(64, 64)
    model(x).backward()  # every gradient made once, before any step is looked at
    return model, x


def test_under_the_cpu_counter_the_engine_still_sums_into_the_first_piece():
    assert _summed_into_a_piece()  # no mode: in place
    registry, tally = shared_registry(), Tally()
    registry.start(tally)
    try:
        assert _summed_into_a_piece()
    finally:
        registry.stop(tally)
    assert not registry.installed()


def _big(events: list[int]) -> list[int]:
    """Without the small ones, among which the 8-byte scalars a dispatch mode wraps Python numbers
    in (made and freed at once: the one difference the mode makes)."""
    return [n for n in events if abs(n) >= 512]


def test_with_the_profiler_on_the_step_allocates_what_it_allocates_without_it():
    """The allocator's events with the profiler on are those without it, and the CPU counter's
    figures over the step (storages made in it: what the allocator's events also cover) are
    theirs to the byte: the bytes made and still alive, and the highest they rose."""
    model, x = _fan()
    unwatched = _step_events(model, x)
    profiler = memory_profiler(model, 1, False, stream=io.StringIO())
    registry, tally = shared_registry(), Tally()
    try:
        registry.start(tally)
        watched = _step_events(model, x)
        allocated, peak = tally.settle()
    finally:
        registry.stop(tally)
        profiler.close()
    assert _big(watched) == _big(unwatched) and sum(watched) == sum(unwatched)
    assert (allocated, peak) == (sum(unwatched), _rise(unwatched))


def test_without_the_rule_the_profiled_step_would_hold_a_piece_more_at_each_sum(monkeypatch):
    """The check above can fail: with the rule off, the counted step makes each sum a new tensor."""
    model, x = _fan()
    unwatched = _step_events(model, x)
    monkeypatch.setattr(engine_sums.EngineAccumulation, "in_place", lambda self, args, kwargs: False)
    registry, tally = shared_registry(), Tally()
    registry.start(tally)
    try:
        watched = _step_events(model, x)
    finally:
        registry.stop(tally)
    piece = 64 * 2048 * 4
    made = lambda events: sum(n for n in events if n >= 512)  # noqa: E731
    assert made(watched) - made(unwatched) == 3 * piece  # three sums of four pieces
    assert _rise(watched) > _rise(unwatched)


def test_a_user_mode_under_the_counter_keeps_its_sums_out_of_place():
    """A user's own dispatch mode already makes the unprofiled step sum out of place: the counter,
    entered above it, does not put them in place."""

    class Passing(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            return func(*args, **(kwargs or {}))

    with Passing():
        assert not _summed_into_a_piece()
        registry, tally = shared_registry(), Tally()
        registry.start(tally)
        try:
            assert not _summed_into_a_piece()
        finally:
            registry.stop(tally)


def test_a_user_mode_over_the_counter_keeps_its_sums_out_of_place():
    class Passing(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            return func(*args, **(kwargs or {}))

    registry, tally = shared_registry(), Tally()
    registry.start(tally)
    try:
        with Passing():
            assert not _summed_into_a_piece()
        assert _summed_into_a_piece()
    finally:
        registry.stop(tally)


def test_values_are_those_of_the_unprofiled_step():
    model, x = _fan()
    for p in model.parameters():
        p.grad = None
    model(x).backward()
    expected = [p.grad.clone() for p in model.parameters()]
    registry, tally = shared_registry(), Tally()
    registry.start(tally)
    try:
        for p in model.parameters():
            p.grad = None
        model(x).backward()
    finally:
        registry.stop(tally)
    for p, grad in zip(model.parameters(), expected):
        assert torch.equal(p.grad, grad)


def test_a_calibration_that_fails_leaves_the_sums_out_of_place_and_counts_on(monkeypatch):
    def broken(self) -> None:
        raise RuntimeError("calibration broke")

    monkeypatch.setattr(engine_sums.EngineAccumulation, "calibrate", broken)
    registry, tally = shared_registry(), Tally()
    registry.start(tally)
    try:
        assert not _summed_into_a_piece()
        torch.zeros(256)
        assert tally.settle()[1] >= 1024
        assert not registry.failed
    finally:
        registry.stop(tally)
