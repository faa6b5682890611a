"""Step time with a memory tool over step time without it: this profiler and its peers, side by side.

    python benchmarks/overhead.py --tools ours --out $OUT  # this profiler's four configurations (~5 min on an H200)
    python benchmarks/overhead.py                        # every workload and tool, the peers too
    python benchmarks/overhead.py --workloads tiny_mlp --tools "profiler, print_period=1"
    python benchmarks/overhead.py --device cpu --quick    # a smoke test in seconds
    python benchmarks/overhead.py --workloads gpt2 resnet50 neumf tiny_mlp deep_64 deep_512 deep_4096 \
        --tools ours "torch.profiler(profile_memory, record_shapes)" '_record_memory_history, stacks="python"' \
        --out $OUT                                        # issue #28: the budget, per-layer mode and the peers

Each round times a block of training steps without any tool, a block with
the tool, and a block without it again, on the same model and batch in the
same process (the GPU synchronized at both ends of each block); a block lasts
about ``--round-seconds``. The round's ratio is the block with the tool over
the mean of the two blocks without it around it, so a drift of the machine
during the round cancels; the row gives the median over the rounds and their
spread (lowest and highest). Tools:

- this profiler, ``print_period`` 1 and 10, by default (its cost budget,
  ``overhead=0.03``) and with ``by_layer=True, overhead=None`` (every reported
  iteration at the ``"full"`` level); each row's note gives the share of
  reported iterations at each level of detail. With a budget, each fresh
  profiler first runs its start untimed (its first reported iteration at the
  richest level, one at ``"light"`` for the base, one try of each detailed
  level: what a run pays once), and the note gives what that start cost;
- ``torch.profiler.profile(profile_memory=True, record_shapes=True)``;
- ``torch.cuda.memory._record_memory_history``, ``stacks="python"`` and ``"all"``;
- the same history as an engine for detailed iterations: on for each step, read back with
  ``_snapshot()`` after it, then restarted (what replacing the pack and gradient hooks
  with it would cost at least, set against ``by_layer`` at ``print_period=1``);
- torch's ``MemTracker``, which tracks one step only and refuses a second: each
  round times one tracked step against one untracked step;
- pytorch_memlab's ``MemReporter(model).report()`` after every step.

A tool that is missing or fails gets ``unavailable: <reason>`` in its row and
the run goes on. Also measured: the device memory the profiler adds to a step
(its peak, what it allocates, what it keeps) and the host memory its records
take over ``--records`` iterations.

Prints Markdown tables; with ``--out DIR`` (default: ``$OUT`` when set) writes
``overhead.md``, ``overhead.csv``, ``overhead_device_memory.csv`` and
``overhead_host_memory.csv`` there.
Absolute times mean something only on the machine where they were taken.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import math
import os
import sys
import time
import tracemalloc
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ContextManager, Iterator

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchutil import environment_line, markdown_table, mb, output_dir, quiet_collector, sync, write_csv  # noqa: E402
from workloads import SCALING, WORKLOADS, Workload, WorkloadUnavailable, build, median  # noqa: E402

from pytorch_mem_profiler import MemoryProfiler  # noqa: E402
from pytorch_mem_profiler.measure.budget import detailed_levels, richest_level  # noqa: E402

#: This profiler's four configurations: (label, print_period, by_layer), in the order of the columns.
CONFIGS = (
    ("print_period=1", 1, False),
    ("print_period=10", 10, False),
    ("by_layer, 1", 1, True),
    ("by_layer, 10", 10, True),
)
#: The goals for this profiler's step-time ratio, by (workload, print_period, by_layer): the
#: GPU-bound steps stay at 1.00x; the 2.3 ms CPU-bound step (tiny_mlp) and NeuMF's per-layer mode
#: have their own. A goal is met when the median ratio, rounded to two decimals, is at most it.
#: The default (its 3% cost budget) at most 1.03x everywhere; per-layer mode (``overhead=None``) at
#: print_period=10 at most 1.05x (at 1 it is to cost less than torch.profiler's memory mode, in the
#: same run: compare the rows).
GOALS: dict[tuple[str, int, bool], float] = {
    **{(w, p, False): 1.03 for w in (*WORKLOADS, *SCALING) for p in (1, 10)},
    **{(w, 10, True): 1.05 for w in (*WORKLOADS, *SCALING)},
}
GOAL_TINY = GOALS[("tiny_mlp", 1, False)]
GOAL_BY_LAYER = GOALS[("tiny_mlp", 10, True)]

PerStep = Callable[[], Any] | None


@dataclass
class Tool:
    """A memory tool as the benchmark sees it.

    ``open(work, device)`` is a context manager that starts the tool and gives
    what to call after each step (or ``None``); ``check(device)`` returns why
    the tool cannot run here, or ``None``. A ``single_step`` tool is timed one
    step at a time (MemTracker).
    """

    name: str
    open: Callable[[Workload, torch.device], ContextManager[PerStep]]
    check: Callable[[torch.device], str | None] = lambda device: None
    single_step: bool = False
    ours: bool = False
    by_layer: bool = False
    print_period: int = 0
    note: str = ""
    #: this profiler: how many reported iterations ran at each level of detail, over every block
    levels: dict[str, int] = field(default_factory=dict)
    #: this profiler: the cost budget it ran with (``overhead=``; ``None``: no limit)
    overhead: float | None = None
    #: this profiler with a budget: the seconds its budget counted as spent and as earned over the
    #: timed steps of every block, its untimed start left out (their ratio times ``overhead`` is the
    #: share of the timed steps the budget believes it cost)
    budget_seconds: list[float] = field(default_factory=lambda: [0.0, 0.0])
    #: called when a block's timed steps begin (after the start): this profiler notes its budget's
    #: account there, so that :attr:`budget_seconds` counts the timed steps alone
    timed: Callable[[], None] | None = None
    #: steps run with the tool before each timed block: its own warm-up, and for this profiler with
    #: a budget its start, which a run pays once (see :func:`profiler_tool`)
    start_steps: int = 2
    #: this profiler with a budget: the start's extra seconds over the steps without the tool, by
    #: round, and how many of its steps ran (fewer where the steps are long)
    start_seconds: list[float] = field(default_factory=list)
    start_steps_run: int = 0

    def next_row(self) -> None:
        """Forget what this row's blocks counted (levels, the budget's seconds, the start), so that
        the next workload's row counts its own alone."""
        self.levels.clear()
        self.budget_seconds[:] = [0.0, 0.0]
        self.start_seconds.clear()
        self.start_steps_run = 0

    def level_note(self) -> str:
        """``levels: phases 12%, light 88%`` (this profiler), else the note."""
        total = sum(self.levels.values())
        if not total:
            return self.note
        shares = ", ".join(f"{k} {100 * n / total:.0f}%" for k, n in sorted(self.levels.items()))
        note = f"{self.note}; levels: {shares}" if self.note else f"levels: {shares}"
        spent, allowed = self.budget_seconds
        if allowed > 0 and self.overhead:
            # what the budget itself counted: set against the measured ratio, what it cannot see
            note += f"; the budget's own count: {100 * self.overhead * spent / allowed:.1f}%"
        if self.start_seconds:
            note += (
                f"; its start, once a run, untimed ({self.start_steps_run} of its {self.start_steps} steps): "
                f"+{1e3 * median(self.start_seconds):.2f} ms"
            )
        return note



