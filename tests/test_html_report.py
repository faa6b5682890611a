"""The HTML report: its structure (html.parser, always) and a real browser opening it (headless
Chromium, when installed: Debian's ``chromium`` package)."""

from __future__ import annotations

import base64
import os
import re
import subprocess
import tempfile
from html.parser import HTMLParser
from pathlib import Path

import pandas as pd
import pytest
import torch
from torch import nn

from .profiled_run import png_size, profile_tiny_model
from pytorch_mem_profiler import memory_profiler
from pytorch_mem_profiler.analysis.html_report import CONTENT_SECURITY_POLICY, render_html, write_html
from pytorch_mem_profiler.analysis.peaks import format_share
from pytorch_mem_profiler.analysis.runs import layers_path, load_run
from pytorch_mem_profiler.measure.saved_tensors import can_chain
from pytorch_mem_profiler.units import format_amount

CHROMIUM = "/usr/bin/chromium"


class Page(HTMLParser):
    """Every element with its attributes, the text of each table's cells, and the <title>."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.elements: list[tuple[str, dict[str, str]]] = []
        self.tables: dict[str, list[list[str]]] = {}
        self.title = ""
        self._table: str | None = None
        self._cell: list[str] | None = None
        self._in_title = False

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.elements.append((tag, attrs))
        if tag == "table":
            self._table = attrs.get("id", f"table-{len(self.tables)}")
            self.tables[self._table] = []
        elif tag == "tr" and self._table is not None:
            self.tables[self._table].append([])
        elif tag in ("td", "th"):
            self._cell = []
        elif tag == "title":
            self._in_title = True

    def handle_endtag(self, tag):
        if tag in ("td", "th") and self._cell is not None and self._table is not None:
            self.tables[self._table][-1].append("".join(self._cell))
            self._cell = None
        elif tag == "table":
            self._table = None
        elif tag == "title":
            self._in_title = False

    def handle_data(self, data):
        if self._cell is not None:
            self._cell.append(data)
        if self._in_title:
            self.title += data


def parse(text: str) -> Page:
    page = Page()
    page.feed(text)
    page.close()
    return page


class OddNames(nn.Module):
    """A module whose name needs escaping in HTML."""

    def __init__(self) -> None:
        super().__init__()
        self.add_module("a<b>&c", nn.Linear(6, 10))
        self.out = nn.Linear(10, 2)

    def forward(self, x):
        return self.out(getattr(self, "a<b>&c")(x))


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    folder = tmp_path_factory.mktemp("report")
    path, model = profile_tiny_model(folder / "csv", units="B")
    out = write_html(load_run(path), folder / "report.html")
    return {"html": out, "csv": path, "model": model}


def test_structure(report):
    pytest.importorskip("matplotlib")
    text = report["html"].read_text(encoding="utf-8")
    page = parse(text)
    tags = [tag for tag, _ in page.elements]
    assert text.startswith("<!DOCTYPE html>")
    assert page.title == f"Memory report: {report['csv'].stem}"
    assert {attrs["id"] for tag, attrs in page.elements if tag == "h2"} == {
        "charts",
        "settings",
        "epochs",
        "parameters",
        "layers",
        "records",
    }
    # self-contained: no script, nothing linked, every image inline, and a policy that forbids fetching
    assert "script" not in tags and "link" not in tags
    for _, attrs in page.elements:
        for name in ("src", "href"):
            assert (
                not attrs.get(name, "data:").lower().startswith(("http:", "https:", "//", "file:"))
            )
    metas = [attrs for tag, attrs in page.elements if tag == "meta" and attrs.get("http-equiv")]
    assert metas == [{"http-equiv": "Content-Security-Policy", "content": CONTENT_SECURITY_POLICY}]
    images = [attrs for tag, attrs in page.elements if tag == "img"]
    assert len(images) == 3
    for img in images:
        prefix = "data:image/png;base64,"
        assert img["src"].startswith(prefix)
        png = base64.b64decode(img["src"][len(prefix) :], validate=True)
        with tempfile.NamedTemporaryFile(suffix=".png", delete=False) as handle:
            handle.write(png)
        try:
            assert png_size(Path(handle.name)) == (int(img["width"]), int(img["height"]))
        finally:
            os.unlink(handle.name)


def test_tables_hold_the_run(report):
    page = parse(report["html"].read_text(encoding="utf-8"))
    # a row per parameter with its bytes: numel() * element_size()
    rows = page.tables["parameter-table"]
    assert rows[0] == ["Parameter", "Layer", "Weights", "Gradients (largest)"]
    expected = [
        [
            name,
            name.rpartition(".")[0],
            format_amount(p.numel() * p.element_size(), "B", digits=3),
            format_amount(p.numel() * p.element_size(), "B", digits=3),
        ]
        for name, p in report["model"].named_parameters()
    ]
    assert rows[1:] == expected
    settings = dict(page.tables["settings-table"][1:])
    assert settings["Device"] == "cpu"
    assert settings["Epochs"] == "2"
    assert settings["Reported iterations"] == "4"
    assert settings["Reported every"] == "2 iteration(s)"
    total = sum(p.numel() * p.element_size() for p in report["model"].parameters())
    assert settings["Weights"] == format_amount(total, "B", digits=3)
    assert len(page.tables["epoch-table"]) == 1 + 2
    assert len(page.tables["records-table"]) == 1 + 4
    assert page.tables["layers-weights"][1][0] == "encoder"


def test_names_are_escaped(tmp_path):
    model = OddNames()
    with memory_profiler(model, 1, True, csv_dir=tmp_path, stream=__import__("io").StringIO()) as p:
        model(torch.randn(3, 6)).sum().backward()
        p.record_stats()
    text = render_html(load_run(p.csv_path))
    assert "a<b>&c" not in text
    assert "a&lt;b&gt;&amp;c.weight" in text
    page = parse(text)
    names = [row[0] for row in page.tables["parameter-table"][1:]]
    assert names == ["a<b>&c.weight", "a<b>&c.bias", "out.weight", "out.bias"]


def test_layers_file_gets_its_tables(tmp_path):
    path, _ = profile_tiny_model(tmp_path, units="B", by_layer=True)
    raw = pd.read_csv(layers_path(path))
    raw["module"] = raw["module"].fillna("(model)")
    page = parse(render_html(load_run(path)))
    if not can_chain():  # torch < 2.8 measures no feature maps by layer: no rows, so no tables
        assert raw.empty
        assert "layers-activations" not in page.tables and "layer-totals" not in page.tables
        assert "per-layer file has no rows" in render_html(load_run(path))
        return
    activations = raw[(raw["category"] == "activations") & (raw["module"] != "(input)")]
    largest = activations.groupby(["step", "module"])["bytes"].sum().groupby("module").max()
    largest = largest.sort_values(ascending=False, kind="stable")
    # no repeated blocks in TinyNet: one row per module, one layer each
    assert page.tables["layers-activations"] == [["Layer", "Layers", "Each", "feature maps"]] + [
        [name, "1", format_amount(n, "B", digits=3), format_amount(n, "B", digits=3)]
        for name, n in largest.items()
    ]
    totals = dict(page.tables["layer-totals"][1:])
    for module in ("(input)", "(total by layer)", "(allocator delta)"):
        assert totals[module] == format_amount(raw[raw["module"] == module]["bytes"].max(), "B", digits=3)


def _chromium(url: str, profile: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            CHROMIUM,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--no-first-run",
            f"--user-data-dir={profile}",
            "--enable-logging=stderr",
            "--v=0",
            "--virtual-time-budget=5000",
            *extra,
            "--dump-dom",
            url,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )


def _console(stderr: str) -> list[str]:
    """The page's console messages (errors, CSP violations, failed loads) in Chromium's log."""
    return [line for line in stderr.splitlines() if ":CONSOLE" in line]


@pytest.mark.skipif(
    not os.path.exists(CHROMIUM), reason="needs Chromium (Debian package 'chromium')"
)
def test_opens_in_a_browser_without_errors(report, tmp_path):
    pytest.importorskip("matplotlib")
    result = _chromium(report["html"].as_uri(), tmp_path / "profile-1")
    assert result.returncode == 0, result.stderr[-2000:]
    assert _console(result.stderr) == []
    dom = parse(result.stdout)
    assert "parameter-table" in dom.tables and len(dom.tables["parameter-table"]) == 1 + 6
    assert len([1 for tag, _ in dom.elements if tag == "img"]) == 3

    # The same page with a probe that reports what each image decoded to: the policy is
    # widened for that one inline script only.
    text = report["html"].read_text(encoding="utf-8")
    policy = CONTENT_SECURITY_POLICY + "; script-src 'unsafe-inline'"
    probe = (
        "<script>window.addEventListener('load', () => document.body.setAttribute('data-images', "
        "Array.from(document.images).map(i => i.complete + ':' + i.naturalWidth + 'x' + i.naturalHeight)"
        ".join(',')));</script></body>"
    )
    probed = tmp_path / "probed.html"
    probed.write_text(
        text.replace(CONTENT_SECURITY_POLICY, policy).replace("</body>", probe), encoding="utf-8"
    )
    result = _chromium(probed.as_uri(), tmp_path / "profile-2")
    assert result.returncode == 0, result.stderr[-2000:]
    assert _console(result.stderr) == []
    body = next(attrs for tag, attrs in parse(result.stdout).elements if tag == "body")
    sizes = [
        f"true:{img['width']}x{img['height']}" for tag, img in parse(text).elements if tag == "img"
    ]
    assert body.get("data-images") == ",".join(sizes)


@pytest.mark.skipif(
    not os.path.exists(CHROMIUM), reason="needs Chromium (Debian package 'chromium')"
)
def test_browser_check_catches_a_broken_page(tmp_path):
    """The console check above is not vacuous: a fetch the policy blocks is reported."""
    page = tmp_path / "broken.html"
    page.write_text(
        f'<!DOCTYPE html><html><head><meta http-equiv="Content-Security-Policy" '
        f'content="{CONTENT_SECURITY_POLICY}"></head><body><img src="https://example.invalid/x.png">'
        "</body></html>"
    )
    result = _chromium(page.as_uri(), tmp_path / "profile")
    assert any("Content Security Policy" in line for line in _console(result.stderr))


# -- headroom and the peak's breakdown ---------------------------------------------------
@pytest.fixture(scope="module")
def broken_down(tmp_path_factory):
    """A report of a run whose file has the device's size and a breakdown per record; the
    second record (epoch 1, iteration 4) has the run's highest peak, 40% of the device."""
    from .peak_columns import add_peak_columns

    folder = tmp_path_factory.mktemp("peak-report")
    path, _ = profile_tiny_model(folder / "csv", units="KB")
    peak = round(pd.read_csv(path)["iteration_peak_allocated"].max() * 1000) * 3
    total = round(peak * 100 / 40)
    expected = add_peak_columns(path, device_total=total, peak_scale={1: 3})
    out = write_html(load_run(path), folder / "report.html", unit="B")
    return {"html": out, "csv": path, "expected": expected, "total": total}


