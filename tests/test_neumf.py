"""The README's demo: NeuMF with the MovieLens-20M sizes reads 35, 7, 71 and 14 MB."""

from __future__ import annotations

import io
import re
import sys
from pathlib import Path

import pytest
import torch

from pytorch_mem_profiler import MemoryProfiler

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from neumf import NUM_ITEMS, NUM_USERS, NeuMF  # noqa: E402

EMBEDDINGS = {
    "mf_user_embed.weight": (NUM_USERS * 64 * 4, "35 MB"),
    "mf_item_embed.weight": (NUM_ITEMS * 64 * 4, "7 MB"),
    "mlp_user_embed.weight": (NUM_USERS * 128 * 4, "71 MB"),
    "mlp_item_embed.weight": (NUM_ITEMS * 128 * 4, "14 MB"),
}


def check_neumf_report(device: torch.device, batch: int) -> None:
    torch.manual_seed(0)
    model = NeuMF().to(device)
    opt = torch.optim.Adam(model.parameters())
    stream = io.StringIO()
    with MemoryProfiler(model, 1, stream=stream, strict=True) as profiler:
        users = torch.randint(0, NUM_USERS, (batch,), device=device)
        items = torch.randint(0, NUM_ITEMS, (batch,), device=device)
        labels = torch.randint(0, 2, (batch,), device=device).float()
        torch.nn.functional.binary_cross_entropy_with_logits(model(users, items), labels).backward()
        opt.step()
        opt.zero_grad()
        record = profiler.record_stats()
    text = stream.getvalue()
    for name, (nbytes, shown) in EMBEDDINGS.items():
        param = dict(model.named_parameters())[name]
        assert record.weights_by_name[name] == param.numel() * param.element_size() == nbytes
        assert record.gradients_by_name[name] == nbytes  # dense embedding gradients
        assert f"  {name}".ljust(43 - len(shown), ".") + shown in text
        assert f"  {name} grad".ljust(43 - len(shown), ".") + shown in text
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    assert record.weights == record.gradients == total
    assert "Total layer weight usage.............127 MB" in text
    assert "Total layer weight gradient usage....127 MB" in text
    assert record.optimizer_state >= 2 * total
    # The seed's whole table, by default (no by_layer): every line has a number.
    assert record.detail == "phases"
    # (a CPU has no allocator cache: its report leaves the two cache lines out)
    cache_lines = ("Peak cached", "Current cached") if device.type != "cpu" else ()
    seed_lines = (*cache_lines, "Total feature map usage", "Total layer weight usage",
                  "Total layer weight gradient usage", "Intermediate gradients")
    for label in seed_lines:
        (line,) = [line for line in text.splitlines() if line.startswith(label + ".")]
        assert re.search(r"\.\d[\d.]* MB$", line), line
    return record


@pytest.mark.default_budget
def test_neumf_report_on_cpu():
    check_neumf_report(torch.device("cpu"), batch=512)


@pytest.mark.default_budget
def test_neumf_intermediate_gradients_by_default_match_the_per_layer_mode():
    """By default (the "phases" level) NeuMF's intermediate gradients are the per-layer mode's, to
    the byte (whose figure tests/test_peak_breakdown.py checks against one computed by hand, in
    both modes): the CPU's breakdown sees every storage, with module boundaries or without."""
    default = check_neumf_report(torch.device("cpu"), batch=512)
    per_layer = neumf_record(torch.device("cpu"), batch=512, by_layer=True)
    assert per_layer.detail == "full"
    assert default.intermediate_gradients == per_layer.intermediate_gradients > 0
    assert dict(default.peak_breakdown) == dict(per_layer.peak_breakdown)
    assert default.intermediate_gradients <= default.iteration_peak_allocated


def neumf_record(device: torch.device, batch: int, **kw):
    torch.manual_seed(0)
    model = NeuMF().to(device)
    opt = torch.optim.Adam(model.parameters())
    with MemoryProfiler(model, 1, stream=io.StringIO(), strict=True, **kw) as profiler:
        users = torch.randint(0, NUM_USERS, (batch,), device=device)
        items = torch.randint(0, NUM_ITEMS, (batch,), device=device)
        labels = torch.randint(0, 2, (batch,), device=device).float()
        torch.nn.functional.binary_cross_entropy_with_logits(model(users, items), labels).backward()
        opt.step()
        opt.zero_grad()
        return profiler.record_stats()


def test_the_demo_prints_the_compact_report_and_writes_its_csv(tmp_path, capsys):
    import pandas as pd
    from neumf import main

    main(["--epochs", "1", "--iterations", "2", "--print-period", "1", "--batch-size", "256",
          "--device", "cpu", "--csv-dir", str(tmp_path)])
    out = capsys.readouterr().out
    heads = [line for line in out.splitlines() if line.startswith("Memory at iteration")]
    assert heads == [
        "Memory at iteration 1 of epoch 1 (cpu; MB = 1,000,000 bytes)",
        "Memory at iteration 2 of epoch 1 (cpu; MB = 1,000,000 bytes)",
    ]
    assert "  weights 127 MB, weight gradients 127 MB" in out
    (csv,) = [p for p in tmp_path.glob("memory_stats_*.csv") if not p.name.endswith("_layers.csv")]
    assert len(pd.read_csv(csv)) == 2
