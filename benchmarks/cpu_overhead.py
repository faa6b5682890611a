"""What the profiler costs when the device is the CPU: step time with it over step time without it.

    python benchmarks/cpu_overhead.py                  # both CPU workloads, 9 rounds, one thread
    python benchmarks/cpu_overhead.py --rounds 15 --round-seconds 1
    python benchmarks/cpu_overhead.py --quick          # a smoke test in seconds

On the CPU PyTorch keeps no memory counters, so the profiler counts live tensor
storages with a dispatch mode: every operator of the step passes through one
Python call. This script measures what that costs on two small CPU training
steps (``benchmarks/workloads.py``: ``cpu_mlp``, ``small_cnn``), where the
per-operator cost shows most.

Interleaved, in one process, on the same model and batch: each round times a
block of steps without the profiler, a block with it, and a block without it
again; the round's ratio is the block with it over the mean of the two blocks
around it, so a drift in the machine's speed cancels. The table gives the
median ratio over the rounds and its spread (lowest to highest). Rows:

- this profiler, ``print_period`` 1 and 10, by default and with ``by_layer=True``
  (the report is formatted to ``os.devnull`` every ``print_period`` steps);
- the exact CPU counter alone (``CpuCounter``, read once a step, no hooks): what
  the counting itself costs, apart from the rest of the profiler;
- a bare dispatch mode that only calls each operator: the floor of any counter
  that sees operators from Python.

Also: the dispatch-mode operators per step, and the profiler's cost per operator.
``--clock cpu`` times with this thread's CPU time instead of wall time: on a
shared machine it leaves out the time other processes took the core away.
Prints a Markdown table; with ``--out DIR`` (default: ``$OUT`` when set) writes
``cpu_overhead.md`` and ``cpu_overhead.csv`` there. Absolute times mean
something only on the machine where they were taken.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ContextManager, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchutil import environment_line, markdown_table, output_dir, write_csv  # noqa: E402
from workloads import CPU_WORKLOADS, Workload, build  # noqa: E402

from pytorch_mem_profiler import MemoryProfiler  # noqa: E402
from pytorch_mem_profiler.measure.devices import CpuCounter  # noqa: E402

#: The goals for this profiler's step-time ratio on the CPU, by workload and print_period.
GOALS = {
    ("cpu_mlp", 1): 1.25,
    ("cpu_mlp", 10): 1.15,
    ("small_cnn", 1): 1.05,
    ("small_cnn", 10): 1.05,
}

PerStep = Callable[[], Any] | None


@dataclass
class Variant:
    """What runs beside the steps: ``open(work)`` starts it and gives what to call after each step."""

    name: str
    open: Callable[[Workload], ContextManager[PerStep]]
    print_period: int = 0


def profiler_variant(print_period: int, by_layer: bool = False) -> Variant:
    @contextlib.contextmanager
    def open_(work: Workload) -> Iterator[PerStep]:
        with open(os.devnull, "w") as sink:
            # strict: a fault raises instead of switching a part off, so no row times half a profiler.
            profiler = MemoryProfiler(work.model, print_period, stream=sink, by_layer=by_layer, strict=True)
            try:
                yield profiler.record_stats
            finally:
                profiler.close()

    name = f"profiler{' by_layer' if by_layer else ''}, print_period={print_period}"
    return Variant(name, open_, print_period)


class BareMode(TorchDispatchMode):
    """Calls each operator and nothing else: what any Python-level operator counter costs at least."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # as the profiler's counting mode: no Dynamo-disabling wrapper per operator

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        return func._op(*args, **kwargs) if kwargs else func._op(*args)


@contextlib.contextmanager
def _bare_mode(work: Workload) -> Iterator[PerStep]:
    with BareMode():
        yield None


@contextlib.contextmanager
def _counter_alone(work: Workload) -> Iterator[PerStep]:
    counter = CpuCounter()
    counter.start()
    try:
        counter.adopt(list(work.model.parameters()))
        yield counter.mark  # one read a step, as a non-reported iteration of the profiler does
    finally:
        counter.stop()


