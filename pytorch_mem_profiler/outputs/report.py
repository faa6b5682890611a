"""The printed report: text made from an :class:`~pytorch_mem_profiler.stats.IterationRecord`.

Three layouts, chosen with ``memory_profiler(..., report=...)``:

- ``"full"`` (:func:`format_report`, the default): the original tool's layout,
  every parameter and its gradient, then the figures it lacked (the peak and
  what it is made of, with advice where it applies (:mod:`.advice`), headroom,
  feature maps by layer with repeated blocks folded);
- ``"compact"`` (:func:`format_compact`): a few lines: the peak and headroom,
  the categories, what is alive at the peak and its advice, the top 5 layers (folded), the phase;
- ``"line"`` (:func:`format_line`): one line per report, for long runs and logs (no advice).

No torch here; amounts go through :func:`~pytorch_mem_profiler.units.format_amount`.

Example::

    >>> from pytorch_mem_profiler.stats import IterationRecord
    >>> rec = IterationRecord(epoch=1, iteration=5, step=5, device="cpu", allocated=35_454_208,
    ...                       weights=35_454_208, iteration_peak_allocated=40_000_000)
    >>> print(format_report(rec).splitlines()[1])
    Memory Usage for Iteration 5 of Epoch 1
    >>> print(format_line(rec))
    memory epoch 1 iteration 5 | peak 40 MB | allocated 35 MB | weights 35 MB, weight gradients 0 MB, optimizer state 0 MB, feature maps 0 MB
"""

from __future__ import annotations

import logging
import operator
from dataclasses import fields, replace
from functools import lru_cache
from types import MappingProxyType
from typing import Any, Callable, Mapping

from ..grouping import LayerGroup, group_repeated
from ..stats import ACTIVATIONS, INPUT, PEAK_CATEGORY_LABELS, PHASE_LABELS, IterationRecord, LayerFeatureMaps
from ..units import UNITS, format_amount
from .advice import advise, format_advice
from .headroom import capacity_unit, of_capacity

__all__ = [
    "format_report",
    "format_compact",
    "format_line",
    "format_record",
    "ReportFormatter",
    "REPORT_MODES",
    "dotted_line",
    "REPORT_WIDTH",
    "COMPACT_TOP",
    "skipped_reason",
]

#: The report layouts, by the name ``memory_profiler(..., report=...)`` takes.
REPORT_MODES = ("full", "compact", "line")

#: How many (folded) layers the compact report lists.
COMPACT_TOP = 5

#: Width of the report's lines, the original tool's 43 characters.
REPORT_WIDTH = 43


def dotted_line(label: str, value: str, width: int = REPORT_WIDTH) -> str:
    """``label`` and ``value`` joined by a dot leader to ``width`` (at least two dots)."""
    dots = max(2, width - len(label) - len(value))
    return f"{label}{'.' * dots}{value}"


@lru_cache(maxsize=8192)
def _line(label: str, nbytes: int | None, unit: str, width: int) -> str:
    # Per-layer lines repeat from one report to the next: format each once.
    return dotted_line(label, format_amount(nbytes, unit), width)


@lru_cache(maxsize=64)
def _rows(items: tuple[tuple[str, int], ...], suffix: str, unit: str, width: int) -> tuple[str, ...]:
    # A row per parameter (hundreds in a large model), the same from one report to the next:
    # made once for all of them, found again by one hash of their names and sizes.
    return tuple(dotted_line(f"  {name}{suffix}", format_amount(n, unit), width) for name, n in items)


@lru_cache(maxsize=64)
def _width(names: tuple[str, ...], grad_names: tuple[str, ...]) -> int:
    longest = max([len(n) for n in names] + [len(n) + 5 for n in grad_names] + [0])
    return max(REPORT_WIDTH, longest + 2 + 2 + 10)


def _outside_section(record: IterationRecord, line) -> list[str]:  # type: ignore[no-untyped-def]
    out = ["", line("Device memory in use (nvidia-smi)", record.device_used)]
    out.append(line("  reserved by PyTorch", record.current_cached))
    out.append(line("  outside PyTorch", record.outside_pytorch))
    if record.process_used is not None:
        out.append(line("  this process", record.process_used))
    out.append("  (outside: CUDA context, cuBLAS/NCCL workspaces, other processes)")
    return out


