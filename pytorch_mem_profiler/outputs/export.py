"""CSV files of the records, through pandas: the only module that imports pandas.

One file per run in ``memory_csv_data/`` (or ``csv_dir``), named by date and
time, never overwriting another. Its columns are a superset of the original
tool's, under the original names, with values in the report's unit:

``epoch, iteration, peak_cached, current_cached, total_feature_map_usage,
total_weight_usage, <parameter>..., total_layer_weight_gradient_usage,
<parameter>_grad..., intermediate_gradients``, then the figures the original
lacked (see :data:`EXTRA_COLUMNS`). Empty cells mean "not known on this device".

Rows are appended in one write per flush, so a crash between flushes loses no
row already written and never leaves half a file.

Example::

    >>> import tempfile, pandas
    >>> from pytorch_mem_profiler.stats import IterationRecord
    >>> folder = tempfile.mkdtemp()
    >>> log = CsvLog(folder, weight_names=["fc.weight"], unit="MB")
    >>> log.add(IterationRecord(epoch=1, iteration=1, step=1, device="cpu", allocated=2_000_000))
    >>> log.flush()
    1
    >>> float(pandas.read_csv(log.path)["allocated"][0])
    2.0
"""

from __future__ import annotations

import datetime as _dt
import os
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import pandas as pd

from ..paths import free_path, prepare_output_dir
from ..units import UNITS
from ..stats import IterationRecord

__all__ = [
    "CsvLog",
    "CsvFile",
    "LayerCsv",
    "LAYER_COLUMNS",
    "record_columns",
    "record_row",
    "layer_rows",
    "EXTRA_COLUMNS",
    "NON_AMOUNT_COLUMNS",
    "new_run_path",
]

#: Columns after the original tool's, in order. ``*_peak_allocated`` and
#: ``*_end_allocated`` are per phase; ``iteration_time_s`` is in seconds, the
#: counts and ``rank`` are plain numbers, every other figure is in the file's ``unit``.
EXTRA_COLUMNS = (
    "allocated",
    "peak_allocated",
    "iteration_peak_allocated",
    "optimizer_state",
    "buffers",
    "forward_end_allocated",
    "forward_peak_allocated",
    "backward_end_allocated",
    "backward_peak_allocated",
    "optimizer_end_allocated",
    "optimizer_peak_allocated",
    "peak_phase",
    "forward_passes",
    "backward_passes",
    "optimizer_steps",
    "iteration_time_s",
    "step",
    "device",
    "unit",
    "peak_location",
    "device_used",
    "process_used",
    "outside_pytorch",
    "fragmentation",
    "layers_total_feature_maps",
    "layers_input",
    "layers_unattributed",
    "ddp_gradient_buckets",
    "fsdp_gathered_parameters",
    "rank",
)


#: Columns of :data:`EXTRA_COLUMNS` that are not amounts in the file's unit.
NON_AMOUNT_COLUMNS = frozenset(
    {
        "peak_phase",
        "forward_passes",
        "backward_passes",
        "optimizer_steps",
        "iteration_time_s",
        "step",
        "device",
        "unit",
        "peak_location",
        "rank",
    }
)


def record_columns(weight_names: Sequence[str]) -> list[str]:
    """The columns of a run's file, given its parameter names."""
    return (
        [
            "epoch",
            "iteration",
            "peak_cached",
            "current_cached",
            "total_feature_map_usage",
            "total_weight_usage",
        ]
        + list(weight_names)
        + ["total_layer_weight_gradient_usage"]
        + [f"{name}_grad" for name in weight_names]
        + ["intermediate_gradients"]
        + list(EXTRA_COLUMNS)
    )


def record_row(record: IterationRecord, weight_names: Sequence[str], unit: str) -> dict[str, Any]:
    """One CSV row: the record's figures in ``unit`` under the file's column names."""
    div = UNITS[unit]

    def u(nbytes: int | None) -> float | None:
        return None if nbytes is None else nbytes / div

    row: dict[str, Any] = {
        "epoch": record.epoch,
        "iteration": record.iteration,
        "peak_cached": u(record.peak_cached),
        "current_cached": u(record.current_cached),
        "total_feature_map_usage": u(record.feature_maps),
        "total_weight_usage": u(record.weights),
    }
    weights, grads = record.weights_by_name, record.gradients_by_name
    for name in weight_names:
        row[name] = u(weights.get(name, 0))
    row["total_layer_weight_gradient_usage"] = u(record.gradients)
    for name in weight_names:
        row[f"{name}_grad"] = u(grads.get(name, 0))
    row["intermediate_gradients"] = u(record.intermediate_gradients)
    row["allocated"] = u(record.allocated)
    row["peak_allocated"] = u(record.peak_allocated)
    row["iteration_peak_allocated"] = u(record.iteration_peak_allocated)
    row["optimizer_state"] = u(record.optimizer_state)
    row["buffers"] = u(record.buffers)
    for phase in ("forward", "backward", "optimizer"):
        stats = record.phases.get(phase)
        row[f"{phase}_end_allocated"] = u(stats.allocated_at_end) if stats else None
        row[f"{phase}_peak_allocated"] = u(stats.peak_allocated) if stats else None
    row["peak_phase"] = record.peak_phase
    row["forward_passes"] = record.forward_passes
    row["backward_passes"] = record.backward_passes
    row["optimizer_steps"] = record.optimizer_steps
    row["iteration_time_s"] = record.iteration_time_s
    row["step"] = record.step
    row["device"] = record.device
    row["unit"] = unit
    row["peak_location"] = record.peak_location
    row["device_used"] = u(record.device_used)
    row["process_used"] = u(record.process_used)
    row["outside_pytorch"] = u(record.outside_pytorch)
    row["fragmentation"] = u(record.fragmentation)
    layers = record.layers
    row["layers_total_feature_maps"] = u(layers.total) if layers else None
    row["layers_input"] = u(layers.inputs) if layers else None
    row["layers_unattributed"] = u(layers.unattributed) if layers else None
    row["ddp_gradient_buckets"] = u(record.ddp_gradient_buckets)
    row["fsdp_gathered_parameters"] = u(record.fsdp_gathered_parameters)
    row["rank"] = record.rank
    return row


