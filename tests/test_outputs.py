"""What people read: report modes, log=, progress bars, warnings that show, headroom, the peak's
make-up, folded layers; and outputs that fail alone (a closed pipe, a deleted folder, a full disk)."""

from __future__ import annotations

import gc
import inspect
import io
import logging
import os
import re
import shutil
import subprocess
import sys
import textwrap
import tracemalloc
import warnings
from pathlib import Path
from types import MappingProxyType

import pandas as pd
import pytest
import torch
from torch import nn
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

import pytorch_mem_profiler
from pytorch_mem_profiler import MemoryProfiler, memory_profiler
from pytorch_mem_profiler.measure.saved_tensors import can_chain
from pytorch_mem_profiler.outputs import progress
from pytorch_mem_profiler.outputs.export import (
    EXTRA_COLUMNS,
    NON_AMOUNT_COLUMNS,
    CsvFile,
    CsvLog,
    record_columns,
    record_values,
)
from pytorch_mem_profiler.outputs.headroom import HeadroomWarning, capacity_unit
from pytorch_mem_profiler.outputs.leaks import LeakWarning
from pytorch_mem_profiler.outputs.notices import OutputWarning
from pytorch_mem_profiler.outputs.report import format_compact, format_line, format_report
from pytorch_mem_profiler.outputs.sinks import CsvSink, LayerCsvSink
from pytorch_mem_profiler.stats import PEAK_CATEGORIES, PEAK_CATEGORY_LABELS, IterationRecord
from pytorch_mem_profiler.units import format_amount

from .helpers import mlp, nbytes, needs_saved_tensor_watch, train_step

ROOT = Path(__file__).resolve().parents[1]


# -- helpers ---------------------------------------------------------------------------------
def adam_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the tensors in the optimizer's state, each storage once (computed here)."""
    seen, total = set(), 0
    for state in optimizer.state.values():
        for value in state.values():
            if torch.is_tensor(value) and value.untyped_storage().data_ptr() not in seen:
                seen.add(value.untyped_storage().data_ptr())
                total += value.untyped_storage().nbytes()
    return total


def saved_by_module(model: nn.Module, x: torch.Tensor) -> dict[str, int]:
    """What one forward of ``model`` saves for backward, by the innermost module running, each
    storage once, parameters and the input left out: measured here with our own pack hook."""
    names = {id(m): name for name, m in model.named_modules()}
    skip = {p.untyped_storage().data_ptr() for p in model.parameters()} | {x.untyped_storage().data_ptr()}
    stack, seen, found = [""], set(), {}

    def pre(module, args):
        stack.append(names.get(id(module), stack[-1]))

    def post(module, args, out):
        stack.pop()

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in seen and ptr not in skip:
            seen.add(ptr)
            found[stack[-1]] = found.get(stack[-1], 0) + t.untyped_storage().nbytes()
        return t

    handles = [register_module_forward_pre_hook(pre), register_module_forward_hook(post)]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(x)
    finally:
        for h in handles:
            h.remove()
    stack.pop(0)
    return {name or "(model)": n for name, n in found.items() if name != "(root)"}


def mlp_adam_peak(model: nn.Module, opt: torch.optim.Optimizer, batch: int = 16) -> dict[str, int]:
    """What is alive at the peak of :func:`run_mlp`'s steps after the first, computed by hand.

    The peak is in Adam's step (single-tensor on the CPU), at the largest parameter: ``sqrt()`` of
    its second moment and that divided by the bias correction are two temporaries of its size,
    alive together, while the weights, their gradients, Adam's state, the batch and the model's
    output (``out`` in :func:`train_step`, still referenced) are alive too.
    """
    weights = sum(nbytes(q) for q in model.parameters())
    largest = max(nbytes(q) for q in model.parameters())
    outputs = model[-1].out_features
    return {
        "weights": weights,
        "gradients": weights,
        "optimizer_state": adam_state_bytes(opt),
        "activations": 0,
        "activation_gradients": 0,
        "inputs": batch * 32 * 4,
        "other": batch * outputs * 4 + 2 * largest,
    }


def at_peak_parts(expected: dict[str, int]) -> list[tuple[str, int]]:
    """The nonzero categories, largest first, ties in :data:`PEAK_CATEGORIES` order."""
    return sorted(((k, expected[k]) for k in PEAK_CATEGORIES if expected[k]), key=lambda kv: -kv[1])


