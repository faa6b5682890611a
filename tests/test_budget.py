"""The cost budget (``overhead=``): its choice on steps whose cost is known, the level each record
carries, and what a record at each level holds."""

from __future__ import annotations

import io
import re
import time

import pytest
import torch
from torch import nn

from pytorch_mem_profiler import MemoryProfiler
from pytorch_mem_profiler.measure import peak_breakdown
from pytorch_mem_profiler.measure.budget import CostBudget, check_overhead
from pytorch_mem_profiler.measure.saved_tensors import can_chain
from pytorch_mem_profiler.options import ProfilerOptions


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def simulate(budget: CostBudget, clock: Clock, iterations: int, base: float, costs: dict[str, float],
             after: dict[str, float] | None = None) -> list[str]:  # fmt: skip
    """Run ``iterations`` reported iterations: a step of ``base`` seconds, plus ``costs[level]`` of
    the profiler's own time for the level the budget chose (half in the step, half in record_stats),
    plus ``after[level]`` in the next step (what a detailed iteration leaves the step after it)."""
    levels = []
    behind = 0.0
    for _ in range(iterations):
        level = budget.choose()
        levels.append(level)
        extra = costs.get(level, 0.0)
        clock.now += base + extra / 2 + behind
        behind = (after or {}).get(level, 0.0)
        budget.entered()
        clock.now += extra / 2
        budget.left(level)
    return levels


def test_the_share_of_detailed_iterations_is_what_the_budget_pays_for():
    clock = Clock()
    budget = CostBudget(0.1, richest="phases", clock=clock)
    levels = simulate(budget, clock, 400, base=0.010, costs={"phases": 0.005})
    assert levels[0] == "phases"  # the first reported iteration: the richest allowed
    # 10% of a 10 ms step pays 1 ms: a 5 ms detailed iteration once in 5
    assert 75 <= levels.count("phases") <= 82
    assert budget.costs["phases"] == pytest.approx(0.005)
    assert budget.base == pytest.approx(0.010)
    # the running cost never goes past the budget by more than one detailed iteration
    assert budget.spent <= budget.allowed + 0.005
    assert budget.spent == pytest.approx(0.1 * 400 * 0.010, rel=0.05)


def test_what_a_detailed_iteration_leaves_the_next_step_is_its_cost():
    """A detailed iteration that costs 3 ms itself and 2 ms more in the step after it (the hooks just
    put to sleep, cold caches: no clock of the profiler runs there) costs 5 ms: at 10% of a 10 ms
    step, once in five iterations, not once in three; and the slow step after it is not the base."""
    clock = Clock()
    budget = CostBudget(0.1, richest="phases", clock=clock)
    simulate(budget, clock, 400, base=0.010, costs={"phases": 0.003}, after={"phases": 0.002})
    assert budget.costs["phases"] == pytest.approx(0.005)
    assert budget.base == pytest.approx(0.010)
    assert budget.spent <= budget.allowed + 0.005
    # settled: 10% of 400 steps of 10 ms pays 80 detailed iterations of 5 ms
    levels = simulate(budget, clock, 400, base=0.010, costs={"phases": 0.003}, after={"phases": 0.002})
    assert 78 <= levels.count("phases") <= 82
    # a budget blind to the step after would buy about 133 (3 ms each) and cost 67% more than allowed
    blind = CostBudget(0.1, richest="phases", clock=Clock())
    simulate(blind, blind._clock, 400, base=0.010, costs={"phases": 0.003})
    blind_levels = simulate(blind, blind._clock, 400, base=0.010, costs={"phases": 0.003})
    assert blind_levels.count("phases") >= 1.5 * levels.count("phases")


def test_a_cheap_level_does_not_starve_the_rich_one():
    clock = Clock()
    budget = CostBudget(0.2, richest="full", clock=clock)
    levels = simulate(budget, clock, 600, base=0.010, costs={"full": 0.020, "phases": 0.001})
    assert levels[0] == "full"
    # each level earns half of 2 ms a step: full (20 ms) once in 20, phases (1 ms) about every other
    assert 25 <= levels.count("full") <= 32
    assert levels.count("phases") >= 250
    assert budget.spent <= budget.allowed + 0.020


def test_a_level_too_costly_for_the_budget_is_not_chosen_again():
    clock = Clock()
    budget = CostBudget(0.01, richest="phases", clock=clock)
    # the detailed level costs 10 steps: at 1%, once in 1000 iterations
    levels = simulate(budget, clock, 300, base=0.010, costs={"phases": 0.100})
    assert levels[0] == "phases"
    assert levels.count("phases") <= 3
    assert levels[-100:] == ["light"] * 100


def test_no_limit_always_gives_the_richest_level():
    clock = Clock()
    budget = CostBudget(None, richest="full", clock=clock)
    assert set(simulate(budget, clock, 50, base=0.001, costs={"full": 1.0})) == {"full"}


@pytest.mark.parametrize("bad", [0, -0.1, 1.5, float("nan")])
def test_an_overhead_out_of_range_fails_at_construction(bad):
    with pytest.raises(ValueError, match="overhead"):
        ProfilerOptions(overhead=bad)
    with pytest.raises(ValueError, match="overhead"):
        MemoryProfiler(nn.Linear(2, 2), overhead=bad)


