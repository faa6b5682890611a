"""Repeated layers folded into one line in ``summary`` and the HTML report, on a run of a
12-block model the profiler wrote in the test; the CSV files keep every name."""

from __future__ import annotations

import io
import re

import pandas as pd
import pytest
import torch
from torch import nn

from .helpers import needs_saved_tensor_watch
from .profiled_run import run_cli
from .test_html_report import parse
from pytorch_mem_profiler import memory_profiler
from pytorch_mem_profiler.analysis.html_report import render_html
from pytorch_mem_profiler.analysis.runs import layers_path, load_run
from pytorch_mem_profiler.units import format_amount

BLOCKS = 12


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.self_attn = nn.Linear(32, 32)
        self.mlp = nn.Linear(32, 64)
        self.out = nn.Linear(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.out(torch.relu(self.mlp(self.self_attn(x))))


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.head = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def module_bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


@pytest.fixture(scope="module")
def stack_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("stack")
    torch.manual_seed(0)
    model = Stack()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with memory_profiler(
        model, 1, True, csv_dir=folder, stream=io.StringIO(), units="KB", by_layer=True, strict=True
    ) as profiler:
        for _ in range(2):
            model(torch.randn(16, 32)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
            profiler.record_stats()
    return {"path": profiler.csv_path, "model": model, "folder": folder}


def test_summary_folds_the_blocks(stack_run):
    model = stack_run["model"]
    result = run_cli("summary", stack_run["path"], "--top", "3", cwd=stack_run["folder"])
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    kb = lambda n: format_amount(n, "KB", digits=3)  # noqa: E731
    at = lines.index("Largest layers by weights:")
    # one line per repeated module, count x bytes of one = bytes of all, largest total first
    expected = []
    for name in ("mlp", "out", "self_attn"):
        each = module_bytes(getattr(model.blocks[0], name))
        assert all(module_bytes(getattr(b, name)) == each for b in model.blocks)
        expected.append((f"blocks.[0-11].{name}", each))
    expected.sort(key=lambda kv: -kv[1])
    shown = [re.split(r"\s{2,}", line.strip()) for line in lines[at + 1 : at + 4]]
    assert shown == [[name, f"12 x {kb(each)} =", kb(12 * each)] for name, each in expected]
    assert lines[at + 4] == ""  # --top 3: three groups, the head (smaller than any) left out


@needs_saved_tensor_watch
def test_feature_maps_fold_too_and_the_csv_keeps_every_name(stack_run):
    raw = pd.read_csv(layers_path(stack_run["path"]))
    activations = raw[(raw["category"] == "activations") & raw["module"].notna()]
    activations = activations[~activations["module"].str.startswith("(")]
    # the per-layer file: every block by its own name
    assert {f"blocks.{i}.mlp" for i in range(BLOCKS)} <= set(activations["module"])
    # independently: each module's largest over the run, summed over the 12 blocks
    largest = activations.groupby(["step", "module"])["bytes"].sum().groupby("module").max()
    mlp = largest[[f"blocks.{i}.mlp" for i in range(BLOCKS)]]
    assert mlp.nunique() == 1  # every block saves the same for backward

    page = parse(render_html(load_run(stack_run["path"]), "B"))
    rows = {row[0]: row[1:] for row in page.tables["layers-activations"][1:]}
    b = lambda n: format_amount(n, "B", digits=3)  # noqa: E731
    assert rows["blocks.[0-11].mlp"] == ["12", b(mlp.iloc[0]), b(mlp.sum())]
    assert not any(re.fullmatch(r"blocks\.\d+\.mlp", name) for name in rows)


def test_html_layer_tables_are_grouped(stack_run):
    model = stack_run["model"]
    page = parse(render_html(load_run(stack_run["path"]), "B"))
    table = page.tables["layers-weights"]
    assert table[0] == ["Layer", "Layers", "Each", "weights"]
    b = lambda n: format_amount(n, "B", digits=3)  # noqa: E731
    mlp = module_bytes(model.blocks[0].mlp)
    assert table[1] == ["blocks.[0-11].mlp", "12", b(mlp), b(12 * mlp)]
    head = module_bytes(model.head)
    assert ["head", "1", b(head), b(head)] in table
    assert len(table) == 1 + 4  # three repeated modules and the head
    # the parameter table keeps every name
    names = [row[0] for row in page.tables["parameter-table"][1:]]
    assert names == [n for n, _ in model.named_parameters()]


def test_a_long_parameter_table_is_folded(stack_run):
    text = render_html(load_run(stack_run["path"]))
    count = len(list(stack_run["model"].parameters()))
    assert count > 40
    assert f'<details><summary>{count} parameters</summary><table id="parameter-table">' in text


def test_layers_chart_has_a_bar_per_group(stack_run):
    pytest.importorskip("matplotlib")
    from pytorch_mem_profiler.analysis.plot import plot_layers

    model = stack_run["model"]
    figure = plot_layers(load_run(stack_run["path"]), unit="B")
    ax = figure.axes[0]
    names = [t.get_text() for t in ax.get_yticklabels()]
    assert len(names) == len(set(names))
    assert not any(re.fullmatch(r"blocks\.\d+\..*", name) for name in names)
    weights = next(c for c in ax.containers if c.get_label() == "weights")
    # the mlp group's weight bar: the twelve blocks' mlp weights together, in bytes
    mlp = sum(module_bytes(b.mlp) for b in model.blocks)
    assert weights[names.index("blocks.[0-11].mlp")].get_width() == mlp
