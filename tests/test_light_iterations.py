"""Iterations that are not reported cost one read of the counters, with no hook on; reported ones
keep every figure.

A stand-in counter (an exact CPU counter that counts its reads and peak resets)
and a stand-in autograd engine (torch's, counting ``queue_callback``) show what
each iteration did; the figures of a non-reported iteration are compared with
those of a reported one of the same step.
"""

from __future__ import annotations

import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import pytorch_mem_profiler.measure.meter as meter_module
from pytorch_mem_profiler import MemoryProfiler
from pytorch_mem_profiler.measure.devices import CpuCounter
from pytorch_mem_profiler.measure.layers import LayerAttribution

PERIOD = 4


class CountingCounter(CpuCounter):
    """The exact CPU counter, counting device reads and peak resets."""

    def __init__(self, device=None) -> None:
        super().__init__(device)
        self.reads = 0
        self.resets = 0

    def _read_device(self):
        self.reads += 1
        return super()._read_device()

    def mark(self):
        self.resets += 1  # CpuCounter.mark reads, then starts a new interval itself
        return super().mark()

    def reset_peak(self) -> None:
        self.resets += 1
        super().reset_peak()


class CountingEngine:
    """torch's autograd engine, counting the callbacks queued on it."""

    def __init__(self, engine) -> None:
        self._engine = engine
        self.queued = 0

    def queue_callback(self, callback):
        self.queued += 1
        return self._engine.queue_callback(callback)

    def __getattr__(self, name):
        return getattr(self._engine, name)


@pytest.fixture
def counting(monkeypatch):
    made: list[CountingCounter] = []

    def make(device):
        counter = CountingCounter(device)
        made.append(counter)
        return counter

    monkeypatch.setattr(meter_module, "make_counter", make)
    engine = CountingEngine(torch.autograd.Variable._execution_engine)
    monkeypatch.setattr(torch.autograd.Variable, "_execution_engine", engine)
    return made, engine


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))


def _train(model, opt, profiler, iterations, x, y, after_step=None):
    """Run ``iterations`` steps; per iteration: (record, reads, resets, callbacks queued, layer starts)."""
    seen = []
    counter = profiler._meter.counter
    engine = torch.autograd.Variable._execution_engine
    for _ in range(iterations):
        before = (counter.reads, counter.resets, engine.queued, LayerStarts.calls)
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        record = profiler.record_stats()
        after = (counter.reads, counter.resets, engine.queued, LayerStarts.calls)
        seen.append((record, *(b - a for a, b in zip(before, after))))
    return seen


class LayerStarts:
    calls = 0


@pytest.fixture
def layer_starts(monkeypatch):
    LayerStarts.calls = 0
    real_start, real_resume = LayerAttribution.start, LayerAttribution.resume

    def start(self, *args, **kwargs):
        LayerStarts.calls += 1
        return real_start(self, *args, **kwargs)

    def resume(self, *args, **kwargs):
        LayerStarts.calls += 1
        return real_resume(self, *args, **kwargs)

    monkeypatch.setattr(LayerAttribution, "start", start)
    monkeypatch.setattr(LayerAttribution, "resume", resume)


@pytest.mark.parametrize("by_layer", [False, True])
def test_a_non_reported_iteration_reads_the_counters_once_and_queues_nothing(counting, layer_starts, by_layer):
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    with MemoryProfiler(model, PERIOD, stream=io.StringIO(), strict=True, by_layer=by_layer) as profiler:
        seen = _train(model, opt, profiler, 3 * PERIOD, x, y)
    assert len(counting[0]) == 1
    for record, reads, resets, queued, layer_calls in seen:
        if record.reported:
            # Every phase boundary read: forward start and end, backward start and end,
            # optimizer step start and end, record_stats(); plus the module boundaries by layer.
            assert reads >= 7 and resets >= 7
            assert queued == 1
            assert (layer_calls >= 1) if by_layer else (layer_calls == 0)
        else:
            assert (reads, resets, queued, layer_calls) == (1, 1, 0, 0)
    assert [r.reported for r, *_ in seen] == [(i + 1) % PERIOD == 0 for i in range(3 * PERIOD)]


