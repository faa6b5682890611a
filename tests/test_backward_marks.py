"""Per-layer mode reads backward at every tracked module once, then only around the interval where
backward peaked, while it peaks there: the records are those of a backward read at every module."""

from __future__ import annotations

import dataclasses
import io

import pytest
import torch
from torch import nn

from pytorch_mem_profiler import MemoryProfiler
from pytorch_mem_profiler.measure.intervals import PhaseIntervals
from pytorch_mem_profiler.measure.phases import PhaseMachine

#: fields that are clocks, not memory
TIMES = {"iteration_time_s"}


class _WideGradient(torch.autograd.Function):
    """``x * 2`` whose backward goes through a 64-times-wider copy of the gradient."""

    @staticmethod
    def forward(ctx, x):  # type: ignore[no-untyped-def]
        return x * 2

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def]
        return grad.repeat(1, 64).view(grad.shape[0], 64, grad.shape[1]).sum(1) / 32


class Heavy(nn.Module):
    """``x * 2``; while ``big``, its backward takes a large transient."""

    def __init__(self) -> None:
        super().__init__()
        self.big = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _WideGradient.apply(x) if self.big else x * 2


def wide_middle() -> nn.Module:
    # backward peaks from where it reaches the 4096 -> 64 layer's output (module "4") to the GELU
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4096), nn.GELU(), nn.Linear(4096, 64), nn.ReLU(), nn.Linear(64, 64))


def two_heavy() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 64), Heavy(), nn.Linear(64, 64), Heavy(), nn.Linear(64, 64))


