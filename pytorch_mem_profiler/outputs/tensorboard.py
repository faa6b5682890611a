"""Send a record's figures to TensorBoard as scalars.

``memory_profiler(model, ..., tensorboard=writer)`` calls :func:`log_record`
with each reported record. The writer is anything with TensorBoard's
``add_scalar(tag, value, global_step)``, usually
``torch.utils.tensorboard.SummaryWriter`` (``pip install
'pytorch_mem_profiler[tensorboard]'``); this module imports nothing of
TensorBoard itself.

Tags: ``memory_<unit>/<figure>`` (e.g. ``memory_MB/peak_allocated``) in the
profiler's unit, with ``memory_<unit>/device_total`` (the device's memory) and
``memory_<unit>/peak_<category>`` (what is alive at the peak, by category) where
known; ``memory/peak_share`` (the peak as a share, 0 to 1, of the device's
memory), ``time/iteration_s`` in seconds and ``progress/epoch``; the
step is the record's ``step`` (iterations since the profiler started). Figures
the device does not know are left out, never logged as 0.

Example::

    >>> from pytorch_mem_profiler.stats import IterationRecord
    >>> class Writer:
    ...     def __init__(self): self.scalars = {}
    ...     def add_scalar(self, tag, value, global_step=None):
    ...         self.scalars[tag] = (value, global_step)
    >>> writer = Writer()
    >>> record = IterationRecord(epoch=1, iteration=3, step=3, device="cpu", allocated=5_000_000)
    >>> log_record(writer, record)
    >>> writer.scalars["memory_MB/allocated"]
    (5.0, 3)
"""

from __future__ import annotations

from typing import Any

from ..units import UNITS
from ..stats import BYTE_FIGURES, PEAK_CATEGORIES, PLAIN_METRICS, IterationRecord, flat_metrics

__all__ = ["MEMORY_FIGURES", "SCALARS", "log_record", "scalar_tag"]

#: The record's byte figures that become scalars, by field name.
MEMORY_FIGURES = BYTE_FIGURES

#: The figures of the record's flat view (:func:`~pytorch_mem_profiler.stats.flat_metrics`)
#: logged, in order.
SCALARS = (
    *MEMORY_FIGURES,
    "device_total",
    "peak_share",
    *(f"peak_{category}" for category in PEAK_CATEGORIES),
    "iteration_time_s",
    "epoch",
)

#: The tags of the scalars that are not amounts.
_PLAIN_TAGS = {"peak_share": "memory/peak_share", "iteration_time_s": "time/iteration_s", "epoch": "progress/epoch"}


def scalar_tag(figure: str, unit: str) -> str:
    """The tag of a figure of the flat view: ``memory_<unit>/<figure>`` for an amount.

    Example::

        >>> scalar_tag("peak_allocated", "MB"), scalar_tag("epoch", "MB")
        ('memory_MB/peak_allocated', 'progress/epoch')
    """
    return _PLAIN_TAGS[figure] if figure in PLAIN_METRICS else f"memory_{unit}/{figure}"


def log_record(writer: Any, record: IterationRecord, unit: str = "MB") -> None:
    """Add one record's figures to ``writer`` as scalars at step ``record.step``.

    Args:
        writer: a ``SummaryWriter`` or anything with ``add_scalar(tag, value, global_step)``.
        record: the iteration's record (bytes).
        unit: the unit the memory figures are logged in; it is part of their tags.
    """
    div = UNITS[unit]
    step = record.step
    flat = flat_metrics(record)
    for figure in SCALARS:
        value = flat[figure]
        if value is not None:
            writer.add_scalar(scalar_tag(figure, unit), value if figure in PLAIN_METRICS else value / div, step)
