"""Charts of a run: memory over iterations by category, what the peak is made of, the largest
layers, iteration time.

Needs matplotlib (``pip install 'pytorch_mem_profiler[plot]'``), imported only
when a chart is drawn. Figures are made with ``matplotlib.figure.Figure``
directly, not pyplot: no global state, no display needed. A figure written to
a file is exactly ``width`` x ``height`` pixels.

The memory chart stacks, per reported iteration, weights, gradients, optimizer
state, feature maps, intermediate gradients and "other": the iteration's peak
allocated (``iteration_peak_allocated``; ``allocated`` where the peak is
unknown) minus those five, where that is positive (inputs, the loss,
buffers, temporaries). The categories are each at their own largest, which do
not all happen at one moment, so the stack may rise above the peak drawn as a
line. The reserved line (``current_cached``) is what the allocator held when
``record_stats()`` read it: a moment, not a peak, so it may run inside the
stack; its legend entry (:data:`RESERVED_LABEL`) says so.

Where the file records what was alive at each iteration's peak (the
``peak_<category>`` columns), :func:`plot_peak_breakdown` draws the run's
highest-peak record as one stacked bar whose parts sum to that peak exactly,
and :func:`plot_memory` adds the same bar as a panel under its chart. Files
without the columns get no panel.

Example::

    >>> import io, tempfile, torch
    >>> from pytorch_mem_profiler import memory_profiler
    >>> from pytorch_mem_profiler.analysis.runs import load_run
    >>> model = torch.nn.Linear(4, 2)
    >>> with memory_profiler(model, 1, True, csv_dir=tempfile.mkdtemp(), stream=io.StringIO()) as p:
    ...     model(torch.randn(3, 4)).sum().backward()
    ...     _ = p.record_stats()
    >>> png = tempfile.mktemp(suffix=".png")
    >>> figure = plot_memory(load_run(p.csv_path), png, width=800, height=400)
    >>> open(png, "rb").read(4) == b"\\x89PNG"
    True
"""

from __future__ import annotations

import io
import os
from typing import Any

import pandas as pd

from ..options import check_int
from ..stats import CATEGORIES as RECORD_CATEGORIES
from ..stats import PEAK_CATEGORIES, PHASE_LABELS
from ..units import UNITS, format_amount
from .peaks import PeakBreakdown, format_share, peak_breakdown, peak_label
from .runs import Run
from .summary import category_label, choose_unit, layer_groups

__all__ = [
    "CATEGORIES",
    "PEAK_COLOURS",
    "RESERVED_LABEL",
    "memory_categories",
    "plot_memory",
    "plot_peak_breakdown",
    "plot_layers",
    "plot_iteration_time",
    "png_bytes",
]

#: The stacked categories, bottom to top: (column, label, colour).
CATEGORIES = (
    *(
        (name, RECORD_CATEGORIES[name], colour)
        for name, colour in (
            ("weights", "#4C72B0"),
            ("gradients", "#DD8452"),
            ("optimizer_state", "#55A868"),
            ("feature_maps", "#C44E52"),
            ("intermediate_gradients", "#8172B3"),
        )
    ),
    ("other", "other", "#B0B0B0"),
)

#: The colour of each peak category; those the memory chart also stacks keep its colours.
PEAK_COLOURS = {
    "weights": "#4C72B0",
    "gradients": "#DD8452",
    "optimizer_state": "#55A868",
    "activations": "#C44E52",
    "activation_gradients": "#8172B3",
    "inputs": "#CCB974",
    "other": "#B0B0B0",
}
assert tuple(PEAK_COLOURS) == PEAK_CATEGORIES

_RESERVED_COLOUR = "#111111"

#: The reserved line's legend entry: what it is, and why it may run inside the stack. It is
#: ``current_cached``, read once at ``record_stats()``; the stack is each category at its own
#: largest during the iteration (feature maps before backward frees them, gradients after), a
#: sum of moments that never coincide, so it can rise above everything the allocator held at
#: once; and a cache emptied after the peak (``torch.cuda.empty_cache()``) is below it too.
RESERVED_LABEL = (
    "reserved by the allocator at\n"
    "record_stats() (allocated + its\n"
    "cache, at that moment; may run\n"
    "inside the stack, which adds\n"
    "each category at its own\n"
    "largest in the iteration)"
)
_PEAK_COLOUR = "#7A1F1F"


def _figure_class() -> Any:
    try:
        from matplotlib.figure import Figure
    except ImportError as err:
        raise ImportError("pip install 'pytorch_mem_profiler[plot]' to draw plots") from err
    return Figure


def _new_figure(width: int, height: int, dpi: int) -> Any:
    for name, value in (("width", width), ("height", height), ("dpi", dpi)):
        check_int(value, name)
    return _figure_class()(figsize=(width / dpi, height / dpi), dpi=dpi)