def render_terminal(text: str) -> list[str]:
    """The lines a terminal shows for ``text``: a carriage return goes back to the line's start."""
    lines, current, column = [], [], 0
    for ch in text:
        if ch == "\n":
            lines.append("".join(current).rstrip())
            current, column = [], 0
        elif ch == "\r":
            column = 0
        else:
            if column < len(current):
                current[column] = ch
            else:
                current.append(ch)
            column += 1
    lines.append("".join(current).rstrip())
    return lines


def mb(n: float) -> str:
    return format_amount(n, "B")


def run_mlp(profiler: MemoryProfiler, model: nn.Module, opt, iterations: int, batch: int = 16):
    records = []
    for _ in range(iterations):
        train_step(model, opt, torch.randn(batch, 32))
        records.append(profiler.record_stats())
    return records


def _record(**kw) -> IterationRecord:
    base = dict(
        epoch=2,
        iteration=30,
        step=70,
        device="cuda:0",
        allocated=1_200_000_000,
        current_cached=2_800_000_000,
        iteration_peak_allocated=2_500_000_000,
        peak_allocated=2_600_000_000,
        peak_phase="backward",
        device_total=100_000_000_000,
        weights=500_000_000,
        gradients=500_000_000,
        optimizer_state=1_000_000_000,
        feature_maps=300_000_000,
        intermediate_gradients=0,
    )
    base.update(kw)
    return IterationRecord(**base)


BREAKDOWN = {
    "weights": 500_000_000,
    "gradients": 250_000_000,
    "optimizer_state": 1_000_000_000,
    "activations": 600_000_000,
    "activation_gradients": 125_000_000,
    "inputs": 0,
    "other": 25_000_000,
}  # sums to 2,500,000,000: the record's iteration peak


# -- report modes, on a CPU run ----------------------------------------------------------------
def test_compact_mode_line_by_line():
    model = mlp(32, 64, 10)
    opt = torch.optim.Adam(model.parameters())
    out = io.StringIO()
    with memory_profiler(model, 2, stream=out, units="B", by_layer=True, report="compact", strict=True) as p:
        record = run_mlp(p, model, opt, 2)[-1]
    weights = sum(nbytes(q) for q in model.parameters())
    state = adam_state_bytes(opt)
    lines = out.getvalue().splitlines()
    assert lines[0] == "Memory at iteration 2 of epoch 1 (cpu; amounts in bytes)"
    phase = {"forward": "forward", "backward": "backward", "optimizer": "optimizer step"}[record.peak_phase]
    where = "" if record.peak_location is None else f", reached in {record.peak_location or '(model, outside its submodules)'}"
    assert lines[1] == f"  peak {mb(record.iteration_peak_allocated)} during {phase}{where}"
    # after the step, zero_grad() freed the gradients: weights and Adam's state are what is left
    assert record.allocated == weights + state
    assert lines[2] == f"  now: allocated {mb(weights + state)}"  # the CPU caches nothing: no "reserved"
    categories = (
        f"  weights {mb(weights)}, weight gradients {mb(weights)}, optimizer state {mb(state)}, "
        f"feature maps {mb(16 * (64 + 10) * 4)}"
    )
    if record.intermediate_gradients:
        categories += f", intermediate gradients {mb(record.intermediate_gradients)}"
    assert lines[3] == categories
    expected = mlp_adam_peak(model, opt)
    peak = sum(expected.values())
    assert record.peak_phase == "optimizer" and record.iteration_peak_allocated == peak
    assert lines[4] == "  at the peak: " + ", ".join(
        f"{label} {mb(n)} ({100 * n / peak:.1f}%)"
        for label, n in ((PEAK_CATEGORY_LABELS[k], n) for k, n in at_peak_parts(expected))
    )
    saved = saved_by_module(model, torch.randn(16, 32))
    assert saved == {"1": 16 * 64 * 4}  # ReLU keeps its output; the Linears save the batch and that
    # 'other' at the peak: all of it made by this iteration (nothing foreign in this process): the
    # model's output, still referenced, and Adam's two temporaries of the largest parameter's size
    other, step = expected["other"], 2 * max(nbytes(q) for q in model.parameters())
    assert record.peak_other_before == 0 and record.peak_step_temporaries == step
    assert lines[5] == (
        f"  other {mb(other)}: {mb(other)} made by this iteration outside the model's tensors "
        f"(the loss, outputs, temporaries), of which {mb(step)} the optimizer step's temporaries"
    )
    if not can_chain():  # torch < 2.8 measures no feature maps by layer: no top layers
        assert record.layers is None and len(lines) == 6, lines
        return
    assert lines[6] == "  top layers (feature maps saved for backward):"
    assert re.fullmatch(rf"    1\.+{16 * 64 * 4} B 100\.0%", lines[7]), lines[7]
    assert len(lines) == 8