def new_run_path(folder: Path, stem: str, suffix: str = ".csv") -> Path:
    """A path in ``folder`` named ``<stem>_<date>-<time><suffix>`` that no file has yet.

    The file is created empty at once (exclusively), so two runs started in
    the same second, or two processes, never share a name.
    """
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    return free_path(folder, f"{stem}_{stamp}", suffix, claim="file")


class CsvFile:
    """A CSV file that grows by whole rows: a header once, then one append per flush."""

    def __init__(self, path: Path, columns: Sequence[str]) -> None:
        self.path = path
        self.columns = list(columns)
        self._pending: list[Mapping[str, Any]] = []
        self._header_written = path.exists() and path.stat().st_size > 0

    def add(self, row: Mapping[str, Any]) -> None:
        self._pending.append(row)

    def extend(self, rows: Iterable[Mapping[str, Any]]) -> None:
        self._pending.extend(rows)

    @property
    def pending(self) -> int:
        return len(self._pending)

    def flush(self) -> int:
        """Append the pending rows; returns how many were written."""
        rows, self._pending = self._pending, []
        if not rows and self._header_written:
            return 0
        frame = pd.DataFrame.from_records(rows, columns=self.columns)
        text = frame.to_csv(index=False, header=not self._header_written)
        with open(self.path, "a", encoding="utf-8", newline="") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        self._header_written = True
        return len(rows)


class CsvLog:
    """The run's main CSV file: one row per reported iteration.

    Args:
        folder: where the file goes (created if missing).
        weight_names: the parameter names, which become columns.
        unit: the unit of the figures (a key of :data:`~pytorch_mem_profiler.outputs.report.UNITS`).
        stem: the file name's start; the date and time follow.
        name_suffix: what the name ends with before ``.csv`` (each rank's
            ``_rank<r>_<host>`` under ``torch.distributed``).
    """

    def __init__(
        self,
        folder: str | os.PathLike,
        weight_names: Sequence[str],
        unit: str = "MB",
        stem: str = "memory_stats",
        name_suffix: str = "",
    ) -> None:
        self.folder = prepare_output_dir(folder, "csv_dir")
        self.weight_names = list(weight_names)
        self.unit = unit
        self.path = new_run_path(self.folder, stem, f"{name_suffix}.csv")
        self._file = CsvFile(self.path, record_columns(self.weight_names))
        self._file.flush()  # the header, so the file is a valid CSV from the start

    def add(self, record: IterationRecord) -> None:
        self._file.add(record_row(record, self.weight_names, self.unit))

    @property
    def pending(self) -> int:
        return self._file.pending

    def flush(self) -> int:
        return self._file.flush()


#: Columns of the per-layer file, one row per (iteration, module, category), in long format
#: for spreadsheet pivots. ``bytes`` is in bytes whatever the run's unit.
LAYER_COLUMNS = ("epoch", "iteration", "step", "module", "category", "calls", "bytes")


def layer_rows(record: IterationRecord) -> list[dict[str, Any]]:
    """The per-layer rows of one record: each module's saved bytes, then the totals.

    Totals are under module names in parentheses: ``(input)``, ``(not saved by a
    module)``, ``(total by layer)``, ``(allocator delta)``.
    """
    layers = record.layers
    if layers is None:
        return []
    base = {"epoch": record.epoch, "iteration": record.iteration, "step": record.step}
    rows = [
        {**base, "module": module, "category": category, "calls": layers.calls.get(module), "bytes": n}
        for (module, category), n in sorted(layers.by_module.items(), key=lambda kv: -kv[1])
    ]
    for module, n in (
        ("(not saved by a module)", layers.unattributed),
        ("(total by layer)", layers.total),
        ("(allocator delta)", record.feature_maps),
    ):
        rows.append({**base, "module": module, "category": "total", "calls": None, "bytes": n})
    return rows


class LayerCsv:
    """The run's per-layer file, beside the main one: ``<main file stem>_layers.csv``."""

    def __init__(self, main_path: Path) -> None:
        self.path = main_path.with_name(main_path.stem + "_layers.csv")
        with open(self.path, "x", encoding="utf-8"):
            pass
        self._file = CsvFile(self.path, LAYER_COLUMNS)
        self._file.flush()

    def add(self, record: IterationRecord) -> None:
        self._file.extend(layer_rows(record))

    def flush(self) -> int:
        return self._file.flush()
