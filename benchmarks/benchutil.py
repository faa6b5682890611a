"""What the benchmark scripts share: where outputs go, Markdown tables, CSV files, the machine's name.

Example::

    >>> print(markdown_table(["a", "b"], [[1, "x"]]))
    | a | b |
    | --- | --- |
    | 1 | x |
"""

from __future__ import annotations

import contextlib
import csv
import datetime
import gc
import os
import platform
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch


def output_dir(arg: str | None) -> Path | None:
    """The folder outputs are written to: ``arg``, else ``$OUT`` when it is set, else none."""
    chosen = arg or os.environ.get("OUT")
    if not chosen:
        return None
    path = Path(chosen)
    path.mkdir(parents=True, exist_ok=True)
    return path


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.processor() or platform.machine()})"


def environment_line(device: torch.device) -> str:
    """Device, torch version and date: the header every table is printed under."""
    today = datetime.date.today().isoformat()
    return f"Device: {device_name(device)}; torch {torch.__version__}; {today}"


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "| " + " | ".join("---" for _ in headers) + " |"]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def write_csv(path: Path, headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(headers)
        writer.writerows(rows)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def mb(nbytes: float | None) -> str:
    """Bytes as decimal megabytes (10^6 bytes), the unit of the profiler's reports."""
    if nbytes is None:
        return "n/a"
    return f"{nbytes / 1e6:.3f}"


@contextlib.contextmanager
def quiet_collector() -> Iterator[None]:
    """Collect garbage first, then keep Python's cycle collector off for the block.

    Peaks are absolute: garbage left by earlier work (and freed whenever the
    collector happens to run) would otherwise move them from one step to the next.
    """
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