def test_line_mode_is_one_line_per_report():
    model = mlp(32, 64, 10)
    opt = torch.optim.Adam(model.parameters())
    out = io.StringIO()
    with memory_profiler(model, 2, stream=out, units="B", report="line", strict=True, by_layer=True) as p:
        records = run_mlp(p, model, opt, 4)
        p.epoch_end()
    weights = sum(nbytes(q) for q in model.parameters())
    state = adam_state_bytes(opt)
    lines = out.getvalue().splitlines()
    assert len(lines) == 3 and lines[2] == "Epoch 1 finished"
    for line, record in zip(lines, (records[1], records[3])):
        phase = {"forward": "forward", "backward": "backward", "optimizer": "optimizer step"}[record.peak_phase]
        extra = f", intermediate gradients {mb(record.intermediate_gradients)}" if record.intermediate_gradients else ""
        expected = mlp_adam_peak(model, opt)
        peak = sum(expected.values())
        assert record.iteration_peak_allocated == peak
        largest, n = at_peak_parts(expected)[0]
        assert line == (
            f"memory epoch 1 iteration {record.iteration} | peak {mb(record.iteration_peak_allocated)} during {phase}"
            f" | allocated {mb(weights + state)}"
            f" | weights {mb(weights)}, weight gradients {mb(weights)}, optimizer state {mb(state)},"
            f" feature maps {mb(16 * 74 * 4)}{extra}"
            f" | largest at the peak: {PEAK_CATEGORY_LABELS[largest]} {100 * n / peak:.1f}%"
            f" | {record.iteration_time_s * 1e3:.1f} ms"
        )


def test_full_mode_stays_the_seed_layout_by_default():
    model = mlp(32, 64, 10)
    out = io.StringIO()
    with memory_profiler(model, 1, stream=out) as p:
        record = run_mlp(p, model, None, 1)[0]
    assert out.getvalue() == format_report(record, "MB") + "\n"
    assert out.getvalue().splitlines()[1] == "Memory Usage for Iteration 1 of Epoch 1"
    assert "  0.weight" in out.getvalue()  # every parameter, as the original printed them


def test_reports_go_through_a_logger(capsys):
    records_seen: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records_seen.append(record)

    logger = logging.getLogger("tests.memory_reports")
    logger.setLevel(logging.INFO)
    logger.propagate = False
    handler = Keep()
    logger.addHandler(handler)
    try:
        model = mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with memory_profiler(model, 2, log=logger, report="compact", strict=True) as p:
            records = run_mlp(p, model, opt, 4)
            p.epoch_end()
    finally:
        logger.removeHandler(handler)
    messages = [(r.levelno, r.getMessage()) for r in records_seen]
    assert messages == [
        (logging.INFO, format_compact(records[1], "MB")),
        (logging.INFO, format_compact(records[3], "MB")),
        (logging.INFO, "Epoch 1 finished"),
    ]
    captured = capsys.readouterr()
    assert captured.out == "" and "Memory at" not in captured.err


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(report="wide"), ValueError, r"report must be one of 'full', 'compact', 'line'; got 'wide'"),
        (dict(report=None), ValueError, r"report must be one of"),
        (dict(log="train.log"), TypeError, r"log must be a logging.Logger .*got str"),
        (dict(log=logging.getLogger("x"), stream=io.StringIO()), ValueError, r"give stream or log, not both"),
    ],
)
def test_bad_report_options_name_the_argument(kwargs, error, match):
    with pytest.raises(error, match=match):
        memory_profiler(nn.Linear(2, 2), 1, **kwargs)


