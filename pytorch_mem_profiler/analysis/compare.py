"""Compare runs: peak memory and time per iteration, what each category holds, and the change
against the first.

The question after "where does my memory go" is "how much did checkpointing or
mixed precision save, and what did it cost in time". :func:`compare_runs`
answers it from runs' CSV files; :func:`format_markdown` makes the table

``| Configuration | Peak memory | Time per iteration | vs first |``

:func:`format_categories_markdown` a second one with each category per run and
its change against the first, :func:`comparison_notes` the warnings that the
runs differ in model or device, and :func:`comparison_frame` all the figures
for a CSV file.

- Peak memory: the largest ``peak_allocated`` of the run (the most bytes
  allocated to tensors since the profiler started, so every iteration counts,
  reported or not). ``peak_cached`` (what the allocator reserved) is in the
  CSV output too.
- Time per iteration: the median of ``iteration_time_s`` over the run's
  records (so the first iteration's warm-up does not count), with its
  interquartile range (IQR) and how many iterations were timed. A time change
  is given in percent only where the two runs' IQRs do not overlap, their
  medians differ by :data:`NOISE_FLOOR` (5%) or more, and each timed at least
  :data:`MIN_TIMED_ITERATIONS`; else "time within noise" or
  "too few timed iterations" (two runs of one configuration differ by a few
  percent either way: a signed figure there would mislead).
- Categories: weights, weight gradients, optimizer state and feature maps, each
  at its largest over the run's records; where the files record it, what was
  alive at the run's highest iteration peak, by category (``peak_<category>``).
- Names: given, or by default the runs' folders where those tell the runs
  apart and their file names are the profiler's own (dates), else the file
  names (:func:`default_names`).

Example::

    >>> rows = [
    ...     Comparison("baseline", 2e9, 4e9, 0.100, categories={"feature_maps": 1.5e9},
    ...                time_quartiles_s=(0.098, 0.103), timed_iterations=20),
    ...     Comparison("checkpointing", 1e9, 2e9, 0.125, categories={"feature_maps": 0.4e9},
    ...                time_quartiles_s=(0.122, 0.127), timed_iterations=20),
    ... ]
    >>> print(format_markdown(rows, "GB"))
    | Configuration | Peak memory | Time per iteration | vs first |
    | --- | ---: | ---: | --- |
    | baseline | 2.00 GB | 100 ms (IQR 98.0-103 ms, 20 it.) | (reference) |
    | checkpointing | 1.00 GB | 125 ms (IQR 122-127 ms, 20 it.) | -50.0% memory, +25.0% time |
    >>> print(format_categories_markdown(rows, "GB"))
    | Category | baseline | checkpointing |
    | --- | ---: | ---: |
    | feature maps | 1.50 GB | 0.400 GB (-1.10 GB, -73.3%) |
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

import pandas as pd

from ..stats import CATEGORIES as RECORD_CATEGORIES
from ..stats import PEAK_CATEGORIES
from ..units import UNITS, check_unit, format_amount
from .peaks import peak_breakdown, peak_label
from .runs import PEAK_COLUMNS, Run
from .summary import format_seconds, peak_memory, time_per_iteration

__all__ = [
    "Comparison",
    "compare_runs",
    "default_names",
    "format_markdown",
    "format_categories_markdown",
    "comparison_notes",
    "comparison_frame",
    "write_comparison_csv",
    "CATEGORY_LABELS",
    "MIN_TIMED_ITERATIONS",
    "time_versus",
]

#: The fewest timed iterations (records with ``iteration_time_s``) a run needs for its time to be
#: compared: fewer give a median that moves by more than most changes measured.
MIN_TIMED_ITERATIONS = 10

#: The categories compared, by key, with their labels, in table order. The record's
#: categories are each at their largest over the run; ``peak_<category>`` is what was
#: alive at the run's highest iteration peak.
CATEGORY_LABELS: Mapping[str, str] = {
    **{name: RECORD_CATEGORIES[name] for name in ("weights", "gradients", "optimizer_state", "feature_maps")},
    **{PEAK_COLUMNS[c]: f"at the peak: {peak_label(c)}" for c in PEAK_CATEGORIES},
}

#: What the profiler names its files: ``memory_stats_<date>-<time>...``, a date, not a name.
_GENERATED_NAME = re.compile(r"^memory_stats_\d{8}-\d{6}")


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
        categories: bytes by :data:`CATEGORY_LABELS` key (``None`` where unknown;
            the peak's categories only where the file records them).
        parameters: the model's parameter names, in the file's order.
        device_total: bytes of memory the device has, where the file says.
        time_quartiles_s: the first and third quartiles of the iteration times, in seconds
            (their distance is the interquartile range, the spread shown; ``None``: unknown).
        timed_iterations: how many records had an iteration time.
    """

    name: str
    peak_allocated: float | None
    peak_cached: float | None
    time_per_iteration_s: float | None
    device: str = ""
    path: str = ""
    categories: Mapping[str, float | None] = field(default_factory=dict)
    parameters: tuple[str, ...] = ()
    device_total: float | None = None
    time_quartiles_s: tuple[float, float] | None = None
    timed_iterations: int = 0


