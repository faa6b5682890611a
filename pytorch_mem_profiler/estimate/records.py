"""The largest batch that fits, predicted from a real run's records (no estimate needed).

One run at one batch size is enough: each phase's peak is split into what stays
whatever the batch and what grows with it.

- Where the record's peak breakdown explains this phase's peak (the iteration
  peaked in it): ``weights``, ``gradients`` and ``optimizer_state`` stay;
  ``activations``, ``activation_gradients``, ``inputs`` and ``other`` (the
  model's outputs, the loss, temporaries: what of it is sized by the
  parameters cannot be told apart at one batch size, so all of it grows, the
  safe side) grow.
- Otherwise the weights, buffers and optimizer state the record counted stay
  and the rest grows; in the optimizer step the weight gradients stay too (the
  step reads them, whatever the batch), in forward and backward they grow (a
  smaller batch predicted: the safe side).

Memory outside PyTorch is the record's own measurement (``outside_pytorch``)
where it has one.

Example::

    >>> from pytorch_mem_profiler.stats import IterationRecord, PhaseStats
    >>> rec = IterationRecord(epoch=1, iteration=1, step=1, device="cuda:0", allocated=0,
    ...     weights=1000, optimizer_state=2000, gradients=1000, device_total=100_000,
    ...     phases={"forward": PhaseStats(None, 13_000), "optimizer": PhaseStats(None, 6_000)})
    >>> max_batch_from_records([rec], batch_size=10, margin=0)   # (100000 - 3000) / 1000 per sample
    97
"""

from __future__ import annotations

from typing import Iterable

from ..stats import IterationRecord
from .result import BatchFit, check_device_memory

__all__ = ["fit_records", "max_batch_from_records"]


#: The parts of the peak breakdown that do not grow with the batch (the rest does).
_FIXED_AT_PEAK = ("weights", "gradients", "optimizer_state")


def _line(record: IterationRecord, phase: str, peak: int, batch_size: int) -> tuple[float, float]:
    """``(fixed, per_sample)`` of ``phase``'s ``peak`` in ``record`` (see the module's text)."""
    breakdown = record.peak_breakdown
    if breakdown is not None and record.peak_phase == phase and sum(breakdown.values()) == peak:
        growing = sum(n for k, n in breakdown.items() if k not in _FIXED_AT_PEAK)
    else:
        fixed = record.weights + record.buffers + record.optimizer_state
        if phase == "optimizer":
            fixed += record.gradients
        growing = peak - fixed
    per_sample = max(0, growing) / batch_size
    return peak - per_sample * batch_size, per_sample


def fit_records(records: Iterable[IterationRecord], batch_size: int) -> BatchFit:
    """Each phase's peak as ``fixed + per_sample * batch`` from records made at ``batch_size``.

    Raises:
        ValueError: no record has phase peaks (a device without peak counters, or no iteration).
    """
    phases: dict[str, tuple[float, float]] = {}
    best: dict[str, int] = {}
    for record in records:
        for phase, stats in record.phases.items():
            peak = stats.peak_allocated
            if peak is None or peak <= best.get(phase, -1):
                continue
            best[phase] = peak
            phases[phase] = _line(record, phase, peak, batch_size)
    if not phases:
        raise ValueError("the records hold no phase peaks to fit (no iteration recorded, or a device without peaks)")
    return BatchFit(phases, (0, batch_size), None, None)


def max_batch_from_records(
    records: Iterable[IterationRecord],
    batch_size: int,
    device_memory: int | None = None,
    margin: float = 0.1,
) -> int:
    """The largest batch size that fits in ``device_memory`` bytes, less ``margin`` of it.

    Args:
        records: records of iterations run at ``batch_size``.
        batch_size: the batch size they ran at.
        device_memory: bytes of the device; default: the records' ``device_total``.
        margin: the share taken off the batch found (Lightning's ``BatchSizeFinder`` rule).

    Raises:
        ValueError: a bad argument, or nothing to fit.
    """
    records = [r for r in records if r is not None]
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    if not isinstance(margin, (int, float)) or not 0 <= margin < 1:
        raise ValueError(f"margin must be at least 0 and less than 1, got {margin!r}")
    if device_memory is None:
        device_memory = next((r.device_total for r in reversed(records) if r.device_total), None)
        if device_memory is None:
            raise ValueError("device_memory is needed: the records do not know the device's total memory (CPU?)")
    check_device_memory(device_memory)
    fit = fit_records(records, batch_size)
    outside = max((r.outside_pytorch for r in records if r.outside_pytorch is not None), default=0)
    largest = fit.largest_batch(device_memory - max(0, outside))
    return int(largest * (1 - margin))