# -- progress bars ---------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["full", "compact", "line"])
def test_reports_never_land_inside_a_tqdm_bar(mode, monkeypatch):
    tqdm = pytest.importorskip("tqdm").tqdm

    def run(out: io.StringIO) -> list[str]:
        model = mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        reports = []
        with memory_profiler(model, 2, stream=out, report=mode) as p:
            with tqdm(total=6, file=out, mininterval=0, miniters=1, ascii=True, ncols=70) as bar:
                for _ in range(6):
                    train_step(model, opt, torch.randn(4, 32))
                    bar.update(1)
                    p.record_stats()
                    if p.last_report is not None and p.last_report not in reports:
                        reports.append(p.last_report)
        return reports

    out = io.StringIO()
    reports = run(out)
    shown = render_terminal(out.getvalue())
    report_lines = [line for text in reports for line in text.splitlines()]
    assert len(reports) == 3
    # every line of every report is a line of its own on the terminal, the bar's never mixed in
    for line in report_lines:
        assert line.rstrip() in shown, line
    assert not [line for line in shown if "it/s" in line and any(r.strip() and r.strip() in line for r in report_lines)]
    assert shown[-1].startswith("100%|") or shown[-2].startswith("100%|")

    # the same run written straight to the stream glues the first report line to the bar
    monkeypatch.setattr(progress, "active_bar_class", lambda: None)
    out = io.StringIO()
    reports = run(out)
    first = reports[0].splitlines()[0]
    assert any("|" in line and line.endswith(first) and line != first for line in render_terminal(out.getvalue()))


# -- warnings that show ----------------------------------------------------------------------
_LEAKING_LOOP = """
import io, sys, torch
sys.path.insert(0, {root!r})
from pytorch_mem_profiler import memory_profiler
torch.manual_seed(0)
model = torch.nn.Linear(32, 8)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
profiler = memory_profiler(model, 1, stream=io.StringIO(), leak_window=5)
kept = []
for _ in range(15):
    loss = model(torch.randn(4, 32)).pow(2).mean()
    loss.backward(); opt.step(); opt.zero_grad()
    kept.append(loss)  # keeps each loss alive
    profiler.record_stats()
profiler.close()
"""


def test_leak_warning_shows_under_default_filters_at_the_users_line(tmp_path):
    script = tmp_path / "leaky.py"
    script.write_text(_LEAKING_LOOP.format(root=str(ROOT)))
    line = next(i for i, text in enumerate(script.read_text().splitlines(), 1) if "profiler.record_stats()" in text)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    shown = [text for text in proc.stderr.splitlines() if "LeakWarning" in text]
    assert shown == [
        f"{script}:{line}: LeakWarning: pytorch_mem_profiler: allocated memory grows by 0.00000400 MB per "
        "iteration since iteration 1 of epoch 1 (5 reported iterations in a row); what grew: tensors kept alive "
        "by the training loop (not weights, gradients, optimizer state or buffers), e.g. a loss summed with its "
        "graph or a list of outputs"
    ]


def test_leak_warning_points_at_record_stats_and_is_logged_once():
    assert issubclass(LeakWarning, UserWarning) and not issubclass(LeakWarning, ResourceWarning)
    logged: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            logged.append(record.getMessage())

    handler = Keep()
    package_log = logging.getLogger("pytorch_mem_profiler")
    package_log.addHandler(handler)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    kept, lines = [], set()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.resetwarnings()
            warnings.simplefilter("always")  # so that a second warning would be seen
            with MemoryProfiler(model, 1, stream=io.StringIO(), leak_window=4) as profiler:
                for _ in range(20):
                    loss = model(torch.randn(4, 32)).pow(2).mean()
                    loss.backward()
                    opt.step()
                    opt.zero_grad()
                    kept.append(loss)
                    lines.add(inspect.currentframe().f_lineno + 1)
                    profiler.record_stats()
    finally:
        package_log.removeHandler(handler)
    leaks = [w for w in caught if w.category is LeakWarning]
    assert len(leaks) == 1  # once per cause, over 20 iterations
    assert leaks[0].filename == __file__ and leaks[0].lineno in lines
    assert [m for m in logged if "grows by" in m] == [str(leaks[0].message)]


def test_headroom_warning_once_at_the_users_line_and_in_every_mode(monkeypatch):
    """CPU has no capacity: the meter is told one, just above this run's peak."""
    assert pytorch_mem_profiler.HeadroomWarning is HeadroomWarning
    model = mlp()
    opt = torch.optim.Adam(model.parameters())
    out = io.StringIO()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with MemoryProfiler(model, 1, stream=out, units="B", report="line", strict=True) as profiler:
            first = run_mlp(profiler, model, opt, 2)[-1]
            capacity = int(first.iteration_peak_allocated / 0.95)  # the peak is 95% of it
            profiler._meter.capacity = capacity
            lines = []
            for _ in range(5):
                train_step(model, opt, torch.randn(16, 32))
                lines.append(inspect.currentframe().f_lineno + 1)
                record = profiler.record_stats()
    assert record.device_total == capacity
    assert record.peak_share == record.iteration_peak_allocated / capacity
    headroom = [w for w in caught if w.category is HeadroomWarning]
    assert len(headroom) == 1
    assert headroom[0].filename == __file__ and headroom[0].lineno == lines[0]
    message = str(headroom[0].message)
    assert "of the device's" in message and "less than 10% headroom" in message
    assert f"{record.iteration_peak_allocated / capacity:.0%}" in message or "95%" in message
    # the share in the line report
    share = f"{100 * record.iteration_peak_allocated / capacity:.0f}%"
    assert capacity_unit(capacity, "B") == "KB"  # a capacity reads in the largest unit it fills
    of = f"{record.iteration_peak_allocated} B of {format_amount(capacity, 'KB', digits=3)} ({share})"
    assert f"| peak {of} during" in out.getvalue().splitlines()[-1]