def run(build, steps: int, *, full: bool, monkeypatch, before_step=None):
    """The records of ``steps`` iterations by layer, and how many boundaries each read in backward."""
    torch.manual_seed(0)
    model = build()
    x = torch.randn(256, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    reads: list[int] = []
    original = PhaseMachine._mark

    def counting(self, following, location=None):
        if self.phase == "backward":
            reads[-1] += 1
        return original(self, following, location)

    with monkeypatch.context() as patch:
        patch.setattr(PhaseMachine, "_mark", counting)
        if full:
            patch.setattr(PhaseIntervals, "backward_marks", lambda self: None)
        records = []
        with MemoryProfiler(model, 1, by_layer=True, overhead=None, stream=io.StringIO(), strict=True) as profiler:
            for i in range(steps):
                if before_step is not None:
                    before_step(model, i)
                reads.append(0)
                model(x).pow(2).mean().backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                records.append(profiler.record_stats())
    return records, reads


def fields(record) -> dict:
    return {f.name: getattr(record, f.name) for f in dataclasses.fields(record) if f.name not in TIMES}


def test_backward_is_read_around_its_peak_after_the_first_iteration_and_the_records_do_not_change(monkeypatch):
    marked, reads = run(wide_middle, 4, full=False, monkeypatch=monkeypatch)
    every, full_reads = run(wide_middle, 4, full=True, monkeypatch=monkeypatch)
    assert marked[0].peak_phase == "backward" and marked[0].peak_location == "4"
    assert marked[0].intermediate_gradients and marked[0].intermediate_gradients > 0
    # the first iteration reads backward where it reaches each module (the last one's output before
    # backward began) and where it ends; the next ones at two modules and where it ends
    assert reads[0] == full_reads[0] == 6 + 1
    assert reads[1:] == [3, 3, 3] and full_reads[1:] == [7, 7, 7]
    for a, b in zip(marked, every):
        assert fields(a) == fields(b)


def test_where_backward_peaks_elsewhere_it_names_no_module_and_reads_every_one_next(monkeypatch):
    def move(model, i):  # the heavy module is the second one for two iterations, then the first
        model[1].big, model[3].big = i >= 2, i < 2

    marked, reads = run(two_heavy, 5, full=False, monkeypatch=monkeypatch, before_step=move)
    every, _ = run(two_heavy, 5, full=True, monkeypatch=monkeypatch, before_step=move)
    assert [r.peak_location for r in every] == ["3", "3", "1", "1", "1"]
    assert reads[0] > reads[1] == 3  # read around module 3's interval from the second iteration on
    # the third: backward peaked outside it, in an interval of no module (not a guess), and the fourth
    # reads every module again, the fifth around module 1's interval
    assert marked[2].peak_location is None and marked[2].peak_phase == "backward"
    assert reads[3] == reads[0] and reads[4] == 3
    for i in (0, 1, 3, 4):
        assert fields(marked[i]) == fields(every[i]), i
    # what the third still measured exactly: the peak, its phase, the weights, gradients and state
    for name in ("peak_allocated", "peak_phase", "weights", "gradients", "optimizer_state"):
        assert getattr(marked[2], name) == getattr(every[2], name), name


@pytest.mark.parametrize(
    "build, marked",
    [
        (wide_middle, 2),  # backward peaks between where it reaches modules 4 and 3
        (two_heavy, 1),  # neither heavy: it peaks from its start to where it reaches module 3
    ],
)
def test_a_marked_iteration_hooks_only_the_outputs_of_the_modules_it_reads(build, marked, monkeypatch):
    # no gradient pre-hook on the other modules' outputs: autograd calls into Python twice a step, not once a module
    registered: list[str] = []
    from pytorch_mem_profiler.measure import layers

    original = layers._BackwardEntered.__init__

    def counting(self, guard, callback, name):
        registered.append(name)
        original(self, guard, callback, name)

    monkeypatch.setattr(layers._BackwardEntered, "__init__", counting)
    run(build, 3, full=False, monkeypatch=monkeypatch)
    tracked = len(build())
    assert len(registered) == tracked + 2 * marked  # the first iteration every module, then those read


class Reordered(nn.Module):
    """Three blocks, the heavy one first or, while ``swapped``, after the one that is light."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.heavy, self.light, self.out = nn.Linear(64, 64), Heavy(), nn.Linear(64, 64), nn.Linear(64, 64)
        self.heavy.big = True
        self.swapped = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        x = self.heavy(self.light(x)) if self.swapped else self.light(self.heavy(x))
        return self.out(x)


def test_a_model_that_runs_otherwise_leaves_the_interval_no_module(monkeypatch):
    # Backward peaked where it reached the heavy block's output, up to the input layer's; then the model
    # runs the light block between them: that interval is no more the one read as a full split reads it
    # (the light block's backward inside it), and it is named after no module, not after the heavy one.
    def swap(model, i):
        model.swapped = i == 2

    marked, reads = run(Reordered, 4, full=False, monkeypatch=monkeypatch, before_step=swap)
    every, _ = run(Reordered, 4, full=True, monkeypatch=monkeypatch, before_step=swap)
    assert [r.peak_location for r in every[:2]] == ["heavy", "heavy"] and every[2].peak_phase == "backward"
    assert reads[1] < reads[0]  # read at marks from the second iteration
    assert marked[2].peak_location is None
    assert fields(marked[1]) == fields(every[1]) and fields(marked[3]) == fields(every[3])


def test_a_phases_iteration_between_per_layer_ones_keeps_the_interval_named(monkeypatch):
    # The budget may run an iteration at "phases" (no module read) between two at "full": the
    # per-layer iteration after it still knows how the model ran when backward was last read fully.
    from pytorch_mem_profiler.measure.budget import CostBudget

    levels = iter(["full", "full", "phases", "full", "full"])
    monkeypatch.setattr(CostBudget, "choose", lambda self: next(levels, "full"))
    torch.manual_seed(0)
    model = wide_middle()
    x = torch.randn(256, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    records = []
    with MemoryProfiler(model, 1, by_layer=True, stream=io.StringIO(), strict=True) as profiler:
        for _ in range(5):
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            records.append(profiler.record_stats())
    assert [r.detail for r in records] == ["full", "full", "phases", "full", "full"]
    # read at marks from the second on; the fourth, after the "phases" one, names the module as the others
    assert [r.peak_location for r in records if r.detail == "full"] == ["4"] * 4
