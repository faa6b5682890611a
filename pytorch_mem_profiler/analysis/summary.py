"""What a run amounts to: per-epoch peaks and times, the largest layers, its settings.

Made from a :class:`~pytorch_mem_profiler.analysis.runs.Run` (figures in bytes); the
command line prints :func:`format_summary`, the HTML report shows the same
tables. Units are applied only when formatting.

Example::

    >>> format_amount(1_234_567, "MB", digits=3), format_amount(12_500, "MB", digits=3), format_amount(None, "MB", digits=3)
    ('1.23 MB', '0.0125 MB', 'n/a')
    >>> module_sizes({"fc.weight": 256, "fc.bias": 16, "head.weight": 64})
    {'fc': 272, 'head': 64}
"""

from __future__ import annotations

import datetime as _dt
import math
from typing import Callable, Mapping

import pandas as pd

from ..stats import ACTIVATIONS, INPUT, WEIGHT_COPIES
from ..units import UNITS, check_unit, format_amount, significant
from .runs import Run, module_of

__all__ = [
    "format_seconds",
    "module_sizes",
    "epoch_table",
    "largest_layers",
    "run_settings",
    "peak_memory",
    "time_per_iteration",
    "format_summary",
    "category_label",
    "iteration_and_time",
    "choose_unit",
]


def _missing(value: float | None) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def choose_unit(unit: str | None, default: str) -> str:
    """``unit``, or ``default`` (the run file's unit) when it is ``None``; ``ValueError`` if not a unit."""
    return check_unit(default if unit is None else unit)


def format_seconds(seconds: float | None) -> str:
    """A duration to three significant digits, in milliseconds below 10 s, else in seconds;
    ``None`` or NaN is ``n/a``."""
    if _missing(seconds):
        return "n/a"
    if seconds == 0:
        return "0 ms"
    if abs(seconds) >= 10:
        return f"{significant(seconds)} s"
    return f"{significant(seconds * 1e3)} ms"


#: How categories are named for people; the per-layer file's "activations" are feature maps.
_CATEGORY_LABELS = {ACTIVATIONS: "feature maps", WEIGHT_COPIES: "autocast weight copies"}

#: Per-layer file rows that are not layers: totals, and the model's inputs.
_NOT_LAYERS = {"category": ("total",), "module": (INPUT,)}


def category_label(category: str) -> str:
    """``"feature_maps"`` -> ``"feature maps"``; the per-layer file's ``"activations"`` too."""
    return _CATEGORY_LABELS.get(category, category.replace("_", " "))


def module_sizes(by_parameter: Mapping[str, float]) -> dict[str, float]:
    """Bytes per module from bytes per parameter (``"fc.weight"`` counts for ``"fc"``)."""
    out: dict[str, float] = {}
    for name, nbytes in by_parameter.items():
        module = module_of(name)
        out[module] = out.get(module, 0) + nbytes
    return out


def peak_memory(run: Run) -> float | None:
    """The run's peak: the largest ``peak_allocated`` of its records, in bytes.

    ``peak_allocated`` is the most allocated since the profiler started, so its
    largest value covers every iteration, reported or not. ``None`` where the
    device keeps no peak (MPS).
    """
    value = run.records["peak_allocated"].max()
    return None if _missing(value) else float(value)


def time_per_iteration(run: Run) -> float | None:
    """The median of the records' ``iteration_time_s``, in seconds.

    The median, so that the first iteration's warm-up (kernel selection, the
    allocator growing its cache) does not count.
    """
    value = run.records["iteration_time_s"].median()
    return None if _missing(value) else float(value)


#: The columns of the per-epoch table, in the summary and the HTML report.
EPOCH_HEADER = ("Epoch", "Records", "Peak allocated", "Peak cached", "Slowest iteration", "Fastest iteration")


def epoch_rows(table: pd.DataFrame, size: Callable[[float], str]) -> list[tuple[str, ...]]:
    """The cells of :func:`epoch_table`'s rows under :data:`EPOCH_HEADER`, sizes through ``size``."""
    return [
        (
            str(row.epoch),
            str(row.records),
            size(row.peak_allocated),
            size(row.peak_cached),
            iteration_and_time(row.slowest_iteration, row.slowest_s),
            iteration_and_time(row.fastest_iteration, row.fastest_s),
        )
        for row in table.itertuples()
    ]


def epoch_table(run: Run) -> pd.DataFrame:
    """One row per epoch: records, peaks (bytes), the slowest and fastest iteration.

    Columns: ``epoch``, ``records`` (reported iterations), ``peak_allocated``
    (the highest ``iteration_peak_allocated`` among them), ``peak_cached``
    (the most reserved since the run started, as of the epoch's last record),
    ``slowest_iteration``, ``slowest_s``, ``fastest_iteration``, ``fastest_s``.
    """
    rows = []
    for epoch, group in run.records.groupby("epoch", sort=True):
        times = group["iteration_time_s"].dropna()
        slow = group.loc[times.idxmax()] if len(times) else None
        fast = group.loc[times.idxmin()] if len(times) else None
        rows.append(
            {
                "epoch": int(epoch),
                "records": len(group),
                "peak_allocated": group["iteration_peak_allocated"].max(),
                "peak_cached": group["peak_cached"].max(),
                "slowest_iteration": None if slow is None else int(slow["iteration"]),
                "slowest_s": None if slow is None else float(slow["iteration_time_s"]),
                "fastest_iteration": None if fast is None else int(fast["iteration"]),
                "fastest_s": None if fast is None else float(fast["iteration_time_s"]),
            }
        )
    return pd.DataFrame(rows)