def test_headroom_in_every_report_mode():
    record = _record(iteration_peak_allocated=2_500_000_000)  # 2.5% of 100 GB
    assert "Headroom: peak 2500 MB of 100 GB (2.5%), 97.5 GB free" in format_report(record).splitlines()
    assert format_compact(record).splitlines()[1] == "  peak 2500 MB of 100 GB (2.5%) during backward"
    assert "| peak 2500 MB of 100 GB (2.5%) during backward |" in format_line(record)
    on_cpu = _record(device_total=None, device="cpu")
    assert "Headroom" not in format_report(on_cpu) and " of " not in format_compact(on_cpu).splitlines()[1]


# -- the peak's make-up ----------------------------------------------------------------------
def test_at_the_peak_block_follows_the_peak_line():
    record = _record(peak_breakdown=MappingProxyType(BREAKDOWN), peak_location="blocks.3")
    lines = format_report(record).splitlines()
    start = lines.index("Peak during: backward, 2500 MB, reached in blocks.3")
    assert lines[start + 1] == "At the peak (2500 MB):"
    block = lines[start + 2 : start + 8]
    expected = [
        ("optimizer state", "1000 MB", "40.0%"),
        ("feature maps (saved for backward)", "600 MB", "24.0%"),
        ("weights", "500 MB", "20.0%"),
        ("weight gradients", "250 MB", "10.0%"),
        ("intermediate gradients", "125 MB", " 5.0%"),
        ("other", "25 MB", " 1.0%"),
    ]
    for line, (label, amount, share) in zip(block, expected):
        assert re.fullmatch(rf"  {re.escape(label)}\.+{amount} {re.escape(share)}", line), line
    assert lines[start + 8].startswith("  (other 25 MB: ")  # what 'other' holds, in one line
    assert not lines[start + 9].startswith("  ")  # the zero "input batch" is left out
    # the report's unit
    assert "At the peak (2 GiB):" in format_report(record, "GiB").splitlines()
    assert any(re.fullmatch(r"  weights\.+0\.47 GiB 20\.0%", line) for line in format_report(record, "GiB").splitlines())
    assert "  at the peak: optimizer state 1000 MB (40.0%), feature maps (saved for backward) 600 MB (24.0%)" in format_compact(record)
    assert "largest at the peak: optimizer state 40.0%" in format_line(record)
    assert "At the peak" not in format_report(_record())  # no breakdown measured: no block


def test_csv_columns_end_with_headroom_and_the_peak_categories(tmp_path):
    assert EXTRA_COLUMNS[-9:] == (
        "device_total",
        "peak_share",
        "peak_weights",
        "peak_gradients",
        "peak_optimizer_state",
        "peak_activations",
        "peak_activation_gradients",
        "peak_inputs",
        "peak_other",
    )
    assert tuple(f"peak_{c}" for c in PEAK_CATEGORIES) == EXTRA_COLUMNS[-7:]
    assert "peak_share" in NON_AMOUNT_COLUMNS and "device_total" not in NON_AMOUNT_COLUMNS
    log = CsvLog(tmp_path, ["w"], unit="GB")
    log.add(_record(peak_breakdown=MappingProxyType(BREAKDOWN), weights_by_name=MappingProxyType({"w": 10**9})))
    log.add(_record(device_total=None, device="cpu"))
    log.close()
    frame = pd.read_csv(log.path)
    assert list(frame.columns) == record_columns(["w"])
    assert frame.loc[0, "device_total"] == 100.0 and frame.loc[0, "peak_share"] == 0.025
    for category, n in BREAKDOWN.items():
        assert frame.loc[0, f"peak_{category}"] == n / 1e9
    assert frame.loc[1, ["device_total", "peak_share", "peak_weights", "peak_other"]].isna().all()
    from pytorch_mem_profiler.analysis.runs import load_run

    run = load_run(log.path)
    assert run.records["device_total"].iloc[0] == 100e9  # read back in bytes
    assert run.records["peak_activations"].iloc[0] == 600e6