def _save(figure: Any, path: str | os.PathLike | None) -> None:
    # No bbox_inches="tight": the file keeps the exact pixel size asked for.
    if path is not None:
        figure.savefig(path, format="png", dpi=figure.dpi)


def png_bytes(figure: Any) -> bytes:
    """The figure as PNG bytes (for embedding)."""
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=figure.dpi)
    return buffer.getvalue()


def memory_categories(run: Run) -> pd.DataFrame:
    """Bytes per stacked category (:data:`CATEGORIES`) per reported iteration, unknowns as 0."""
    rec = run.records
    parts = pd.DataFrame({column: rec[column].fillna(0) for column, _, _ in CATEGORIES[:-1]})
    total = rec["iteration_peak_allocated"].fillna(rec["allocated"]).fillna(0)
    parts["other"] = (total - parts.sum(axis=1)).clip(lower=0)
    return parts


def _amount_axis(ax: Any, unit: str) -> None:
    from matplotlib.ticker import FuncFormatter

    ax.set_ylabel(f"Memory ({unit}, 1 {unit} = {UNITS[unit]:,} bytes)")
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:,.6g}"))
    ax.grid(axis="y", color="#DDDDDD", linewidth=0.8)
    ax.set_axisbelow(True)


def _iteration_axis(ax: Any, run: Run, steps: pd.Series) -> None:
    """x: iterations since the run started; a dotted line and a label where each epoch starts."""
    from matplotlib.ticker import MaxNLocator

    ax.set_xlabel("Iteration (counted from the start of the run)")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    epochs = run.records["epoch"]
    first_steps = steps.groupby(epochs).min()
    last_steps = steps.groupby(epochs).max()
    for position, epoch in enumerate(first_steps.index):
        start = float(first_steps[epoch])
        if position > 0:
            boundary = (float(last_steps.iloc[position - 1]) + start) / 2
            ax.axvline(boundary, color="#555555", linestyle=":", linewidth=1.2)
        else:
            boundary = ax.get_xlim()[0]
        ax.annotate(
            f"epoch {epoch}",
            xy=(boundary, 1.0),
            xycoords=("data", "axes fraction"),
            xytext=(3, -3),
            textcoords="offset points",
            ha="left",
            va="top",
            fontsize=9,
            color="#333333",
        )


def _widen(x: pd.Series, frame: pd.DataFrame) -> tuple[pd.Series, pd.DataFrame]:
    """A single record becomes a short plateau, so an area chart can show it."""
    if len(x) != 1:
        return x, frame
    x = pd.Series([float(x.iloc[0]) - 0.5, float(x.iloc[0]) + 0.5])
    return x, pd.concat([frame, frame], ignore_index=True)


def plot_memory(
    run: Run,
    path: str | os.PathLike | None = None,
    *,
    unit: str | None = None,
    width: int = 1200,
    height: int = 600,
    dpi: int = 100,
    peak_bar: bool = True,
) -> Any:
    """Memory over the run's reported iterations, stacked by category, reserved on top.

    Args:
        run: the run to draw.
        path: where to write the PNG; ``None`` writes nothing.
        unit: the unit of the y axis; default the run file's.
        width: the image's width in pixels.
        height: the image's height in pixels.
        dpi: dots per inch (text size grows with it).
        peak_bar: where the run records its peak's breakdown, draw it under the
            chart (:func:`plot_peak_breakdown`'s bar, as a second axes).

    Returns:
        The ``matplotlib.figure.Figure``; its first axes is the chart over iterations.

    Raises:
        ImportError: matplotlib is not installed (the message says what to install).
    """
    unit = choose_unit(unit, run.unit)
    div = UNITS[unit]
    figure = _new_figure(width, height, dpi)
    breakdown = peak_breakdown(run) if peak_bar else None
    if breakdown is None:
        ax = figure.subplots()
    else:
        ax, bar_ax = figure.subplots(2, 1, gridspec_kw={"height_ratios": [4.2, 1]})
    steps = run.records["step"].astype(float)
    parts = memory_categories(run) / div
    lines = pd.DataFrame(
        {
            "reserved": run.records["current_cached"] / div,
            "peak": run.records["iteration_peak_allocated"] / div,
        }
    )
    x, parts = _widen(steps, parts.reset_index(drop=True))
    _, lines = _widen(steps, lines.reset_index(drop=True))

    stacks = ax.stackplot(
        x,
        *[parts[column] for column, _, _ in CATEGORIES],
        labels=[label for _, label, _ in CATEGORIES],
        colors=[colour for _, _, colour in CATEGORIES],
        alpha=0.9,
        linewidth=0,
    )
    handles = list(stacks)
    if lines["peak"].notna().any():
        (peak,) = ax.plot(
            x,
            lines["peak"],
            color=_PEAK_COLOUR,
            linestyle="--",
            linewidth=1.4,
            label="peak allocated, this iteration",
        )
        handles.append(peak)
    if lines["reserved"].notna().any():
        (reserved,) = ax.plot(
            x, lines["reserved"], color=_RESERVED_COLOUR, linewidth=2.0, label=RESERVED_LABEL
        )
        handles.append(reserved)
    ax.set_xlim(float(x.min()), float(x.max()))
    top = max(
        float(parts.sum(axis=1).max()),
        float(lines.max().max()) if lines.notna().any().any() else 0.0,
    )
    ax.set_ylim(0, top * 1.12 if top > 0 else 1)
    _amount_axis(ax, unit)
    _iteration_axis(ax, run, steps)
    ax.set_title(f"Memory by category: {run.name} ({run.device})", fontsize=12)
    # Top of the legend = top of the chart: lines first, then the stack from the top down.
    handles = handles[len(stacks) :][::-1] + handles[: len(stacks)][::-1]
    ax.legend(
        handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False, fontsize=9
    )
    if breakdown is None:
        figure.subplots_adjust(left=0.08, right=0.77, top=0.92, bottom=0.11)
    else:
        _draw_peak_bar(bar_ax, breakdown, unit, run.device_total)
        # fixed pixel margins, so the two titles and the axis labels fit at any height
        figure.subplots_adjust(
            left=0.08, right=0.77, top=1 - 36 / height, bottom=48 / height, hspace=150 / (height * 0.6)
        )
    _save(figure, path)
    return figure


