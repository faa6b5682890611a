"""The estimate's header names every setting it was made with; each what-if says what it acted on,
and why, where it changed nothing."""

from __future__ import annotations

import functools
import re
import sys
from pathlib import Path

import torch
from torch import nn

from pytorch_mem_profiler.estimate import OPTIMIZATIONS, estimate_memory
from pytorch_mem_profiler.estimate.step import repeated_blocks

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from optimizations import FeedForwardStack  # noqa: E402

MOMENTUM = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 10))


def header(report: str) -> list[str]:
    """The report's lines between the title and the first blank line: its settings."""
    lines = report.splitlines()
    start = lines.index("Estimated memory of one training step") + 2
    return lines[start : lines.index("", start)]


def test_the_header_names_every_setting():
    est = estimate_memory(
        FeedForwardStack(32, 3),
        torch.zeros(4, 16, 32),
        device="cuda",
        emulate=True,
        autocast=torch.bfloat16,
        checkpointing=True,
        optimizer=MOMENTUM,
        outside=123_000_000,
        workspace=4_000_000,
        fit=False,
    )
    blocks = repeated_blocks(FeedForwardStack(32, 3))
    assert blocks == ["blocks.0", "blocks.1", "blocks.2"]
    assert est.checkpointed == tuple(blocks)
    assert header(est.format("MB")) == [
        "Device: cuda, fake tensors on the CPU standing in for it",
        "Batch size: 4",
        "Autocast: bf16 (the forward under torch.autocast)",
        "Gradient checkpointing: 3 modules (the model's repeated blocks): blocks.0, blocks.1, blocks.2",
        "Optimizer: SGD(lr=0.1, momentum=0.9)",
        "Allowed outside PyTorch: 123 MB (the CUDA context; outside=)",
        "Workspace allowed: 4 MB (cuBLAS; workspace=)",
    ]
    # the allowances named are those counted in what the device needs
    assert est.required == est.needed + 123_000_000 and est.workspace == 4_000_000


def test_the_header_says_what_is_off():
    est = estimate_memory(mlp(), torch.zeros(8, 64), device="cpu", fit=False)
    assert header(str(est)) == [
        "Device: cpu, fake tensors on it",
        "Batch size: 8",
        "Autocast: off (the model's own dtypes)",
        "Gradient checkpointing: off",
        "Optimizer: Adam",
        "Allowed outside PyTorch: 0 MB (none off CUDA; outside=)",
        "Workspace allowed: 0 MB (none off CUDA; workspace=)",
    ]
    fp16 = estimate_memory(mlp(), torch.zeros(8, 64), device="cpu", autocast="fp16", fit=False)
    assert "Autocast: fp16 (the forward under torch.autocast)" in header(str(fp16))


def test_the_command_names_its_settings_in_the_header(tmp_path, capsys):
    from pytorch_mem_profiler.analysis.cli import main

    path = tmp_path / "model.py"
    path.write_text(
        "import torch\nfrom torch import nn\nbatch_size = 16\n"
        "def build_model():\n    return nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 4))\n"
        "def example_inputs(batch_size):\n    return torch.randn(batch_size, 32)\n"
    )
    args = ["estimate", str(path), "--device", "cpu", "--autocast", "bf16", "--checkpointing"]
    assert main(args + ["--optimizer", "sgd", "--batch-size", "8", "--units", "KB"]) == 0
    lines = header(capsys.readouterr().out)
    assert lines[:5] == [
        "Device: cpu, fake tensors on it",
        "Batch size: 8",
        "Autocast: bf16 (the forward under torch.autocast)",
        "Gradient checkpointing: 3 modules (the model's repeated blocks): 0, 1, 2",
        "Optimizer: SGD(lr=0.1, momentum=0.9)",
    ]
    assert main(["estimate", str(path), "--device", "cpu", "--autocast", "fp16"]) == 0
    lines = header(capsys.readouterr().out)
    assert "Autocast: fp16 (the forward under torch.autocast)" in lines
    assert "Batch size: 16" in lines and "Gradient checkpointing: off" in lines


def _row(table: str, name: str) -> list[str]:
    line = next(line for line in table.splitlines() if line.startswith(f"| {name} |"))
    return [cell.strip() for cell in re.split(r"(?<!\\)\|", line)[1:-1]]


