"""A run as one self-contained HTML file: charts, the peak's breakdown, per-epoch and per-layer
tables, settings.

Everything is inside the file: the charts are PNG images embedded as
``data:`` URLs, the style is inline, there is no script, and a
Content-Security-Policy forbids loading anything else, so the page opens the
same offline, attached to an e-mail, or years later. The charts need
matplotlib; without it the report says so in their place.

Where the run's file has them, the report adds the headroom (the peak as a
share of ``device_total``) under the title, and a section "At the peak": what
was alive at the run's highest-peak record by category (a stacked bar and a
table) and the same per epoch. Repeated layers are folded into one row
(``blocks.[0-11].attn``, 12 layers of 3 MB each).

Example::

    >>> import io, tempfile, torch
    >>> from pytorch_mem_profiler import memory_profiler
    >>> from pytorch_mem_profiler.analysis.runs import load_run
    >>> model = torch.nn.Linear(4, 2)
    >>> with memory_profiler(model, 1, True, csv_dir=tempfile.mkdtemp(), stream=io.StringIO()) as p:
    ...     model(torch.randn(3, 4)).sum().backward()
    ...     _ = p.record_stats()
    >>> page = render_html(load_run(p.csv_path))
    >>> page.startswith("<!DOCTYPE html>") and "<td>weight</td>" in page
    True
"""

from __future__ import annotations

import base64
import datetime as _dt
import os
import re
from html import escape
from pathlib import Path
from typing import Iterable, Sequence

import pandas as pd

from ..stats import CATEGORIES as RECORD_CATEGORIES
from ..stats import INPUT, PEAK_CATEGORIES, PHASE_LABELS
from ..units import UNITS, format_amount
from .peaks import PeakBreakdown, epoch_breakdowns, format_share, peak_breakdown, peak_label
from .plot import PEAK_COLOURS
from .runs import Run, module_of
from .summary import (
    category_label,
    choose_unit,
    epoch_header,
    epoch_rows,
    epoch_table,
    format_headroom,
    format_seconds,
    group_each,
    largest_layers,
    layer_groups,
    run_settings,
)

__all__ = ["render_html", "write_html", "CONTENT_SECURITY_POLICY"]

#: Nothing may be fetched: images only from data: URLs, style only inline.
CONTENT_SECURITY_POLICY = "default-src 'none'; img-src data:; style-src 'unsafe-inline'"

#: A parameter table longer than this is folded (a <details> element, opened by a click).
_OPEN_PARAMETER_ROWS = 40

#: The records table shows at most this many rows (the last ones); the CSV has them all.
_MAX_RECORD_ROWS = 2000

_STYLE = """
body { font-family: system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; margin: 2rem auto;
       max-width: 1280px; padding: 0 1rem; color: #222; line-height: 1.4; }
h1 { font-size: 1.6rem; margin-bottom: 0.2rem; }
h2 { font-size: 1.25rem; margin-top: 2rem; border-bottom: 1px solid #ddd; padding-bottom: 0.2rem; }
.sub { color: #666; margin-top: 0; }
table { border-collapse: collapse; margin: 0.5rem 0 1rem; font-size: 0.9rem; }
th, td { border: 1px solid #ddd; padding: 0.25rem 0.6rem; text-align: left; }
th { background: #f4f4f4; }
td.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
img { max-width: 100%; height: auto; display: block; margin: 0.5rem 0; }
.note { color: #666; font-size: 0.85rem; }
.warning { color: #8a4b00; }
details summary { cursor: pointer; }
.peakbars { margin: 0.5rem 0 1rem; font-size: 0.85rem; }
.peakrow { display: flex; align-items: center; margin: 0.25rem 0; }
.peakrow .label { width: 13rem; flex: none; white-space: nowrap; }
.peakrow .track { flex: 1; display: flex; height: 1.5rem; }
.peakrow .seg { display: block; flex: none; height: 100%; overflow: hidden; color: #fff;
                text-align: center; line-height: 1.5rem; font-size: 0.75rem; }
.legend span { display: inline-block; margin-right: 1rem; }
.legend i { display: inline-block; width: 0.8rem; height: 0.8rem; margin-right: 0.3rem;
            vertical-align: middle; }
"""


def _table(
    header: Sequence[str], rows: Iterable[Sequence[str]], numeric: Sequence[bool], table_id: str
) -> str:
    head = "".join(f"<th>{escape(h)}</th>" for h in header)
    body = []
    for row in rows:
        cells = "".join(
            f'<td class="num">{escape(c)}</td>' if num else f"<td>{escape(c)}</td>"
            for c, num in zip(row, numeric)
        )
        body.append(f"<tr>{cells}</tr>")
    return (
        f'<table id="{table_id}"><thead><tr>{head}</tr></thead>'
        f"<tbody>{''.join(body)}</tbody></table>"
    )


