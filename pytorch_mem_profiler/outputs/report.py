"""The printed report: text made from an :class:`~pytorch_mem_profiler.stats.IterationRecord`.

No torch here; amounts go through :func:`~pytorch_mem_profiler.units.format_amount`.

Example::

    >>> from pytorch_mem_profiler.stats import IterationRecord
    >>> rec = IterationRecord(epoch=1, iteration=5, step=5, device="cpu", allocated=35_454_208)
    >>> print(format_report(rec).splitlines()[1])
    Memory Usage for Iteration 5 of Epoch 1
"""

from __future__ import annotations

from functools import lru_cache

from ..stats import ACTIVATIONS, INPUT, PHASE_LABELS, IterationRecord
from ..units import UNITS, format_amount

__all__ = ["format_report", "dotted_line", "REPORT_WIDTH"]

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
def _width(names: tuple[str, ...], grad_names: tuple[str, ...]) -> int:
    longest = max([len(n) for n in names] + [len(n) + 5 for n in grad_names] + [0])
    return max(REPORT_WIDTH, longest + 2 + 2 + 10)


def _outside_section(record: IterationRecord, line) -> list[str]:  # type: ignore[no-untyped-def]
    out = ["", line("Device memory in use (nvidia-smi)", record.device_used)]
    out.append(line("  cached by PyTorch", record.current_cached))
    out.append(line("  outside PyTorch", record.outside_pytorch))
    if record.process_used is not None:
        out.append(line("  this process", record.process_used))
    out.append("  (outside: CUDA context, cuBLAS/NCCL workspaces, other processes)")
    return out


def _layers_section(record: IterationRecord, fmt, width: int, top: int) -> list[str]:  # type: ignore[no-untyped-def]
    layers = record.layers
    assert layers is not None
    total = layers.total
    ranked = sorted(
        ((m, c, n) for (m, c), n in layers.by_module.items() if m != INPUT),
        key=lambda item: -item[2],
    )
    out = ["", "Feature maps by layer (saved for backward by each module's forward):"]
    for module, category, n in ranked[:top]:
        label = f"  {module or '(model)'}" + (" [weight copies]" if category != ACTIVATIONS else "")
        share = f" {100 * n / total:4.1f}%" if total else ""
        calls = layers.calls.get(module, 1)
        suffix = f"{share}" + (f"  x{calls} calls" if calls > 1 else "")
        out.append(dotted_line(label, fmt(n), width) + suffix)
    rest = ranked[top:]
    if rest:
        n_rest = sum(n for _, _, n in rest)
        share = f" {100 * n_rest / total:4.1f}%" if total else ""
        out.append(dotted_line(f"  ({len(rest)} more)", fmt(n_rest), width) + share)
    if layers.inputs:
        out.append(dotted_line("  Input batch (saved)", fmt(layers.inputs), width))
    out.append(dotted_line("  Not saved by a module", fmt(layers.unattributed), width) + "  (outputs, temporaries, checkpoints)")
    out.append(dotted_line("Total by layer", fmt(total), width))
    out.append(dotted_line("Total feature maps (allocator delta)", fmt(record.feature_maps), width))
    return out


def format_report(record: IterationRecord, unit: str = "MB", top: int = 10) -> str:
    """The report of one iteration, in the original tool's layout plus the figures it lacked.

    ``top``: how many modules the "Feature maps by layer" section lists before
    summing the rest on one line.
    """
    fmt = lambda n: format_amount(n, unit)  # noqa: E731
    width = _width(tuple(record.weights_by_name), tuple(record.gradients_by_name))
    stars = "*" * width
    line = lambda label, n: _line(label, n, unit, width)  # noqa: E731
    out = [
        stars,
        f"Memory Usage for Iteration {record.iteration} of Epoch {record.epoch}",
        stars,
        line("Peak cached", record.peak_cached),
        line("Current cached", record.current_cached),
        line("Total feature map usage", record.feature_maps),
        "",
        line("Total layer weight usage", record.weights),
    ]
    out += [line(f"  {name}", n) for name, n in record.weights_by_name.items()]
    out.append(line("Total layer weight gradient usage", record.gradients))
    out += [line(f"  {name} grad", n) for name, n in record.gradients_by_name.items()]
    out.append(line("Intermediate gradients", record.intermediate_gradients))
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
    if record.peak_phase is not None and record.iteration_peak_allocated is not None:
        where = PHASE_LABELS.get(record.peak_phase, PHASE_LABELS["other"])
        text = f"Peak during: {where}, {fmt(record.iteration_peak_allocated)}"
        if record.peak_location is not None:
            text += f", reached in {record.peak_location or '(model, outside its submodules)'}"
        out.append(text)
    if record.fragmentation is not None and record.current_cached is not None:
        out.append(line("Fragmentation (cached - allocated)", record.fragmentation))
    if record.device_used is not None:
        out += _outside_section(record, line)
    if record.layers is not None:
        out += _layers_section(record, fmt, width, top)
    if record.iteration_time_s is not None:
        out.append(dotted_line("Iteration time", f"{record.iteration_time_s * 1e3:.1f} ms", width))
    out.append(f"({unit} = {UNITS[unit]:,} bytes; device {record.device})")
    return "\n".join(out)