def _time_spread(run: Run) -> tuple[tuple[float, float] | None, int]:
    """The iteration times' first and third quartiles, and how many records were timed."""
    times = run.records["iteration_time_s"].dropna()
    if times.empty:
        return None, 0
    return (float(times.quantile(0.25)), float(times.quantile(0.75))), int(len(times))


def default_names(runs: Sequence[Run]) -> tuple[list[str], str]:
    """Names for runs nobody named, and where they come from (``"file names"`` or ``"folders"``).

    A file the user named (``baseline.csv``) is named by its stem. The profiler's
    own names are dates (``memory_stats_20240601-101500``), so where every run has
    one, the runs are named by the nearest folder that tells them apart
    (``runs/baseline/memory_stats_...csv`` and ``runs/ckpt/memory_stats_...csv``
    are ``baseline`` and ``ckpt``); where no folder does, by file name.
    A name that comes twice gets `` (2)``, `` (3)``... after it.

    Example::

        >>> from types import SimpleNamespace as Fake
        >>> fake = lambda path: Fake(path=Path(path), name=Path(path).stem)
        >>> default_names([fake("runs/base/memory_stats_20240601-101500.csv"),
        ...                fake("runs/ckpt/memory_stats_20240601-111500.csv")])
        (['base', 'ckpt'], 'folders')
        >>> default_names([fake("base.csv"), fake("ckpt.csv")])
        (['base', 'ckpt'], 'file names')
    """
    stems = [run.name for run in runs]
    names, source = stems, "file names"
    if stems and all(_GENERATED_NAME.match(stem) for stem in stems):
        folders = [Path(os.path.abspath(run.path)).parent.parts[::-1] for run in runs]
        for depth in range(min(len(f) for f in folders)):
            level = [f[depth] for f in folders]
            if len(set(level)) == len(level):
                names, source = level, "folders"
                break
    return _unique(names), source


def _unique(names: Sequence[str]) -> list[str]:
    seen: dict[str, int] = {}
    out = []
    for name in names:
        seen[name] = seen.get(name, 0) + 1
        out.append(name if seen[name] == 1 else f"{name} ({seen[name]})")
    return out


def _largest(run: Run, column: str) -> float | None:
    value = run.records[column].max()
    return None if pd.isna(value) else float(value)


def _categories(run: Run) -> dict[str, float | None]:
    out: dict[str, float | None] = {
        key: _largest(run, key) for key in ("weights", "gradients", "optimizer_state", "feature_maps")
    }
    breakdown = peak_breakdown(run)
    if breakdown is not None:
        out.update({PEAK_COLUMNS[c]: breakdown.parts[c] for c in PEAK_CATEGORIES})
    return out


