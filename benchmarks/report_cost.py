"""What printing the report costs per reported iteration, in microseconds of CPU time.

    python benchmarks/report_cost.py                 # the default (full) report
    python benchmarks/report_cost.py --by-layer --rounds 9
    python benchmarks/report_cost.py --device-figures   # as on a GPU: headroom, device use

Builds a real profiler on a small CPU model (8 x Linear(16) + ReLU: 16
parameters, Adam, batch 4) with ``print_period=1``, runs some steps to collect
its reported records, then times, per call over those records in turn (so the
iteration number and the time change from one call to the next, as in a run):
``ReportSink.on_record`` (format and write to ``os.devnull``), the same with one
figure changing at every call (so the text made from the figures is made again),
:class:`~pytorch_mem_profiler.outputs.report.ReportFormatter` and ``format_record``
(which keeps nothing) for each layout, and pieces of the full report.
``--device-figures`` gives the records a GPU's capacity and device use, as a CUDA
run's have, so that the headroom and device sections are printed. Each figure is the median of
``--rounds`` rounds of ``time.thread_time`` (the calling thread's CPU time, which
other processes do not inflate).
"""

from __future__ import annotations

import argparse
import dataclasses
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
from pytorch_mem_profiler.outputs.report import ReportFormatter  # noqa: E402
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
    parser.add_argument("--device-figures", action="store_true", help="records with a GPU's capacity and device use")
    args = parser.parse_args()
    torch.set_num_threads(1)
    records = collect_records(args.steps, by_layer=args.by_layer)
    if args.device_figures:
        records = [
            dataclasses.replace(r, device="cuda:0", device_total=143_771_000_000, device_used=2_000_000_000,
                                process_used=1_500_000_000, outside_pytorch=600_000_000, current_cached=1_400_000_000)
            for r in records
        ]
    # a figure that changes at every record: the kept text is made again each time
    changing = [dataclasses.replace(r, allocated=r.allocated + i) for i, r in enumerate(records)]
    unit = args.units
    with open(os.devnull, "w") as devnull:
        sink = ReportSink(lambda: devnull, units=unit)
        text = report.format_report(records[-1], unit)
        formatters = {mode: ReportFormatter() for mode in report.REPORT_MODES}
        rows: dict[str, tuple[Callable[[IterationRecord], object], list[IterationRecord]]] = {
            "ReportSink.on_record (full)": (sink.on_record, records),
            "  write_text": (lambda r: write_text(devnull, text + "\n"), records),
            "  a figure changing each call": (sink.on_record, changing),
        }
        for mode in report.REPORT_MODES:
            rows[f"ReportFormatter {mode}"] = (lambda r, m=mode: formatters[m](r, unit, m), records)
        for mode in report.REPORT_MODES:
            rows[f"format_record {mode} (keeps nothing)"] = (lambda r, m=mode: report.format_record(r, unit, m), records)
        rows["  _advice_lines"] = (lambda r: report._advice_lines(r, unit, "  "), records)
        print(
            f"{len(records)} records of 8 x Linear(16) + Adam on the CPU"
            f"{', by_layer' if args.by_layer else ''}{', device figures' if args.device_figures else ''}, {unit},"
            f" {len(text.splitlines())} report lines; us per call (median of {args.rounds} rounds, thread CPU time)"
        )
        for name, (fn, recs) in rows.items():
            print(f"  {name:36s} {per_call_us(fn, recs, args.rounds):8.2f}")


if __name__ == "__main__":
    main()