@pytest.mark.parametrize("bad", ["3%", True, [0.03]])
def test_an_overhead_of_the_wrong_type_fails_at_construction(bad):
    with pytest.raises(TypeError, match="overhead"):
        check_overhead(bad)
    with pytest.raises(TypeError, match="overhead"):
        MemoryProfiler(nn.Linear(2, 2), overhead=bad)


class Sleepy(nn.Module):
    """A step whose cost is known: each forward sleeps ``STEP`` seconds."""

    STEP = 0.020

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.STEP)
        return self.fc(x).relu()


def test_the_budget_chooses_by_the_measured_cost_of_a_sleeping_detail(monkeypatch):
    """The detailed level made to cost a known 10 ms (the peak breakdown's result sleeps) on a
    20 ms step, with a 25% budget: each iteration earns 5 ms, so about one reported iteration in
    two is detailed, the profiler's measured cost stays within a quarter of the run's steps, and
    every record says its level and holds that level's figures."""
    real_result = peak_breakdown.CpuPeakBreakdown.result

    def slow_result(self, *args, **kwargs):
        time.sleep(0.010)
        return real_result(self, *args, **kwargs)

    monkeypatch.setattr(peak_breakdown.CpuPeakBreakdown, "result", slow_result)
    model = Sleepy()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    stream = io.StringIO()
    records = []
    with MemoryProfiler(model, 1, stream=stream, strict=True, overhead=0.25, report="line") as profiler:
        for _ in range(30):
            model(torch.randn(8, 16)).sum().backward()
            opt.step()
            opt.zero_grad()
            records.append(profiler.record_stats())
        budget = profiler._budget
        assert budget.costs["phases"] >= 0.010  # the sleep, measured
        assert budget.spent <= budget.allowed + budget.costs["phases"]
    levels = [r.detail for r in records]
    assert levels[0] == "phases"
    assert 9 <= levels.count("phases") <= 19, levels
    assert "phases, phases, phases" not in ", ".join(levels)
    assert all(r.reported and r.overhead_budget == 0.25 for r in records)
    weights = 16 * 16 * 4 + 16 * 4
    for r in records:
        if r.detail == "phases":
            assert r.feature_maps > 0 and r.gradients == weights and r.peak_breakdown is not None
            assert r.intermediate_gradients is not None and r.phases
        else:
            assert r.feature_maps is None and r.gradients is None and r.intermediate_gradients is None
            assert r.peak_breakdown is None and not r.phases
            assert r.weights == weights and r.iteration_peak_allocated is not None
    lines = stream.getvalue().splitlines()
    assert sum("detail light (skipped: over the 25% budget)" in line for line in lines) == levels.count("light")


@pytest.mark.default_budget
def test_the_default_budget_is_three_percent_and_the_first_report_is_the_richest():
    model = nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with MemoryProfiler(model, 1, stream=io.StringIO(), strict=True) as profiler:
        assert profiler.options.overhead == 0.03
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        first = profiler.record_stats()
        model(torch.randn(4, 8)).sum().backward()
        second = profiler.record_stats()
    assert first.detail == "phases" and first.overhead_budget == 0.03
    assert first.intermediate_gradients is not None and first.peak_breakdown is not None
    assert second.detail == "light"  # no step without detail timed yet: this one is
    assert second.reported and second.gradients is None


def test_records_carry_their_level():
    model = nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for by_layer, richest in ((False, "phases"), (True, "full")):
        with MemoryProfiler(model, 2, stream=io.StringIO(), strict=True, by_layer=by_layer, overhead=None) as p:
            records = []
            for _ in range(4):
                model(torch.randn(4, 8)).sum().backward()
                opt.step()
                opt.zero_grad()
                records.append(p.record_stats())
        assert [r.detail for r in records] == ["light", richest, "light", richest]
        assert [r.reported for r in records] == [False, True, False, True]
        assert all(r.overhead_budget is None for r in records)
        assert (records[1].layers is not None) == (by_layer and can_chain())  # by layer: torch 2.8 or later
        assert records[1].gradients == 8 * 8 * 4 + 8 * 4 and records[1].intermediate_gradients is not None


def test_a_reported_light_record_says_why_in_every_layout():
    from pytorch_mem_profiler.outputs.report import format_record
    from pytorch_mem_profiler.stats import IterationRecord

    record = IterationRecord(
        epoch=1, iteration=4, step=4, device="cpu", allocated=1_000_000, feature_maps=None,
        gradients=None, intermediate_gradients=None, detail="light", overhead_budget=0.03,
    )
    full = format_record(record, "MB", "full")
    assert re.search(r"^Total feature map usage\.+skipped$", full, re.M)
    assert re.search(r"^Intermediate gradients\.+skipped$", full, re.M)
    assert re.search(r"^Total layer weight gradient usage\.+skipped$", full, re.M)
    assert "skipped: over the 3% budget" in full
    assert "skipped: over the 3% budget" in format_record(record, "MB", "compact")
    assert format_record(record, "MB", "line").endswith("| detail light (skipped: over the 3% budget)")
    measured = IterationRecord(epoch=1, iteration=4, step=4, device="cpu", allocated=1_000_000, detail="phases")
    assert "skipped" not in format_record(measured, "MB", "full")
