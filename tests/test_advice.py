"""Advice from the peak's make-up: each line's bytes against the figure computed here from the
record's fields (and, for checkpointing, from what a pack hook saw each block save); the
thresholds; the report's modes; a record without a breakdown gets none."""

from __future__ import annotations

import dataclasses
import io
import re
from types import MappingProxyType

import pytest
import torch
from torch import nn

from pytorch_mem_profiler import memory_profiler
from pytorch_mem_profiler.outputs import report as report_module
from pytorch_mem_profiler.outputs.advice import (
    CHECKPOINT_COVER,
    DOMINANT_SHARE,
    MIN_SAVING_SHARE,
    Advice,
    advise,
    format_advice,
)
from pytorch_mem_profiler.outputs.report import format_compact, format_line, format_report
from pytorch_mem_profiler.stats import PEAK_CATEGORIES, IterationRecord, LayerFeatureMaps
from pytorch_mem_profiler.units import format_amount

from .helpers import needs_saved_tensor_watch

PEAK = 2_000_000_000


def breakdown(**parts: int) -> MappingProxyType:
    """A breakdown summing to :data:`PEAK`: the parts given, ``other`` the rest."""
    full = {c: parts.get(c, 0) for c in PEAK_CATEGORIES if c != "other"}
    full["other"] = parts.get("other", PEAK - sum(full.values()))
    assert sum(full.values()) == PEAK
    return MappingProxyType(full)


def record(**kw) -> IterationRecord:
    base = dict(
        epoch=1,
        iteration=4,
        step=4,
        device="cuda:0",
        allocated=900_000_000,
        iteration_peak_allocated=PEAK,
        peak_phase="backward",
        weights=300_000_000,
        gradients=300_000_000,
        optimizer_state=600_000_000,
        forward_passes=1,
        backward_passes=1,
        optimizer_steps=1,
    )
    base.update(kw)
    return IterationRecord(**base)


def layers(by_module: dict[tuple[str, str], int]) -> LayerFeatureMaps:
    return LayerFeatureMaps(
        by_module=MappingProxyType(by_module),
        calls=MappingProxyType({}),
        total=sum(n for (m, _), n in by_module.items() if m != "(input)"),
        inputs=by_module.get(("(input)", "activations"), 0),
        unattributed=0,
    )