def compare_runs(runs: Sequence[Run], names: Sequence[str] | None = None) -> list[Comparison]:
    """One :class:`Comparison` per run, in the order given (the first is the reference).

    Args:
        runs: the runs to compare.
        names: a name per run; default :func:`default_names`.

    Raises:
        ValueError: ``names`` does not have one name per run.
    """
    if names is not None and len(names) != len(runs):
        raise ValueError(
            f"names must give one name per run ({len(runs)}), got {len(names)}: {list(names)!r}"
        )
    if names is None:
        names, _ = default_names(runs)
    out = []
    for name, run in zip(names, runs):
        cached = run.records["peak_cached"].max()
        quartiles, timed = _time_spread(run)
        out.append(
            Comparison(
                name=name,
                peak_allocated=peak_memory(run),
                peak_cached=None if pd.isna(cached) else float(cached),
                time_per_iteration_s=time_per_iteration(run),
                device=run.device,
                path=str(run.path),
                categories=_categories(run),
                parameters=tuple(run.parameters),
                device_total=run.device_total,
                time_quartiles_s=quartiles,
                timed_iterations=timed,
            )
        )
    return out


def _change(value: float | None, reference: float | None) -> float | None:
    """Percentage change of ``value`` against ``reference``; ``None`` when either is unknown."""
    if value is None or reference is None or reference == 0:
        return None
    return (value - reference) / reference * 100.0


#: Medians of iteration time closer than this (relative) are within noise even where the two runs'
#: interquartile ranges do not overlap: runs of one configuration one after the other differ by a
#: few percent (warm caches, clocks, a shared machine), and a tight spread does not make that a change.
NOISE_FLOOR = 0.05


def _within_noise(row: Comparison, first: Comparison) -> bool | None:
    """Whether the two runs' iteration times are within noise (``None``: unknown): their
    interquartile ranges overlap, or their medians differ by less than :data:`NOISE_FLOOR`."""
    a, b = row.time_quartiles_s, first.time_quartiles_s
    if a is None or b is None:
        return None
    if a[0] <= b[1] and b[0] <= a[1]:
        return True
    medians = row.time_per_iteration_s, first.time_per_iteration_s
    if None in medians or not medians[1]:
        return False
    return abs(medians[0] - medians[1]) < NOISE_FLOOR * medians[1]


def time_versus(row: Comparison, first: Comparison) -> str:
    """The time change of ``row`` against ``first``, as the table words it.

    ``"+25.0% time"`` where each run timed :data:`MIN_TIMED_ITERATIONS` or more and their
    interquartile ranges do not overlap; ``"time within noise"`` where they overlap; ``"time:
    too few timed iterations (4; 10 needed)"``; ``"+25.0% time (spread unknown)"`` for rows
    made without the spread; ``"n/a time"`` without times.

    Example::

        >>> a = Comparison("a", None, None, 0.100, time_quartiles_s=(0.095, 0.104), timed_iterations=30)
        >>> b = Comparison("b", None, None, 0.102, time_quartiles_s=(0.097, 0.106), timed_iterations=30)
        >>> time_versus(b, a)
        'time within noise (medians 102 ms and 100 ms, IQRs overlap)'
    """
    pct = _change(row.time_per_iteration_s, first.time_per_iteration_s)
    if pct is None:
        return "n/a time"
    if row.time_quartiles_s is None or first.time_quartiles_s is None:
        return f"{pct:+.1f}% time (spread unknown)"
    fewest = min(row.timed_iterations, first.timed_iterations)
    if fewest < MIN_TIMED_ITERATIONS:
        return f"time: too few timed iterations ({fewest}; {MIN_TIMED_ITERATIONS} needed)"
    if _within_noise(row, first):
        a, b = row.time_quartiles_s, first.time_quartiles_s
        why = "IQRs overlap" if a[0] <= b[1] and b[0] <= a[1] else f"medians within {NOISE_FLOOR:.0%}"
        return (
            f"time within noise (medians {format_seconds(row.time_per_iteration_s)} and "
            f"{format_seconds(first.time_per_iteration_s)}, {why})"
        )
    return f"{pct:+.1f}% time"


