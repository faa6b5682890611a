"""What a run amounts to: per-epoch peaks and times, the largest layers, its settings.

Made from a :class:`~pytorch_mem_profiler.analysis.runs.Run` (figures in bytes); the
command line prints :func:`format_summary`, the HTML report shows the same
tables. Units are applied only when formatting.

Words are torch's: "allocated" is what tensors hold (``memory_allocated``),
"reserved" what the caching allocator holds (``memory_reserved``; the seed's
CSV columns call it ``peak_cached``/``current_cached``), and reserved minus
allocated is the cache's slack. Layers repeated N times (``blocks.0.attn`` ...
``blocks.11.attn``) are folded into one line (:func:`layer_groups`). Where the
file has them, the device's size gives the headroom (:func:`headroom`) and the
peak's breakdown names the largest category per epoch.

Example::

    >>> format_amount(1_234_567, "MB", digits=3), format_amount(12_500, "MB", digits=3), format_amount(None, "MB", digits=3)
    ('1.23 MB', '0.0125 MB', 'n/a')
    >>> module_sizes({"fc.weight": 256, "fc.bias": 16, "head.weight": 64})
    {'fc': 272, 'head': 64}
    >>> sizes = {f"blocks.{i}.attn": 3_000_000 for i in range(12)} | {"head": 5_000_000}
    >>> group_line(group_repeated(sizes)[0], sizes, lambda n: format_amount(n, "MB"))
    ('blocks.[0-11].attn', '12 x 3 MB', 36000000.0)
"""

from __future__ import annotations

import datetime as _dt
import math
from typing import Callable, Mapping

import pandas as pd

from ..grouping import LayerGroup, group_repeated
from ..stats import ACTIVATIONS, INPUT, PHASE_LABELS, WEIGHT_COPIES
from ..units import UNITS, check_unit, format_amount, significant
from .peaks import epoch_breakdowns, format_share, peak_breakdown, peak_label
from .runs import Run, module_of