# -- checkpointing, on a real per-layer record ---------------------------------------------
class Block(nn.Module):
    def __init__(self, d: int, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(d, hidden)
        self.act = nn.ReLU()
        self.down = nn.Linear(hidden, d)

    def forward(self, x):
        return x + self.down(self.act(self.up(x)))


class Stack(nn.Module):
    """Four blocks of different widths (so the largest one is known) and a small head."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(d, h) for h in (96, 128, 112, 120))
        self.head = nn.Linear(d, 2)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def saved_by_block(model: Stack, x: torch.Tensor) -> dict[str, int]:
    """What each block's forward saved for backward, unique storages, parameters and the batch
    left out (the record counts the batch as the input): seen by a pack hook of this test's
    own, the running block known from its own hooks."""
    running: list[str] = []
    params = {p.untyped_storage().data_ptr() for p in model.parameters()} | {x.untyped_storage().data_ptr()}
    seen: set[int] = set()
    saved: dict[str, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if running and storage.data_ptr() not in params and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            saved[running[-1]] = saved.get(running[-1], 0) + storage.nbytes()
        return t

    handles = []
    for i, block in enumerate(model.blocks):
        handles.append(block.register_forward_pre_hook(lambda _m, _a, name=f"blocks.{i}": running.append(name)))
        handles.append(block.register_forward_hook(lambda *_: running.pop() and None))
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = model(x)
    finally:
        for handle in handles:
            handle.remove()
    del out
    return saved


@needs_saved_tensor_watch
def test_checkpointing_names_the_blocks_and_saves_their_activations_less_the_largest():
    torch.manual_seed(0)
    model = Stack()
    x = torch.randn(64, 16)
    expected_blocks = saved_by_block(model, x)
    assert len(expected_blocks) == 4 and len(set(expected_blocks.values())) == 4
    with memory_profiler(model, 1, stream=io.StringIO(), by_layer=True, strict=True) as p:
        model(x).sum().backward()
        measured = p.record_stats()
    assert measured.layers is not None
    attributed = sum(n for (m, c), n in measured.layers.by_module.items() if c == "activations" and m not in ("", "(input)"))
    # the four blocks hold CHECKPOINT_COVER of it: they are named, the head is not
    assert CHECKPOINT_COVER * attributed <= sum(expected_blocks.values()) < attributed

    # a peak of this model's size, 60% of it activations (the saving must be worth a line)
    peak = 200_000
    parts = {"activations": 120_000, "weights": 50_000, "other": 30_000}
    rec = dataclasses.replace(
        record(),
        iteration_peak_allocated=peak,
        layers=measured.layers,
        peak_breakdown=MappingProxyType({c: parts.get(c, 0) for c in PEAK_CATEGORIES}),
    )
    (advice,) = advise(rec)
    assert advice.kind == "checkpointing" and advice.subject == "blocks.[0-3]"
    assert advice.saves == sum(expected_blocks.values()) - max(expected_blocks.values())
    line = format_advice(advice, "B")
    assert line.startswith(f"checkpointing blocks.[0-3] would save up to {advice.saves} B: ")
    assert f"{sum(expected_blocks.values())} B" in line and f"{max(expected_blocks.values())} B" in line


def test_checkpointing_reads_what_is_alive_at_the_peak_first():
    """peak_layers (alive at the peak) wins over what the forward saved; blocks fold by name."""
    forward = layers({(f"h.{i}.mlp", "activations"): 50_000_000 for i in range(12)})
    alive = {f"h.{i}.attn": 80_000_000 + i for i in range(6)} | {"h.6.mlp": 10, "ln_f": 1_000}
    rec = record(
        layers=forward,
        peak_layers=MappingProxyType(alive),
        peak_breakdown=breakdown(activations=900_000_000),
    )
    blocks = {f"h.{i}": 80_000_000 + i for i in range(6)} | {"h.6": 10}  # ln_f: not needed for the cover
    (advice,) = advise(rec)
    assert advice.subject == "h.[0-6]"
    assert advice.saves == sum(blocks.values()) - max(blocks.values())


def test_no_checkpointing_without_per_layer_figures_or_below_the_threshold():
    per_layer = layers({(f"b.{i}", "activations"): 200_000_000 for i in range(5)})
    assert advise(record(peak_breakdown=breakdown(activations=round(0.9 * PEAK)))) == []
    at = round(DOMINANT_SHARE * PEAK)
    assert [a.kind for a in advise(record(layers=per_layer, peak_breakdown=breakdown(activations=at)))] == ["checkpointing"]
    assert advise(record(layers=per_layer, peak_breakdown=breakdown(activations=at - 1))) == []
    # one block: checkpointing it saves nothing at the peak (backward recomputes it all)
    one = layers({("encoder.fc", "activations"): 900_000_000, ("(input)", "activations"): 1})
    assert advise(record(layers=one, peak_breakdown=breakdown(activations=900_000_000))) == []


# -- the optimizer ------------------------------------------------------------------------
def adam_state(model: nn.Module) -> int:
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 16)).sum().backward()
    opt.step()
    storages = {
        v.untyped_storage().data_ptr(): v.untyped_storage().nbytes()
        for s in opt.state.values()
        for v in s.values()
        if torch.is_tensor(v)
    }
    return sum(storages.values())


def test_eight_bit_optimizer_saves_three_quarters_of_the_state():
    state = adam_state(Stack())
    peak = round(state / 0.5)  # the state is half the peak
    parts = {"optimizer_state": state, "weights": state // 2, "gradients": state // 2}
    parts["other"] = peak - sum(parts.values())
    rec = record(iteration_peak_allocated=peak, optimizer_state=state,
                 peak_breakdown=MappingProxyType({c: parts.get(c, 0) for c in PEAK_CATEGORIES}))
    (advice,) = advise(rec)
    assert advice.kind == "8-bit optimizer" and advice.saves == state * 3 // 4
    assert format_advice(advice, "B") == (
        f"an 8-bit optimizer (bitsandbytes, e.g. AdamW8bit) would save about {state * 3 // 4} B: "
        f"3/4 of the optimizer state's {state} B (each fp32 state in 1 byte)"
    )


def test_foreach_free_step_at_an_optimizer_peak():
    weights = MappingProxyType({"a.weight": 120_000_000, "b.weight": 40_000_000})
    other = 500_000_000
    rec = record(peak_phase="optimizer", weights_by_name=weights, peak_step_temporaries=other,
                 peak_other_before=0,
                 peak_breakdown=breakdown(weights=160_000_000, gradients=160_000_000,
                                          optimizer_state=320_000_000, other=other, inputs=PEAK - 1_140_000_000))
    (advice,) = advise(rec)
    assert advice.kind == "foreach-free step" and advice.saves == other - 2 * 120_000_000
    # temporaries within two of the largest parameter: already a per-parameter step, no advice
    assert advise(dataclasses.replace(rec, peak_step_temporaries=2 * 120_000_000)) == []
    # 'other' that existed before the iteration (another model) is no temporary of the step
    foreign = dataclasses.replace(rec, peak_step_temporaries=0, peak_other_before=other)
    assert advise(foreign) == []
    # no measurement of the step's temporaries: no advice, whatever 'other' holds
    assert advise(dataclasses.replace(rec, peak_step_temporaries=None)) == []
    # the same make-up at a backward peak: the step's temporaries are not what peaks
    assert advise(dataclasses.replace(rec, peak_phase="backward")) == []


def test_set_to_none_at_a_forward_peak_saves_the_gradients():
    grads = 400_000_000
    rec = record(peak_phase="forward", peak_breakdown=breakdown(gradients=grads, weights=400_000_000,
                                                                 activations=300_000_000))
    (advice,) = advise(rec)
    assert (advice.kind, advice.saves) == ("set_to_none", grads)
    assert format_advice(advice) == (
        "optimizer.zero_grad(set_to_none=True) before the forward would save 400 MB: "
        "the previous step's weight gradients, alive at this forward peak"
    )
    # gradient accumulation (several forwards) needs them; a backward peak is another matter
    assert advise(dataclasses.replace(rec, forward_passes=4)) == []
    assert advise(dataclasses.replace(rec, peak_phase="backward")) == []
    # below MIN_SAVING_SHARE of the peak: not worth a line
    small = round(MIN_SAVING_SHARE * PEAK) - 1
    assert advise(record(peak_phase="forward", peak_breakdown=breakdown(gradients=small))) == []


def test_at_most_two_largest_first():
    per_layer = layers({(f"b.{i}.f", "activations"): 100_000_000 for i in range(10)})
    rec = record(
        peak_phase="forward",
        layers=per_layer,
        peak_breakdown=breakdown(activations=900_000_000, optimizer_state=800_000_000, gradients=200_000_000),
    )
    found = advise(rec)
    assert [(a.kind, a.saves) for a in found] == [
        ("checkpointing", 1_000_000_000 - 100_000_000),  # all ten b.N: one family
        ("8-bit optimizer", 600_000_000),
    ]  # set_to_none (200 MB) applies too, but is the third


def test_no_breakdown_no_advice():
    assert advise(record()) == []
    assert advise(record(peak_breakdown=MappingProxyType({c: 0 for c in PEAK_CATEGORIES}),
                         iteration_peak_allocated=0)) == []
    with pytest.raises(ValueError, match="unknown advice kind"):
        format_advice(Advice("faster GPU", 1))


# -- in the report ------------------------------------------------------------------------
def _optimizer_heavy() -> IterationRecord:
    return record(peak_breakdown=breakdown(optimizer_state=1_200_000_000, weights=300_000_000,
                                           gradients=300_000_000, activations=100_000_000))


def test_full_report_prints_advice_after_the_at_the_peak_block():
    lines = format_report(_optimizer_heavy()).splitlines()
    start = lines.index("At the peak (2000 MB):")
    end = start + 1
    while lines[end].startswith("  "):
        end += 1
    assert end - start - 2 == 5  # the five nonzero categories, then what 'other' holds
    assert lines[end - 1].startswith("  (other 100 MB: ")
    assert lines[end : end + 2] == [
        "Advice (from what is alive at the peak):",
        "  an 8-bit optimizer (bitsandbytes, e.g. AdamW8bit) would save about 900 MB: "
        "3/4 of the optimizer state's 1200 MB (each fp32 state in 1 byte)",
    ]
    assert not lines[end + 2].startswith("  ")
    assert "Advice" not in format_report(record())


def test_compact_report_prints_advice_and_the_line_does_not():
    rec = _optimizer_heavy()
    lines = format_compact(rec, "GB").splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("  at the peak: "))
    saves = format_amount(900_000_000, "GB")
    assert lines[at + 1].startswith(f"  other {format_amount(100_000_000, 'GB')}: what no category claims")
    assert lines[at + 2].startswith(f"  advice: an 8-bit optimizer (bitsandbytes, e.g. AdamW8bit) would save about {saves}: ")
    assert "advice" not in format_line(rec) and "8-bit" not in format_line(rec)
    assert not any("advice" in line for line in format_compact(record()).splitlines())


def test_advice_that_fails_never_fails_the_report(monkeypatch):
    def broken(_record):
        raise RuntimeError("a bug in a rule")

    monkeypatch.setattr(report_module, "advise", broken)
    rec = _optimizer_heavy()
    text = format_report(rec)
    assert "At the peak (2000 MB):" in text and "Advice" not in text
    assert "advice" not in format_compact(rec)


def test_a_profiled_run_prints_advice_in_its_report():
    """A record the profiler made, given a breakdown by hand: the printed report carries the advice."""
    model = Stack()
    out = io.StringIO()
    with memory_profiler(model, 1, stream=out, units="B", report="compact", strict=True) as p:
        model(torch.randn(8, 16)).sum().backward()
        rec = p.record_stats()
    peak = rec.iteration_peak_allocated
    parts = {"optimizer_state": peak // 2, "other": peak - peak // 2}
    rec = dataclasses.replace(rec, peak_breakdown=MappingProxyType({c: parts.get(c, 0) for c in PEAK_CATEGORIES}))
    text = format_compact(rec, "B")
    assert re.search(rf"  advice: an 8-bit optimizer .* would save about {peak // 2 * 3 // 4} B: ", text)