def _short_amount(nbytes: float, unit: str) -> str:
    """Three significant digits without trailing zeros (``3 MB``, ``2.62 MB``), so that
    ``12 x 2.62 MB = 31.4 MB`` adds up on the page."""
    number, _, suffix = format_amount(nbytes, unit, digits=3).partition(" ")
    if "." in number:
        number = number.rstrip("0").rstrip(".")
    return f"{number} {suffix}"


def _layer_groups(record: IterationRecord) -> list[LayerGroup]:
    """The per-layer feature maps with repeated blocks folded, largest first (the input left out)."""
    layers = record.layers
    assert layers is not None
    ranked = sorted(
        ((m, c, n) for (m, c), n in layers.by_module.items() if m != INPUT), key=lambda item: -item[2]
    )
    labels = [(_module_label(m, c, record.model_name), n) for m, c, n in ranked]
    return group_repeated(labels)


def root_label(model_name: str | None) -> str:
    """How the model's own forward (the root module, whose name is ``""``) is named for people.

    Example::

        >>> root_label("NeuMF"), root_label(None)
        ('NeuMF (its own forward)', '(the model, its own forward)')
    """
    return f"{model_name} (its own forward)" if model_name else "(the model, its own forward)"


def _module_label(module: str, category: str, model_name: str | None = None) -> str:
    return (module or root_label(model_name)) + (" [weight copies]" if category != ACTIVATIONS else "")


def _is_cpu(record: IterationRecord) -> bool:
    """On the CPU nothing is cached: reserved equals allocated, and the cache lines say nothing."""
    return record.device.split(":")[0] == "cpu"


#: What ``other`` at the peak holds, for the line that splits it.
OTHER_BEFORE = "existed before this iteration (not this model's parameters, gradients or optimizer state: another model, a cache, tensors kept from earlier iterations)"
OTHER_MADE = "made by this iteration outside the model's tensors (the loss, outputs, temporaries)"
OTHER_UNSPLIT = "what no category claims (the loss, outputs, temporaries, and memory that is not this model's)"


def other_text(record: IterationRecord, unit: str) -> str | None:
    """One line saying what ``other`` at the peak holds; ``None`` where it is 0 or not measured.

    Example::

        >>> from pytorch_mem_profiler.stats import IterationRecord, PEAK_CATEGORIES
        >>> parts = dict.fromkeys(PEAK_CATEGORIES, 0); parts["other"] = 101_000_000
        >>> rec = IterationRecord(epoch=1, iteration=1, step=1, device="cpu", allocated=0,
        ...     peak_breakdown=parts, peak_other_before=100_000_000, peak_step_temporaries=0)
        >>> print(other_text(rec, "MB"))  # doctest: +ELLIPSIS
        other 101 MB: 100 MB existed before this iteration (not this model's ...); 1 MB made by this iteration ...
    """
    breakdown = record.peak_breakdown
    if not breakdown or not breakdown.get("other"):
        return None
    other = breakdown["other"]
    fmt = lambda n: format_amount(n, unit)  # noqa: E731
    before = record.peak_other_before
    if before is None:
        return f"other {fmt(other)}: {OTHER_UNSPLIT}"
    made = other - before
    parts = [f"{fmt(before)} {OTHER_BEFORE}"] if before else []
    if made or not before:
        made_text = f"{fmt(made)} {OTHER_MADE}"
        if record.peak_step_temporaries:
            made_text += f", of which {fmt(record.peak_step_temporaries)} the optimizer step's temporaries"
        parts.append(made_text)
    return f"other {fmt(other)}: " + "; ".join(parts)


def _group_value(group: LayerGroup, unit: str) -> str:
    """``12 x 3 MB = 36 MB`` for a folded group; the amount alone for one module."""
    if group.count == 1:
        return format_amount(group.total, unit)
    if group.per_member is not None:
        return f"{group.count} x {_short_amount(group.per_member, unit)} = {_short_amount(group.total, unit)}"
    return f"{group.count} modules = {_short_amount(group.total, unit)}"