def largest_layers(run: Run, top: int = 5) -> dict[str, list[tuple[str, float]]]:
    """The ``top`` largest layers (modules) by category, in bytes, largest first.

    ``weights`` and ``gradients`` come from the run's parameter columns, summed
    per module; a module's size is its largest over the records. Every category
    of the per-layer file (``activations``: feature maps; ``weight copies``)
    follows when the run has one, without its totals and the model's inputs.
    """
    out: dict[str, list[tuple[str, float]]] = {}
    for category, frame in (("weights", run.weights), ("gradients", run.gradients)):
        if frame.shape[1] == 0:
            continue
        by_module = frame.T.groupby(lambda name: module_of(name), sort=False).sum().T
        out[category] = _top(by_module.max(), top)
    layers = run.layers
    if layers is not None:
        layers = layers[
            ~layers["category"].isin(_NOT_LAYERS["category"])
            & ~layers["module"].isin(_NOT_LAYERS["module"])
        ]
    if layers is not None and len(layers):
        per_iteration = layers.groupby(["category", "epoch", "iteration", "module"], sort=False)[
            "bytes"
        ].sum()
        largest = per_iteration.groupby(level=["category", "module"], sort=False).max()
        for category in layers["category"].unique():
            out[str(category)] = _top(largest.loc[category], top)
    return out


def _top(sizes: pd.Series, top: int) -> list[tuple[str, float]]:
    sizes = sizes.dropna()
    sizes = sizes[sizes > 0].sort_values(ascending=False, kind="stable")
    return [(str(name), float(nbytes)) for name, nbytes in sizes.head(top).items()]


def run_settings(run: Run, unit: str | None = None) -> list[tuple[str, str]]:
    """The run's settings and totals as (label, text) pairs, for a table."""
    unit = choose_unit(unit, run.unit)
    rec = run.records
    last = rec.iloc[-1]
    written = _dt.datetime.fromtimestamp(run.path.stat().st_mtime).strftime("%Y-%m-%d %H:%M:%S")

    def count(column: str) -> str:
        value = last[column]
        return "n/a" if _missing(value) else f"{int(value)}"

    return [
        ("File", str(run.path)),
        ("Last written", written),
        ("Device", run.device),
        ("Unit in the file", f"{run.unit} ({UNITS[run.unit]:,} bytes)"),
        ("Epochs", str(len(run.epochs))),
        ("Reported iterations", str(len(rec))),
        ("Reported every", f"{int(rec['iteration'].min())} iteration(s)"),
        ("Iterations run (by the last record)", str(int(rec["step"].max()))),
        ("Parameters", str(len(run.parameters))),
        ("Weights", format_amount(last["weights"], unit, digits=3)),
        ("Buffers", format_amount(last["buffers"], unit, digits=3)),
        ("Optimizer state (last record)", format_amount(last["optimizer_state"], unit, digits=3)),
        (
            "Forward passes / backward passes / optimizer steps per iteration",
            f"{count('forward_passes')} / {count('backward_passes')} / {count('optimizer_steps')}",
        ),
        ("Peak allocated (max of peak_allocated)", format_amount(peak_memory(run), unit, digits=3)),
        ("Peak reserved (max of peak_cached)", format_amount(rec["peak_cached"].max(), unit, digits=3)),
        ("Time per iteration (median)", format_seconds(time_per_iteration(run))),
        ("Per-layer file", "none" if run.layers is None else f"{len(run.layers)} rows"),
    ]


def format_summary(run: Run, unit: str | None = None, top: int = 5) -> str:
    """The text the ``summary`` command prints.

    Args:
        run: the run.
        unit: the unit of the figures; default the file's.
        top: how many layers to list per category.
    """
    unit = choose_unit(unit, run.unit)
    lines = [f"Run {run.path} on {run.device} ({unit} = {UNITS[unit]:,} bytes)", ""]
    lines.append(f"Peak allocated: {format_amount(peak_memory(run), unit, digits=3)} (max of peak_allocated)")
    lines.append(
        f"Peak reserved:  {format_amount(run.records['peak_cached'].max(), unit, digits=3)} (max of peak_cached)"
    )
    lines.append(f"Time per iteration: {format_seconds(time_per_iteration(run))} (median)")
    lines.append("")

    body = epoch_rows(epoch_table(run), lambda n: format_amount(n, unit, digits=3))
    lines += _columns(EPOCH_HEADER, body)
    lines.append(
        "(peak allocated: highest iteration peak among the epoch's records; "
        "peak cached: most reserved since the start, by the epoch's end)"
    )

    for category, layers in largest_layers(run, top).items():
        lines += ["", f"Largest layers by {category_label(category)}:"]
        if not layers:
            lines.append("  (none)")
        width = max((len(name) for name, _ in layers), default=0)
        lines += [f"  {name:<{width}}  {format_amount(nbytes, unit, digits=3):>12}" for name, nbytes in layers]
    return "\n".join(lines)


def iteration_and_time(iteration: float | None, seconds: float | None) -> str:
    """``"12 (3.45 ms)"``: an iteration and its time; ``n/a`` when either is unknown."""
    if _missing(iteration) or _missing(seconds):
        return "n/a"
    return f"{int(iteration)} ({format_seconds(seconds)})"


def _columns(header: tuple[str, ...], body: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(cell) for cell in column) for column in zip(header, *body)]
    fmt = lambda cells: "  ".join(  # noqa: E731
        cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(cells, widths))
    ).rstrip()
    return [fmt(header), fmt(tuple("-" * w for w in widths))] + [fmt(row) for row in body]
