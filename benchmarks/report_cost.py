"""What printing the report costs per reported iteration, in microseconds of CPU time.

    python benchmarks/report_cost.py                 # the default (full) report
    python benchmarks/report_cost.py --by-layer --rounds 9

Builds a real profiler on a small CPU model (8 x Linear(16) + ReLU: 16
parameters, Adam, batch 4) with ``print_period=1``, runs some steps to collect
its reported records, then times, per call over those records in turn (so the
iteration number and the time change from one call to the next, as in a run):
``ReportSink.on_record`` (format and write to ``os.devnull``), ``format_record``
for each layout, and the pieces of the full report. Each figure is the median of
``--rounds`` rounds of ``time.thread_time`` (the calling thread's CPU time, which
other processes do not inflate).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Sequence

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pytorch_mem_profiler import MemoryProfiler  # noqa: E402
from pytorch_mem_profiler.outputs import report  # noqa: E402
from pytorch_mem_profiler.outputs.progress import write_text  # noqa: E402
from pytorch_mem_profiler.outputs.sinks import ReportSink  # noqa: E402
from pytorch_mem_profiler.stats import IterationRecord  # noqa: E402


def collect_records(steps: int, *, by_layer: bool = False) -> list[IterationRecord]:
    """The reported records of ``steps`` training steps of 8 x Linear(16) + ReLU with Adam, batch 4."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(8):
        layers += [nn.Linear(16, 16), nn.ReLU()]
    model = nn.Sequential(*layers)
    optimizer = torch.optim.Adam(model.parameters())
    batch = torch.randn(4, 16)
    with open(os.devnull, "w") as sink:
        prof = MemoryProfiler(model, 1, stream=sink, optimizer=optimizer, by_layer=by_layer)
        try:
            for _ in range(steps):
                model(batch).square().mean().backward()
                optimizer.step()
                optimizer.zero_grad()
                prof.record_stats()
            return list(prof.records)
        finally:
            prof.close()


def per_call_us(fn: Callable[[IterationRecord], object], records: Sequence[IterationRecord], rounds: int) -> float:
    """Median over ``rounds`` of the thread CPU time per call of ``fn`` over ``records``, in microseconds."""
    fn(records[0])  # warm any caches once, as the first report of a run does
    times = []
    for _ in range(rounds):
        start = time.thread_time()
        for record in records:
            fn(record)
        times.append((time.thread_time() - start) / len(records) * 1e6)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="training steps, each reported")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--by-layer", action="store_true", help="per-layer records (longer reports)")
    parser.add_argument("--units", default="MB")
    args = parser.parse_args()
    torch.set_num_threads(1)
    records = collect_records(args.steps, by_layer=args.by_layer)
    unit = args.units
    with open(os.devnull, "w") as devnull:
        sink = ReportSink(lambda: devnull, units=unit)
        text = report.format_report(records[-1], unit)
        rows = {
            "ReportSink.on_record (full)": lambda r: sink.on_record(r),
            "  format_report": lambda r: report.format_report(r, unit),
            "  write_text": lambda r: write_text(devnull, text + "\n"),
            "  _headroom_text": lambda r: report._headroom_text(r, unit) if r.device_total else None,
            "  _advice_lines": lambda r: report._advice_lines(r, unit, "  "),
            "format_record compact": lambda r: report.format_record(r, unit, "compact"),
            "format_record line": lambda r: report.format_record(r, unit, "line"),
        }
        print(
            f"{len(records)} records of 8 x Linear(16) + Adam on the CPU"
            f"{', by_layer' if args.by_layer else ''}, {unit}, {len(text.splitlines())} report lines;"
            f" us per call (median of {args.rounds} rounds, thread CPU time)"
        )
        for name, fn in rows.items():
            print(f"  {name:32s} {per_call_us(fn, records, args.rounds):8.2f}")


if __name__ == "__main__":
    main()