def _calls_suffix(record: IterationRecord, group: LayerGroup) -> str:
    layers = record.layers
    assert layers is not None
    calls = {layers.calls.get(name.removesuffix(" [weight copies]"), 1) for name in group.members}
    if len(calls) == 1 and (n := calls.pop()) > 1:
        return f"  x{n} calls" + (" each" if group.count > 1 else "")
    return ""


def _group_lines(
    record: IterationRecord, unit: str, width: int | None, top: int, indent: str
) -> tuple[list[str], int]:
    """One line per folded group (the first ``top``), then one for the rest; and their width.

    ``width``: of the dotted lines, widened to fit the longest of them.
    """
    layers = record.layers
    assert layers is not None
    total = layers.total
    groups = _layer_groups(record)
    shown = [(f"{indent}{group.name}", _group_value(group, unit), group) for group in groups[:top]]
    width = max([width or REPORT_WIDTH] + [len(label) + len(value) + 2 for label, value, _ in shown])
    out = []
    for label, value, group in shown:
        share = f" {100 * group.total / total:4.1f}%" if total else ""
        out.append(dotted_line(label, value, width) + share + _calls_suffix(record, group))
    rest = groups[top:]
    if rest:
        n_rest = sum(g.total for g in rest)
        share = f" {100 * n_rest / total:4.1f}%" if total else ""
        modules = sum(g.count for g in rest)
        out.append(dotted_line(f"{indent}({modules} more)", format_amount(n_rest, unit), width) + share)
    return out, width


def _layers_section(record: IterationRecord, fmt: Callable[[int | None], str], width: int, top: int, unit: str) -> list[str]:
    layers = record.layers
    assert layers is not None
    total = layers.total
    out = ["", "Feature maps by layer (saved for backward by each module's forward; repeated blocks folded):"]
    lines, width = _group_lines(record, unit, width, top, "  ")
    out += lines
    if layers.inputs:
        out.append(dotted_line("  Input batch (saved)", fmt(layers.inputs), width))
    out.append(dotted_line("  Not saved by a module", fmt(layers.unattributed), width) + "  (outputs, temporaries, checkpoints)")
    out.append(dotted_line("Total by layer", fmt(total), width))
    out.append(dotted_line("Total feature maps (allocator delta)", fmt(record.feature_maps), width))
    return out


def _at_peak(record: IterationRecord) -> tuple[int, list[tuple[str, int]]] | None:
    """(the peak, its nonzero categories largest first), or ``None`` when no breakdown was measured."""
    breakdown = record.peak_breakdown
    if breakdown is None:
        return None
    parts = sorted(((k, v) for k, v in breakdown.items() if v), key=lambda kv: -kv[1])
    total = record.iteration_peak_allocated
    if not total:
        total = sum(v for _, v in parts)
    return total, parts


def _share(part: int, total: int) -> str:
    return f"{100 * part / total:4.1f}%" if total else ""


def _at_peak_section(record: IterationRecord, fmt: Callable[[int | None], str], width: int, unit: str) -> list[str]:
    found = _at_peak(record)
    if found is None:
        return []
    total, parts = found
    out = [f"At the peak ({fmt(total)}):"]
    for name, n in parts:
        out.append(dotted_line(f"  {PEAK_CATEGORY_LABELS.get(name, name)}", fmt(n), width) + " " + _share(n, total))
    other = other_text(record, unit)
    if other is not None:
        out.append(f"  ({other})")
    return out


_log = logging.getLogger("pytorch_mem_profiler")


def _advice_lines(record: IterationRecord, unit: str, indent: str) -> list[str]:
    """The advice (:mod:`.advice`) the record's peak supports, one line each; none if it fails:
    advice is a bonus that must never cost the report."""
    try:
        return [f"{indent}{format_advice(a, unit)}" for a in advise(record)]
    except Exception:  # noqa: BLE001
        _log.debug("no advice for this record", exc_info=True)
        return []


def skipped_reason(record: IterationRecord) -> str | None:
    """Why a reported record's detailed figures are ``None``: ``"skipped: over the 3% budget"``
    for one measured at the ``"light"`` level (the cost budget afforded no more); ``None`` otherwise.

    Example::

        >>> from pytorch_mem_profiler.stats import IterationRecord
        >>> skipped_reason(IterationRecord(epoch=1, iteration=2, step=2, device="cpu", allocated=0,
        ...                                detail="light", overhead_budget=0.03))
        'skipped: over the 3% budget'
    """
    if record.detail != "light" or not record.reported:
        return None
    budget = record.overhead_budget
    if budget is None:
        return "skipped"
    return f"skipped: over the {100 * budget:.3g}% budget"


