"""Give a run's CSV file the columns of newer files: the device's size and the peak's breakdown.

The profiler's CSV writer adds ``device_total``, ``peak_share`` and ``peak_<category>``
columns; the analysis tests make such files themselves from a run the profiler wrote,
with breakdowns chosen here (so the expected figures are known independently) that
sum to each record's ``iteration_peak_allocated`` to the byte.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Mapping

import pandas as pd

from pytorch_mem_profiler.stats import PEAK_CATEGORIES
from pytorch_mem_profiler.units import UNITS

#: Shares of the peak per category for epochs 1, 2, 3...: "other" gets the remainder.
#: Epoch 1's largest part is the activations, epoch 2's the optimizer state.
DEFAULT_SHARES = (
    {"weights": 0.10, "gradients": 0.10, "optimizer_state": 0.15, "activations": 0.45,
     "activation_gradients": 0.12, "inputs": 0.03},
    {"weights": 0.12, "gradients": 0.12, "optimizer_state": 0.50, "activations": 0.10,
     "activation_gradients": 0.06, "inputs": 0.05},
)


def breakdown_bytes(peak: int, shares: Mapping[str, float]) -> dict[str, int]:
    """Whole bytes per category, ``other`` the rest, summing to ``peak`` exactly."""
    parts = {c: math.floor(peak * shares.get(c, 0.0)) for c in PEAK_CATEGORIES if c != "other"}
    parts["other"] = peak - sum(parts.values())
    assert parts["other"] >= 0
    return {c: parts[c] for c in PEAK_CATEGORIES}


def add_peak_columns(
    path: Path,
    *,
    device_total: int | None = None,
    shares: tuple[Mapping[str, float], ...] | None = DEFAULT_SHARES,
    peak_scale: Mapping[int, int] | None = None,
) -> pd.DataFrame:
    """Append the newer columns to the run's CSV file at ``path``; the bytes written, per row.

    Args:
        path: a run's CSV file the profiler wrote.
        device_total: the device's bytes, or ``None`` for empty ``device_total``/``peak_share``.
        shares: per epoch (1, 2, ...; the last repeats), the share of each category;
            ``None`` leaves the breakdown columns empty (not measured).
        peak_scale: multiply the ``iteration_peak_allocated`` of these rows (by position)
            first, to make one record's peak the highest (``peak_allocated``, the peak
            since the start, rises with it).

    Returns:
        One row per record: ``peak`` (the iteration's peak in bytes) and a column per
        category (bytes), as written.
    """
    frame = pd.read_csv(path)
    unit = UNITS[str(frame["unit"].iloc[0])]
    expected = []
    for position, row in frame.iterrows():
        peak = round(row["iteration_peak_allocated"] * unit) * (peak_scale or {}).get(position, 1)
        frame.loc[position, "iteration_peak_allocated"] = peak / unit
        parts = (
            breakdown_bytes(peak, shares[min(int(row["epoch"]), len(shares)) - 1])
            if shares is not None
            else {c: None for c in PEAK_CATEGORIES}
        )
        expected.append({"epoch": int(row["epoch"]), "iteration": int(row["iteration"]), "peak": peak, **parts})
    # the running peak since the start covers every iteration peak, the raised one too
    frame["peak_allocated"] = frame[["peak_allocated"]].assign(
        it=frame["iteration_peak_allocated"].cummax()
    ).max(axis=1)
    added = {
        "device_total": [None if device_total is None else device_total / unit] * len(frame),
        "peak_share": [None if device_total is None else e["peak"] / device_total for e in expected],
        **{
            f"peak_{category}": [None if e[category] is None else e[category] / unit for e in expected]
            for category in PEAK_CATEGORIES
        },
    }
    # at the end of the columns, as the writer puts them (in place of the writer's own)
    frame = frame.drop(columns=[c for c in added if c in frame.columns])
    frame = pd.concat([frame, pd.DataFrame(added, index=frame.index)], axis=1)
    frame.to_csv(path, index=False)
    return pd.DataFrame(expected)