# -- the tools -----------------------------------------------------------------


def profiler_tool(print_period: int, by_layer: bool = False) -> Tool:
    """The default (``overhead=0.03``), or per-layer mode with no budget (``overhead=None``).

    With a budget, a run starts by measuring what its levels cost: its first reported iteration at
    the richest level (warm-up, not a cost estimate), an iteration at ``"light"`` (the base), then
    one at each detailed level. A run pays that once; a block of a few long steps timed right after
    a fresh profiler's two warm-up steps would count it in every round (half the reported
    iterations of a 110 ms step at ``"phases"``). So those iterations run before each timed block,
    and their cost shows apart in the row's note.
    """
    overhead = None if by_layer else 0.03

    @contextlib.contextmanager
    def open_(work: Workload, device: torch.device) -> Iterator[PerStep]:
        with open(os.devnull, "w") as sink:
            # strict: a fault raises instead of switching a part off, so no row times half a profiler.
            profiler = MemoryProfiler(
                work.model, print_period, stream=sink, by_layer=by_layer, strict=True, overhead=overhead
            )
            budget = profiler._budget  # noqa: SLF001 - the benchmark reads the budget's own account
            at_timed = [0.0, 0.0]  # the budget's account where the timed steps began

            def timed() -> None:
                at_timed[:] = [budget.spent, budget.allowed]

            tool.timed = timed
            try:
                yield profiler.record_stats
            finally:
                profiler.close()
                for record in profiler.records:
                    if record.iteration > tool.start_steps_run:  # the timed steps' records, not the start's
                        tool.levels[record.detail] = tool.levels.get(record.detail, 0) + 1
                tool.timed = None
                tool.budget_seconds[0] += budget.spent - at_timed[0]
                tool.budget_seconds[1] += budget.allowed - at_timed[1]

    name = f"profiler{' by_layer' if by_layer else ''}, print_period={print_period}"
    # the start counts reported iterations: print_period steps each
    start = 2 if overhead is None else (2 + len(detailed_levels(richest_level(by_layer)))) * print_period
    tool = Tool(
        name, open_, ours=True, by_layer=by_layer, print_period=print_period, overhead=overhead,
        note=f"overhead={overhead}", start_steps=start,
    )
    return tool