def test_fast_csv_line_equals_the_csv_module(tmp_path):
    import csv

    record = _record(
        peak_breakdown=MappingProxyType(BREAKDOWN),
        weights_by_name=MappingProxyType({"a.weight": 123_456, "b,odd": 7}),
        gradients_by_name=MappingProxyType({"a.weight": 123_456}),
        peak_location='blocks."3",x',
        iteration_time_s=0.0123,
    )
    log = CsvLog(tmp_path, ["a.weight", "b,odd"], unit="MB")
    expected = io.StringIO()
    csv.writer(expected, lineterminator="\n").writerow(record_values(record, log.weight_names, "MB"))
    for _ in range(2):  # the second line reuses the parameters' cells
        assert log.line(record) == expected.getvalue()
    changed = _record(weights_by_name=MappingProxyType({"a.weight": 1, "b,odd": 2}))
    again = io.StringIO()
    csv.writer(again, lineterminator="\n").writerow(record_values(changed, log.weight_names, "MB"))
    assert log.line(changed) == again.getvalue()
    log.close()


# -- folded layers ---------------------------------------------------------------------------
class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.self_attn = nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.ReLU(), nn.Linear(4 * d, d))

    def forward(self, x):
        return x + self.mlp(self.self_attn(x))


class TwelveBlocks(nn.Module):
    def __init__(self, d: int = 32) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(d, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(12))
        self.head = nn.Linear(d, 4)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


@needs_saved_tensor_watch
def test_twelve_blocks_fold_into_one_line_per_repeated_module(csv_dir):
    model = TwelveBlocks()
    x = torch.randn(8, 32)
    saved = saved_by_module(model, x)  # measured here, by module name
    expected: dict[str, list[int]] = {}
    for name, n in saved.items():
        expected.setdefault(re.sub(r"^blocks\.\d+\.", "blocks.[0-11].", name), []).append(n)
    assert sorted(expected) == ["blocks.[0-11].mlp.0", "blocks.[0-11].mlp.1", "blocks.[0-11].self_attn", "head"]
    out = io.StringIO()
    with memory_profiler(model, 1, True, csv_dir=csv_dir, by_layer=True, units="B", stream=out, strict=True) as p:
        model(x).sum().backward()
        record = p.record_stats()
    lines = out.getvalue().splitlines()
    section = lines[lines.index(next(l for l in lines if l.startswith("Feature maps by layer"))) + 1 :]
    total = sum(saved.values())
    assert record.layers.total == total
    shown = {}
    for line in section[: len(expected)]:
        m = re.fullmatch(r"  (\S+?)\.{2,}(\S.*?) +(\d+\.\d)%", line)
        assert m, line
        shown[m.group(1)] = (m.group(2), m.group(3))
    for name, sizes in expected.items():
        share = f"{100 * sum(sizes) / total:.1f}"
        if len(sizes) == 1:
            assert shown[name] == (f"{sizes[0]} B", share)
        else:
            assert len(sizes) == 12 and len(set(sizes)) == 1
            assert shown[name] == (f"12 x {sizes[0]:,} B = {sum(sizes):,} B", share)
    assert not any(re.match(r"  blocks\.\d+\.", line) for line in section)
    # the per-layer CSV keeps every module's own name
    layers = pd.read_csv(p.layers_csv_path)
    by_name = dict(zip(layers.module, layers.bytes))
    for name, n in saved.items():
        assert by_name[name] == n


# -- outputs fail alone ----------------------------------------------------------------------
class ClosingStream(io.StringIO):
    """A stream whose reader goes away after ``writes`` writes (``| head``)."""

    def __init__(self, writes: int) -> None:
        super().__init__()
        self.left = writes

    def write(self, text: str) -> int:
        if self.left <= 0:
            raise BrokenPipeError(32, "Broken pipe")
        self.left -= 1
        return super().write(text)


