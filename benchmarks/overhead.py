"""Step time with the profiler over step time without it, in one process, alternating rounds.

    python benchmarks/overhead.py --workloads gpt2 tiny_mlp --rounds 5 --steps 30

Each round times ``--steps`` training steps without any tool, then the same
number with the tool, on the same model and batch (the GPU synchronized at
both ends of each timed block); the ratio is the median over rounds. Prints a
Markdown table and writes it as CSV (``--csv``). Absolute times mean something
only on the machine where they were taken.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import os
import sys
import time
from pathlib import Path
from typing import Callable, ContextManager

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from workloads import WORKLOADS, Workload, median  # noqa: E402

from pytorch_mem_profiler import MemoryProfiler  # noqa: E402


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(work: Workload, device: torch.device, steps: int, per_step: Callable[[], None] | None) -> float:
    """Seconds per step over ``steps`` steps."""
    _sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        work.step()
        if per_step is not None:
            per_step()
    _sync(device)
    return (time.perf_counter() - start) / steps


def profiler_tool(print_period: int, **options) -> Callable[[Workload], ContextManager]:
    """The profiler as a benchmark tool: made before the timed steps, closed after."""

    @contextlib.contextmanager
    def tool(work: Workload):
        sink = open(os.devnull, "w")
        profiler = MemoryProfiler(work.model, print_period, stream=sink, **options)
        try:
            yield profiler.record_stats
        finally:
            profiler.close()
            sink.close()

    return tool


TOOLS: dict[str, Callable[[Workload], ContextManager]] = {
    "profiler, print_period=1": profiler_tool(1),
    "profiler, print_period=10": profiler_tool(10),
    "profiler by_layer, print_period=1": profiler_tool(1, by_layer=True),
    "profiler by_layer, print_period=10": profiler_tool(10, by_layer=True),
}


def measure(work: Workload, device: torch.device, tool, rounds: int, steps: int) -> tuple[float, float, float]:
    """(median ratio, median baseline s/step, median tool s/step)."""
    ratios, base_times, tool_times = [], [], []
    for _ in range(rounds):
        base = time_steps(work, device, steps, None)
        with tool(work) as per_step:
            time_steps(work, device, 2, per_step)  # the tool's own warm-up
            with_tool = time_steps(work, device, steps, per_step)
        ratios.append(with_tool / base)
        base_times.append(base)
        tool_times.append(with_tool)
    return median(ratios), median(base_times), median(tool_times)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="+", default=["gpt2", "tiny_mlp"], choices=sorted(WORKLOADS))
    parser.add_argument("--tools", nargs="+", default=list(TOOLS), choices=list(TOOLS))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--csv", default=None, help="also write the table as CSV here")
    args = parser.parse_args(argv)
    device = torch.device(args.device)

    rows = []
    for name in args.workloads:
        work = WORKLOADS[name](device)
        for _ in range(args.warmup):
            work.step()
        for tool_name in args.tools:
            ratio, base, with_tool = measure(work, device, TOOLS[tool_name], args.rounds, args.steps)
            rows.append((name, tool_name, ratio, base * 1e3, with_tool * 1e3))
            print(f"{name:10s} {tool_name:32s} {ratio:.4f}x  ({base * 1e3:.2f} -> {with_tool * 1e3:.2f} ms)", flush=True)
        del work
        if device.type == "cuda":
            torch.cuda.empty_cache()

    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"\nDevice: {gpu}; torch {torch.__version__}; {args.rounds} rounds x {args.steps} steps, median ratio\n")
    print("| Workload | Tool | Step time ratio | Step without (ms) | Step with (ms) |")
    print("| --- | --- | --- | --- | --- |")
    for name, tool_name, ratio, base, with_tool in rows:
        print(f"| {name} | {tool_name} | {ratio:.3f}x | {base:.2f} | {with_tool:.2f} |")
    if args.csv:
        with open(args.csv, "w", newline="") as handle:
            writer = csv.writer(handle)
            writer.writerow(["workload", "tool", "ratio", "step_ms_without", "step_ms_with", "device", "torch"])
            for row in rows:
                writer.writerow([*row, gpu, torch.__version__])


if __name__ == "__main__":
    main()