def _torch_profiler_check(device: torch.device) -> str | None:
    try:
        import torch.profiler  # noqa: F401
    except ImportError as err:
        return f"torch.profiler cannot be imported ({err})"
    return None


@contextlib.contextmanager
def _torch_profiler(work: Workload, device: torch.device) -> Iterator[PerStep]:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities, profile_memory=True, record_shapes=True):
        yield None


def _history_check(device: torch.device) -> str | None:
    if device.type != "cuda":
        return "needs a CUDA device"
    if not hasattr(torch.cuda.memory, "_record_memory_history"):
        return f"torch {torch.__version__} has no torch.cuda.memory._record_memory_history"
    return None


def history_tool(stacks: str, max_entries: int) -> Tool:
    @contextlib.contextmanager
    def open_(work: Workload, device: torch.device) -> Iterator[PerStep]:
        torch.cuda.memory._record_memory_history(enabled="all", stacks=stacks, max_entries=max_entries)
        try:
            yield None
        finally:
            torch.cuda.memory._record_memory_history(enabled=None)

    return Tool(
        f'_record_memory_history, stacks="{stacks}"',
        open_,
        _history_check,
        note=f"max_entries={max_entries:,}",
    )


def history_engine_tool(max_entries: int) -> Tool:
    """The allocator history as an engine for detailed iterations: switched on for each step
    (Python stacks), read back with ``_snapshot()`` after it, its trace walked for the step's
    peak, then switched off and on again (a fresh trace). A floor of what such an engine costs
    per detailed iteration: attributing the trace to layers comes on top."""

    def enable() -> None:
        torch.cuda.memory._record_memory_history(enabled="all", stacks="python", max_entries=max_entries)

    def read_back() -> None:
        snapshot = torch.cuda.memory._snapshot()
        live = peak = 0
        for trace in snapshot["device_traces"]:
            for event in trace:
                if event["action"] == "alloc":
                    live += event["size"]
                    peak = max(peak, live)
                elif event["action"] == "free_completed":
                    live -= event["size"]
        torch.cuda.memory._record_memory_history(enabled=None)
        enable()

    @contextlib.contextmanager
    def open_(work: Workload, device: torch.device) -> Iterator[PerStep]:
        enable()
        try:
            yield read_back
        finally:
            torch.cuda.memory._record_memory_history(enabled=None)

    return Tool(
        "history engine: on each step, read back by _snapshot()",
        open_,
        _history_check,
        note="a floor for an allocator-history engine at the full level each iteration",
    )


def _memtracker_check(device: torch.device) -> str | None:
    if not torch.distributed.is_available():
        return "torch.distributed is not available in this build"
    try:
        from torch.distributed._tools.mem_tracker import MemTracker  # noqa: F401
    except ImportError as err:
        return f"torch {torch.__version__} has no torch.distributed._tools.mem_tracker ({err})"
    return None


@contextlib.contextmanager
def _memtracker(work: Workload, device: torch.device) -> Iterator[PerStep]:
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(work.model, work.optimizer)
    with tracker:
        yield None


