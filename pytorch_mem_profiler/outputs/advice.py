"""Advice read from the peak's make-up: what to change, and how many bytes it would save.

Each rule looks at one record's :attr:`~pytorch_mem_profiler.stats.IterationRecord.peak_breakdown`
(what was alive at the iteration's peak, by category) and, when it applies,
gives one :class:`Advice` whose ``saves`` is computed from the record's own
figures, each a measurement tied to what the advice names (the named blocks'
feature maps, the optimizer's state, the step's temporaries, the
gradients): never a remainder. A rule whose figures are missing gives nothing,
never a generic tip.
At most :data:`MAX_ADVICE` pieces are given, the largest saving first, and only
those that save at least :data:`MIN_SAVING_SHARE` of the peak.

The rules (``a`` is a category's bytes at the peak, ``P`` the iteration's peak):

- **checkpointing**: feature maps (saved for backward) ``>= DOMINANT_SHARE * P``
  and per-layer figures are known. Each module's feature maps (those alive
  at the peak, :attr:`~pytorch_mem_profiler.stats.IterationRecord.peak_layers`;
  else what each module saved in the forward, :attr:`~pytorch_mem_profiler.stats.IterationRecord.layers`)
  are summed per block: a name up to its first numeric part (``h.3`` for
  ``h.3.attn.c_attn``, ``layer2.1`` for ``layer2.1.conv1``), else its first part
  (``encoder`` for ``encoder.fc``); blocks that differ only in their last number
  (``h.0`` ... ``h.11``) are one family. The largest families are named, as many
  as it takes to cover :data:`CHECKPOINT_COVER` of the attributed feature maps. Saving:
  ``sum(blocks) - max(blocks)``: checkpointed blocks keep only their inputs,
  and backward recomputes one block at a time, whose feature maps are alive again
  then. The blocks' inputs, which checkpointing keeps, are not in the record:
  the figure is an upper bound, off by those inputs (a block's input is usually
  a few percent of what it saves).
- **8-bit optimizer**: optimizer state ``>= DOMINANT_SHARE * P``. An 8-bit
  optimizer (bitsandbytes ``Adam8bit``, ``AdamW8bit``, ``SGD8bit``...) keeps each
  fp32 state (4 bytes) in 1 byte: saving ``3/4 * optimizer_state``. States that
  are already smaller than fp32 save less.
- **foreach-free step**: the peak is in the optimizer step and the step's own
  temporaries alive at it (:attr:`~pytorch_mem_profiler.stats.IterationRecord.peak_step_temporaries`:
  what the step allocated above what was allocated at its start, less the
  optimizer state it made) are ``>= FOREACH_SHARE * P``. The default ``foreach``
  step makes its temporaries for all parameters at once; with ``foreach=False``
  it makes them one parameter at a time. Saving: ``temporaries - 2 x largest
  parameter`` (the per-parameter loop holds at most two temporaries of one
  parameter's size, Adam's ``sqrt`` and its division). Temporaries no larger
  than that are already a per-parameter step: no advice. The step is slower.
  Never read from ``other`` as a remainder: memory that was alive before the
  iteration (another model, an EMA copy, a cached dataset) is in ``other`` too,
  and is not the step's.
- **set_to_none**: the peak is in the forward, weight gradients are alive then
  and there is one forward in the iteration (with gradient accumulation the
  gradients must stay). They are the previous step's: ``zero_grad(set_to_none=True)``
  before the forward frees them, saving the gradients' bytes at the peak.

No torch here: pure functions of a record.

Example::

    >>> from pytorch_mem_profiler.stats import IterationRecord
    >>> rec = IterationRecord(epoch=1, iteration=2, step=2, device="cuda:0", allocated=0,
    ...     iteration_peak_allocated=1_000_000_000, peak_phase="backward",
    ...     peak_breakdown={"weights": 200_000_000, "gradients": 200_000_000,
    ...                     "optimizer_state": 400_000_000, "activations": 0,
    ...                     "activation_gradients": 0, "inputs": 0, "other": 200_000_000})
    >>> [(a.kind, a.saves) for a in advise(rec)]
    [('8-bit optimizer', 300000000)]
    >>> print(format_advice(advise(rec)[0], "MB"))
    an 8-bit optimizer (bitsandbytes, e.g. AdamW8bit) would save about 300 MB: 3/4 of the optimizer state's 400 MB (each fp32 state in 1 byte)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from ..grouping import numbers_label
from ..stats import ACTIVATIONS, INPUT, IterationRecord
from ..units import format_amount

__all__ = [
    "Advice",
    "advise",
    "format_advice",
    "block_of",
    "DOMINANT_SHARE",
    "FOREACH_SHARE",
    "MIN_SAVING_SHARE",
    "CHECKPOINT_COVER",
    "MAX_ADVICE",
]

#: A category "dominates" the peak from this share of it on.
DOMINANT_SHARE = 0.40
#: ``other`` at an optimizer-step peak from this share of the peak on suggests foreach temporaries.
FOREACH_SHARE = 0.10
#: Advice that would save less than this share of the peak is not given.
MIN_SAVING_SHARE = 0.05
#: The checkpointing advice names the largest blocks until they hold this share of the
#: feature maps attributed to blocks.
CHECKPOINT_COVER = 0.80
#: At most this many pieces of advice per record, the largest saving first.
MAX_ADVICE = 2
#: How many block names (folded) the checkpointing advice spells out.
_NAMED_GROUPS = 3


@dataclass(frozen=True)
class Advice:
    """One change and the bytes it would save at the iteration's peak.

    Attributes:
        kind: ``"checkpointing"``, ``"8-bit optimizer"``, ``"foreach-free step"`` or ``"set_to_none"``.
        saves: bytes the change would save at the peak (the rule's formula, see the module).
        subject: what the change applies to: the blocks to checkpoint (``h.[0-11]``), else ``""``.
        basis: the figures the saving is computed from, in bytes, by name.
    """

    kind: str
    saves: int
    subject: str = ""
    basis: Mapping[str, int] | None = None


def block_of(module: str) -> str:
    """The block a module belongs to: its name up to the first numeric part, else its first part.

    Example::

        >>> block_of("h.3.attn.c_attn"), block_of("layer2.1.conv1"), block_of("encoder.fc"), block_of("0")
        ('h.3', 'layer2.1', 'encoder', '0')
    """
    parts = module.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return parts[0]


def _module_feature_maps(record: IterationRecord) -> dict[str, int]:
    """Feature maps by module: those alive at the peak where known, else those the forward saved."""
    if record.peak_layers:
        return {m: n for m, n in record.peak_layers.items() if m not in ("", INPUT) and n > 0}
    if record.layers is None:
        return {}
    return {
        m: n
        for (m, category), n in record.layers.by_module.items()
        if category == ACTIVATIONS and m not in ("", INPUT) and n > 0
    }


def _fold_names(blocks: list[str]) -> list[str]:
    """``h.0`` ... ``h.11`` as ``h.[0-11]``; blocks without a last number as they are (first met first)."""
    folded: dict[str, list[int]] = {}  # prefix (or the whole name) -> its numbers
    for name in blocks:
        prefix, _, last = name.rpartition(".")
        if last.isdigit():
            folded.setdefault(prefix + ".", []).append(int(last))
        else:
            folded.setdefault(name, [])
    return [
        name if not numbers else name.lstrip(".") + (numbers_label(numbers) if len(numbers) > 1 else str(numbers[0]))
        for name, numbers in folded.items()
    ]


def _checkpointing(record: IterationRecord) -> Advice | None:
    modules = _module_feature_maps(record)
    blocks: dict[str, int] = {}
    for module, nbytes in modules.items():
        block = block_of(module)
        blocks[block] = blocks.get(block, 0) + nbytes
    attributed = sum(blocks.values())
    if not attributed:
        return None
    # repeated blocks (h.0 ... h.11) are one family, checkpointed together
    families: dict[str, list[tuple[str, int]]] = {}
    for block, nbytes in blocks.items():
        prefix, _, last = block.rpartition(".")
        families.setdefault(prefix + ".#" if last.isdigit() else block, []).append((block, nbytes))
    chosen: list[tuple[str, int]] = []
    for members in sorted(families.values(), key=lambda ms: -sum(n for _, n in ms)):
        if sum(n for _, n in chosen) >= CHECKPOINT_COVER * attributed:
            break
        chosen += members
    saved = sum(n for _, n in chosen)
    largest = max(n for _, n in chosen)
    names = _fold_names([name for name, _ in chosen])
    subject = ", ".join(names[:_NAMED_GROUPS])
    if len(names) > _NAMED_GROUPS:
        subject += f" and {len(names) - _NAMED_GROUPS} more"
    return Advice(
        "checkpointing",
        saved - largest,
        subject,
        {"blocks": len(chosen), "blocks_feature_maps": saved, "largest_block": largest},
    )


def _eight_bit(breakdown: Mapping[str, int]) -> Advice:
    state = breakdown.get("optimizer_state", 0)
    return Advice("8-bit optimizer", state * 3 // 4, basis={"optimizer_state": state})


def _foreach_free(record: IterationRecord, temporaries: int) -> Advice:
    largest = max(record.weights_by_name.values(), default=0)
    # a per-parameter step keeps at most two temporaries of the largest parameter's size
    saves = max(0, temporaries - 2 * largest)
    return Advice("foreach-free step", saves, basis={"step_temporaries": temporaries, "largest_parameter": largest})


def advise(record: IterationRecord) -> list[Advice]:
    """The advice the record's peak breakdown supports, largest saving first (at most :data:`MAX_ADVICE`).

    A record without a breakdown, or with a peak of 0, gets none.
    """
    breakdown = record.peak_breakdown
    if not breakdown:
        return []
    peak = record.iteration_peak_allocated or sum(breakdown.values())
    if peak <= 0:
        return []
    found: list[Advice] = []
    if breakdown.get("activations", 0) >= DOMINANT_SHARE * peak:
        advice = _checkpointing(record)
        if advice is not None:
            found.append(advice)
    if breakdown.get("optimizer_state", 0) >= DOMINANT_SHARE * peak:
        found.append(_eight_bit(breakdown))
    temporaries = record.peak_step_temporaries
    if record.peak_phase == "optimizer" and temporaries is not None and temporaries >= FOREACH_SHARE * peak:
        found.append(_foreach_free(record, temporaries))
    # several forwards in one iteration: gradient accumulation, whose gradients must stay
    if record.peak_phase == "forward" and breakdown.get("gradients", 0) > 0 and (record.forward_passes or 0) <= 1:
        found.append(Advice("set_to_none", breakdown["gradients"], basis={"gradients": breakdown["gradients"]}))
    useful = [a for a in found if a.saves >= MIN_SAVING_SHARE * peak]
    return sorted(useful, key=lambda a: -a.saves)[:MAX_ADVICE]


def format_advice(advice: Advice, unit: str = "MB") -> str:
    """One line of advice, its saving and the figures it comes from, in ``unit``."""
    fmt = lambda n: format_amount(n, unit)  # noqa: E731
    basis = advice.basis or {}
    if advice.kind == "checkpointing":
        blocks = basis["blocks"]
        return (
            f"checkpointing {advice.subject} would save up to {fmt(advice.saves)}: "
            f"the {'blocks' if blocks > 1 else 'block'}' feature maps, {fmt(basis['blocks_feature_maps'])}, "
            f"less the largest block's, {fmt(basis['largest_block'])}, recomputed in backward "
            "(less each block's input, which it keeps)"
        )
    if advice.kind == "8-bit optimizer":
        return (
            f"an 8-bit optimizer (bitsandbytes, e.g. AdamW8bit) would save about {fmt(advice.saves)}: "
            f"3/4 of the optimizer state's {fmt(basis['optimizer_state'])} (each fp32 state in 1 byte)"
        )
    if advice.kind == "foreach-free step":
        return (
            f"the optimizer with foreach=False would save up to {fmt(advice.saves)} (a slower step): "
            f"the step's temporaries at the peak, {fmt(basis['step_temporaries'])} (what it allocated "
            f"above what was allocated at its start, less new state), less twice the largest parameter, "
            f"{fmt(basis['largest_parameter'])} (temporaries one parameter at a time)"
        )
    if advice.kind == "set_to_none":
        return (
            f"optimizer.zero_grad(set_to_none=True) before the forward would save {fmt(advice.saves)}: "
            "the previous step's weight gradients, alive at this forward peak"
        )
    raise ValueError(f"unknown advice kind: kind={advice.kind!r}")