def test_a_what_if_with_repeated_blocks_names_them_and_its_saving():
    est = estimate_memory(FeedForwardStack(64, 3), torch.zeros(4, 32, 64), device="cpu", fit=False, compare=OPTIMIZATIONS)
    checkpointed = est.alternatives["gradient checkpointing"]
    assert checkpointed.checkpointed == ("blocks.0", "blocks.1", "blocks.2")
    assert checkpointed.peak < est.peak
    table = est.format_comparison("B")
    name, peak, change, acted = _row(table, "gradient checkpointing")
    assert peak == f"{checkpointed.peak_allocated:,} B"
    assert change == f"{100 * (checkpointed.peak_allocated - est.peak_allocated) / est.peak_allocated:+.1f}%"
    assert change.startswith("-")
    assert acted == "checkpointed 3 modules (the model's repeated blocks): blocks.0, blocks.1, blocks.2"
    _, _, change, acted = _row(table, "bf16 autocast")
    assert change.startswith("-") and acted == "the forward under autocast to bf16 (float32 parameters)"
    assert _row(table, "baseline")[2] == "(reference)"


def test_a_what_if_that_finds_nothing_to_act_on_says_why():
    est = estimate_memory(mlp(), torch.zeros(8, 64), device="cpu", fit=False, compare=OPTIMIZATIONS)
    assert repeated_blocks(mlp()) == []
    checkpointed = est.alternatives["gradient checkpointing"]
    assert checkpointed.checkpointed == ()
    assert checkpointed.peak_allocated == est.peak_allocated
    table = est.format_comparison()
    assert "+0.0%" not in table
    _, _, change, acted = _row(table, "gradient checkpointing")
    assert change == (
        "no change: the model has no repeated blocks to checkpoint (give checkpointing=fn to choose modules)"
    )
    assert acted == "nothing"
    # with autocast beside it, the saving is autocast's and the row says checkpointing found nothing
    both = est.alternatives["checkpointing + bf16 autocast"]
    _, _, change, acted = _row(table, "checkpointing + bf16 autocast")
    if both.peak_allocated != est.peak_allocated:
        assert change.endswith("%")
    assert acted.startswith("checkpointed nothing: the model has no repeated blocks to checkpoint")
    assert "Gradient checkpointing: no module: the model has no repeated blocks" in str(checkpointed)


def test_what_ifs_chosen_by_a_function_and_autocast_in_the_models_own_dtype():
    model = mlp().to(torch.bfloat16)
    est = estimate_memory(
        model,
        torch.zeros(8, 64, dtype=torch.bfloat16),
        device="cpu",
        fit=False,
        compare={
            "bf16": {"autocast": torch.bfloat16},
            "no module": {"checkpointing": lambda name, module: False},
            "layer 2": {"checkpointing": lambda name, module: name == "2"},
        },
    )
    assert est.parameter_dtypes == ("bfloat16",)
    table = est.format_comparison()
    assert est.alternatives["bf16"].peak_allocated == est.peak_allocated
    assert _row(table, "bf16")[2] == "no change: autocast to bf16: the model's parameters are already bfloat16"
    assert _row(table, "no module")[2] == (
        "no change: checkpointing=fn chose no module (it returned False for every (name, module))"
    )
    assert est.alternatives["layer 2"].checkpointed == ("2",)
    _, _, change, acted = _row(table, "layer 2")
    assert acted == "checkpointed 1 module (the modules checkpointing=fn chose): 2"
    if est.alternatives["layer 2"].peak_allocated == est.peak_allocated:
        # the peak is in the optimizer step here, where a checkpointed layer holds nothing
        assert change.startswith("no change: what it acted on is not at the peak (")
    else:
        assert change.endswith("%")


def test_autocast_s_weight_copies_are_named_apart_from_the_layer_s_feature_maps():
    """Under autocast a layer holds its input saved for backward and the cast of its weight: the
    report names them apart (``2`` and ``2 [weight copies]``), as the profiler's report does, where
    it listed ``2`` twice."""
    est = estimate_memory(mlp(), torch.zeros(8, 64), device="cpu", autocast="fp16", fit=False)
    lines = str(est).splitlines()
    start = lines.index(next(line for line in lines if line.startswith("Feature maps by layer")))
    names = [line.strip().split(".")[0] for line in lines[start + 1 :] if line.startswith("  ")]
    copies = {m for (m, kind), n in est.layers.by_module.items() if kind == "weight copies" and n}
    assert copies and len(names) == len(set(names))
    assert {f"{m} [weight copies]" for m in copies} <= set(names)