def _percent(fraction: float) -> str:
    return f"{fraction * 100:.0f}%"


def test_the_peak_section(broken_down):
    import html
    import re

    from pytorch_mem_profiler.stats import PEAK_CATEGORIES, PEAK_CATEGORY_LABELS

    text = broken_down["html"].read_text(encoding="utf-8")
    page = parse(text)
    expected, total = broken_down["expected"], broken_down["total"]
    b = lambda n: format_amount(n, "B", digits=3)  # noqa: E731
    record = expected.iloc[1]
    assert record["peak"] == expected["peak"].max()

    assert "peak" in {attrs["id"] for tag, attrs in page.elements if tag == "h2"}
    headroom = html.unescape(re.search(r'<p id="headroom">(.*?)</p>', text).group(1))
    assert headroom.startswith(f"Headroom: peak {b(record['peak'])} of {b(total)} (40%); reserved at most ")

    # the run's peak, largest first, the parts summing to it
    ranked = sorted(
        ((c, int(record[c])) for c in PEAK_CATEGORIES if record[c] > 0), key=lambda kv: -kv[1]
    )
    assert page.tables["peak-table"] == [["Category", "At the peak", "Share of the peak"]] + [
        [PEAK_CATEGORY_LABELS[c], b(n), _percent(n / record["peak"])] for c, n in ranked
    ]
    assert sum(n for _, n in ranked) == record["peak"]

    # per epoch: its highest-peak record, every category
    assert page.tables["peak-epochs-table"][0] == ["Epoch", "Iteration", "Peak"] + [
        PEAK_CATEGORY_LABELS[c] for c in PEAK_CATEGORIES
    ]
    for cells, position in zip(page.tables["peak-epochs-table"][1:], (1, 2)):
        row = expected.iloc[position]
        assert cells == [str(row["epoch"]), str(row["iteration"]), b(row["peak"])] + [
            b(row[c]) for c in PEAK_CATEGORIES
        ]

    epochs = page.tables["epoch-table"]
    assert epochs[0][-2:] == ["Peak of device", "Largest at the peak"]
    assert epochs[1][-2:] == ["40%", f"feature maps (saved for backward) {_percent(record['activations'] / record['peak'])}"]
    second = expected.iloc[2]
    assert epochs[2][-2:] == [
        _percent(second["peak"] / total),
        f"optimizer state {_percent(second['optimizer_state'] / second['peak'])}",
    ]

    # each record's peak as a share of the device
    records = page.tables["records-table"]
    column = records[0].index("Peak of device")
    assert [row[column] for row in records[1:]] == [_percent(p / total) for p in expected["peak"]]
    assert "Cache slack" in records[0] and "Reserved" in records[0] and "Cached" not in records[0]