def _skipped_line(record: IterationRecord, reason: str) -> str:
    return f"Detail: {record.detail} (phases, gradients and the peak's make-up {reason})"


def format_report(record: IterationRecord, unit: str = "MB", top: int = 10) -> str:
    """The report of one iteration, in the original tool's layout plus the figures it lacked.

    ``top``: how many lines (repeated blocks folded into one) the "Feature maps
    by layer" section lists before summing the rest on one line.
    """
    return _report_frame(record, _report_body(record, unit, top))


def _report_body(record: IterationRecord, unit: str, top: int = 10) -> tuple[int, str, str, str]:
    """The full report's text that depends on the figures only: (its width, the stars,
    the lines from "Peak cached" on, the closing line). :func:`_report_frame` adds the rest."""
    fmt = lambda n: format_amount(n, unit)  # noqa: E731
    width = _width(tuple(record.weights_by_name), tuple(record.gradients_by_name))
    skipped = skipped_reason(record)

    line = lambda label, n: _line(label, n, unit, width)  # noqa: E731

    def detailed(label: str, n: int | None) -> str:  # a figure the "light" level does not measure
        return dotted_line(label, "skipped", width) if n is None and skipped is not None else line(label, n)

    cached = [] if _is_cpu(record) else [
        line("Peak cached", record.peak_cached),
        line("Current cached", record.current_cached),
    ]
    out = [
        *cached,
        detailed("Total feature map usage", record.feature_maps),
        "",
        line("Total layer weight usage", record.weights),
    ]
    out += _rows(tuple(record.weights_by_name.items()), "", unit, width)
    out.append(detailed("Total layer weight gradient usage", record.gradients))
    out += _rows(tuple(record.gradients_by_name.items()), " grad", unit, width)
    out.append(detailed("Intermediate gradients", record.intermediate_gradients))
    out += [
        "",
        line("Optimizer state", record.optimizer_state),
        line("Buffers", record.buffers),
    ]
    if record.ddp_gradient_buckets is not None:
        out.append(line("DDP gradient buckets", record.ddp_gradient_buckets))
    if record.fsdp_gathered_parameters is not None:
        out.append(line("FSDP gathered parameters", record.fsdp_gathered_parameters))
    out += [
        line("Current allocated", record.allocated),
        line("Peak allocated, this iteration", record.iteration_peak_allocated),
        line("Peak allocated, since start", record.peak_allocated),
    ]
    if record.device_total and record.iteration_peak_allocated is not None:
        out.append(_headroom_text(record, unit))
    if record.peak_phase is not None and record.iteration_peak_allocated is not None:
        where = PHASE_LABELS.get(record.peak_phase, PHASE_LABELS["other"])
        text = f"Peak during: {where}, {fmt(record.iteration_peak_allocated)}"
        if record.peak_location is not None:
            text += f", reached in {record.peak_location or '(model, outside its submodules)'}"
        out.append(text)
    if skipped is not None:
        out.append(_skipped_line(record, skipped))
    out += _at_peak_section(record, fmt, width, unit)
    advice = _advice_lines(record, unit, "  ")
    if advice:
        out += ["Advice (from what is alive at the peak):", *advice]
    if record.fragmentation is not None and record.current_cached is not None and not _is_cpu(record):
        out.append(line("Cache slack (reserved - allocated)", record.fragmentation))
    if record.device_used is not None:
        out += _outside_section(record, line)
    if record.layers is not None:
        out += _layers_section(record, fmt, width, top, unit)
    return width, "*" * width, "\n".join(out), f"({_unit_note(unit)}; device {record.device})"


def _report_frame(record: IterationRecord, body: tuple[int, str, str, str]) -> str:
    """The full report from its :func:`_report_body` and the record's position and time."""
    return _full_frame(body)(record)


#: The label of the full report's last line but one.
_TIME_LABEL = "Iteration time"