def test_a_broken_pipe_stops_the_report_only(csv_dir):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    stream = ClosingStream(3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with memory_profiler(model, 1, True, csv_dir=csv_dir, stream=stream, report="line") as p:
            records = run_mlp(p, model, opt, 40)
            p.epoch_end()
    assert all(r is not None for r in records) and not p._guard.disabled
    assert len(stream.getvalue().splitlines()) == 3
    frame = pd.read_csv(p.csv_path)
    assert list(frame.iteration) == list(range(1, 41))
    notes = [str(w.message) for w in caught if w.category is OutputWarning]
    assert len(notes) == 1 and "broken pipe" in notes[0] and "reports stop" in notes[0]


_PIPED_LOOP = """
import sys, time, torch
sys.path.insert(0, {root!r})
from pytorch_mem_profiler import memory_profiler
model = torch.nn.Linear(16, 4)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
profiler = memory_profiler(model, 1, True, csv_dir={csv_dir!r}, report="line")
print(profiler.csv_path, file=sys.stderr, flush=True)
for i in range(40):
    model(torch.randn(4, 16)).sum().backward(); opt.step(); opt.zero_grad()
    profiler.record_stats()
    time.sleep(0.01)
profiler.close()
print("done", file=sys.stderr, flush=True)
"""


def test_python_train_py_piped_into_head(tmp_path):
    """`python train.py | head -3`: the reader closes the pipe; the run and its CSV go on."""
    script = tmp_path / "train.py"
    script.write_text(_PIPED_LOOP.format(root=str(ROOT), csv_dir=str(tmp_path / "csv")))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    head = [proc.stdout.readline() for _ in range(3)]
    proc.stdout.close()  # what `head -3` does after its third line
    _, err = proc.communicate(timeout=120)
    err = err.decode()
    # the reports, and once, at the first row, where the CSV rows go
    assert all(line.startswith((b"memory epoch 1 iteration", b"CSV: a row per report in ")) for line in head)
    assert "done" in err, err
    assert "OutputWarning" in err and "broken pipe" in err
    csv_path = err.splitlines()[0]
    assert list(pd.read_csv(csv_path).iteration) == list(range(1, 41))


OUTPUTS_DIR = str(Path(pytorch_mem_profiler.__file__).parent / "outputs")


def outputs_heap_growth(step, n: int) -> int:
    """Bytes the package's outputs hold more after ``n`` more calls of ``step`` (tracemalloc: what
    was allocated with a line of ``outputs/`` running)."""
    only_outputs = [tracemalloc.Filter(True, OUTPUTS_DIR + os.sep + "*")]
    tracemalloc.start(1)
    try:
        for _ in range(5):
            step()
        gc.collect()
        before = tracemalloc.take_snapshot().filter_traces(only_outputs)
        for _ in range(n):
            step()
        gc.collect()
        after = tracemalloc.take_snapshot().filter_traces(only_outputs)
    finally:
        tracemalloc.stop()
    return sum(stat.size_diff for stat in after.compare_to(before, "traceback"))


def test_a_deleted_csv_folder_is_made_again_with_every_row(csv_dir):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with memory_profiler(
            model, 1, True, csv_dir=csv_dir, by_layer=True, stream=open(os.devnull, "w"), history=1, report="line"
        ) as p:
            run_mlp(p, model, opt, 10)
            shutil.rmtree(csv_dir)
            assert not Path(p.csv_path).exists()

            def step():
                train_step(model, opt, torch.randn(16, 32))
                p.record_stats()

            growth = outputs_heap_growth(step, 100)
    total = 10 + 5 + 100
    frame = pd.read_csv(p.csv_path)  # made again, with the rows written before the folder went
    assert list(frame.iteration) == list(range(1, total + 1))
    layers = pd.read_csv(p.layers_csv_path)  # made again too
    # torch < 2.8 measures no feature maps by layer: the per-layer file holds its header alone
    assert sorted(set(layers.iteration)) == (list(range(1, total + 1)) if can_chain() else [])
    notes = [str(w.message) for w in caught if w.category is OutputWarning]
    assert len(notes) == 2  # one per file
    assert all("was deleted during the run; it was made again" in n for n in notes)
    assert growth < 2_000, growth  # flat: nothing piles up per row (100 rows are ~20 KB)


def test_a_deleted_folder_warns_once_for_the_csv(csv_dir):
    model = mlp()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with memory_profiler(model, 1, True, csv_dir=csv_dir, stream=io.StringIO()) as p:
            for round_ in range(3):
                run_mlp(p, model, None, 5)
                shutil.rmtree(csv_dir)  # three times
            p.epoch_end()  # the last deletion is found when the epoch's rows are synced
    assert list(pd.read_csv(p.csv_path).iteration) == list(range(1, 16))
    assert len([w for w in caught if w.category is OutputWarning]) == 1
    assert p._sink(CsvSink).log.file.remade == 3


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (a disk that is always full)")
def test_a_full_disk_keeps_a_bounded_buffer_and_says_so_once(csv_dir, monkeypatch, caplog):
    """The CSV's descriptor is pointed at /dev/full (every write: ENOSPC), then back."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with memory_profiler(model, 1, True, csv_dir=csv_dir, stream=open(os.devnull, "w"), history=1) as p:
            file = p._sink(CsvSink).log.file
            run_mlp(p, model, opt, 5)
            row_bytes = len(Path(p.csv_path).read_bytes().splitlines()[-1]) + 1
            monkeypatch.setattr(CsvFile, "MAX_PENDING_BYTES", 10 * row_bytes + row_bytes // 2)
            # The bound is ten rows and a half (the peak_<category> columns included): far below
            # what the 150 failed rows below would take if nothing bounded them.
            assert 150 * row_bytes > 10 * CsvFile.MAX_PENDING_BYTES
            real = os.dup(file._fd)
            full = os.open("/dev/full", os.O_WRONLY)
            os.dup2(full, file._fd)
            try:
                run_mlp(p, model, opt, 4)
                assert file.pending == 4 and file.failure is not None and file.failure.errno == 28

                def step():
                    train_step(model, opt, torch.randn(16, 32))
                    p.record_stats()

                growth = outputs_heap_growth(step, 150)
                assert file.pending == 10  # the newest rows only
                assert file.dropped_rows == 4 + 5 + 150 - 10
            finally:
                os.dup2(real, file._fd)
                os.close(real)
                os.close(full)
            run_mlp(p, model, opt, 2)  # the disk has room again: what waits is written
            assert file.pending == 0 and file.failure is None
    frame = pd.read_csv(p.csv_path)
    kept_from = 5 + 4 + 5 + 150 - 10 + 1
    assert list(frame.iteration) == list(range(1, 6)) + list(range(kept_from, 5 + 4 + 5 + 150 + 2 + 1))
    notes = [str(w.message) for w in caught if w.category is OutputWarning]
    assert len(notes) == 1 and "No space left on device" in notes[0] and "wait in memory" in notes[0]
    assert growth < CsvFile.MAX_PENDING_BYTES + 1_000, (growth, 150 * row_bytes)  # bounded: not 150 rows
    assert not p._guard.disabled


def test_short_writes_finish_their_line_before_the_next(tmp_path, monkeypatch):
    """A disk that takes a few bytes, then none: the line begun is finished first, never torn."""
    import pytorch_mem_profiler.outputs.export as export

    real_write = os.write
    budget = {"bytes": None}

    def stingy_write(fd, data):
        if budget["bytes"] is None:
            return real_write(fd, data)
        if budget["bytes"] <= 0:
            raise OSError(28, "No space left on device")
        n = real_write(fd, bytes(data[: min(7, budget["bytes"])]))
        budget["bytes"] -= n
        return n

    log = CsvLog(tmp_path, ["w"], unit="B")
    monkeypatch.setattr(export.os, "write", stingy_write)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        log.add(_record(iteration=1))  # written 7 bytes at a time
        budget["bytes"] = 40
        log.add(_record(iteration=2))  # 40 bytes reach the file, then the disk is full
        assert log.pending == 1 and log.file.failure is not None
        log.add(_record(iteration=3))
        assert log.pending == 2
        budget["bytes"] = None  # room again
        log.add(_record(iteration=4))
    monkeypatch.setattr(export.os, "write", real_write)
    log.close()
    assert log.pending == 0
    frame = pd.read_csv(log.path)
    assert list(frame.iteration) == [1, 2, 3, 4]
    assert frame.allocated.tolist() == [1_200_000_000] * 4
    assert len([w for w in caught if w.category is OutputWarning]) == 1


def test_a_row_is_on_disk_when_record_stats_returns(csv_dir):
    model = mlp()
    with memory_profiler(model, 2, True, csv_dir=csv_dir, by_layer=True, stream=io.StringIO()) as p:
        sizes = []
        for _ in range(4):
            train_step(model, None, torch.randn(4, 32))
            p.record_stats()
            sizes.append((len(pd.read_csv(p.csv_path)), len(set(pd.read_csv(p.layers_csv_path).iteration))))
    # no flush, no epoch end: written as reported (torch < 2.8 writes no per-layer rows)
    assert sizes == ([(0, 0), (1, 1), (1, 1), (2, 2)] if can_chain() else [(0, 0), (1, 0), (1, 0), (2, 0)])