def _versus(row: Comparison, first: Comparison) -> str:
    memory = _change(row.peak_allocated, first.peak_allocated)
    memory_text = "n/a" if memory is None else f"{memory:+.1f}%"
    return f"{memory_text} memory, {time_versus(row, first)}"


def _time_cell(row: Comparison) -> str:
    """``"137 ms (IQR 130-141 ms, 20 it.)"``: the median, its interquartile range, the iterations timed."""
    median = format_seconds(row.time_per_iteration_s)
    if row.time_quartiles_s is None or row.time_per_iteration_s is None:
        return median
    low, high = row.time_quartiles_s
    spread = f"{format_seconds(low).removesuffix(' ms').removesuffix(' s')}-{format_seconds(high)}"
    if (low < 10) != (high < 10):  # one in ms, one in s: both with their unit
        spread = f"{format_seconds(low)}-{format_seconds(high)}"
    return f"{median} (IQR {spread}, {row.timed_iterations} it.)"


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
            f"{_time_cell(row)} | {versus} |"
        )
    return "\n".join(lines)


def _compared_categories(rows: Sequence[Comparison]) -> list[str]:
    """The :data:`CATEGORY_LABELS` keys that at least one row has, in table order."""
    return [key for key in CATEGORY_LABELS if any(row.categories.get(key) is not None for row in rows)]


def _delta(value: float | None, reference: float | None, unit: str) -> str:
    """``"3.10 MB (-9.20 MB, -74.8%)"``: the value, then its change against the reference."""
    text = format_amount(value, unit, digits=3)
    if value is None or reference is None:
        return text
    if value == reference:
        return f"{text} (same)"
    sign = "+" if value > reference else "-"
    change = f"{sign}{format_amount(abs(value - reference), unit, digits=3)}"
    pct = _change(value, reference)
    return f"{text} ({change}, {'n/a' if pct is None else f'{pct:+.1f}%'})"