def test_a_non_reported_record_carries_what_one_read_gives_exactly(counting):
    """Same step, same figures: the non-reported iteration just before a reported one
    has the same allocated, iteration peak and counts; the rest is None, not a guess."""
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    with MemoryProfiler(model, PERIOD, stream=io.StringIO(), strict=True) as profiler:
        seen = _train(model, opt, profiler, 2 * PERIOD, x, y)
    light, full = seen[2 * PERIOD - 2][0], seen[2 * PERIOD - 1][0]
    assert (light.reported, full.reported) == (False, True)
    for name in (
        "allocated", "iteration_peak_allocated", "peak_allocated", "peak_cached", "current_cached",
        "weights", "buffers", "optimizer_state",
    ):  # fmt: skip
        assert getattr(light, name) == getattr(full, name), name
    assert light.iteration_peak_allocated > light.allocated > 0
    state = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for s in opt.state.values() for t in s.values()}
    assert light.optimizer_state == sum(state.values())
    assert light.weights == sum(p.untyped_storage().nbytes() for p in model.parameters())
    # Nothing watched it (the hooks were off): its passes are unknown, not 0.
    assert (light.forward_passes, light.backward_passes, light.optimizer_steps) == (None, None, None)
    assert (full.forward_passes, full.backward_passes, full.optimizer_steps) == (1, 1, 1)
    # The first iteration, which learns where the forward enters the model, is watched and counted.
    assert (seen[0][0].forward_passes, seen[0][0].backward_passes, seen[0][0].optimizer_steps) == (1, 1, 1)
    assert light.feature_maps is None and light.gradients is None and light.intermediate_gradients is None
    assert light.peak_phase is None and dict(light.phases) == {} and light.layers is None
    assert full.gradients == light.weights and full.feature_maps > 0 and full.peak_phase in ("backward", "optimizer")
    assert light.model_state == light.weights + light.optimizer_state + light.buffers


def test_accumulation_and_recomputation_are_counted_alike_reported_or_not(counting):
    """Two forwards and two backwards before one step, each forward through a checkpointed
    block: the recomputation inside backward is no forward, reported or not."""

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.block = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))

        def forward(self, x):
            return checkpoint(self.block, x, use_reentrant=False)

    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    records = []
    with MemoryProfiler(model, 2, stream=io.StringIO(), strict=True) as profiler:
        for _ in range(4):
            for half in (x[:4], x[4:]):
                F.mse_loss(model(half), y[:4]).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            records.append(profiler.record_stats())
    assert [r.reported for r in records] == [False, True, False, True]
    counts = [(r.forward_passes, r.backward_passes, r.optimizer_steps) for r in records]
    # Watched: the first iteration (learning the entries) and the reported ones; the hooks
    # are off on the third, whose counts are unknown.
    assert counts == [(2, 2, 1), (2, 2, 1), (None, None, None), (2, 2, 1)]
    assert [r.iteration_peak_allocated for r in records[2:]] == [records[1].iteration_peak_allocated] * 2


def test_a_backward_left_open_is_counted_at_record_stats(counting):
    """A non-reported iteration ending right after backward (no step): its backward is
    counted, and the next, reported, iteration finds forward and backward again."""
    model = _model()
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    with MemoryProfiler(model, 2, stream=io.StringIO(), strict=True) as profiler:
        records = []
        for _ in range(2):
            F.mse_loss(model(x), y).backward()
            records.append(profiler.record_stats())
    light, full = records
    assert (light.reported, full.reported) == (False, True)
    assert (light.forward_passes, light.backward_passes) == (full.forward_passes, full.backward_passes) == (1, 1)
    assert full.phases["backward"].occurrences == 1 and full.phases["forward"].occurrences == 1


class Calls:
    """Counts the calls of functions and methods replaced by counting stand-ins."""

    def __init__(self, monkeypatch) -> None:
        self.monkeypatch = monkeypatch
        self.counts: dict[str, int] = {}

    def count(self, owner, name: str, label: str | None = None) -> None:
        real = getattr(owner, name)
        key = label or name
        self.counts[key] = 0

        def counted(*args, **kwargs):
            self.counts[key] += 1
            return real(*args, **kwargs)

        self.monkeypatch.setattr(owner, name, counted)

    def snapshot(self) -> dict[str, int]:
        return dict(self.counts)