def _draw_peak_bar(ax: Any, breakdown: PeakBreakdown, unit: str, device_total: float | None) -> None:
    """One horizontal bar: the categories alive at the peak, left to right, their widths in bytes."""
    div = UNITS[unit]
    left = 0.0
    for category in PEAK_CATEGORIES:
        nbytes = breakdown.parts[category]
        if nbytes <= 0:
            continue
        amount = format_amount(nbytes, unit, digits=3)
        ax.barh(
            0,
            nbytes / div,
            left=left,
            height=0.6,
            color=PEAK_COLOURS[category],
            # the short name ("feature maps", not "feature maps (saved for backward)"): it fits
            label=f"{peak_label(category).split(' (')[0]}: {amount} ({format_share(breakdown.share(category))})",
            gid=f"peak-{category}",
        )
        # the share inside the part where it fits
        if breakdown.peak > 0 and nbytes / breakdown.peak >= 0.07:
            ax.text(
                left + nbytes / div / 2,
                0,
                format_share(breakdown.share(category)),
                ha="center",
                va="center",
                fontsize=9,
                color="white",
            )
        left += nbytes / div
    ax.set_xlim(0, left if left > 0 else 1)
    ax.set_ylim(-0.5, 0.5)
    ax.set_yticks([])
    ax.set_xlabel(f"Memory ({unit}, 1 {unit} = {UNITS[unit]:,} bytes)")
    from matplotlib.ticker import FuncFormatter

    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:,.6g}"))
    title = (
        f"At the run's peak: {format_amount(breakdown.peak, unit, digits=3)}, "
        f"epoch {breakdown.epoch} iteration {breakdown.iteration}"
    )
    if breakdown.phase is not None:
        title += f", {PHASE_LABELS.get(breakdown.phase, breakdown.phase)}"
    if device_total:
        title += (
            f"; {format_share(breakdown.peak / device_total)} of the device's "
            f"{format_amount(device_total, unit, digits=3)}"
        )
    ax.set_title(title, fontsize=10, loc="left")
    # largest first in the legend, as the summary lists them
    handles, labels = ax.get_legend_handles_labels()
    order = sorted(range(len(handles)), key=lambda i: -handles[i].patches[0].get_width())
    ax.legend(
        [handles[i] for i in order],
        [labels[i] for i in order],
        loc="center left",
        bbox_to_anchor=(1.01, 0.5),
        frameon=False,
        fontsize=8,
    )