#: A layout's text of one record, whose body (its figures' text) it was made from, then ``end``
#: (``frame(record, end="")``): all but the position and the time is made once per body.
Frame = Callable[..., str]


def _full_frame(body: tuple[int, str, str, str]) -> Frame:
    """Makes the full report of a record whose body is ``body`` (:func:`_report_body`): its
    text but the position and the time made once, for every record that shares the body."""
    width, stars, middle, closing = body
    head = f"{stars}\nMemory Usage for Iteration "
    after_title = f"\n{stars}\n{middle}"
    last = f"\n{closing}"
    room = width - len(_TIME_LABEL)  # dotted_line's, with its label's length taken once

    def frame(record: IterationRecord, end: str = "") -> str:
        seconds = record.iteration_time_s
        if seconds is None:
            return f"{head}{record.iteration} of Epoch {record.epoch}{after_title}{last}{end}"
        value = f"{seconds * 1e3:.1f} ms"
        dots = "." * max(2, room - len(value))
        return f"{head}{record.iteration} of Epoch {record.epoch}{after_title}\n{_TIME_LABEL}{dots}{value}{last}{end}"

    return frame


def _headroom_text(record: IterationRecord, unit: str) -> str:
    """``Headroom: peak 2571 MB of 144 GB (1.8%), 141 GB free``."""
    total, peak = record.device_total, record.iteration_peak_allocated
    assert total and peak is not None
    free = format_amount(total - peak, capacity_unit(total, unit), digits=3)
    return f"Headroom: peak {of_capacity(peak, total, unit)}, {free} free"


def _peak_text(record: IterationRecord, unit: str) -> str:
    """``peak 2571 MB of 144 GB (1.8%) during backward, reached in blocks.3``."""
    text = "peak " + of_capacity(record.iteration_peak_allocated, record.device_total, unit)
    if record.peak_phase is not None and record.iteration_peak_allocated is not None:
        text += f" during {PHASE_LABELS.get(record.peak_phase, PHASE_LABELS['other'])}"
        if record.peak_location is not None:
            text += f", reached in {record.peak_location or '(model, outside its submodules)'}"
    return text


def _categories(record: IterationRecord, unit: str) -> list[str]:
    """The record's categories as ``name amount``: model state, then what one iteration makes."""
    fmt = lambda n: format_amount(n, unit)  # noqa: E731
    parts = [
        f"weights {fmt(record.weights)}",
        f"weight gradients {fmt(record.gradients)}",
        f"optimizer state {fmt(record.optimizer_state)}",
    ]
    if record.buffers:
        parts.append(f"buffers {fmt(record.buffers)}")
    parts.append(f"feature maps {fmt(record.feature_maps)}")
    if record.intermediate_gradients:
        parts.append(f"intermediate gradients {fmt(record.intermediate_gradients)}")
    if record.ddp_gradient_buckets is not None:
        parts.append(f"DDP gradient buckets {fmt(record.ddp_gradient_buckets)}")
    if record.fsdp_gathered_parameters is not None:
        parts.append(f"FSDP gathered parameters {fmt(record.fsdp_gathered_parameters)}")
    return parts


def _now_text(record: IterationRecord, unit: str) -> str:
    text = f"allocated {format_amount(record.allocated, unit)}"
    if record.current_cached is not None and not _is_cpu(record):
        text += f", reserved {format_amount(record.current_cached, unit)}"
    return text


def _unit_note(unit: str) -> str:
    return "amounts in bytes" if UNITS[unit] == 1 else f"{unit} = {UNITS[unit]:,} bytes"


def format_compact(record: IterationRecord, unit: str = "MB", top: int = COMPACT_TOP) -> str:
    """A few lines: the peak with headroom and phase, the categories, the peak's make-up, the top layers.

    Example::

        >>> from pytorch_mem_profiler.stats import IterationRecord
        >>> rec = IterationRecord(epoch=2, iteration=30, step=70, device="cuda:0", allocated=1_200_000_000,
        ...                       current_cached=2_800_000_000, iteration_peak_allocated=2_571_000_000,
        ...                       peak_phase="backward", device_total=143_771_000_000,
        ...                       weights=500_000_000, gradients=500_000_000)
        >>> print(format_compact(rec))
        Memory at iteration 30 of epoch 2 (cuda:0; MB = 1,000,000 bytes)
          peak 2571 MB of 144 GB (1.8%) during backward
          now: allocated 1200 MB, reserved 2800 MB
          weights 500 MB, weight gradients 500 MB, optimizer state 0 MB, feature maps 0 MB
    """
    return _compact_frame(record, _compact_body(record, unit, top))