def test_a_non_reported_iteration_skips_the_detailed_work(counting, monkeypatch):
    """Counted with stand-ins: a non-reported iteration recomputes no weights, buffers,
    gradients or optimizer state, calls no output, makes no guard wrapper and calls no
    guard frame; the optimizer is told to the meter once. Its figures stay exact."""
    from pytorch_mem_profiler.faults import FaultGuard
    from pytorch_mem_profiler.measure import accounting, hooks as hooks_module
    from pytorch_mem_profiler.outputs import sinks

    calls = Calls(monkeypatch)
    from pytorch_mem_profiler.measure import model_state

    for name in ("weight_bytes", "buffer_bytes"):
        calls.count(model_state, name)
    for name in ("gradient_bytes", "optimizer_state_bytes"):
        calls.count(meter_module, name)
    calls.count(accounting.GradientSizes, "__call__", "gradient sizes")
    calls.count(hooks_module, "output_grad_nodes")
    calls.count(FaultGuard, "wrap", "FaultGuard.wrap")
    calls.count(FaultGuard, "call", "FaultGuard.call")
    calls.count(meter_module.Meter, "_optimizer_stepped")
    for kind in (sinks.ReportSink, sinks.LeakSink, sinks.HeadroomSink):
        calls.count(kind, "on_record", f"{kind.__name__}.on_record")

    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    seen = []
    with MemoryProfiler(model, PERIOD, stream=io.StringIO(), strict=True, by_layer=True) as profiler:
        for _ in range(2 * PERIOD):
            before = calls.snapshot()
            F.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            record = profiler.record_stats()
            seen.append((record, {k: v - before[k] for k, v in calls.snapshot().items()}))
    # weights and buffers: counted when the profiler was made (and at each epoch end), never per iteration
    assert all(delta["weight_bytes"] == delta["buffer_bytes"] == 0 for _, delta in seen)
    # the optimizer is told to the meter once; its state counted when it appears (Adam's first step)
    assert sum(delta["_optimizer_stepped"] for _, delta in seen) == 1
    assert [delta["optimizer_state_bytes"] for _, delta in seen] == [1] + [0] * (2 * PERIOD - 1)
    state = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for s in opt.state.values() for t in s.values()}
    for record, delta in seen:
        assert record.optimizer_state == sum(state.values())  # exact on every iteration, reported or not
        assert record.weights == sum(p.untyped_storage().nbytes() for p in model.parameters())
        if record.reported:
            assert delta["gradient sizes"] >= 1
            for kind in ("ReportSink", "LeakSink", "HeadroomSink"):
                assert delta[f"{kind}.on_record"] == 1
        else:
            assert delta["gradient sizes"] == delta["gradient_bytes"] == 0
            assert delta["output_grad_nodes"] == 0  # one tensor out: its grad_fn, no walk
            assert delta["FaultGuard.wrap"] == delta["FaultGuard.call"] == 0
            assert all(delta[f"{kind}.on_record"] == 0 for kind in ("ReportSink", "LeakSink", "HeadroomSink"))
    assert [r.reported for r, _ in seen].count(False) == 2 * (PERIOD - 1)


def test_optimizer_state_follows_a_new_optimizer_and_one_that_is_freed(counting):
    """Counted from every known optimizer: a second optimizer found stepping the model adds
    its state on the iteration it appears, reported or not; once freed it counts no more."""
    import gc

    model = _model()
    first = torch.optim.Adam(model[0].parameters(), lr=1e-3)
    x, y = torch.randn(8, 16), torch.randn(8, 4)

    def state_bytes(*optimizers) -> int:
        return sum(t.untyped_storage().nbytes() for o in optimizers for s in o.state.values() for t in s.values())

    with MemoryProfiler(model, PERIOD, stream=io.StringIO(), strict=True) as profiler:
        F.mse_loss(model(x), y).backward()
        first.step()
        assert profiler.record_stats().optimizer_state == state_bytes(first)
        second = torch.optim.Adam(model[2].parameters(), lr=1e-3)
        F.mse_loss(model(x), y).backward()
        first.step()
        second.step()
        record = profiler.record_stats()
        assert not record.reported and record.optimizer_state == state_bytes(first, second) > state_bytes(first)
        del second
        gc.collect()
        F.mse_loss(model(x), y).backward()
        first.step()
        assert profiler.record_stats().optimizer_state == state_bytes(first)


