"""The analysis of a run profiled on a CUDA GPU: headroom against the device's own size, and the
peak's breakdown read back from the file, in summary, report and compare."""

from __future__ import annotations

import io
import re

import pandas as pd
import pytest
import torch
from torch import nn

from pytorch_mem_profiler import memory_profiler
from pytorch_mem_profiler.analysis.compare import compare_runs, comparison_notes
from pytorch_mem_profiler.analysis.html_report import render_html
from pytorch_mem_profiler.analysis.peaks import format_share
from pytorch_mem_profiler.analysis.runs import load_run
from pytorch_mem_profiler.analysis.summary import format_summary
from pytorch_mem_profiler.stats import PEAK_CATEGORIES
from pytorch_mem_profiler.units import format_amount

from .test_html_report import parse

pytestmark = pytest.mark.cuda


def _profile(folder, *, width: int = 256, batch: int = 64):
    torch.manual_seed(0)
    model = nn.Sequential(
        *[nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)) for _ in range(3)]
    ).cuda()
    optimizer = torch.optim.Adam(model.parameters())
    with memory_profiler(model, 2, True, csv_dir=folder, stream=io.StringIO(), units="MB", by_layer=True) as profiler:
        for _ in range(2):
            for _ in range(4):
                model(torch.randn(batch, width, device="cuda")).square().mean().backward()
                optimizer.step()
                optimizer.zero_grad()
                profiler.record_stats()
            profiler.epoch_end()
    torch.cuda.synchronize()
    return profiler.csv_path


@pytest.fixture(scope="module")
def cuda_run(tmp_path_factory):
    path = _profile(tmp_path_factory.mktemp("cuda-analysis"))
    if "device_total" not in pd.read_csv(path):
        pytest.skip("this tree's CSV writer does not write device_total and the peak columns yet")
    return path


def test_headroom_is_the_device_size(cuda_run):
    raw = pd.read_csv(cuda_run)
    run = load_run(cuda_run)
    total = torch.cuda.get_device_properties(0).total_memory
    assert run.device_total == total
    peak = round(raw["peak_allocated"].max() * 1e6)
    reserved = round(raw["peak_cached"].max() * 1e6)
    # the share's text through the one formatter (a small model is well under 1% of a GPU)
    share = lambda n: format_share(n / total)  # noqa: E731
    mb = lambda n: format_amount(n, "MB", digits=3)  # noqa: E731
    assert (
        f"Headroom: peak {mb(peak)} of {mb(total)} ({share(peak)}); "
        f"reserved at most {mb(reserved)} ({share(reserved)})"
    ) in format_summary(run).splitlines()


def test_breakdown_sums_to_the_peak_in_summary_and_report(cuda_run):
    run = load_run(cuda_run)
    assert run.has_peak_breakdown
    columns = [f"peak_{c}" for c in PEAK_CATEGORIES]
    # every record with a breakdown: its parts sum to its iteration peak, to the byte
    measured = run.records.dropna(subset=["peak_weights"])
    assert len(measured)
    assert list(measured[columns].sum(axis=1)) == list(measured["iteration_peak_allocated"])
    highest = measured.loc[measured["iteration_peak_allocated"].idxmax()]
    text = format_summary(run, "B")
    line = next(line for line in text.splitlines() if line.startswith("At the run's peak ("))
    assert line.endswith(f"): {format_amount(highest['iteration_peak_allocated'], 'B', digits=3)}")
    assert f"epoch {int(highest['epoch'])}, iteration {int(highest['iteration'])}" in line
    # Adam's state is two moments per weight, alive at every peak after the first step
    table = parse(render_html(run, "B")).tables["peak-table"]
    shown = {row[0]: int(re.sub(r"[^0-9]", "", row[1])) for row in table[1:]}
    assert sum(shown.values()) == highest["iteration_peak_allocated"]
    assert shown["weights"] == run.records["weights"].iloc[-1]


def test_same_model_same_device_has_no_notes(cuda_run, tmp_path):
    other = _profile(tmp_path, batch=128)
    rows = compare_runs([load_run(cuda_run), load_run(other)])
    assert rows[0].device_total == rows[1].device_total == torch.cuda.get_device_properties(0).total_memory
    assert comparison_notes(rows) == []
    assert rows[1].categories["feature_maps"] > rows[0].categories["feature_maps"]
