"""A run as one self-contained HTML file: charts, per-epoch and per-layer tables, settings.

Everything is inside the file: the charts are PNG images embedded as
``data:`` URLs, the style is inline, there is no script, and a
Content-Security-Policy forbids loading anything else, so the page opens the
same offline, attached to an e-mail, or years later. The charts need
matplotlib; without it the report says so in their place.

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
from ..stats import INPUT
from ..units import UNITS, format_amount
from .runs import Run, module_of
from .summary import (
    EPOCH_HEADER,
    category_label,
    choose_unit,
    epoch_rows,
    epoch_table,
    format_seconds,
    largest_layers,
    run_settings,
)

__all__ = ["render_html", "write_html", "CONTENT_SECURITY_POLICY"]

#: Nothing may be fetched: images only from data: URLs, style only inline.
CONTENT_SECURITY_POLICY = "default-src 'none'; img-src data:; style-src 'unsafe-inline'"

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
td.num { text-align: right; font-variant-numeric: tabular-nums; }
img { max-width: 100%; height: auto; display: block; margin: 0.5rem 0; }
.note { color: #666; font-size: 0.85rem; }
.warning { color: #8a4b00; }
details summary { cursor: pointer; }
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
        from .plot import plot_iteration_time, plot_layers, plot_memory, png_bytes

        figures = [
            (
                "chart-memory",
                "Memory by category over the run's reported iterations",
                plot_memory(run, unit=unit),
            ),
            ("chart-layers", "The largest layers by category", plot_layers(run, unit=unit)),
            ("chart-time", "Host wall time per reported iteration", plot_iteration_time(run)),
        ]
    except ImportError as err:
        return [], str(err)
    out = []
    for chart_id, caption, figure in figures:
        width, height = (int(round(v)) for v in figure.get_size_inches() * figure.dpi)
        data = base64.b64encode(png_bytes(figure)).decode("ascii")
        out.append(
            f'<figure id="{chart_id}"><img src="data:image/png;base64,{data}" width="{width}" '
            f'height="{height}" alt="{escape(caption)}"><figcaption class="note">{escape(caption)}'
            "</figcaption></figure>"
        )
    return out, None


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
    parts += [f'<p class="warning">{escape(w)}</p>' for w in run.warnings]

    parts.append('<h2 id="charts">Charts</h2>')
    charts, missing = _charts(run, unit)
    parts += charts
    if missing is not None:
        parts.append(f'<p class="note" id="no-charts">No charts: {escape(missing)}</p>')

    parts.append('<h2 id="settings">Run settings</h2>')
    parts.append(
        _table(("Setting", "Value"), run_settings(run, unit), (False, False), "settings-table")
    )

    parts.append('<h2 id="epochs">Epochs</h2>')
    epochs = epoch_table(run)
    parts.append(
        _table(
            EPOCH_HEADER,
            epoch_rows(epochs, size),
            (False, True, True, True, True, True),
            "epoch-table",
        )
    )
    parts.append(
        '<p class="note">Peak allocated: the highest iteration peak among the epoch\'s records '
        "(iteration_peak_allocated). Peak cached: the most the allocator reserved since the run "
        "started, by the epoch's last record (peak_cached).</p>"
    )

    parts.append('<h2 id="parameters">Layers: weights and gradients by parameter</h2>')
    last_weights = run.weights.iloc[-1] if len(run.weights.columns) else {}
    largest_grads = run.gradients.max() if len(run.gradients.columns) else {}
    parts.append(
        _table(
            ("Parameter", "Layer", "Weights", "Gradients (largest)"),
            (
                (name, module_of(name), size(last_weights[name]), size(largest_grads[name]))
                for name in run.parameters
            ),
            (False, False, True, True),
            "parameter-table",
        )
    )

    parts.append('<h2 id="layers">Largest layers by category</h2>')
    for category, layers in largest_layers(run, top=25).items():
        parts.append(f"<h3>{escape(category_label(category).capitalize())}</h3>")
        parts.append(
            _table(
                ("Layer", escape(category_label(category))),
                ((name, size(nbytes)) for name, nbytes in layers),
                (False, True),
                f"layers-{_slug(category)}",
            )
        )
    if run.layers is not None:
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
        ("current_cached", "Cached"),
        *(
            (name, RECORD_CATEGORIES[name].capitalize())
            for name in ("weights", "gradients", "optimizer_state", "feature_maps", "intermediate_gradients")
        ),
        ("outside_pytorch", "Outside PyTorch"),
    )
    # Figures this run's device or settings never produced are left out, not shown as n/a.
    columns = tuple((c, label) for c, label in columns if run.records[c].notna().any())
    records = run.records.tail(_MAX_RECORD_ROWS)
    rows = (
        [str(int(r["epoch"])), str(int(r["iteration"]))]
        + [format_amount(r[c], unit, digits=3) for c, _ in columns]
        + [format_seconds(r["iteration_time_s"]), _text(r["peak_phase"]), _text(r["peak_location"])]
        for _, r in records.iterrows()
    )
    header = (
        ["Epoch", "Iteration"]
        + [label for _, label in columns]
        + ["Time", "Peak during", "Peak in"]
    )
    numeric = [False, False] + [True] * (len(columns) + 1) + [False, False]
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