def format_categories_markdown(rows: Sequence[Comparison], unit: str = "MB") -> str:
    """Each category per run as a Markdown table (a column per run), the change against the first.

    Categories no run has are left out; a run without one shows ``n/a``. Empty
    when no run has any.
    """
    check_unit(unit)
    keys = _compared_categories(rows)
    if not rows or not keys:
        return ""
    lines = [
        "| Category | " + " | ".join(_cell(row.name) for row in rows) + " |",
        "| --- |" + " ---: |" * len(rows),
    ]
    first = rows[0]
    for key in keys:
        reference = first.categories.get(key)
        cells = [format_amount(reference, unit, digits=3)] + [
            _delta(row.categories.get(key), reference, unit) for row in rows[1:]
        ]
        lines.append(f"| {_cell(CATEGORY_LABELS[key])} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _examples(names: Sequence[str], most: int = 2) -> str:
    shown = ", ".join(names[:most])
    return shown + (", ..." if len(names) > most else "")


def _device_kind(device: str) -> str:
    return device.partition(":")[0]


def comparison_notes(rows: Sequence[Comparison], unit: str = "MB") -> list[str]:
    """Why the comparison may mislead: runs of different models (different parameter
    names) or on different devices (kind, or memory size where the files say), one line each.

    Example::

        >>> a = Comparison("mlp", 1e6, None, 0.1, "cuda:0", parameters=("fc.weight", "fc.bias"))
        >>> b = Comparison("gpt", 9e6, None, 0.2, "cpu", parameters=("h.0.attn.weight",))
        >>> for note in comparison_notes([a, b]):
        ...     print(note)
        runs differ in model: gpt has 1 parameter name mlp lacks (h.0.attn.weight) and lacks 2 of mlp's (fc.weight, fc.bias); comparing them is comparing different things
        runs differ in device: mlp on cuda:0, gpt on cpu; comparing them is comparing different things
    """
    if not rows:
        return []
    notes = []
    first = rows[0]
    models = []
    for row in rows[1:]:
        if not row.parameters or not first.parameters or set(row.parameters) == set(first.parameters):
            continue
        theirs = set(first.parameters)
        ours = set(row.parameters)
        extra = [p for p in row.parameters if p not in theirs]
        missing = [p for p in first.parameters if p not in ours]
        parts = []
        if extra:
            noun = "name" if len(extra) == 1 else "names"
            parts.append(f"has {len(extra)} parameter {noun} {first.name} lacks ({_examples(extra)})")
        if missing:
            parts.append(f"lacks {len(missing)} of {first.name}'s ({_examples(missing)})")
        models.append(f"{row.name} " + " and ".join(parts))
    if models:
        notes.append(f"runs differ in model: {'; '.join(models)}; comparing them is comparing different things")

    kinds = {_device_kind(row.device) for row in rows if row.device and row.device != "unknown"}
    totals = {row.device_total for row in rows if row.device_total is not None}
    if len(kinds) > 1 or len(totals) > 1:
        described = ", ".join(
            f"{row.name} on {row.device or 'unknown'}"
            + (f" ({format_amount(row.device_total, unit, digits=3)})" if row.device_total is not None else "")
            for row in rows
        )
        notes.append(f"runs differ in device: {described}; comparing them is comparing different things")
    return notes


def comparison_frame(rows: Sequence[Comparison], unit: str = "MB") -> pd.DataFrame:
    """The comparison as a table with full precision: memory in ``unit``, time in seconds,
    changes in percent against the first row (empty for the first).

    After the headline columns come ``device_total``, ``same_model_as_first`` (the
    same parameter names as the first run) and, per category any run has
    (:data:`CATEGORY_LABELS`), ``<category>`` and ``<category>_change_pct``; then
    ``time_q1_s``, ``time_q3_s`` (the iteration times' quartiles), ``timed_iterations``
    and ``time_within_noise`` (the interquartile ranges overlap the first run's).
    """
    check_unit(unit)
    div = UNITS[unit]
    scale = lambda n: None if n is None else n / div  # noqa: E731
    first = rows[0] if rows else None
    keys = _compared_categories(rows)
    columns = [
        "configuration",
        "peak_memory",
        "peak_cached",
        "unit",
        "time_per_iteration_s",
        "peak_memory_change_pct",
        "time_change_pct",
        "device",
        "file",
        "device_total",
        "same_model_as_first",
    ]
    for key in keys:
        columns += [key, f"{key}_change_pct"]
    columns += ["time_q1_s", "time_q3_s", "timed_iterations", "time_within_noise"]
    records = []
    for i, row in enumerate(rows):
        record = {
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
            "device_total": scale(row.device_total),
            "same_model_as_first": set(row.parameters) == set(first.parameters),
            "time_q1_s": row.time_quartiles_s[0] if row.time_quartiles_s else None,
            "time_q3_s": row.time_quartiles_s[1] if row.time_quartiles_s else None,
            "timed_iterations": row.timed_iterations,
            "time_within_noise": None if i == 0 else _within_noise(row, first),
        }
        for key in keys:
            value = row.categories.get(key)
            record[key] = scale(value)
            record[f"{key}_change_pct"] = (
                None if i == 0 else _change(value, first.categories.get(key))
            )
        records.append(record)
    return pd.DataFrame(records, columns=columns)


def write_comparison_csv(
    rows: Sequence[Comparison], path: str | os.PathLike, unit: str = "MB"
) -> None:
    """Write :func:`comparison_frame` to ``path``."""
    comparison_frame(rows, unit).to_csv(path, index=False)
