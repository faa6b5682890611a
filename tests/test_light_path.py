"""The light path (an iteration the hooks slept through, and a report at the ``"light"`` level)
gives what the generic one gives: the records its template makes are the constructor's, the
budget's inline accounting is its general one to the last bit, each output still fails alone,
and nothing the hooks keep while asleep holds an optimizer alive."""

from __future__ import annotations

import dataclasses
import gc
import io
import random
import weakref

import pytest
import torch
from torch import nn

from pytorch_mem_profiler import MemoryProfiler
from pytorch_mem_profiler.measure.budget import CostBudget
from pytorch_mem_profiler.measure.meter import Meter
from pytorch_mem_profiler.outputs import sinks
from pytorch_mem_profiler.outputs.progress import active_bar_class
from pytorch_mem_profiler.outputs.report import REPORT_MODES, ReportFormatter, format_record
from pytorch_mem_profiler.stats import IterationRecord, records_like

FIELDS = [f.name for f in dataclasses.fields(IterationRecord)]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def _step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    model(torch.randn(8, 16)).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _bytes(tensors) -> int:
    """Bytes of the unique storages of ``tensors``."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def _state_bytes(*optimizers: torch.optim.Optimizer) -> int:
    return _bytes(t for o in optimizers for s in o.state.values() for t in s.values() if isinstance(t, torch.Tensor))


# -- the records a template makes ------------------------------------------------------------


def test_a_record_like_a_template_is_the_constructors_record():
    base = IterationRecord(epoch=1, iteration=1, step=1, device="cpu", allocated=0, weights=64, detail="light")
    make = records_like(base, ("iteration", "step", "allocated", "reported"))
    made = make(7, 9, 1_000, False)
    assert made == dataclasses.replace(base, iteration=7, step=9, allocated=1_000, reported=False)
    assert type(made) is IterationRecord and list(vars(made)) == FIELDS  # every field, in order
    assert made == IterationRecord(**vars(made))  # what the constructor makes of its fields
    assert make(iteration=2, step=2, allocated=5, reported=True).allocated == 5  # by name too
    assert base.iteration == 1 and base.allocated == 0  # the template is not changed
    with pytest.raises(dataclasses.FrozenInstanceError):
        made.allocated = 3  # type: ignore[misc]


def test_a_misspelt_or_repeated_varying_field_is_refused_when_the_maker_is_made():
    base = IterationRecord(epoch=1, iteration=1, step=1, device="cpu", allocated=0)
    with pytest.raises(TypeError, match="alocated"):
        records_like(base, ("alocated",))
    with pytest.raises(TypeError, match="named twice"):
        records_like(base, ("step", "step"))


def test_the_meters_light_records_follow_the_device_and_the_model():
    """Records of iterations the hooks slept through: the constructor's, with the pass counts
    unknown; the capacity and the weights they carry follow a change (the template is remade)."""
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with MemoryProfiler(model, 3, stream=io.StringIO(), strict=True) as profiler:
        records = []
        for _ in range(5):
            _step(model, opt)
            records.append(profiler.record_stats())
        light = [r for r in records if not r.reported]
        assert len(light) == 4 and records[2].reported
        for record in light[1:]:  # the first iteration is watched (it learns the entry modules)
            assert record.detail == "light" and record.forward_passes is None and record.gradients is None
            assert record == IterationRecord(**{name: getattr(record, name) for name in FIELDS})
            assert record.weights == _bytes(model.parameters())
            assert record.optimizer_state == _state_bytes(opt)
        profiler._meter.capacity = 80_000_000_000
        _step(model, opt)
        assert profiler.record_stats().device_total == 80_000_000_000
        # the model grows (a parameter its forward does not use): its weights are counted at the epoch's end
        model[0].register_parameter("extra", nn.Parameter(torch.zeros(64, 64)))
        profiler.epoch_end()
        _step(model, opt)
        record = profiler.record_stats()
        assert not record.reported and record.weights == _bytes(model.parameters())
        assert record.epoch == 2 and record.iteration == 1


# -- preparing the next iteration ----------------------------------------------------------------


def test_a_light_iteration_after_a_slept_one_prepares_nothing_and_a_fault_still_reaches_the_meter(monkeypatch):
    """After an iteration the hooks slept through, a light one needs no Meter.prepare; the one
    before a report is prepared (its hooks wake), and once a part is switched off every
    iteration is (the switched-off part's hooks go there)."""
    prepared: list[str] = []
    real = Meter.prepare
    monkeypatch.setattr(Meter, "prepare", lambda self, level: (prepared.append(level), real(self, level))[1])
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with MemoryProfiler(model, 4, stream=io.StringIO(), strict=True) as profiler:
        per_iteration = []
        for _ in range(8):
            _step(model, opt)
            prepared.clear()
            record = profiler.record_stats()
            per_iteration.append((record.iteration, record.detail, list(prepared), profiler._meter._hooks.asleep))
        # iteration 1 (its hooks on, learning where forward enters) readies a light one; 2 and 3
        # are slept through: 4 is reported, its hooks woken at 3's end
        assert [p for _, _, p, _ in per_iteration] == [["light"], [], ["phases"], ["light"], [], [], ["phases"], ["light"]]
        assert [d for _, d, _, _ in per_iteration] == ["light", "light", "light", "phases"] * 2
        assert [asleep for *_, asleep in per_iteration] == [True, True, False, True, True, True, False, True]
        profiler._guard.disabled.add("leak check")  # a part switched off (not strict: no raise)
        for _ in range(2):
            _step(model, opt)
            prepared.clear()
            profiler.record_stats()
            assert prepared == ["light"]


# -- the budget's light accounting -----------------------------------------------------------------


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class _Reference(CostBudget):
    """The light accounting as it is spelled by the budget's parts: ``_spend`` then ``_earn``."""

    def left(self, level: str) -> None:
        if level != "light":
            return super().left(level)
        now = self._clock()
        own = max(0.0, now - self._entered)
        self._left = now
        step = self._step
        warm_up, self._warm_up = self._warm_up, False
        if self._after is not None:
            step = self._after_detail(step)
        elif not warm_up:
            self.base = step if self.base is None else self.base + 0.25 * (step - self.base)
        self._spend(own, level)
        self._earn(self._share(step))


@pytest.mark.parametrize("richest, overhead", [("phases", 0.03), ("full", 0.03), ("full", 0.2), ("phases", None)])
def test_the_inline_light_accounting_is_the_budgets_own_to_the_bit(richest, overhead):
    rng = random.Random(richest + str(overhead))
    budgets = []
    for kind in (CostBudget, _Reference):
        clock = _Clock()
        budgets.append((kind(overhead, richest=richest, clock=clock), clock))
    levels = []
    for _ in range(3_000):
        step, own, detail = rng.uniform(0.001, 0.003), rng.uniform(1e-5, 2e-4), rng.uniform(0.0, 0.004)
        chosen = [budget.choose() for budget, _ in budgets]
        assert chosen[0] == chosen[1]
        for budget, clock in budgets:
            clock.now += step + (detail if chosen[0] != "light" else 0.0)
            budget.entered()
            clock.now += own
            budget.left(chosen[0])
        (new, _), (reference, _) = budgets
        assert (new.base, new.spent, new.allowed, new.costs, new._accounts) == (
            reference.base, reference.spent, reference.allowed, reference.costs, reference._accounts
        )
        levels.append(chosen[0])
    if overhead is not None:
        assert "light" in levels and len(set(levels)) > 1  # both paths ran


def test_a_budget_without_a_limit_earns_nothing_and_follows_a_new_limit():
    clock = _Clock()
    budget = CostBudget(None, clock=clock)
    for _ in range(3):
        clock.now += 0.01
        budget.entered()
        budget.left("light")
    assert budget.allowed == 0.0 and budget.choose() == "phases"
    budget.overhead = 0.5
    clock.now += 0.01
    budget.entered()
    budget.left("light")
    assert budget.allowed == pytest.approx(0.005)


# -- the outputs -------------------------------------------------------------------------------------


def test_a_failing_output_is_switched_off_alone(monkeypatch, caplog):
    """A fault in one output (here the headroom check) switches that output off, logged once;
    the report and the leak check go on with every reported record, and so does the run."""

    def broken(self, record):
        raise RuntimeError("headroom check broke")

    seen: list[int] = []
    real_leak = sinks.LeakSink.on_record
    monkeypatch.setattr(sinks.HeadroomSink, "on_record", broken)
    monkeypatch.setattr(sinks.LeakSink, "on_record", lambda self, r: (seen.append(r.iteration), real_leak(self, r))[1])
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = io.StringIO()
    with MemoryProfiler(model, 1, stream=out) as profiler:
        records = []
        for _ in range(4):
            _step(model, opt)
            records.append(profiler.record_stats())
        assert profiler._guard.disabled == {"output: headroom check"}
    assert all(r is not None for r in records)
    assert seen == [1, 2, 3, 4]
    assert [line for line in out.getvalue().splitlines() if line.startswith("Memory Usage for")] == [
        f"Memory Usage for Iteration {i} of Epoch 1" for i in (1, 2, 3, 4)
    ]
    assert [r.message for r in caplog.records].count(
        "pytorch_mem_profiler: output: headroom check failed and is switched off; training continues "
        "(RuntimeError: headroom check broke)"
    ) == 1


@pytest.mark.parametrize("mode", REPORT_MODES)
def test_a_report_made_with_its_newline_is_the_report_then_the_newline(mode):
    formatter = ReportFormatter()
    base = IterationRecord(
        epoch=2, iteration=3, step=9, device="cuda:0", allocated=1_200_000, current_cached=2_000_000,
        weights=1_000_000, weights_by_name={"w": 1_000_000}, iteration_time_s=0.0123, detail="light",
        overhead_budget=0.03, feature_maps=None, gradients=None, intermediate_gradients=None,
    )
    for record in (base, dataclasses.replace(base, iteration=4, iteration_time_s=None), dataclasses.replace(base, iteration=5)):
        assert formatter(record, "MB", mode, "\n") == format_record(record, "MB", mode) + "\n"
        assert formatter(record, "KB", mode) == format_record(record, "KB", mode)


def test_the_sink_keeps_the_last_report_without_its_newline():
    out = io.StringIO()
    sink = sinks.ReportSink(lambda: out, units="MB")
    assert sink.last_report is None
    record = IterationRecord(epoch=1, iteration=2, step=2, device="cpu", allocated=10**6)
    sink.on_record(record)
    assert sink.last_report == format_record(record) and out.getvalue() == sink.last_report + "\n"
    sink.on_epoch_end(1)
    assert out.getvalue().endswith("\nEpoch 1 finished\n") and sink.last_report == format_record(record)


def test_an_open_bar_is_found_and_none_when_every_bar_is_closed_or_disabled():
    tqdm = pytest.importorskip("tqdm").tqdm
    out = io.StringIO()
    assert active_bar_class() is None  # imported, no bar open
    with tqdm(total=2, file=out, disable=True):
        assert active_bar_class() is None
    with tqdm(total=2, file=out):
        assert active_bar_class() is tqdm
    assert active_bar_class() is None


# -- what stays installed while the hooks sleep -------------------------------------------------------


def test_the_step_hook_asleep_keeps_no_optimizer_alive_and_finds_a_new_one():
    """The optimizer step post-hook that stays while the hooks sleep remembers the optimizer it
    checked last weakly: an optimizer dropped is freed; one that appears is still counted from the
    iteration it steps the model in (Adam's state made at its first step)."""
    model = _model()
    first = torch.optim.SGD(model.parameters(), lr=0.1)
    with MemoryProfiler(model, 100, stream=io.StringIO(), strict=True) as profiler:
        for _ in range(3):
            _step(model, first)
            assert profiler.record_stats().optimizer_state == 0
        assert profiler._meter._hooks.asleep
        second = torch.optim.Adam(model.parameters(), lr=1e-3)
        _step(model, second)
        record = profiler.record_stats()
        assert not record.reported and record.optimizer_state == _state_bytes(second) > 0
        dropped = weakref.ref(first)
        del first
        gc.collect()
        assert dropped() is None
        _step(model, second)
        assert profiler.record_stats().optimizer_state == _state_bytes(second)