def test_the_peak_chart_is_inline(broken_down):
    pytest.importorskip("matplotlib")
    page = parse(broken_down["html"].read_text(encoding="utf-8"))
    figures = [attrs["id"] for tag, attrs in page.elements if tag == "figure"]
    assert figures == ["chart-memory", "chart-layers", "chart-time", "chart-peak"]
    images = [attrs for tag, attrs in page.elements if tag == "img"]
    assert len(images) == 4
    peak = images[-1]
    assert peak["src"].startswith("data:image/png;base64,")
    assert (int(peak["width"]), int(peak["height"])) == (1200, 260)
    assert "script" not in [tag for tag, _ in page.elements]


def test_older_files_have_no_peak_section(report):
    text = report["html"].read_text(encoding="utf-8")
    page = parse(text)
    assert 'id="headroom"' not in text and 'id="peak"' not in text
    assert "peak-table" not in page.tables
    assert page.tables["epoch-table"][0][-1] == "Fastest iteration"
    assert "fragmentation" not in text.lower()


@pytest.mark.skipif(
    not os.path.exists(CHROMIUM), reason="needs Chromium (Debian package 'chromium')"
)
def test_the_peak_report_opens_in_a_browser(broken_down, tmp_path):
    pytest.importorskip("matplotlib")
    result = _chromium(broken_down["html"].as_uri(), tmp_path / "profile")
    assert result.returncode == 0, result.stderr[-2000:]
    assert _console(result.stderr) == []
    dom = parse(result.stdout)
    assert dom.tables["peak-table"] == parse(broken_down["html"].read_text(encoding="utf-8")).tables["peak-table"]
    assert len([1 for tag, _ in dom.elements if tag == "img"]) == 4