def _charts(run: Run, unit: str) -> tuple[list[str], str | None]:
    """The charts as <figure> elements, or a note why there are none."""
    try:
        from .plot import plot_iteration_time, plot_layers, plot_memory

        figures = [
            (
                "chart-memory",
                "Memory by category over the run's reported iterations",
                plot_memory(run, unit=unit, peak_bar=False),
            ),
            ("chart-layers", "The largest layers by category", plot_layers(run, unit=unit)),
            ("chart-time", "Host wall time per reported iteration", plot_iteration_time(run)),
        ]
    except ImportError as err:
        return [], str(err)
    return [_figure(chart_id, caption, figure) for chart_id, caption, figure in figures], None


def render_html(run: Run, unit: str | None = None) -> str:
    """The report of ``run`` as one HTML document (a string).

    Args:
        run: the run.
        unit: the unit of the figures; default the run file's.
    """
    from .. import __version__  # here, not at the top: the package imports this module

    unit = choose_unit(unit, run.unit)
    size = lambda n: format_amount(n, unit, digits=3)  # noqa: E731
    title = f"Memory report: {run.name}"
    made = _dt.datetime.now().strftime("%Y-%m-%d %H:%M:%S")
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f'<meta http-equiv="Content-Security-Policy" content="{CONTENT_SECURITY_POLICY}">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>{escape(title)}</title><style>{_STYLE}</style></head><body>",
        f"<h1>{escape(title)}</h1>",
        f'<p class="sub">{escape(str(run.path))} &middot; {escape(run.device)} &middot; figures in '
        f"{escape(unit)} (1 {escape(unit)} = {UNITS[unit]:,} bytes) &middot; made {made} by "
        f"pytorch_mem_profiler {escape(__version__)}</p>",
    ]
    room = format_headroom(run, unit)
    if room is not None:
        parts.append(f'<p id="headroom">Headroom: {escape(room)}</p>')
    parts += [f'<p class="warning">{escape(w)}</p>' for w in run.warnings]

    parts.append('<h2 id="charts">Charts</h2>')
    charts, missing = _charts(run, unit)
    parts += charts
    if missing is not None:
        parts.append(f'<p class="note" id="no-charts">No charts: {escape(missing)}</p>')

    parts += _peak_section(run, unit)

    parts.append('<h2 id="settings">Run settings</h2>')
    parts.append(
        _table(("Setting", "Value"), run_settings(run, unit), (False, False), "settings-table")
    )

    parts.append('<h2 id="epochs">Epochs</h2>')
    epochs = epoch_table(run)
    header = epoch_header(epochs)
    parts.append(
        _table(
            header,
            epoch_rows(epochs, size),
            [h not in ("Epoch", "Largest at the peak") for h in header],
            "epoch-table",
        )
    )
    notes = [
        "Peak allocated: the highest iteration peak among the epoch's records "
        "(iteration_peak_allocated).",
        "Peak reserved: the most the allocator reserved since the run started, by the epoch's "
        "last record (peak_cached).",
    ]
    if "device_share" in epochs:
        notes.append("Peak of device: peak allocated as a share of the device's memory (device_total).")
    if "largest_category" in epochs:
        notes.append(
            "Largest at the peak: the category with the most bytes alive at the epoch's "
            "highest-peak record, and its share of that peak."
        )
    parts.append(f'<p class="note">{escape(" ".join(notes))}</p>')

    parts.append('<h2 id="parameters">Layers: weights and gradients by parameter</h2>')
    last_weights = run.weights.iloc[-1] if len(run.weights.columns) else {}
    largest_grads = run.gradients.max() if len(run.gradients.columns) else {}
    parameters = _table(
        ("Parameter", "Layer", "Weights", "Gradients (largest)"),
        (
            (name, module_of(name), size(last_weights[name]), size(largest_grads[name]))
            for name in run.parameters
        ),
        (False, False, True, True),
        "parameter-table",
    )
    # A long list (every block's every parameter) folds away; the grouped layers follow.
    if len(run.parameters) > _OPEN_PARAMETER_ROWS:
        parameters = f"<details><summary>{len(run.parameters)} parameters</summary>{parameters}</details>"
    parts.append(parameters)

    parts.append('<h2 id="layers">Largest layers by category</h2>')
    parts.append(
        '<p class="note">Layers that differ only in a number (blocks.0.attn ... blocks.11.attn) '
        "are one row: how many, the size of each, and their total; each layer at its largest "
        "over the run. The CSV files keep every name.</p>"
    )
    sizes = {category: dict(layers) for category, layers in largest_layers(run, top=None).items()}
    for category, groups in layer_groups(run, top=25).items():
        parts.append(f"<h3>{escape(category_label(category).capitalize())}</h3>")
        parts.append(
            _table(
                ("Layer", "Layers", "Each", category_label(category)),
                (
                    (g.name, str(g.count), group_each(g, sizes[category], size), size(g.total))
                    for g in groups
                ),
                (False, True, True, True),
                f"layers-{_slug(category)}",
            )
        )
    if run.layers is not None and not len(run.layers):
        parts.append(
            '<p class="note">This run\'s per-layer file has no rows: feature maps by layer are '
            "measured with torch 2.8 or later, on reported iterations.</p>"
        )
    elif run.layers is not None:
        parts.append(_layer_totals_table(run, unit))
    else:
        parts.append(
            '<p class="note">This run has no per-layer file; feature maps by layer appear here '
            "when the profiler writes one.</p>"
        )

    parts.append('<h2 id="records">Records</h2>')
    parts.append(_records_table(run, unit))
    parts.append("</body></html>")
    return "\n".join(parts)