def _compact_body(record: IterationRecord, unit: str, top: int = COMPACT_TOP) -> tuple[str, str]:
    """The compact report's text that depends on the figures only: (the first line's
    ending, the other lines)."""
    out = [
        "  " + _peak_text(record, unit),
        "  now: " + _now_text(record, unit),
        "  " + ", ".join(_categories(record, unit)),
    ]
    skipped = skipped_reason(record)
    if skipped is not None:
        out.append("  " + _skipped_line(record, skipped))
    found = _at_peak(record)
    if found is not None:
        total, parts = found
        out.append(
            "  at the peak: "
            + ", ".join(
                f"{PEAK_CATEGORY_LABELS.get(k, k)} {format_amount(v, unit)} ({_share(v, total).strip()})"
                for k, v in parts
            )
        )
        other = other_text(record, unit)
        if other is not None:
            out.append("  " + other)
        out += _advice_lines(record, unit, "  advice: ")
    if record.layers is not None:
        out.append("  top layers (feature maps saved for backward):")
        out += _group_lines(record, unit, None, top, "    ")[0]
    return f" ({record.device}; {_unit_note(unit)})", "\n".join(out)


def _compact_frame(record: IterationRecord, body: tuple[str, str]) -> str:
    return _compact_frame_of(body)(record)


def _compact_frame_of(body: tuple[str, str]) -> Frame:
    """Makes the compact report of a record whose body is ``body`` (:func:`_compact_body`)."""
    ending, rest = body
    tail = f"{ending}\n{rest}"

    def frame(record: IterationRecord, end: str = "") -> str:
        return f"Memory at iteration {record.iteration} of epoch {record.epoch}{tail}{end}"

    return frame


def format_line(record: IterationRecord, unit: str = "MB") -> str:
    """One line: the peak with headroom and phase, what is allocated now, the categories, the time.

    Example::

        >>> from pytorch_mem_profiler.stats import IterationRecord
        >>> rec = IterationRecord(epoch=2, iteration=30, step=70, device="cuda:0", allocated=1_200_000_000,
        ...                       iteration_peak_allocated=2_571_000_000, device_total=143_771_000_000)
        >>> format_line(rec)
        'memory epoch 2 iteration 30 | peak 2571 MB of 144 GB (1.8%) | allocated 1200 MB | weights 0 MB, weight gradients 0 MB, optimizer state 0 MB, feature maps 0 MB'
    """
    return _line_frame(record, _line_body(record, unit))


def _line_body(record: IterationRecord, unit: str, top: int = 0) -> str:
    """The one line's middle, which depends on the figures only (``top`` is unused: no layers)."""
    parts = [
        _peak_text(record, unit),
        _now_text(record, unit),
        ", ".join(_categories(record, unit)),
    ]
    found = _at_peak(record)
    if found is not None and found[1]:
        total, at_peak = found
        name, n = at_peak[0]
        parts.append(f"largest at the peak: {PEAK_CATEGORY_LABELS.get(name, name)} {_share(n, total).strip()}")
    skipped = skipped_reason(record)
    if skipped is not None:
        parts.append(f"detail {record.detail} ({skipped})")
    return " | ".join(parts)


def _line_frame(record: IterationRecord, body: str) -> str:
    return _line_frame_of(body)(record)


def _line_frame_of(body: str) -> Frame:
    """Makes the one line of a record whose middle is ``body`` (:func:`_line_body`)."""
    middle = f" | {body}"

    def frame(record: IterationRecord, end: str = "") -> str:
        seconds = record.iteration_time_s
        if seconds is None:
            return f"memory epoch {record.epoch} iteration {record.iteration}{middle}{end}"
        return f"memory epoch {record.epoch} iteration {record.iteration}{middle} | {seconds * 1e3:.1f} ms{end}"

    return frame