class OperatorCount(TorchDispatchMode):
    """Counts the operators a step dispatches."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.calls += 1
        return func(*args, **(kwargs or {}))


def operators_per_step(work: Workload) -> int:
    counting = OperatorCount()
    with counting:
        work.step()
    return counting.calls


VARIANTS = {
    v.name: v
    for v in (
        profiler_variant(1),
        profiler_variant(10),
        profiler_variant(1, by_layer=True),
        profiler_variant(10, by_layer=True),
        Variant("counter alone (no hooks)", _counter_alone),
        Variant("bare dispatch mode (the floor)", _bare_mode),
    )
}


# -- timing ---------------------------------------------------------------------


#: ``wall``: elapsed time, the project's measure. ``cpu``: this thread's CPU time, which
#: leaves out the time other processes of a shared machine took the core away.
CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}
_clock = time.perf_counter


def time_block(work: Workload, steps: int, per_step: PerStep) -> float:
    """Seconds per step over ``steps`` steps."""
    start = _clock()
    for _ in range(steps):
        work.step()
        if per_step is not None:
            per_step()
    return (_clock() - start) / steps


@dataclass
class Row:
    workload: str
    variant: str
    ratios: list[float] = field(default_factory=list)
    without_s: list[float] = field(default_factory=list)
    with_s: list[float] = field(default_factory=list)
    steps: int = 0
    operators: int = 0
    goal: float | None = None

    @property
    def ratio(self) -> float:
        return statistics.median(self.ratios)

    @property
    def spread(self) -> str:
        return f"{min(self.ratios):.3f}-{max(self.ratios):.3f}"

    @property
    def without_ms(self) -> float:
        return statistics.median(self.without_s) * 1e3

    @property
    def with_ms(self) -> float:
        return statistics.median(self.with_s) * 1e3

    @property
    def us_per_operator(self) -> float | None:
        if not self.operators:
            return None
        return (self.with_ms - self.without_ms) * 1e3 / self.operators

    @property
    def verdict(self) -> str:
        if self.goal is None:
            return ""
        return f"<= {self.goal:.2f}x: {'met' if self.ratio <= self.goal else 'missed'}"


def measure(work: Workload, variant: Variant, rounds: int, steps: int, operators: int) -> Row:
    """``rounds`` rounds of: a block without, a block with, a block without."""
    row = Row(work.name, variant.name, steps=steps, operators=operators)
    row.goal = GOALS.get((work.name, variant.print_period))
    for _ in range(rounds):
        before = time_block(work, steps, None)
        with variant.open(work) as per_step:
            time_block(work, 2, per_step)  # its own warm-up: the first record, the first report
            with_ = time_block(work, steps, per_step)
        after = time_block(work, steps, None)
        row.without_s.append((before + after) / 2)
        row.with_s.append(with_)
        row.ratios.append(with_ / ((before + after) / 2))
    return row


def main(argv: list[str] | None = None) -> list[Row]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="+", default=list(CPU_WORKLOADS), choices=list(CPU_WORKLOADS))
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS), metavar="VARIANT")
    parser.add_argument("--rounds", type=int, default=9, help="rounds per row (at least 9 for a reported table)")
    parser.add_argument("--round-seconds", type=float, default=0.5, help="about how long each timed block lasts")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads for the run")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--clock", choices=list(CLOCKS), default="wall", help="wall time, or this thread's CPU time")
    parser.add_argument("--quick", action="store_true", help="small models and short blocks: a smoke test")
    parser.add_argument("--out", default=None, help="folder for cpu_overhead.md and .csv (default: $OUT)")
    args = parser.parse_args(argv)
    for name in ("rounds", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    global _clock
    _clock = CLOCKS[args.clock]
    threads_before = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    device = torch.device("cpu")
    round_seconds = min(args.round_seconds, 0.02) if args.quick else args.round_seconds
    out = output_dir(args.out)
    lines: list[str] = []

    def emit(text: str = "") -> None:
        print(text, flush=True)
        lines.append(text)

    rows: list[Row] = []
    descriptions = []
    try:
        for name in args.workloads:
            work = build(name, device, quick=args.quick)
            for _ in range(2 if args.quick else args.warmup):
                work.step()
            step_s = statistics.median(time_block(work, 1, None) for _ in range(5))
            steps = max(3, round(round_seconds / max(step_s, 1e-9)))
            operators = operators_per_step(work)
            descriptions.append(f"- {name}: {work.description}; {operators} operators a step")
            for variant_name in args.variants:
                row = measure(work, VARIANTS[variant_name], args.rounds, steps, operators)
                rows.append(row)
                print(f"{name:10s} {variant_name:40s} {row.ratio:.3f}x ({row.spread})", flush=True)
            del work
            gc.collect()
    finally:
        torch.set_num_threads(threads_before)

    emit()
    emit(
        f"{environment_line(device)}; {os.cpu_count()} cores; torch.set_num_threads({args.threads}); "
        f"clock: {args.clock}"
    )
    emit(
        f"Median over {args.rounds} interleaved rounds (without, with, without; the ratio is against the mean of "
        "the two blocks around it) of step time with the profiler / step time without it, in one process."
    )
    emit()
    emit("Workloads:")
    for text in descriptions:
        emit(text)
    emit()
    headers = [
        "Workload", "Variant", "Step time ratio (median)", "Spread (lowest-highest)", "Goal",
        "Step without (ms)", "Step with (ms)", "Rounds x steps", "Added per operator (us)",
    ]  # fmt: skip
    table = [
        [
            r.workload, r.variant, f"{r.ratio:.3f}x", r.spread, r.verdict, f"{r.without_ms:.2f}", f"{r.with_ms:.2f}",
            f"{len(r.ratios)} x {r.steps}", f"{r.us_per_operator:.2f}" if r.us_per_operator is not None else "",
        ]  # fmt: skip
        for r in rows
    ]
    emit(markdown_table(headers, table))
    if out is not None:
        csv_headers = [
            "workload", "variant", "ratio", "ratio_min", "ratio_max", "goal", "step_ms_without", "step_ms_with",
            "rounds", "steps", "operators", "us_per_operator", "ratios", "threads", "clock", "device", "torch",
        ]  # fmt: skip
        csv_rows = [
            [
                r.workload, r.variant, r.ratio, min(r.ratios), max(r.ratios), r.goal, r.without_ms, r.with_ms,
                len(r.ratios), r.steps, r.operators, r.us_per_operator, " ".join(f"{x:.4f}" for x in r.ratios),
                args.threads, args.clock, environment_line(device), torch.__version__,
            ]  # fmt: skip
            for r in rows
        ]
        write_csv(out / "cpu_overhead.csv", csv_headers, csv_rows)
        (out / "cpu_overhead.md").write_text("\n".join(lines) + "\n")
        print(f"\nwrote cpu_overhead.md and cpu_overhead.csv in {out}")
    return rows


if __name__ == "__main__":
    main()