def _ours(hooks: dict, profiler) -> list:
    """The hooks in ``hooks`` (a module's or torch's global dict) that belong to ``profiler``."""
    watchers = (profiler._meter._hooks, profiler._meter._hooks._entries)
    return [h for h in hooks.values() if getattr(h, "__self__", None) in watchers]


def test_the_hooks_are_off_between_reported_iterations_and_back_for_them(counting):
    """Between reported iterations the model's modules and the optimizer steps run none of the
    profiler's hooks (only a step post-hook that notices a new optimizer); a user's own hook
    stays; for a reported iteration every hook is back; close() leaves none."""
    from torch.optim import optimizer as optim_module

    model = _model()
    user_calls = []
    model.register_forward_pre_hook(lambda m, a: user_calls.append(1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    seen = []
    with MemoryProfiler(model, PERIOD, stream=io.StringIO(), strict=True) as profiler:
        for i in range(3 * PERIOD):
            on_model = len(_ours(model._forward_pre_hooks, profiler)) + len(_ours(model._forward_hooks, profiler))
            pre = _ours(optim_module._global_optimizer_pre_hooks, profiler)
            post = [h.__name__ for h in _ours(optim_module._global_optimizer_post_hooks, profiler)]
            F.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            record = profiler.record_stats()
            seen.append((i, record.reported, on_model, len(pre), post))
    for i, reported, on_model, pre, post in seen:
        if i == 0 or reported:  # the first iteration learns the entry modules
            assert (on_model, pre, post) == (2, 1, ["_optimizer_post"]), i
        else:
            assert (on_model, pre, post) == (0, 0, ["_optimizer_seen"]), i
    assert len(user_calls) == 3 * PERIOD
    assert not _ours(model._forward_pre_hooks, profiler) and not _ours(model._forward_hooks, profiler)
    assert not _ours(optim_module._global_optimizer_pre_hooks, profiler)
    assert not _ours(optim_module._global_optimizer_post_hooks, profiler)


def test_the_hooks_stay_on_while_a_forward_awaits_its_backward(counting):
    """record_stats() between a forward and its backward: the hooks stay on, so the backward is
    still found and counted in the next iteration."""
    model = _model()
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    with MemoryProfiler(model, PERIOD, stream=io.StringIO(), strict=True) as profiler:
        for _ in range(PERIOD - 1):
            F.mse_loss(model(x), y).backward()
            profiler.record_stats()
        loss = F.mse_loss(model(x), y)  # a reported iteration: watched
        first = profiler.record_stats()
        assert first.reported and not profiler._meter._hooks.asleep
        loss.backward()
        second = profiler.record_stats()
        assert profiler._meter._hooks.asleep  # nothing open any more
    assert (first.forward_passes, first.backward_passes) == (1, 0)
    assert (second.forward_passes, second.backward_passes) == (0, 1)


def test_a_compiled_model_keeps_its_hooks(counting):
    """Compiled code is guarded on the hooks it ran with: they are never taken off and put back."""
    model = torch.compile(_model(), backend="eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    with MemoryProfiler(model, PERIOD, stream=io.StringIO(), strict=True) as profiler:
        seen = _train(model, opt, profiler, PERIOD, x, y)
        assert not profiler._meter._hooks.asleep
    assert [(r.forward_passes, r.backward_passes, r.optimizer_steps) for r, *_ in seen] == [(1, 1, 1)] * PERIOD


def test_a_fault_while_taking_the_hooks_off_leaves_them_on(counting, monkeypatch):
    """The sleeping is the smallest part: a fault there switches it off alone, and every
    iteration is then watched as before."""
    from pytorch_mem_profiler.measure.hooks import StepHooks

    def broken(self):
        raise RuntimeError("injected")

    monkeypatch.setattr(StepHooks, "sleep", broken)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    with MemoryProfiler(model, PERIOD, stream=io.StringIO()) as profiler:
        seen = _train(model, opt, profiler, 2 * PERIOD, x, y)
        assert profiler._guard.disabled == {"hooks off between reports"}
    assert [(r.forward_passes, r.optimizer_steps) for r, *_ in seen] == [(1, 1)] * (2 * PERIOD)
    assert [r.reported for r, *_ in seen].count(True) == 2


def test_forward_is_split_by_module_only_while_the_peak_is_there(counting, monkeypatch):
    """Per-layer mode reads the counters at each tracked module's end in forward on the first
    reported iteration, then only while forward holds the iteration's peak: one read per module
    saved, and where the peak was is found all the same. (Backward read at every module here:
    what reading it around its peak saves is tests/test_backward_marks.py's.)"""
    from pytorch_mem_profiler.measure.intervals import PhaseIntervals

    monkeypatch.setattr(PhaseIntervals, "backward_marks", lambda self: None)

    class Widen(nn.Module):
        """A forward-time transient much larger than anything backward or the step holds."""

        def forward(self, x):
            with torch.no_grad():  # nothing of it is kept for backward, which stays small
                scale = (x.unsqueeze(-1) * torch.ones(4096)).sum(-1).mean()
            return x * scale

    def run(model, steps, opt=None):
        x, y = torch.randn(8, 16), torch.randn(8, 4)
        with MemoryProfiler(model, 1, stream=io.StringIO(), strict=True, by_layer=True) as profiler:
            seen = _train(model, opt or torch.optim.SGD(model.parameters(), lr=0.01), profiler, steps, x, y)
        return [(record, reads) for record, reads, *_ in seen]

    # The peak is in backward or the step: forward is split once, then not.
    model = _model()
    seen = run(model, 4)
    assert seen[0][0].peak_phase in ("backward", "optimizer")
    tracked_in_forward = 5  # Linear, ReLU, Linear, ReLU, Linear
    assert seen[0][1] - seen[1][1] == tracked_in_forward
    assert len({reads for _, reads in seen[1:]}) == 1
    assert len({(r.iteration_peak_allocated, r.peak_phase, r.peak_location) for r, _ in seen}) == 1

    # The peak is in forward, inside the module "1": split every time, the module named each time.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), Widen(), nn.Linear(16, 4))
    seen = run(model, 3)
    assert [(r.peak_phase, r.peak_location) for r, _ in seen] == [("forward", "1")] * 3
    assert len({reads for _, reads in seen}) == 1


def test_a_phase_marked_by_hand_while_asleep_stays_in_its_own_iteration(counting):
    """A framework's ``phase()`` block on a non-reported iteration (hooks asleep) is closed with
    that iteration: the reported iteration after it counts only its own passes and steps, and
    the light iteration still reads the counters once."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    with MemoryProfiler(model, PERIOD, stream=io.StringIO(), strict=True) as profiler:
        counter = profiler._meter.counter
        _train(model, opt, profiler, PERIOD, x, y)  # learning, then asleep after the report
        for _ in range(PERIOD - 1):
            assert profiler._meter._hooks.asleep
            reads = counter.reads
            with profiler.phase("forward"):
                out = model(x)
            with profiler.phase("backward"):
                F.mse_loss(out, y).backward()
            with profiler.phase("optimizer"):
                opt.step()
            opt.zero_grad(set_to_none=True)
            light = profiler.record_stats()
            assert light.reported is False and counter.reads - reads == 1
            assert light.iteration_peak_allocated >= light.allocated > 0
        (full, *_), = _train(model, opt, profiler, 1, x, y)
    assert full.reported
    assert (full.forward_passes, full.backward_passes, full.optimizer_steps) == (1, 1, 1)
    assert {name: stats.occurrences for name, stats in full.phases.items()} == {"forward": 1, "backward": 1, "optimizer": 1}
