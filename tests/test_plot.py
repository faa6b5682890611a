"""Charts: the PNG's size, what is stacked, labels and units, matplotlib as an optional extra."""

from __future__ import annotations

import io
import sys

import pandas as pd
import pytest
import torch

from .profiled_run import png_size, profile_tiny_model
from pytorch_mem_profiler import memory_profiler
from pytorch_mem_profiler.analysis.runs import load_run

pytest.importorskip("matplotlib")

from pytorch_mem_profiler.analysis.plot import (  # noqa: E402
    CATEGORIES,
    memory_categories,
    plot_iteration_time,
    plot_layers,
    plot_memory,
)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    path, _ = profile_tiny_model(tmp_path_factory.mktemp("plot"), epochs=3, print_period=1)
    return load_run(path)


@pytest.mark.parametrize("width,height,dpi", [(1200, 600, 100), (800, 500, 80), (1600, 900, 150)])
def test_png_has_the_pixel_size_asked(run, tmp_path, width, height, dpi):
    out = tmp_path / "memory.png"
    plot_memory(run, out, width=width, height=height, dpi=dpi)
    assert png_size(out) == (width, height)


def test_other_charts_write_pngs(run, tmp_path):
    plot_layers(run, tmp_path / "layers.png", width=900, height=400)
    plot_iteration_time(run, tmp_path / "time.png", width=700, height=300)
    assert png_size(tmp_path / "layers.png") == (900, 400)
    assert png_size(tmp_path / "time.png") == (700, 300)


def test_stacked_categories(run):
    parts = memory_categories(run)
    rec = run.records
    assert list(parts.columns) == [column for column, _, _ in CATEGORIES]
    assert list(parts["weights"]) == list(rec["weights"])
    assert list(parts["feature_maps"]) == list(rec["feature_maps"])
    known = rec[
        ["weights", "gradients", "optimizer_state", "feature_maps", "intermediate_gradients"]
    ].sum(axis=1)
    expected_other = (rec["iteration_peak_allocated"] - known).clip(lower=0)
    assert list(parts["other"]) == list(expected_other)
    # where "other" is positive, the stack's top is the iteration's peak
    top = parts.sum(axis=1)
    positive = parts["other"] > 0
    assert positive.any()
    assert list(top[positive]) == list(rec["iteration_peak_allocated"][positive])


def test_memory_chart_labels_units_and_epochs(run):
    figure = plot_memory(run, unit="KiB")
    ax = figure.axes[0]
    assert ax.get_ylabel() == "Memory (KiB, 1 KiB = 1,024 bytes)"
    assert "Iteration" in ax.get_xlabel()
    labels = [text.get_text() for text in ax.get_legend().get_texts()]
    assert labels[:2] == ["reserved", "peak allocated, this iteration"]
    assert sorted(labels[2:]) == sorted(label for _, label, _ in CATEGORIES)
    # the reserved line is current_cached, in KiB
    reserved = next(line for line in ax.lines if line.get_label() == "reserved")
    assert list(reserved.get_ydata()) == pytest.approx(list(run.records["current_cached"] / 1024))
    # one label per epoch, a boundary line between epochs
    epoch_labels = [t.get_text() for t in ax.texts if t.get_text().startswith("epoch ")]
    assert epoch_labels == ["epoch 1", "epoch 2", "epoch 3"]
    boundaries = [line for line in ax.lines if line.get_linestyle() == ":"]
    assert len(boundaries) == 2
    steps = run.records["step"]
    assert (
        boundaries[0].get_xdata()[0]
        == (steps[run.records["epoch"] == 1].max() + steps[run.records["epoch"] == 2].min()) / 2
    )


def test_a_single_record_is_drawn(tmp_path):
    model = torch.nn.Linear(8, 8)
    with memory_profiler(model, 1, True, csv_dir=tmp_path, stream=io.StringIO()) as profiler:
        model(torch.randn(4, 8)).sum().backward()
        profiler.record_stats()
    figure = plot_memory(load_run(profiler.csv_path), tmp_path / "one.png", width=600, height=300)
    assert png_size(tmp_path / "one.png") == (600, 300)
    lo, hi = figure.axes[0].get_xlim()
    assert hi - lo == pytest.approx(1.0)


def test_bad_size_is_named(run):
    with pytest.raises(ValueError, match="width must be an integer >= 1, got 0"):
        plot_memory(run, width=0)


def test_without_matplotlib_the_error_says_what_to_install(run, monkeypatch, capsys):
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    with pytest.raises(
        ImportError, match=r"pip install 'pytorch_mem_profiler\[plot\]' to draw plots"
    ):
        plot_memory(run)

    from pytorch_mem_profiler.analysis.cli import main

    assert main(["plot", str(run.path), "-o", "unused.png"]) == 2
    err = capsys.readouterr().err
    assert (
        err
        == "pytorch-mem-profiler: error: pip install 'pytorch_mem_profiler[plot]' to draw plots\n"
    )

    from pytorch_mem_profiler.analysis.html_report import render_html

    page = render_html(run)
    assert 'id="no-charts"' in page and "pytorch_mem_profiler[plot]" in page
    assert "<img" not in page


def test_layers_chart_orders_by_size(run):
    figure = plot_layers(run)
    ax = figure.axes[0]
    names = [t.get_text() for t in ax.get_yticklabels()]
    sizes = run.weights.iloc[-1].groupby(lambda n: n.rpartition(".")[0]).sum()
    grads = run.gradients.max().groupby(lambda n: n.rpartition(".")[0]).sum()
    expected = (sizes + grads).sort_values(ascending=False)
    assert names == list(expected.index)
    assert isinstance(expected, pd.Series)