def format_record(record: IterationRecord, unit: str = "MB", mode: str = "full") -> str:
    """The report of ``record`` in layout ``mode`` (one of :data:`REPORT_MODES`)."""
    make, frame_of = _LAYOUTS.get(mode, _LAYOUTS["full"])
    return frame_of(make(record, unit))(record)


#: Each layout as (the text made from the figures, the maker of the frame that adds the
#: position and the time to it).
_LAYOUTS: dict[str, tuple[Callable[[IterationRecord, str], Any], Callable[[Any], Frame]]] = {
    "full": (_report_body, _full_frame),
    "compact": (_compact_body, _compact_frame_of),
    "line": (_line_body, _line_frame_of),
}

#: Fields no layout's body reads: the frame's position and time, counters that change at
#: every record (``step``), and ``phases`` (its comparison would cost more than the rest).
#: tests/test_report_cache.py changes every field, these included, to show none is missed.
_NOT_IN_BODY = frozenset({"epoch", "iteration", "iteration_time_s", "step", "rank", "reported", "phases"})

#: A record's figures that the layouts' bodies are made from, as one tuple: read from the
#: record's ``__dict__`` (which holds every field of a record its constructor made) in one
#: call, without a lookup on the class per field; :data:`_figures` reads them one by one.
_FIGURE_NAMES = tuple(f.name for f in fields(IterationRecord) if f.name not in _NOT_IN_BODY)
_figure_items = operator.itemgetter(*_FIGURE_NAMES)
_figures = operator.attrgetter(*_FIGURE_NAMES)


_IMMUTABLE = (int, float, str, bool)
_MAPPINGS = (MappingProxyType, dict)


def _copied(value: object) -> object:
    """``value``, its mappings copied: a record holds read-only views of mappings that whoever
    made it could still change, and a kept view would compare equal to itself after a change."""
    if value is None or type(value) in _IMMUTABLE:  # most figures; cheaper than asking the Mapping ABC
        return value
    if isinstance(value, LayerFeatureMaps):
        return replace(value, by_module=_dict(value.by_module), calls=_dict(value.calls))
    return _dict(value) if type(value) in _MAPPINGS or isinstance(value, Mapping) else value


def _dict(mapping: Mapping[Any, Any]) -> dict[Any, Any]:
    # a view's copy() copies the dict under it at C speed; dict(view) goes item by item
    return mapping.copy() if type(mapping) in _MAPPINGS else dict(mapping)  # type: ignore[attr-defined]


class ReportFormatter:
    """:func:`format_record` for one run's records in turn, remaking only what changed.

    From one reported iteration to the next usually only the position and the
    time change. The text made from the figures (every amount, the rows of the
    parameters and gradients, the advice, the layers) is kept with a copy of the
    figures, the unit and the layout it was made from, and made again when any
    of them differs; the position and the time are added at each call. The text
    is :func:`format_record`'s, byte for byte.

    Example::

        >>> from pytorch_mem_profiler.stats import IterationRecord
        >>> formatter = ReportFormatter()
        >>> recs = [IterationRecord(epoch=1, iteration=i, step=i, device="cpu", allocated=10**6) for i in (1, 2)]
        >>> all(formatter(r, "MB", "full") == format_record(r, "MB", "full") for r in recs)
        True
    """

    def __init__(self) -> None:
        self._key: tuple[Any, ...] | None = None
        self._body: Any = None
        # the frame made from the body: the report of a record with these figures
        self._frame: Frame | None = None

    def __call__(self, record: IterationRecord, unit: str = "MB", mode: str = "full", end: str = "") -> str:
        """``format_record(record, unit, mode) + end``, made in one piece (a report's newline is
        not added by copying its text)."""
        try:
            figures = _figure_items(record.__dict__)
        except (AttributeError, KeyError):  # not a record as its constructor makes them
            figures = _figures(record)
        key = (unit, mode, figures)
        frame = self._frame
        if frame is None or key != self._key:
            make, frame_of = _LAYOUTS.get(mode, _LAYOUTS["full"])
            self._body = make(record, unit)
            frame = self._frame = frame_of(self._body)
            self._key = (unit, mode, tuple(map(_copied, key[2])))
        return frame(record, end)