def _memlab_check(device: torch.device) -> str | None:
    try:
        # Imported here, not in the timed blocks: importing it empties the CUDA cache once.
        with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink):
            import pytorch_memlab  # noqa: F401
    except ImportError as err:
        return f"pytorch_memlab is not installed (pip install pytorch-memlab): {err}"
    return None


@contextlib.contextmanager
def _memreporter(work: Workload, device: torch.device) -> Iterator[PerStep]:
    from pytorch_memlab import MemReporter

    with open(os.devnull, "w") as sink:

        def report() -> None:
            with contextlib.redirect_stdout(sink):
                MemReporter(work.model).report()

        yield report


def make_tools(max_entries: int) -> dict[str, Tool]:
    tools = [
        profiler_tool(1),
        profiler_tool(10),
        profiler_tool(1, by_layer=True),
        profiler_tool(10, by_layer=True),
        Tool("torch.profiler(profile_memory, record_shapes)", _torch_profiler, _torch_profiler_check),
        history_tool("python", max_entries),
        history_tool("all", max_entries),
        history_engine_tool(max_entries),
        Tool(
            "MemTracker",
            _memtracker,
            _memtracker_check,
            single_step=True,
            note="one tracked step vs one untracked step per round (it refuses a second step)",
        ),
        Tool("MemReporter(model).report() each step", _memreporter, _memlab_check, note="pytorch_memlab"),
    ]
    return {tool.name: tool for tool in tools}


# -- timing ---------------------------------------------------------------------


def time_steps(work: Workload, device: torch.device, steps: int, per_step: PerStep) -> float:
    """Seconds per step over ``steps`` steps."""
    sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        work.step()
        if per_step is not None:
            per_step()
    sync(device)
    return (time.perf_counter() - start) / steps


def steps_for(seconds: float, step_s: float, minimum: int, maximum: int) -> int:
    """How many steps of ``step_s`` seconds fill ``seconds``, within bounds."""
    return max(minimum, min(maximum, math.ceil(seconds / max(step_s, 1e-9))))


@dataclass
class Settings:
    rounds: int = 9
    peer_rounds: int = 3
    round_seconds: float = 0.5
    min_steps: int = 5
    max_steps: int = 500


@dataclass
class Row:
    workload: str
    tool: str
    status: str = "ok"
    ratio: float | None = None
    base_ms: float | None = None
    tool_ms: float | None = None
    rounds: int = 0
    base_steps: int = 0
    tool_steps: int = 0
    stop_s: float | None = None
    goal: float | None = None
    note: str = ""
    ratios: list[float] = field(default_factory=list)

    @property
    def met(self) -> bool | None:
        if self.goal is None or self.ratio is None:
            return None
        return round(self.ratio, 2) <= self.goal

    @property
    def verdict(self) -> str:
        if self.met is None:
            return ""
        return f"<= {self.goal:.2f}x: {'met' if self.met else 'missed'}"

    @property
    def spread(self) -> str:
        """The lowest and highest round's ratio."""
        return f"{min(self.ratios):.3f}-{max(self.ratios):.3f}" if self.ratios else ""


def goal_for(tool: Tool, workload: str) -> float | None:
    if not tool.ours:
        return None
    return GOALS.get((workload, tool.print_period, tool.by_layer))