__all__ = [
    "format_seconds",
    "module_sizes",
    "epoch_table",
    "largest_layers",
    "layer_groups",
    "group_line",
    "group_each",
    "headroom",
    "format_headroom",
    "epoch_header",
    "epoch_rows",
    "EPOCH_HEADER",
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


def headroom(run: Run) -> tuple[float, float] | None:
    """(the run's peak in bytes, the device's total bytes), or ``None`` where either is unknown.

    The peak is :func:`peak_memory` (the highest ``iteration_peak_allocated`` where the
    device keeps no running peak); the total is the file's ``device_total``.
    """
    total = run.device_total
    peak = peak_memory(run)
    if peak is None:
        value = run.records["iteration_peak_allocated"].max()
        peak = None if _missing(value) else float(value)
    if total is None or peak is None:
        return None
    return peak, total


def format_headroom(run: Run, unit: str) -> str | None:
    """``"peak 7.70 GB of 16.0 GB (48%)"``, with the most reserved where known; ``None``
    without the device's size."""
    known = headroom(run)
    if known is None:
        return None
    peak, total = known
    text = (
        f"peak {format_amount(peak, unit, digits=3)} of {format_amount(total, unit, digits=3)} "
        f"({format_share(peak / total)})"
    )
    reserved = run.records["peak_cached"].max()
    if not _missing(reserved):
        text += f"; reserved at most {format_amount(reserved, unit, digits=3)} ({format_share(reserved / total)})"
    return text


#: The columns of the per-epoch table that every run has, in the summary and the HTML report.
EPOCH_HEADER = (
    "Epoch",
    "Records",
    "Peak allocated",
    "Peak reserved",
    "Slowest iteration",
    "Fastest iteration",
)

#: Columns a run has when its file records them: (column of :func:`epoch_table`, header).
_OPTIONAL_EPOCH_COLUMNS = (
    ("device_share", "Peak of device"),
    ("largest_category", "Largest at the peak"),
)


def epoch_header(table: pd.DataFrame) -> tuple[str, ...]:
    """The header of :func:`epoch_rows`: :data:`EPOCH_HEADER`, then the device's share of the
    peak and the largest category at the peak where the table has them."""
    return EPOCH_HEADER + tuple(h for c, h in _OPTIONAL_EPOCH_COLUMNS if c in table)


def epoch_rows(table: pd.DataFrame, size: Callable[[float], str]) -> list[tuple[str, ...]]:
    """The cells of :func:`epoch_table`'s rows under :func:`epoch_header`, sizes through ``size``."""
    rows = []
    for row in table.itertuples():
        cells = [
            str(row.epoch),
            str(row.records),
            size(row.peak_allocated),
            size(row.peak_cached),
            iteration_and_time(row.slowest_iteration, row.slowest_s),
            iteration_and_time(row.fastest_iteration, row.fastest_s),
        ]
        if "device_share" in table:
            cells.append(format_share(row.device_share))
        if "largest_category" in table:
            cells.append(
                "n/a"
                if _missing(row.largest_category)
                else f"{peak_label(row.largest_category)} {format_share(row.largest_share)}"
            )
        rows.append(tuple(cells))
    return rows


def epoch_table(run: Run) -> pd.DataFrame:
    """One row per epoch: records, peaks (bytes), the slowest and fastest iteration.

    Columns: ``epoch``, ``records`` (reported iterations), ``peak_allocated``
    (the highest ``iteration_peak_allocated`` among them), ``peak_cached``
    (the most reserved since the run started, as of the epoch's last record),
    ``slowest_iteration``, ``slowest_s``, ``fastest_iteration``, ``fastest_s``.
    Where the file has the device's size: ``device_share`` (``peak_allocated``
    as a fraction of ``device_total``). Where it has the peak's breakdown: the
    largest category alive at the epoch's highest-peak record, ``largest_category``,
    its bytes ``largest_bytes`` and ``largest_share`` of that record's peak.
    """
    breakdowns = epoch_breakdowns(run) if run.has_peak_breakdown else None
    with_total = run.device_total is not None
    rows = []
    for epoch, group in run.records.groupby("epoch", sort=True):
        times = group["iteration_time_s"].dropna()
        slow = group.loc[times.idxmax()] if len(times) else None
        fast = group.loc[times.idxmin()] if len(times) else None
        peak = group["iteration_peak_allocated"].max()
        row = {
            "epoch": int(epoch),
            "records": len(group),
            "peak_allocated": peak,
            "peak_cached": group["peak_cached"].max(),
            "slowest_iteration": None if slow is None else int(slow["iteration"]),
            "slowest_s": None if slow is None else float(slow["iteration_time_s"]),
            "fastest_iteration": None if fast is None else int(fast["iteration"]),
            "fastest_s": None if fast is None else float(fast["iteration_time_s"]),
        }
        if with_total:
            totals = group["device_total"].dropna()
            totals = totals[totals > 0]
            row["device_share"] = (
                peak / totals.iloc[-1] if len(totals) and not _missing(peak) else None
            )
        if breakdowns is not None:
            breakdown = breakdowns.get(int(epoch))
            largest = None if breakdown is None else breakdown.largest
            row["largest_category"] = largest
            row["largest_bytes"] = None if breakdown is None else breakdown.parts[largest]
            row["largest_share"] = None if breakdown is None else breakdown.share(largest)
        rows.append(row)
    return pd.DataFrame(rows)


def largest_layers(run: Run, top: int | None = 5) -> dict[str, list[tuple[str, float]]]:
    """The ``top`` largest layers (modules) by category, in bytes, largest first (``None``: all).

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


def _top(sizes: pd.Series, top: int | None) -> list[tuple[str, float]]:
    sizes = sizes.dropna()
    sizes = sizes[sizes > 0].sort_values(ascending=False, kind="stable")
    if top is not None:
        sizes = sizes.head(top)
    return [(str(name), float(nbytes)) for name, nbytes in sizes.items()]


def layer_groups(run: Run, top: int | None = 5) -> dict[str, list[LayerGroup]]:
    """:func:`largest_layers` with repeated layers folded, the ``top`` largest groups by category.

    Layers whose names differ only in numeric parts (``blocks.0.attn`` ...
    ``blocks.11.attn``) become one :class:`~pytorch_mem_profiler.grouping.LayerGroup`
    whose total is the sum of its members, each member at its largest over the
    run; groups are ranked by that total, so twelve blocks of 3 MB rank above one
    head of 10 MB. The ungrouped names stay in the CSV files.
    """
    out = {}
    for category, layers in largest_layers(run, top=None).items():
        groups = group_repeated([(name, int(nbytes)) for name, nbytes in layers])
        out[category] = groups if top is None else groups[:top]
    return out


def group_line(
    group: LayerGroup, sizes: Mapping[str, float], size: Callable[[float], str]
) -> tuple[str, str, float]:
    """(name, count and size per layer, total bytes) of a group, for a table row.

    The middle cell is ``"12 x 3.00 MB"`` for twelve equal layers, ``"12 x 2.00 to
    3.00 MB"`` (smallest to largest) for unequal ones, and empty for a single layer.
    """
    if group.count == 1:
        return group.name, "", float(group.total)
    return group.name, f"{group.count} x {group_each(group, sizes, size)}", float(group.total)


def group_each(group: LayerGroup, sizes: Mapping[str, float], size: Callable[[float], str]) -> str:
    """The size of each layer of a group: ``"3.00 MB"``, or ``"2.00 to 3.00 MB"`` when they differ."""
    if group.per_member is not None:
        return size(group.per_member)
    members = [sizes[name] for name in group.members]
    low, high = size(min(members)), size(max(members))
    unit = low.rpartition(" ")[2]
    if high.endswith(f" {unit}"):
        low = low.rpartition(" ")[0]  # "2.00 to 3.00 MB", not "2.00 MB to 3.00 MB"
    return f"{low} to {high}"


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
        *(
            [("Device memory (device_total)", format_amount(run.device_total, unit, digits=3))]
            if run.device_total is not None
            else []
        ),
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
        (
            "Cache slack (reserved - allocated, last record)",
            format_amount(last["current_cached"] - last["allocated"], unit, digits=3),
        ),
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
    room = format_headroom(run, unit)
    if room is not None:
        lines.append(f"Headroom: {room}")
    lines.append(f"Time per iteration: {format_seconds(time_per_iteration(run))} (median)")
    lines.append("")

    size = lambda n: format_amount(n, unit, digits=3)  # noqa: E731
    table = epoch_table(run)
    header = epoch_header(table)
    text_columns = {0} | {i for i, h in enumerate(header) if h == "Largest at the peak"}
    lines += _columns(header, epoch_rows(table, size), left=text_columns)
    notes = [
        "peak allocated: highest iteration peak among the epoch's records",
        "peak reserved: most reserved since the start (peak_cached), by the epoch's end",
    ]
    if "device_share" in table:
        notes.append("peak of device: peak allocated / device_total")
    if "largest_category" in table:
        notes.append("largest at the peak: at the epoch's highest-peak record, share of its peak")
    lines += [("(" if i == 0 else " ") + note + (")" if i == len(notes) - 1 else ";") for i, note in enumerate(notes)]

    lines += _breakdown_lines(run, size)

    sizes = {category: dict(layers) for category, layers in largest_layers(run, top=None).items()}
    for category, groups in layer_groups(run, top).items():
        lines += ["", f"Largest layers by {category_label(category)}:"]
        if not groups:
            lines.append("  (none)")
        cells = [group_line(g, sizes[category], size) for g in groups]
        name_width = max((len(name) for name, _, _ in cells), default=0)
        detail_width = max((len(detail) for _, detail, _ in cells), default=0)
        amount_width = max((len(size(total)) for _, _, total in cells), default=0)
        for name, detail, total in cells:
            if detail_width == 0:
                lines.append(f"  {name:<{name_width}}  {size(total):>{amount_width}}")
            else:
                middle = f"{detail} =" if detail else ""
                lines.append(
                    f"  {name:<{name_width}}  {middle:>{detail_width + 2}}  {size(total):>{amount_width}}"
                )
    return "\n".join(lines)


def _breakdown_lines(run: Run, size: Callable[[float], str]) -> list[str]:
    """The run's highest-peak record's breakdown, largest first; nothing without one."""
    breakdown = peak_breakdown(run)
    if breakdown is None:
        return []
    where = f"epoch {breakdown.epoch}, iteration {breakdown.iteration}"
    if breakdown.phase is not None:
        where += f", during {PHASE_LABELS.get(breakdown.phase, breakdown.phase)}"
    cells = [
        (peak_label(category), size(nbytes), format_share(breakdown.share(category)))
        for category, nbytes in breakdown.ranked()
    ]
    width = max((len(label) for label, _, _ in cells), default=0)
    amount_width = max((len(amount) for _, amount, _ in cells), default=0)
    return ["", f"At the run's peak ({where}): {size(breakdown.peak)}"] + [
        f"  {label:<{width}}  {amount:>{amount_width}}  {share:>4}" for label, amount, share in cells
    ]


def iteration_and_time(iteration: float | None, seconds: float | None) -> str:
    """``"12 (3.45 ms)"``: an iteration and its time; ``n/a`` when either is unknown."""
    if _missing(iteration) or _missing(seconds):
        return "n/a"
    return f"{int(iteration)} ({format_seconds(seconds)})"


def _columns(
    header: tuple[str, ...], body: list[tuple[str, ...]], left: frozenset[int] | set[int] = frozenset({0})
) -> list[str]:
    """Text columns: those in ``left`` aligned left, the figures right."""
    widths = [max(len(cell) for cell in column) for column in zip(header, *body)]
    fmt = lambda cells: "  ".join(  # noqa: E731
        cell.ljust(w) if i in left else cell.rjust(w) for i, (cell, w) in enumerate(zip(cells, widths))
    ).rstrip()
    return [fmt(header), fmt(tuple("-" * w for w in widths))] + [fmt(row) for row in body]