def plot_peak_breakdown(
    run: Run,
    path: str | os.PathLike | None = None,
    *,
    unit: str | None = None,
    width: int = 1200,
    height: int = 260,
    dpi: int = 100,
) -> Any:
    """What was alive at the run's peak: one bar, stacked by category, largest first in the legend.

    The record drawn is the one with the highest ``iteration_peak_allocated`` among
    those with a breakdown (the earliest of equal ones); its parts sum to that peak.
    Arguments as :func:`plot_memory`.

    Raises:
        ValueError: the run's file has no breakdown (no ``peak_<category>`` figures).
        ImportError: matplotlib is not installed.
    """
    unit = choose_unit(unit, run.unit)
    breakdown = peak_breakdown(run)
    if breakdown is None:
        raise ValueError(
            f"{run.path.name} does not record what was alive at its peak (no peak_<category> "
            "figures): the profiler version that wrote it did not measure it"
        )
    figure = _new_figure(width, height, dpi)
    ax = figure.subplots()
    _draw_peak_bar(ax, breakdown, unit, run.device_total)
    figure.subplots_adjust(left=0.03, right=0.7, top=1 - 40 / height, bottom=55 / height)
    _save(figure, path)
    return figure


def plot_layers(
    run: Run,
    path: str | os.PathLike | None = None,
    *,
    unit: str | None = None,
    top: int = 12,
    width: int = 1200,
    height: int | None = None,
    dpi: int = 100,
) -> Any:
    """The ``top`` largest layers, a bar per category (weights, gradients, and those of the
    per-layer file such as feature maps); each layer at its largest over the run.

    Repeated layers are one bar, their total (``blocks.[0-11].attn``), as in the summary
    (:func:`~pytorch_mem_profiler.analysis.summary.layer_groups`). ``height`` defaults to
    one that fits the layers. Other arguments as :func:`plot_memory`.
    """
    unit = choose_unit(unit, run.unit)
    div = UNITS[unit]
    by_category = {
        category: [(group.name, float(group.total)) for group in groups]
        for category, groups in layer_groups(run, top=None).items()
    }
    totals: dict[str, float] = {}
    for layers in by_category.values():
        for name, nbytes in layers:
            totals[name] = totals.get(name, 0.0) + nbytes
    names = [n for n, _ in sorted(totals.items(), key=lambda kv: -kv[1])[:top]]
    categories = [c for c, layers in by_category.items() if layers]
    if height is None:
        # Room for each layer's group of bars, plus the title and the axis.
        height = max(300, 110 + len(names) * (10 + 12 * max(1, len(categories))))
    figure = _new_figure(width, height, dpi)
    ax = figure.subplots()
    colours = {column: colour for column, _, colour in CATEGORIES}
    colours.update(activations=colours["feature_maps"], **{"weight copies": "#937860"})
    bar = 0.8 / max(1, len(categories))
    for i, category in enumerate(categories):
        sizes = dict(by_category[category])
        positions = [row + i * bar for row in range(len(names))]
        ax.barh(
            positions,
            [sizes.get(name, 0.0) / div for name in names],
            height=bar,
            label=category_label(category),
            color=colours.get(category, f"C{i}"),
        )
    ax.set_yticks([row + bar * (len(categories) - 1) / 2 for row in range(len(names))])
    ax.set_yticklabels(names, fontsize=9)
    ax.invert_yaxis()
    ax.set_xlabel(f"Memory ({unit}, 1 {unit} = {UNITS[unit]:,} bytes)")
    ax.grid(axis="x", color="#DDDDDD", linewidth=0.8)
    ax.set_axisbelow(True)
    if not names:
        ax.text(0.5, 0.5, "no layers recorded", transform=ax.transAxes, ha="center")
    else:
        ax.legend(loc="lower right", fontsize=9)
    ax.set_title(f"Largest layers: {run.name}", fontsize=12)
    label_room = min(0.45, 0.04 + 0.0075 * max((len(n) for n in names), default=0))
    figure.subplots_adjust(
        left=max(0.1, label_room), right=0.97, top=1 - 40 / height, bottom=55 / height
    )
    _save(figure, path)
    return figure


def plot_iteration_time(
    run: Run,
    path: str | os.PathLike | None = None,
    *,
    width: int = 1200,
    height: int = 350,
    dpi: int = 100,
) -> Any:
    """Host wall time per reported iteration, in milliseconds, with epoch boundaries."""
    figure = _new_figure(width, height, dpi)
    ax = figure.subplots()
    steps = run.records["step"].astype(float)
    ms = run.records["iteration_time_s"] * 1e3
    ax.plot(steps, ms, marker="o", markersize=3, linewidth=1.2, color="#4C72B0")
    if len(steps) > 1:
        ax.set_xlim(float(steps.min()), float(steps.max()))
    ax.set_ylim(0, float(ms.max()) * 1.15 if ms.notna().any() and ms.max() > 0 else 1)
    ax.set_ylabel("Iteration time (ms)")
    ax.grid(axis="y", color="#DDDDDD", linewidth=0.8)
    _iteration_axis(ax, run, steps)
    ax.set_title(f"Time per iteration: {run.name}", fontsize=12)
    figure.subplots_adjust(left=0.08, right=0.97, top=1 - 40 / height, bottom=55 / height)
    _save(figure, path)
    return figure