def measure_loop(work: Workload, device: torch.device, tool: Tool, rounds: int, base_step_s: float, s: Settings) -> Row:
    """Interleaved rounds: a block without the tool, a block with it, a block without it."""
    row = Row(work.name, tool.name, rounds=rounds, note=tool.note)
    row.base_steps = steps_for(s.round_seconds, base_step_s, s.min_steps, s.max_steps)
    bases, withs, stops = [], [], []
    for _ in range(rounds):
        before = time_steps(work, device, row.base_steps, None)
        cm = tool.open(work, device)
        per_step = cm.__enter__()
        try:
            # the tool's own warm-up (CUPTI starts, caches fill), or this profiler's start; on
            # steps so long that the start would outlast five blocks, as much of it as fits
            start = min(tool.start_steps, max(2, int(5 * s.round_seconds / max(base_step_s, 1e-9))))
            started = time_steps(work, device, start, per_step)
            if tool.overhead is not None:
                tool.start_seconds.append(max(0.0, started - before) * start)
                tool.start_steps_run = start
            if not row.tool_steps:
                # Slow tools (MemReporter) get fewer steps, so each block lasts about the same.
                estimate = time_steps(work, device, 2, per_step)
                row.tool_steps = steps_for(s.round_seconds, estimate, 3, s.max_steps)
            if tool.timed is not None:
                tool.timed()
            with_tool = time_steps(work, device, row.tool_steps, per_step)
        except BaseException:
            cm.__exit__(*sys.exc_info())
            raise
        stop = time.perf_counter()
        cm.__exit__(None, None, None)
        stops.append(time.perf_counter() - stop)
        after = time_steps(work, device, row.base_steps, None)
        base = (before + after) / 2
        bases.append(base)
        withs.append(with_tool)
        row.ratios.append(with_tool / base)
    row.ratio, row.base_ms, row.tool_ms = median(row.ratios), median(bases) * 1e3, median(withs) * 1e3
    row.stop_s = median(stops)
    return row


def time_one_step(work: Workload, device: torch.device) -> float:
    sync(device)
    start = time.perf_counter()
    work.step()
    sync(device)
    return time.perf_counter() - start


def measure_single_step(work: Workload, device: torch.device, tool: Tool, rounds: int) -> Row:
    """One untracked step, then one step inside a fresh tool, per round."""
    row = Row(work.name, tool.name, rounds=rounds, base_steps=1, tool_steps=1, note=tool.note)
    bases, withs, stops = [], [], []
    for _ in range(rounds):
        base = time_one_step(work, device)
        with tool.open(work, device):
            with_tool = time_one_step(work, device)
            stop = time.perf_counter()
        stops.append(time.perf_counter() - stop)
        bases.append(base)
        withs.append(with_tool)
        row.ratios.append(with_tool / base)
    row.ratio, row.base_ms, row.tool_ms = median(row.ratios), median(bases) * 1e3, median(withs) * 1e3
    row.stop_s = median(stops)
    return row


def measure_tool(work: Workload, device: torch.device, tool: Tool, base_step_s: float, s: Settings) -> Row:
    """The tool's row; a tool that is missing or fails gets ``unavailable: <reason>``."""
    reason = tool.check(device)
    if reason is not None:
        return Row(work.name, tool.name, status=f"unavailable: {reason}", note=tool.note)
    rounds = s.rounds if tool.ours or tool.single_step else s.peer_rounds
    try:
        if tool.single_step:
            row = measure_single_step(work, device, tool, max(rounds, 3))
        else:
            row = measure_loop(work, device, tool, rounds, base_step_s, s)
    except Exception as exc:  # noqa: BLE001 - one failing tool must not end the run
        # A step cut short leaves gradients behind; the next tool starts clean.
        work.optimizer.zero_grad(set_to_none=True)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        message = " ".join(str(exc).split())[:200]
        return Row(work.name, tool.name, status=f"unavailable: {type(exc).__name__}: {message}", note=tool.note)
    row.goal = goal_for(tool, work.name)
    row.note = tool.level_note()
    tool.next_row()
    return row


# -- memory the profiler adds ---------------------------------------------------------


