"""Headroom on a CUDA GPU: the device's capacity and the peak's share of it, in every report mode and
the CSV, against torch's own figures; the warning near the real limit."""

from __future__ import annotations

import io
import warnings

import pandas as pd
import pytest
import torch
from torch import nn

from pytorch_mem_profiler import HeadroomWarning, memory_profiler
from pytorch_mem_profiler.outputs.headroom import capacity_unit, share_text
from pytorch_mem_profiler.units import format_amount

pytestmark = pytest.mark.cuda


def _devices() -> list[int]:
    if not torch.cuda.is_available():
        return [0]
    count = torch.cuda.device_count()
    return sorted({0, count - 1})  # the first, and the last (an index other than 0) where there are several


@pytest.mark.parametrize("index", _devices())
@pytest.mark.parametrize("mode", ["full", "compact", "line"])
def test_headroom_is_the_devices_memory(index, mode, tmp_path):
    device = torch.device("cuda", index)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 1024)).to(device)
    opt = torch.optim.Adam(model.parameters())
    out = io.StringIO()
    with memory_profiler(model, 1, True, csv_dir=tmp_path, stream=out, report=mode, strict=True) as profiler:
        for _ in range(2):
            model(torch.randn(256, 1024, device=device)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            record = profiler.record_stats()
    total = torch.cuda.get_device_properties(index).total_memory
    free_and_total = torch.cuda.mem_get_info(index)
    assert record.device_total == total == free_and_total[1]
    assert record.peak_share == record.iteration_peak_allocated / total
    assert 0 < record.peak_share < 0.5
    # the report says it the same way in every mode: "<peak> MB of <capacity> GB (<share>)"
    unit = capacity_unit(total, "MB")
    assert unit == "GB"
    of = (
        f"{format_amount(record.iteration_peak_allocated, 'MB')} of {format_amount(total, 'GB', digits=3)} "
        f"({share_text(record.iteration_peak_allocated / total)})"
    )
    assert of in profiler.last_report and out.getvalue().endswith(profiler.last_report + "\n")
    # and the CSV: the capacity in the file's unit, the share as a fraction
    frame = pd.read_csv(profiler.csv_path)
    assert frame.device_total.iloc[-1] == total / 1e6
    assert frame.peak_share.iloc[-1] == pytest.approx(record.iteration_peak_allocated / total, rel=1e-12)


def test_headroom_warning_past_90_percent_of_the_device():
    device = torch.device("cuda", 0)
    model = nn.Linear(64, 64).to(device)
    free, total = torch.cuda.mem_get_info(0)
    torch.cuda.empty_cache()
    allocated = torch.cuda.memory_allocated(0)
    # a transient inside forward that takes the peak just past 91% of the device
    transient = int(0.91 * total) - allocated
    if transient > free - 512 * 2**20:
        pytest.skip(f"needs {transient:,} bytes free on the GPU, {free:,} are")

    class Spike(nn.Module):
        def forward(self, x):
            scratch = torch.empty(transient, dtype=torch.uint8, device=x.device)
            del scratch
            return x

    spiky = nn.Sequential(model, Spike())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with memory_profiler(spiky, 1, stream=io.StringIO(), report="line", strict=True) as profiler:
            records = []
            for _ in range(3):
                spiky(torch.randn(8, 64, device=device)).sum().backward()
                records.append(profiler.record_stats())
    record = records[0]
    torch.cuda.empty_cache()
    assert record.device_total == total
    assert record.iteration_peak_allocated >= allocated + transient
    assert record.peak_share > 0.9
    found = [w for w in caught if w.category is HeadroomWarning]
    assert len(found) == 1  # once, though all three iterations passed 90%
    assert found[0].filename == __file__
    message = str(found[0].message)
    assert f"in iteration 1 of epoch 1, {share_text(record.peak_share)} of the device's " in message
    assert f"{format_amount(total, capacity_unit(total, 'MB'), digits=3)} (cuda:0): less than 10% headroom" in message
