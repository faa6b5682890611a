"""Compare runs: peak memory and time per iteration, and the change against the first.

The question after "where does my memory go" is "how much did checkpointing or
mixed precision save, and what did it cost in time". :func:`compare_runs`
answers it from runs' CSV files; :func:`format_markdown` makes the table

``| Configuration | Peak memory | Time per iteration | vs first |``

and :func:`comparison_frame` the same figures for a CSV file.

- Peak memory: the largest ``peak_allocated`` of the run (the most bytes
  allocated to tensors since the profiler started, so every iteration counts,
  reported or not). ``peak_cached`` (the allocator's reservation) is in the
  CSV output too.
- Time per iteration: the median of ``iteration_time_s``, so the first
  iteration's warm-up does not count.

Example::

    >>> rows = [
    ...     Comparison("baseline", 2e9, 4e9, 0.100),
    ...     Comparison("checkpointing", 1e9, 2e9, 0.125),
    ... ]
    >>> print(format_markdown(rows, "GB"))
    | Configuration | Peak memory | Time per iteration | vs first |
    | --- | ---: | ---: | --- |
    | baseline | 2.00 GB | 100 ms | (reference) |
    | checkpointing | 1.00 GB | 125 ms | -50.0% memory, +25.0% time |
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Sequence

import pandas as pd

from .runs import Run
from ..units import UNITS, check_unit, format_amount
from .summary import format_seconds, peak_memory, time_per_iteration

__all__ = [
    "Comparison",
    "compare_runs",
    "format_markdown",
    "comparison_frame",
    "write_comparison_csv",
]


@dataclass(frozen=True)
class Comparison:
    """One configuration's figures: bytes and seconds (``None`` when unknown).

    Attributes:
        name: the configuration's name.
        peak_allocated: the run's largest ``peak_allocated``, in bytes.
        peak_cached: the run's largest ``peak_cached`` (reserved), in bytes.
        time_per_iteration_s: the median iteration time, in seconds.
        device: the device the run was profiled on.
        path: the run's file, as text.
    """

    name: str
    peak_allocated: float | None
    peak_cached: float | None
    time_per_iteration_s: float | None
    device: str = ""
    path: str = ""


def compare_runs(runs: Sequence[Run], names: Sequence[str] | None = None) -> list[Comparison]:
    """One :class:`Comparison` per run, in the order given (the first is the reference).

    Args:
        runs: the runs to compare.
        names: a name per run; default the runs' file names.

    Raises:
        ValueError: ``names`` does not have one name per run.
    """
    if names is not None and len(names) != len(runs):
        raise ValueError(
            f"names must give one name per run ({len(runs)}), got {len(names)}: {list(names)!r}"
        )
    out = []
    for i, run in enumerate(runs):
        cached = run.records["peak_cached"].max()
        out.append(
            Comparison(
                name=names[i] if names is not None else run.name,
                peak_allocated=peak_memory(run),
                peak_cached=None if pd.isna(cached) else float(cached),
                time_per_iteration_s=time_per_iteration(run),
                device=run.device,
                path=str(run.path),
            )
        )
    return out


def _change(value: float | None, reference: float | None) -> float | None:
    """Percentage change of ``value`` against ``reference``; ``None`` when either is unknown."""
    if value is None or reference is None or reference == 0:
        return None
    return (value - reference) / reference * 100.0


def _versus(row: Comparison, first: Comparison) -> str:
    memory = _change(row.peak_allocated, first.peak_allocated)
    time = _change(row.time_per_iteration_s, first.time_per_iteration_s)
    text = lambda pct: "n/a" if pct is None else f"{pct:+.1f}%"  # noqa: E731
    return f"{text(memory)} memory, {text(time)} time"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def format_markdown(rows: Sequence[Comparison], unit: str = "MB") -> str:
    """The comparison as a Markdown table, figures in ``unit``, changes against the first row."""
    check_unit(unit)
    lines = [
        "| Configuration | Peak memory | Time per iteration | vs first |",
        "| --- | ---: | ---: | --- |",
    ]
    for i, row in enumerate(rows):
        versus = "(reference)" if i == 0 else _versus(row, rows[0])
        lines.append(
            f"| {_cell(row.name)} | {format_amount(row.peak_allocated, unit, digits=3)} | "
            f"{format_seconds(row.time_per_iteration_s)} | {versus} |"
        )
    return "\n".join(lines)


def comparison_frame(rows: Sequence[Comparison], unit: str = "MB") -> pd.DataFrame:
    """The comparison as a table with full precision: memory in ``unit``, time in seconds,
    changes in percent against the first row (empty for the first)."""
    check_unit(unit)
    div = UNITS[unit]
    scale = lambda n: None if n is None else n / div  # noqa: E731
    first = rows[0] if rows else None
    return pd.DataFrame(
        [
            {
                "configuration": row.name,
                "peak_memory": scale(row.peak_allocated),
                "peak_cached": scale(row.peak_cached),
                "unit": unit,
                "time_per_iteration_s": row.time_per_iteration_s,
                "peak_memory_change_pct": None
                if i == 0
                else _change(row.peak_allocated, first.peak_allocated),
                "time_change_pct": None
                if i == 0
                else _change(row.time_per_iteration_s, first.time_per_iteration_s),
                "device": row.device,
                "file": row.path,
            }
            for i, row in enumerate(rows)
        ],
        columns=[
            "configuration",
            "peak_memory",
            "peak_cached",
            "unit",
            "time_per_iteration_s",
            "peak_memory_change_pct",
            "time_change_pct",
            "device",
            "file",
        ],
    )


def write_comparison_csv(
    rows: Sequence[Comparison], path: str | os.PathLike, unit: str = "MB"
) -> None:
    """Write :func:`comparison_frame` to ``path``."""
    comparison_frame(rows, unit).to_csv(path, index=False)