class PeakMeter:
    """The allocator's peak over an interval, kept right across anyone's peak resets.

    The profiler resets CUDA's peak statistics at each phase boundary; while
    the meter is open, every reset first folds ``max_memory_allocated()`` into
    the meter's own peak. Make the profiler inside the meter: its counter looks
    the reset function up when it is made.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.peak = 0
        self._original: Any = None

    def __enter__(self) -> PeakMeter:
        original = self._original = torch._C._cuda_resetPeakMemoryStats

        def reset(index: int) -> None:
            self.peak = max(self.peak, torch.cuda.max_memory_allocated(index))
            original(index)

        torch._C._cuda_resetPeakMemoryStats = reset
        return self

    def __exit__(self, *exc: object) -> None:
        torch._C._cuda_resetPeakMemoryStats = self._original

    def start(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)
        self.peak = 0

    def stop(self) -> int:
        return max(self.peak, torch.cuda.max_memory_allocated(self.device))


@dataclass
class StepMemory:
    """One step's device memory, relative to what was allocated when it began: so two
    measurements compare the step itself, not what else happened to be alive."""

    peak: int  # peak above the step's start
    allocated_after: int  # left allocated at the end, above the start
    bytes_allocated: int
    allocations: int


def measure_step_memory(work: Workload, device: torch.device, by_layer: bool | None) -> StepMemory:
    """One step's device memory, without the profiler (``by_layer`` None) or with it."""
    with PeakMeter(device) as meter, open(os.devnull, "w") as sink:
        profiler = None
        if by_layer is not None:
            profiler = MemoryProfiler(work.model, 1, stream=sink, by_layer=by_layer, strict=True)
        try:
            for _ in range(2):
                work.step()
                if profiler is not None:
                    profiler.record_stats()
            with quiet_collector():
                sync(device)
                meter.start()
                before = torch.cuda.memory_stats(device)
                work.step()
                if profiler is not None:
                    profiler.record_stats()
                sync(device)
                peak = meter.stop()
                after = torch.cuda.memory_stats(device)
        finally:
            if profiler is not None:
                profiler.close()
    start = before["allocated_bytes.all.current"]
    return StepMemory(
        peak=peak - start,
        allocated_after=after["allocated_bytes.all.current"] - start,
        bytes_allocated=after["allocated_bytes.all.allocated"] - before["allocated_bytes.all.allocated"],
        allocations=after["allocation.all.allocated"] - before["allocation.all.allocated"],
    )


def device_memory_rows(work: Workload, device: torch.device) -> list[list[Any]]:
    """The profiler's device memory: one step's figures with it minus without it."""
    if device.type != "cuda":
        return [[work.name, "device memory", "n/a on CPU (no allocator counters)", "", "", ""]]
    without = measure_step_memory(work, device, None)
    rows = []
    for label, by_layer in (("profiler, print_period=1", False), ("profiler by_layer, print_period=1", True)):
        with_ = measure_step_memory(work, device, by_layer)
        rows.append(
            [
                work.name,
                label,
                with_.peak - without.peak,
                with_.bytes_allocated - without.bytes_allocated,
                with_.allocations - without.allocations,
                with_.allocated_after - without.allocated_after,
            ]
        )
    return rows


def host_memory_of_records(device: torch.device, iterations: int, by_layer: bool) -> tuple[int, int, int, int]:
    """Host bytes the profiler holds after ``iterations`` reported iterations (history kept whole).

    A cheap step on a small model; tracemalloc counts what Python allocates
    from the first recorded iteration on. Returns (bytes held at the end,
    peak bytes, records kept, bytes per record). Bytes per record is the slope
    between the held bytes at half the iterations and at all of them: what one
    more record costs, without what the first ones allocate once (caches,
    the report's kept text), which held bytes over records would spread over them.
    """
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(8, 32, device=device)

    def step() -> None:
        model(x).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    with open(os.devnull, "w") as sink:
        profiler = MemoryProfiler(model, 1, stream=sink, history=iterations, by_layer=by_layer, strict=True)
        try:
            for _ in range(3):
                step()
                profiler.record_stats()
            profiler.records.clear()
            gc.collect()
            half, held_half = iterations // 2, 0
            tracemalloc.start()
            try:
                for i in range(iterations):
                    if i == half:
                        gc.collect()
                        held_half = tracemalloc.get_traced_memory()[0]
                    step()
                    profiler.record_stats()
                gc.collect()
                held, peak = tracemalloc.get_traced_memory()
            finally:
                tracemalloc.stop()
            kept = len(profiler.records)
        finally:
            profiler.close()
    return held, peak, kept, (held - held_half) // max(iterations - half, 1)


# -- the run ----------------------------------------------------------------------


def ours_table(rows: list[Row]) -> str:
    """This profiler's rows as workloads x the four configurations, each cell the median ratio, its
    spread and its goal with the verdict (empty when this profiler was not timed)."""
    names = {f"profiler{' by_layer' if b else ''}, print_period={p}": label for label, p, b in CONFIGS}
    cells: dict[str, dict[str, str]] = {}
    for r in rows:
        label = names.get(r.tool)
        if label is None:
            continue
        if r.ratio is None:
            text = r.status
        else:
            text = f"{r.ratio:.3f}x ({r.spread})"
            if r.goal is not None:
                text += f", goal {r.goal:.2f}x: {'met' if r.met else '**missed**'}"
        cells.setdefault(r.workload, {})[label] = text
    if not cells:
        return ""
    labels = [label for label, _, _ in CONFIGS]
    return markdown_table(["Workload", *labels], [[w, *(c.get(label, "") for label in labels)] for w, c in cells.items()])