# -- the per-epoch bars, in HTML ---------------------------------------------------------
def _bars(page: Page) -> dict[int, tuple[dict[str, str], list[dict[str, str]]]]:
    """Each epoch's bar: the row's attributes and its parts' attributes, in order."""
    bars: dict[int, tuple[dict[str, str], list[dict[str, str]]]] = {}
    current = None
    for tag, attrs in page.elements:
        if tag == "div" and attrs.get("class") == "peakrow":
            current = int(attrs["data-epoch"])
            bars[current] = (attrs, [])
        elif tag == "span" and attrs.get("class") == "seg":
            bars[current][1].append(attrs)
    return bars


def _csv_epoch_peaks(path: Path) -> dict[int, pd.Series]:
    """Straight from the CSV file: each epoch's highest-peak row (the first of equal ones)."""
    raw = pd.read_csv(path)
    return {int(e): g.loc[g["iteration_peak_allocated"].idxmax()] for e, g in raw.groupby("epoch")}


def _check_bars(bars, path: Path, unit_bytes: int, unit: str) -> None:
    from pytorch_mem_profiler.stats import PEAK_CATEGORIES, PEAK_CATEGORY_LABELS

    rows = _csv_epoch_peaks(path)
    assert sorted(bars) == sorted(rows)
    largest = max(round(r["iteration_peak_allocated"] * unit_bytes) for r in rows.values())
    for epoch, row in rows.items():
        attrs, segments = bars[epoch]
        peak = round(row["iteration_peak_allocated"] * unit_bytes)
        assert int(attrs["data-peak"]) == peak and int(attrs["data-iteration"]) == int(row["iteration"])
        drawn = [c for c in PEAK_CATEGORIES if row[f"peak_{c}"] > 0]
        assert [s["data-category"] for s in segments] == drawn
        values = [round(row[f"peak_{c}"] * unit_bytes) for c in drawn]
        assert [int(s["data-bytes"]) for s in segments] == values
        assert sum(values) == peak
        for s, c, n in zip(segments, drawn, values):
            assert s["title"] == f"{PEAK_CATEGORY_LABELS[c]}: {format_amount(n, unit, digits=3)} ({format_share(n / peak)})"
            width = float(re.search(r"width:([0-9.]+)%", s["style"]).group(1))
            assert width == pytest.approx(100 * n / largest, abs=1e-4)


