"""What the framework callbacks share: checking the profiler's keywords early, and the few
figures a record sends to a framework's loggers.

No framework is imported here.

Example::

    >>> from pytorch_mem_profiler.stats import IterationRecord
    >>> record = IterationRecord(epoch=1, iteration=1, step=1, device="cpu", allocated=2_000_000,
    ...                          iteration_peak_allocated=5_000_000)
    >>> logger_metrics(record, "MB")["memory/iteration_peak_MB"]
    5.0
"""

from __future__ import annotations

from typing import Any

from ..options import ProfilerOptions
from ..stats import PLAIN_METRICS, IterationRecord, flat_metrics
from ..units import UNITS

__all__ = ["LOGGED_FIGURES", "logger_metrics", "check_profiler_arguments"]

#: The figures of the record's flat view (:func:`~pytorch_mem_profiler.stats.flat_metrics`) sent
#: to loggers: ``(figure, key)``. A handful a dashboard can show, not every counter: the full
#: record is in the CSV file.
LOGGED_FIGURES = (
    ("iteration_peak_allocated", "iteration_peak"),
    ("allocated", "allocated"),
    ("current_cached", "reserved"),
    ("feature_maps", "feature_maps"),
    ("gradients", "gradients"),
    ("optimizer_state", "optimizer_state"),
    ("peak_share", "peak_share"),
)


def logger_metrics(record: IterationRecord, unit: str = "MB", prefix: str = "memory", separator: str = "/") -> dict[str, float]:
    """The record's logged figures: ``{"memory/iteration_peak_MB": 5.0, ...}``.

    Amounts are in ``unit``, which is part of each key (key names carry no
    brackets, which some trackers refuse); ``memory/peak_share`` is the peak's
    share of the device (0 to 1) where the device's size is known. Figures the
    device does not know are left out, never sent as 0.
    """
    div = UNITS[unit]
    flat = flat_metrics(record)
    metrics: dict[str, float] = {}
    for figure, key in LOGGED_FIGURES:
        value = flat[figure]
        if value is None:
            continue
        if figure in PLAIN_METRICS:
            metrics[f"{prefix}{separator}{key}"] = value
        else:
            metrics[f"{prefix}{separator}{key}_{unit}"] = value / div
    return metrics


def check_profiler_arguments(print_period: int, csv: bool, kwargs: dict[str, Any]) -> None:
    """Validate the profiler's keywords now, when the callback is made, not when training starts.

    ``TypeError`` for a keyword the profiler does not take; the profiler's own
    messages for bad values.
    """
    unknown = sorted(set(kwargs) - set(ProfilerOptions.__dataclass_fields__))
    if unknown:
        raise TypeError(f"unknown profiler argument(s): {', '.join(unknown)}")
    ProfilerOptions(print_period=print_period, csv=csv, **kwargs)