CSV_HEADERS = [
    "workload", "tool", "status", "ratio", "step_ms_without", "step_ms_with", "rounds", "steps_without",
    "steps_with", "tool_stop_s", "goal", "ratios", "note", "device", "torch",
]  # fmt: skip


def ratio_csv_rows(rows: list[Row], device: torch.device) -> list[list[Any]]:
    gpu = environment_line(device)
    return [
        [
            r.workload, r.tool, r.status, r.ratio, r.base_ms, r.tool_ms, r.rounds, r.base_steps, r.tool_steps,
            r.stop_s, r.goal, " ".join(f"{x:.4f}" for x in r.ratios), r.note, gpu, torch.__version__,
        ]  # fmt: skip
        for r in rows
    ]


def main(argv: list[str] | None = None) -> list[Row]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    tools = make_tools(100_000)
    parser.add_argument(
        "--tools",
        nargs="+",
        default=list(tools),
        choices=["ours", *tools],
        metavar="TOOL",
        help="tools to time; 'ours': this profiler's four configurations only (default: every tool)",
    )
    parser.add_argument("--rounds", type=int, default=9, help="rounds for this profiler and MemTracker")
    parser.add_argument("--peer-rounds", type=int, default=3, help="rounds for the other peer tools")
    parser.add_argument("--round-seconds", type=float, default=0.5, help="about how long each timed block lasts")
    parser.add_argument("--max-steps", type=int, default=500, help="most steps in one timed block")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--max-entries", type=int, default=100_000, help="_record_memory_history's max_entries")
    parser.add_argument("--records", type=int, default=10_000, help="iterations for the host-memory measurement")
    parser.add_argument("--time-limit", type=float, default=420.0, help="seconds; tools after it are skipped")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="small models and short blocks: a smoke test")
    parser.add_argument("--out", default=None, help="folder for overhead.md and the CSV files (default: $OUT)")
    parser.add_argument("--csv", default=None, help="also write the ratio table as CSV here")
    args = parser.parse_args(argv)
    for name in ("rounds", "peer_rounds", "max_steps", "records"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    device = torch.device(args.device)
    tools = make_tools(args.max_entries)
    chosen: list[str] = []
    for name in args.tools:
        for picked in [t.name for t in tools.values() if t.ours] if name == "ours" else [name]:
            if picked not in chosen:
                chosen.append(picked)
    args.tools = chosen
    settings = Settings(args.rounds, args.peer_rounds, args.round_seconds, max_steps=args.max_steps)
    if args.quick:
        settings.round_seconds = min(settings.round_seconds, 0.05)
        settings.min_steps = 2
    deadline = time.monotonic() + args.time_limit
    out = output_dir(args.out)
    lines: list[str] = []

    def emit(text: str = "") -> None:
        print(text, flush=True)
        lines.append(text)

    rows: list[Row] = []
    memory_rows: list[list[Any]] = []
    descriptions: list[str] = []
    for name in args.workloads:
        if time.monotonic() > deadline:
            rows += [Row(name, t, status="skipped: --time-limit reached") for t in args.tools]
            continue
        try:
            work = build(name, device, quick=args.quick)
        except WorkloadUnavailable as exc:
            rows += [Row(name, t, status=f"unavailable: {exc}") for t in args.tools]
            print(f"{name}: unavailable: {exc}", flush=True)
            continue
        descriptions.append(f"- {name}: {work.description}")
        for _ in range(args.warmup):
            work.step()
        base_step_s = median([time_steps(work, device, 1, None) for _ in range(3)])
        for tool_name in args.tools:
            tool = tools[tool_name]
            if time.monotonic() > deadline:
                row = Row(name, tool_name, status="skipped: --time-limit reached", note=tool.note)
            else:
                row = measure_tool(work, device, tool, base_step_s, settings)
            rows.append(row)
            if out is not None:  # a run cut short (a time limit, a kill) keeps every row measured so far
                write_csv(out / "overhead_partial.csv", CSV_HEADERS, ratio_csv_rows(rows, device))
            if row.ratio is not None:
                print(f"{name:9s} {tool_name:48s} {row.ratio:7.3f}x [{row.spread}]  ({row.base_ms:.2f} -> {row.tool_ms:.2f} ms)  {row.note}", flush=True)
            else:
                print(f"{name:9s} {tool_name:48s} {row.status}", flush=True)
        if any(tools[t].ours for t in args.tools) and time.monotonic() < deadline:
            memory_rows += device_memory_rows(work, device)
        del work
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()

    records = min(args.records, 300) if args.quick else args.records
    host_rows = []
    for by_layer in (False, True):
        held, peak, kept, per_record = host_memory_of_records(device, records, by_layer)
        label = "profiler by_layer, print_period=1" if by_layer else "profiler, print_period=1"
        host_rows.append([label, records, kept, held, peak, per_record])

    emit()
    emit(environment_line(device))
    emit(
        f"Median over rounds ({settings.rounds} for this profiler and MemTracker, {settings.peer_rounds} for the "
        f"other peers) of step time with the tool / the mean of the blocks without it before and after, "
        f"interleaved in one process; spread: the lowest and highest round."
    )
    emit()
    emit("Workloads:")
    for text in descriptions:
        emit(text)
    emit()
    headers = ["Workload", "Tool", "Step time ratio", "Spread", "Goal", "Step without (ms)", "Step with (ms)", "Rounds x steps", "Tool stop (s)", "Note"]  # fmt: skip
    table = []
    for r in rows:
        if r.ratio is None:
            table.append([r.workload, r.tool, r.status, "", "", "", "", "", "", r.note])
        else:
            table.append(
                [
                    r.workload,
                    r.tool,
                    f"{r.ratio:.3f}x",
                    r.spread,
                    r.verdict,
                    f"{r.base_ms:.2f}",
                    f"{r.tool_ms:.2f}",
                    f"{r.rounds} x {r.base_steps}/{r.tool_steps}",
                    f"{r.stop_s:.2f}",
                    r.note,
                ]
            )
    emit(markdown_table(headers, table))
    emit()
    ours = ours_table(rows)
    if ours:
        emit("This profiler, median ratio (lowest-highest round) and the goal where there is one:")
        emit()
        emit(ours)
        emit()
    emit("Device memory the profiler adds to one training step (with it minus without it, bytes):")
    emit()
    mem_headers = ["Workload", "Mode", "Peak allocated", "Bytes allocated in the step", "Allocations in the step", "Allocated after the step"]
    emit(markdown_table(mem_headers, memory_rows) if memory_rows else "(not measured)")
    emit()
    emit(
        f"Host memory of the profiler's records (Python heap, tracemalloc; history={records}; bytes per record: "
        "the growth from half the iterations to all of them, per record):"
    )
    emit()
    host_headers = ["Mode", "Iterations", "Records kept", "Bytes held", "Peak bytes", "Bytes per record"]
    emit(
        markdown_table(
            host_headers,
            [[m, f"{n:,}", f"{k:,}", f"{h:,} ({mb(h)} MB)", f"{p:,} ({mb(p)} MB)", f"{b:,}"] for m, n, k, h, p, b in host_rows],
        )
    )
    emit()
    emit("Tool stop: seconds to leave the tool's context after a block (torch.profiler processes its trace then).")

    csv_rows = ratio_csv_rows(rows, device)
    if args.csv:
        write_csv(Path(args.csv), CSV_HEADERS, csv_rows)
    if out is not None:
        write_csv(out / "overhead.csv", CSV_HEADERS, csv_rows)
        (out / "overhead_partial.csv").unlink(missing_ok=True)
        write_csv(out / "overhead_device_memory.csv", mem_headers, memory_rows)
        write_csv(out / "overhead_host_memory.csv", host_headers, host_rows)
        (out / "overhead.md").write_text("\n".join(lines) + "\n")
        print(f"\nwrote overhead.md, overhead.csv, overhead_device_memory.csv, overhead_host_memory.csv in {out}")
    return rows


if __name__ == "__main__":
    main()