def _peak_section(run: Run, unit: str) -> list[str]:
    """"At the peak": the run's highest-peak record by category (bar and table), then per epoch."""
    breakdown = peak_breakdown(run)
    if breakdown is None:
        return []
    size = lambda n: format_amount(n, unit, digits=3)  # noqa: E731
    where = f"epoch {breakdown.epoch}, iteration {breakdown.iteration}"
    if breakdown.phase is not None:
        where += f", during {PHASE_LABELS.get(breakdown.phase, breakdown.phase)}"
    parts = [
        '<h2 id="peak">At the peak</h2>',
        f'<p id="peak-where">The run\'s highest iteration peak: {escape(size(breakdown.peak))} '
        f"({escape(where)}). What was alive then, by category; the parts sum to the peak.</p>",
    ]
    try:
        from .plot import plot_peak_breakdown

        parts.append(
            _figure("chart-peak", "What was alive at the run's peak", plot_peak_breakdown(run, unit=unit))
        )
    except ImportError:
        pass  # the charts section says what to install
    parts.append(
        _table(
            ("Category", "At the peak", "Share of the peak"),
            (
                (peak_label(c), size(n), format_share(breakdown.share(c)))
                for c, n in breakdown.ranked()
            ),
            (False, True, True),
            "peak-table",
        )
    )
    by_epoch = epoch_breakdowns(run)
    parts.append("<h3>Per epoch, at its highest-peak record</h3>")
    parts.append(_epoch_bars(by_epoch, unit))
    parts.append(
        _table(
            ("Epoch", "Iteration", "Peak", *(peak_label(c) for c in PEAK_CATEGORIES)),
            (
                (str(e), str(b.iteration), size(b.peak), *(size(b.parts[c]) for c in PEAK_CATEGORIES))
                for e, b in by_epoch.items()
            ),
            (False, False) + (True,) * (1 + len(PEAK_CATEGORIES)),
            "peak-epochs-table",
        )
    )
    return parts


def _epoch_bars(by_epoch: dict[int, PeakBreakdown], unit: str) -> str:
    """One stacked bar per epoch (its highest-peak record), in HTML: no image, no script.

    Each part is a ``<span class="seg">`` whose ``data-bytes`` are the category's bytes and whose
    width is that share of the largest epoch peak, so the bars compare across epochs; its
    ``title`` (shown on hover) and the legend give the amounts.
    """
    size = lambda n: format_amount(n, unit, digits=3)  # noqa: E731
    # a peak below its parts' sum (a file's rounding) must not push a bar past its track
    scale = max((max(b.peak, sum(b.parts.values())) for b in by_epoch.values()), default=0.0)
    rows = []
    for epoch, b in by_epoch.items():
        segments = []
        for category in PEAK_CATEGORIES:
            nbytes = b.parts[category]
            if nbytes <= 0:
                continue
            share = format_share(b.share(category))
            # the share written inside a part wide enough for it (7% of the largest peak)
            text = share if scale and nbytes / scale >= 0.07 else ""
            segments.append(
                f'<span class="seg" data-category="{category}" data-bytes="{nbytes:.0f}" '
                f'style="width:{100 * nbytes / scale:.4f}%;background:{PEAK_COLOURS[category]}" '
                f'title="{escape(peak_label(category))}: {escape(size(nbytes))} ({escape(share)})">'
                f"{escape(text)}</span>"
            )
        rows.append(
            f'<div class="peakrow" data-epoch="{epoch}" data-iteration="{b.iteration}" '
            f'data-peak="{b.peak:.0f}"><span class="label">Epoch {epoch}: {escape(size(b.peak))}</span>'
            f'<span class="track">{"".join(segments)}</span></div>'
        )
    legend = "".join(
        f'<span><i style="background:{PEAK_COLOURS[c]}"></i>{escape(peak_label(c))}</span>'
        for c in PEAK_CATEGORIES
        if any(b.parts[c] > 0 for b in by_epoch.values())
    )
    return (
        f'<div class="peakbars" id="peak-bars">{"".join(rows)}'
        f'<p class="legend note">{legend}</p><p class="note">Each bar: what was alive at the epoch\'s '
        "highest iteration peak, by category, its length that peak against the largest; hover over a "
        "part for its amount.</p></div>"
    )