def test_the_epoch_bars_hold_the_csv_figures(broken_down):
    page = parse(broken_down["html"].read_text(encoding="utf-8"))
    bars = _bars(page)
    assert len(bars) == 2
    _check_bars(bars, broken_down["csv"], 1000, "B")  # the file in KB, the report in bytes


def test_older_files_have_no_epoch_bars(report):
    page = parse(report["html"].read_text(encoding="utf-8"))
    assert _bars(page) == {} and 'id="peak-bars"' not in report["html"].read_text(encoding="utf-8")


def test_bars_of_records_the_export_wrote(tmp_path):
    """Records made by hand, written by the profiler's CSV writer: the HTML bars and the plot's
    bar carry the file's peak_<category> figures; a record without a breakdown draws nothing."""
    from types import MappingProxyType

    from pytorch_mem_profiler.outputs.export import CsvLog
    from pytorch_mem_profiler.stats import PEAK_CATEGORIES, IterationRecord

    def rec(epoch, iteration, peak, **parts):
        breakdown = None
        if parts:
            full = {c: parts.get(c, 0) for c in PEAK_CATEGORIES if c != "other"}
            full["other"] = peak - sum(full.values())
            breakdown = MappingProxyType(full)
        return IterationRecord(
            epoch=epoch, iteration=iteration, step=2 * (epoch - 1) + iteration, device="cuda:0",
            allocated=peak // 2, peak_allocated=peak, iteration_peak_allocated=peak, peak_phase="backward",
            current_cached=peak, weights=1_000_000, weights_by_name=MappingProxyType({"w": 1_000_000}),
            peak_breakdown=breakdown,
        )

    records = [
        rec(1, 1, 9_000_000),  # no breakdown measured on this one
        rec(1, 2, 10_000_000, weights=1_000_000, activations=6_500_000, inputs=40_000),
        rec(2, 1, 12_000_000, weights=1_000_000, gradients=1_000_000, optimizer_state=7_000_000),
        rec(2, 2, 11_000_000, weights=1_000_000, activations=9_000_000),
    ]
    log = CsvLog(tmp_path, ["w"], unit="KB")
    for r in records:
        log.add(r)
    log.close()
    run = load_run(log.path)
    page = parse(render_html(run, unit="KB"))
    bars = _bars(page)
    # epoch 1's highest-peak record with a breakdown is its second; epoch 2's its first
    raw = pd.read_csv(log.path)
    assert [int(bars[1][0]["data-iteration"]), int(bars[2][0]["data-iteration"])] == [2, 1]
    _check_bars(bars, log.path, 1000, "KB")
    assert [int(s["data-bytes"]) for s in bars[1][1]] == [1_000_000, 6_500_000, 40_000, 2_460_000]

    pytest.importorskip("matplotlib")
    from pytorch_mem_profiler.analysis.plot import plot_peak_breakdown

    figure = plot_peak_breakdown(run, unit="KB")
    top = raw.loc[raw["iteration_peak_allocated"].idxmax()]
    drawn = [c for c in PEAK_CATEGORIES if top[f"peak_{c}"] > 0]
    assert [p.get_gid() for p in figure.axes[0].patches] == [f"peak-{c}" for c in drawn]
    assert [p.get_width() for p in figure.axes[0].patches] == pytest.approx([top[f"peak_{c}"] for c in drawn])

    # the same run, no breakdown anywhere: no bars, no peak section
    log = CsvLog(tmp_path / "none", ["w"], unit="KB")
    for r in (rec(1, 1, 9_000_000), rec(1, 2, 8_000_000)):
        log.add(r)
    log.close()
    text = render_html(load_run(log.path))
    assert _bars(parse(text)) == {} and 'id="peak"' not in text


