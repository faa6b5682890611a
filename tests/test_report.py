"""The printed report: layout, units, precision."""

from __future__ import annotations

from types import MappingProxyType

import pytest

from pytorch_mem_profiler.outputs.report import REPORT_WIDTH, format_report
from pytorch_mem_profiler.units import format_amount
from pytorch_mem_profiler.stats import IterationRecord


def _record(**kw) -> IterationRecord:
    base = dict(
        epoch=1,
        iteration=85,
        step=85,
        device="cuda:0",
        allocated=600_000_000,
        peak_cached=857_000_000,
        current_cached=857_000_000,
        feature_maps=301_000_000,
        weights=127_000_000,
        weights_by_name=MappingProxyType({"mf_user_embed.weight": 35_454_208, "mlp.0.weight": 262_144}),
        gradients=127_000_000,
        gradients_by_name=MappingProxyType({"mf_user_embed.weight": 35_454_208}),
        intermediate_gradients=34_000_000,
    )
    base.update(kw)
    return IterationRecord(**base)


def test_layout_matches_the_original():
    lines = format_report(_record()).splitlines()
    assert lines[0] == "*" * REPORT_WIDTH
    assert lines[1] == "Memory Usage for Iteration 85 of Epoch 1"
    assert lines[3] == "Peak cached..........................857 MB"
    assert lines[4] == "Current cached.......................857 MB"
    assert lines[5] == "Total feature map usage..............301 MB"
    assert lines[6] == ""
    assert lines[7] == "Total layer weight usage.............127 MB"
    assert lines[8] == "  mf_user_embed.weight................35 MB"
    assert lines[9] == "  mlp.0.weight......................0.26 MB"
    assert lines[10] == "Total layer weight gradient usage....127 MB"
    assert lines[11] == "  mf_user_embed.weight grad...........35 MB"
    assert lines[12] == "Intermediate gradients................34 MB"
    assert all(len(line) == REPORT_WIDTH for line in lines[3:13] if line)


def test_new_figures_are_labelled():
    text = format_report(_record(optimizer_state=254_000_000, buffers=1_000, peak_allocated=700_000_000))
    assert "Optimizer state......................254 MB" in text
    assert "Current allocated....................600 MB" in text
    assert "Peak allocated, since start..........700 MB" in text
    assert "(MB = 1,000,000 bytes; device cuda:0)" in text


@pytest.mark.parametrize(
    "nbytes, unit, text",
    [
        (35_454_208, "MB", "35 MB"),  # 138,493 x 64 float32, as the original printed it
        (6_846_464, "MB", "7 MB"),
        (262_144, "MB", "0.26 MB"),  # small layers keep two significant digits
        (4, "MB", "0.0000040 MB"),
        (0, "MB", "0 MB"),
        (2**20, "MiB", "1 MiB"),
        (3 * 10**9, "GB", "3 GB"),
        (2**29, "GiB", "0.5 GiB"),
        (None, "MB", "n/a"),
    ],
)
def test_format_amount(nbytes, unit, text):
    assert format_amount(nbytes, unit) == text


def test_missing_counters_read_na():
    text = format_report(_record(peak_cached=None, intermediate_gradients=None))
    assert "Peak cached" + "." * 29 + "n/a" in text
    assert "Intermediate gradients" + "." * 18 + "n/a" in text


def test_long_names_widen_the_report():
    name = "encoder.layers.11.self_attention.query_key_value.weight"
    text = format_report(_record(weights_by_name=MappingProxyType({name: 10**6})))
    line = next(line for line in text.splitlines() if name in line)
    assert line.endswith("..1 MB") and line.startswith("  " + name)


def test_words_are_torchs():
    """"reserved" and "allocated" as torch says them; the seed's "cached" only in the seed's lines."""
    text = format_report(_record(allocated=600_000_000, current_cached=857_000_000, device_used=2_000_000_000,
                                 outside_pytorch=1_143_000_000))
    assert "Cache slack (reserved - allocated)...257 MB" in text  # 857 - 600
    assert "  reserved by PyTorch................857 MB" in text
    assert "Fragmentation" not in text and "cached by PyTorch" not in text
    assert [line for line in text.splitlines() if "cached" in line.lower()] == [
        "Peak cached..........................857 MB",
        "Current cached.......................857 MB",
    ]