def _figure(chart_id: str, caption: str, figure: object) -> str:
    from .plot import png_bytes

    width, height = (int(round(v)) for v in figure.get_size_inches() * figure.dpi)  # type: ignore[attr-defined]
    data = base64.b64encode(png_bytes(figure)).decode("ascii")
    return (
        f'<figure id="{chart_id}"><img src="data:image/png;base64,{data}" width="{width}" '
        f'height="{height}" alt="{escape(caption)}"><figcaption class="note">{escape(caption)}'
        "</figcaption></figure>"
    )


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def _layer_totals_table(run: Run, unit: str) -> str:
    """The per-layer file's totals and the model's inputs, each at its largest over the run."""
    layers = run.layers
    assert layers is not None
    rows = layers[(layers["category"] == "total") | (layers["module"] == INPUT)]
    if not len(rows):
        return ""
    per_iteration = rows.groupby(["epoch", "iteration", "module"], sort=False)["bytes"].sum()
    largest = per_iteration.groupby(level="module", sort=False).max()
    return "<h3>Per-layer totals</h3>" + _table(
        ("Row of the per-layer file", "Largest"),
        ((name, format_amount(nbytes, unit, digits=3)) for name, nbytes in largest.items()),
        (False, True),
        "layer-totals",
    )


def _records_table(run: Run, unit: str) -> str:
    columns = (
        ("allocated", "Allocated"),
        ("iteration_peak_allocated", "Peak this iteration"),
        ("peak_allocated", "Peak since start"),
        ("current_cached", "Reserved"),
        ("cache_slack", "Cache slack"),
        *(
            (name, RECORD_CATEGORIES[name].capitalize())
            for name in ("weights", "gradients", "optimizer_state", "feature_maps", "intermediate_gradients")
        ),
        ("outside_pytorch", "Outside PyTorch"),
    )
    records = run.records.assign(
        cache_slack=run.records["current_cached"] - run.records["allocated"],
        device_share=run.records["iteration_peak_allocated"] / run.records["device_total"].where(run.records["device_total"] > 0),
    )
    # Figures this run's device or settings never produced are left out, not shown as n/a.
    columns = tuple((c, label) for c, label in columns if records[c].notna().any())
    shares = records["device_share"].notna().any()
    records = records.tail(_MAX_RECORD_ROWS)
    rows = (
        [str(int(r["epoch"])), str(int(r["iteration"]))]
        + [format_amount(r[c], unit, digits=3) for c, _ in columns]
        + ([format_share(r["device_share"])] if shares else [])
        + [format_seconds(r["iteration_time_s"]), _text(r["peak_phase"]), _text(r["peak_location"])]
        for _, r in records.iterrows()
    )
    header = (
        ["Epoch", "Iteration"]
        + [label for _, label in columns]
        + (["Peak of device"] if shares else [])
        + ["Time", "Peak during", "Peak in"]
    )
    numeric = [False, False] + [True] * (len(columns) + int(shares) + 1) + [False, False]
    note = (
        f'<p class="note">The last {_MAX_RECORD_ROWS} of {len(run.records)} records; the CSV has all.</p>'
        if len(run.records) > _MAX_RECORD_ROWS
        else ""
    )
    return (
        f"<details><summary>{len(records)} reported iterations</summary>"
        f"{_table(header, rows, numeric, 'records-table')}{note}</details>"
    )


def _text(value: object) -> str:
    return "" if value is None or pd.isna(value) else str(value)


def write_html(run: Run, path: str | os.PathLike, unit: str | None = None) -> Path:
    """Write :func:`render_html` to ``path`` (UTF-8); returns the path."""
    path = Path(path)
    path.write_text(render_html(run, unit), encoding="utf-8")
    return path