@pytest.mark.skipif(
    not os.path.exists(CHROMIUM), reason="needs Chromium (Debian package 'chromium')"
)
def test_the_epoch_bars_in_a_browser(broken_down, tmp_path):
    """The browser's page has the bars' parts with the CSV's figures, and draws each part as
    wide as its bytes (against the largest epoch peak, on the row's track)."""
    import json

    text = broken_down["html"].read_text(encoding="utf-8")
    result = _chromium(broken_down["html"].as_uri(), tmp_path / "profile-1", "--window-size=1400,900")
    assert result.returncode == 0, result.stderr[-2000:]
    assert _console(result.stderr) == []
    _check_bars(_bars(parse(result.stdout)), broken_down["csv"], 1000, "B")

    policy = CONTENT_SECURITY_POLICY + "; script-src 'unsafe-inline'"
    probe = (
        "<script>window.addEventListener('load', () => document.body.setAttribute('data-bars', "
        "JSON.stringify(Array.from(document.querySelectorAll('.peakrow')).map(r => ({epoch: r.dataset.epoch, "
        "track: r.querySelector('.track').getBoundingClientRect().width, "
        "parts: Array.from(r.querySelectorAll('.seg')).map(s => [s.dataset.category, "
        "Number(s.dataset.bytes), s.getBoundingClientRect().width])})))));</script></body>"
    )
    probed = tmp_path / "probed.html"
    probed.write_text(text.replace(CONTENT_SECURITY_POLICY, policy).replace("</body>", probe), encoding="utf-8")
    result = _chromium(probed.as_uri(), tmp_path / "profile-2", "--window-size=1400,900")
    assert result.returncode == 0, result.stderr[-2000:]
    assert _console(result.stderr) == []
    body = next(attrs for tag, attrs in parse(result.stdout).elements if tag == "body")
    drawn = json.loads(body["data-bars"])
    rows = _csv_epoch_peaks(broken_down["csv"])
    largest = max(round(r["iteration_peak_allocated"] * 1000) for r in rows.values())
    assert [int(r["epoch"]) for r in drawn] == sorted(rows)
    for row in drawn:
        csv_row = rows[int(row["epoch"])]
        assert row["track"] > 300
        for category, nbytes, width in row["parts"]:
            assert nbytes == round(csv_row[f"peak_{category}"] * 1000)
            assert width == pytest.approx(row["track"] * nbytes / largest, abs=1.0)


def test_a_per_layer_file_without_rows_is_said_so(tmp_path):
    """A per-layer file holding its header alone (torch < 2.8 measures no feature maps by layer)
    gets a note saying why there are no layer tables, not the note for a run without the file."""
    path, _ = profile_tiny_model(tmp_path, units="B", by_layer=True)
    header = layers_path(path).read_text().splitlines()[0]
    layers_path(path).write_text(header + "\n")
    text = render_html(load_run(path))
    page = parse(text)
    assert "layers-activations" not in page.tables and "layer-totals" not in page.tables
    assert "per-layer file has no rows" in text and "has no per-layer file" not in text
