"""CSV files of the records, written row by row as each record is reported.

One file per run in ``memory_csv_data/`` (or ``csv_dir``), named by date and
time, never overwriting another. Its columns are a superset of the original
tool's, under the original names, with values in the report's unit:

``epoch, iteration, peak_cached, current_cached, total_feature_map_usage,
total_weight_usage, <parameter>..., total_layer_weight_gradient_usage,
<parameter>_grad..., intermediate_gradients``, then the figures the original
lacked (see :data:`EXTRA_COLUMNS`). Empty cells mean "not known on this device".

What is written when: the header when the profiler is made; then each
reported row, the moment ``record_stats()`` reports it, as one whole line in
one ``write()`` to the operating system (the per-layer file: one ``write()``
per reported iteration). Nothing waits in memory, so a process killed by
SIGTERM, SIGKILL or the OOM killer loses no row already reported, and the
file is a valid CSV at any moment. The rows are ``fsync``-ed to the disk at
each ``epoch_end()`` and at ``close()``: only a power loss can take rows the
operating system had not yet stored.

Each output fails alone (:class:`CsvFile`): a folder deleted mid-run is made
again and the file with it, rows already written included, with one
:class:`~pytorch_mem_profiler.outputs.notices.OutputWarning`; any other write
failure (a full disk) keeps the newest rows in a bounded buffer, says so
once, and writes them when the file can be written again.

Example::

    >>> import tempfile, pandas
    >>> from pytorch_mem_profiler.stats import IterationRecord
    >>> folder = tempfile.mkdtemp()
    >>> log = CsvLog(folder, weight_names=["fc.weight"], unit="MB")
    >>> log.add(IterationRecord(epoch=1, iteration=1, step=1, device="cpu", allocated=2_000_000))
    >>> float(pandas.read_csv(log.path)["allocated"][0])    # on disk already: no flush needed
    2.0
    >>> log.close()
"""

from __future__ import annotations

import csv
import datetime as _dt
import os
from collections import deque
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from ..paths import free_path, prepare_output_dir
from ..stats import PEAK_CATEGORIES, PLAIN_METRICS, IterationRecord, flat_metrics
from ..units import UNITS
from .notices import OutputWarning, package_logger, warn_user

__all__ = [
    "CsvLog",
    "csv_line",
    "CsvFile",
    "LayerCsv",
    "LAYER_COLUMNS",
    "record_columns",
    "record_row",
    "record_values",
    "CellFormatter",
    "layer_rows",
    "layer_values",
    "EXTRA_COLUMNS",
    "NON_AMOUNT_COLUMNS",
    "SEED_COLUMNS",
    "new_run_path",
]

#: Columns after the original tool's, in order (new ones are only ever added at the end).
#: ``*_peak_allocated`` and ``*_end_allocated`` are per phase; ``iteration_time_s`` is in
#: seconds, the counts and ``rank`` are plain numbers, ``peak_share`` is the iteration's
#: peak as a share (0 to 1) of ``device_total`` (the device's memory); ``peak_<category>``
#: are the bytes alive at the peak by category (:data:`~pytorch_mem_profiler.stats.PEAK_CATEGORIES`);
#: every figure but the plain numbers is in the file's ``unit``.
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
    "device_total",
    "peak_share",
    *(f"peak_{category}" for category in PEAK_CATEGORIES),
)


#: Columns of :data:`EXTRA_COLUMNS` that are not amounts in the file's unit.
NON_AMOUNT_COLUMNS = frozenset({"unit"} | (PLAIN_METRICS & set(EXTRA_COLUMNS)))

#: The original tool's names for the figures of its columns, where they are not the figures'
#: own (:func:`~pytorch_mem_profiler.stats.flat_metrics`): ``figure -> column``.
SEED_COLUMNS: Mapping[str, str] = {
    "feature_maps": "total_feature_map_usage",
    "weights": "total_weight_usage",
    "gradients": "total_layer_weight_gradient_usage",
}

#: The figures of the columns before the parameters' ones, and after the gradients' ones.
_HEAD = ("epoch", "iteration", "peak_cached", "current_cached", "feature_maps", "weights")
_TAIL = ("intermediate_gradients", *EXTRA_COLUMNS)


def record_columns(weight_names: Sequence[str]) -> list[str]:
    """The columns of a run's file, given its parameter names."""
    return (
        [SEED_COLUMNS.get(figure, figure) for figure in _HEAD]
        + list(weight_names)
        + [SEED_COLUMNS["gradients"]]
        + [f"{name}_grad" for name in weight_names]
        + list(_TAIL)
    )


def _values(flat: Mapping[str, Any], figures: Sequence[str], u: Any, unit: str) -> list[Any]:
    """The cells of ``figures`` from a record's flat view: amounts in ``unit``, the rest as they are."""
    return [
        unit if figure == "unit" else flat[figure] if figure in PLAIN_METRICS else u(flat[figure])
        for figure in figures
    ]


def _in_unit(unit: str) -> Any:
    div = UNITS[unit]

    def u(nbytes: int | None) -> float | None:
        return None if nbytes is None else nbytes / div

    return u


def record_values(record: IterationRecord, weight_names: Sequence[str], unit: str) -> list[Any]:
    """One CSV row's values, in the order of :func:`record_columns`, amounts in ``unit``.

    Example::

        >>> rec = IterationRecord(epoch=1, iteration=2, step=2, device="cpu", allocated=3_000_000,
        ...                       weights_by_name={"w": 1_000_000})
        >>> values = record_values(rec, ["w"], "MB")
        >>> dict(zip(record_columns(["w"]), values))["w"], values[:2]
        (1.0, [1, 2])
    """
    u = _in_unit(unit)
    div = UNITS[unit]
    flat = flat_metrics(record)
    weights, grads = record.weights_by_name, record.gradients_by_name
    values = _values(flat, _HEAD, u, unit)
    values += [weights.get(name, 0) / div for name in weight_names]
    values.append(u(flat["gradients"]))
    values += [grads.get(name, 0) / div for name in weight_names]
    return values + _values(flat, _TAIL, u, unit)


def record_row(record: IterationRecord, weight_names: Sequence[str], unit: str) -> dict[str, Any]:
    """One CSV row: the record's figures in ``unit`` under the file's column names."""
    return dict(zip(record_columns(weight_names), record_values(record, weight_names, unit)))


def new_run_path(folder: Path, stem: str, suffix: str = ".csv") -> Path:
    """A path in ``folder`` named ``<stem>_<date>-<time><suffix>`` that no file has yet.

    The file is created empty at once (exclusively), so two runs started in
    the same second, or two processes, never share a name.
    """
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    return free_path(folder, f"{stem}_{stamp}", suffix, claim="file")


_NEEDS_QUOTES = frozenset(',"\r\n')


def _text_cell(value: object) -> str:
    text = str(value)
    if not _NEEDS_QUOTES.isdisjoint(text):
        text = '"' + text.replace('"', '""') + '"'
    return text


class CellFormatter:
    """Values to CSV cells, as :mod:`csv` writes them: ``repr`` of a float, empty for ``None``,
    text quoted only where it must be (a comma, a quote, a line break)."""

    def line(self, values: Iterable[Any]) -> str:
        """One ``\\n``-ended CSV line of ``values``."""
        return self.join(values) + "\n"

    def join(self, values: Iterable[Any]) -> str:
        """The cells of ``values``, comma-separated (no line end)."""
        cells = []
        for value in values:
            kind = type(value)
            if kind is float:
                cells.append(repr(value))
            elif kind is int:
                cells.append(str(value))
            elif value is None:
                cells.append("")
            else:
                cells.append(_text_cell(value))
        return ",".join(cells)


def csv_line(values: Iterable[Any]) -> str:
    """One CSV line (``\\n``-ended) of ``values``: ``None`` an empty cell, text quoted where it must be.

    Example::

        >>> csv_line([1, 0.25, None, "a,b"])
        '1,0.25,,"a,b"\\n'
    """
    return CellFormatter().line(values)


_log = package_logger


class CsvFile:
    """A CSV file that grows by whole lines, each handed to the operating system as it comes.

    The header is written once, when the file is empty. :meth:`add` and
    :meth:`extend` write their rows at once, as one ``write()``; the file
    descriptor stays open (opened for appending), so a row costs one system
    call, and :meth:`sync` (``fsync``) is left to the epoch's end and to closing.

    Failures stay here, never reach the caller:

    - the file's folder was deleted (the open file has no name left): the folder
      and the file are made again, the rows already written copied into it from
      the deleted file, and writing goes on; one :class:`OutputWarning` says so;
    - any other failure (a full disk, a file system gone read-only): rows wait
      in memory, at most :attr:`MAX_PENDING_BYTES` of the newest (older ones are
      dropped and counted in :attr:`dropped_rows`), one :class:`OutputWarning`
      says so, and each later write tries again.

    Args:
        path: the file (created if missing).
        columns: the header.
        name: how warnings name the file (``"CSV file"``).
        log: where the warnings are also logged (the package logger when ``None``).
    """

    #: The most bytes of unwritten rows kept while the file cannot be written.
    MAX_PENDING_BYTES = 1 << 20

    #: The size of the chunks the rows of a deleted file are copied in.
    COPY_CHUNK_BYTES = 1 << 20

    def __init__(self, path: Path, columns: Sequence[str], *, name: str = "CSV file", log: Any = None) -> None:
        self.path = Path(path)
        self.columns = list(columns)
        self.name = name
        self.log = log
        self.cells = CellFormatter()
        self._header = self.cells.line(self.columns).encode("utf-8")
        #: rows (lines) not yet written, oldest first, with how many rows each holds
        self._pending: deque[tuple[bytes, int]] = deque()
        self._pending_bytes = 0
        self._head_partial = False  # the first pending chunk is the rest of a line begun on disk
        #: rows dropped because the file could not be written for too long
        self.dropped_rows = 0
        #: how many times the file was made again after its folder vanished
        self.remade = 0
        #: the last write failure, while the file cannot be written
        self.failure: OSError | None = None
        self._warned_failure = False
        self._warned_remade = False
        self._fd: int | None = self._open()
        if os.fstat(self._fd).st_size == 0:
            self._write(self._header, 0)

    # -- the public surface ----------------------------------------------------
    def add(self, row: Mapping[str, Any]) -> None:
        """Write one row (a mapping from column to value) now."""
        self.add_values([row.get(c) for c in self.columns])

    def add_values(self, values: Sequence[Any]) -> None:
        """Write one row (its values in the columns' order) now."""
        self.add_line(self.cells.line(values))

    def add_line(self, line: str) -> None:
        """Write one row, already a ``\\n``-ended CSV line, now."""
        self._write(line.encode("utf-8"), 1)

    def extend(self, rows: Iterable[Mapping[str, Any]]) -> None:
        """Write ``rows`` (mappings from column to value) now, all in one ``write()``."""
        self.extend_values([[row.get(c) for c in self.columns] for row in rows])

    def extend_values(self, rows: Sequence[Sequence[Any]]) -> None:
        """Write ``rows`` (each its values in the columns' order) now, all in one ``write()``."""
        if rows:
            line = self.cells.line
            self._write("".join([line(values) for values in rows]).encode("utf-8"), len(rows))

    @property
    def pending(self) -> int:
        """Rows waiting in memory because the file could not be written (0 when all is well)."""
        return sum(rows for _, rows in self._pending)

    def flush(self) -> int:
        """Write what waits, then ``fsync`` the file to the disk; returns the rows still waiting."""
        if self._fd is None:
            return self.pending
        self._write(b"", 0)  # what waits, and a file whose folder vanished since the last row
        if not self._pending:
            try:
                os.fsync(self._fd)
            except OSError:  # pipes and some special files cannot be synced: nothing to do
                pass
        return self.pending

    sync = flush

    def close(self) -> None:
        """Write what waits, sync and close; says how many rows could not be written, if any."""
        if self._fd is None:
            return
        left = self.flush()
        fd, self._fd = self._fd, None
        os.close(fd)
        if left:
            _log.warning(
                "pytorch_mem_profiler: %d rows could not be written to the %s %s (%s)",
                left, self.name, self.path, self.failure,
            )
        if self.dropped_rows:
            _log.warning(
                "pytorch_mem_profiler: %d rows of the %s %s were dropped while it could not be written",
                self.dropped_rows, self.name, self.path,
            )

    # -- internals -------------------------------------------------------------
    def _open(self) -> int:
        return os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o666)

    def _write(self, data: bytes, rows: int) -> None:
        if self._fd is None:
            raise ValueError(f"the {self.name} {self.path} is closed")
        if data:
            self._pending.append((data, rows))
            self._pending_bytes += len(data)
        if self._vanished() and not self._remake():
            self._bound()
            return
        self._drain()
        self._bound()

    def _drain(self) -> None:
        fd = self._fd
        assert fd is not None
        pending = self._pending
        while pending:
            data, rows = pending[0]
            try:
                written = os.write(fd, data)
            except OSError as err:
                self._failed(err)
                return
            self._pending_bytes -= written
            if written < len(data):  # a short write (the disk filling up): the rest goes next
                pending[0] = (data[written:], rows)
                self._head_partial = True
                continue
            pending.popleft()
            self._head_partial = False
        if self.failure is not None:
            self.failure = None
            _log.info("pytorch_mem_profiler: the %s %s is written again", self.name, self.path)

    def _bound(self) -> None:
        """Drop the oldest whole rows while more than :attr:`MAX_PENDING_BYTES` wait."""
        pending = self._pending
        keep = 1 if self._head_partial else 0  # a line begun on disk must be finished
        while self._pending_bytes > self.MAX_PENDING_BYTES and len(pending) > keep + 1:
            data, rows = pending[keep]
            del pending[keep]
            self._pending_bytes -= len(data)
            self.dropped_rows += rows

    def _vanished(self) -> bool:
        """True when the open file has no name left (its folder, or itself, was deleted)."""
        try:
            return os.fstat(self._fd).st_nlink == 0  # type: ignore[arg-type]
        except OSError:
            return False

    def _remake(self) -> bool:
        """Make the folder and the file again, with the rows of the deleted one; False if it cannot."""
        old = self._fd
        assert old is not None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            new = self._open()
        except OSError as err:
            self._failed(err)
            return False
        try:
            if os.fstat(new).st_size == 0:
                self._copy(old, new)
        except OSError as err:
            os.close(new)
            self._failed(err)
            return False
        self._fd = new
        os.close(old)
        self.remade += 1
        message = (
            f"the {self.name}'s folder {self.path.parent} was deleted during the run; it was made again "
            f"with {self.path.name} and the rows written so far, and writing goes on"
        )
        if not self._warned_remade:
            self._warned_remade = True
            self._notify(message)
        else:
            _log.info("pytorch_mem_profiler: %s", message)
        return True

    def _copy(self, source: int, target: int) -> None:
        """Copy the whole of ``source`` (an open, deleted file) to ``target``, chunk by chunk."""
        pread = getattr(os, "pread", None)
        if pread is None:  # no pread (Windows, where an open file cannot be deleted anyway)
            os.write(target, self._header)
            return
        offset = 0
        while True:
            chunk = pread(source, self.COPY_CHUNK_BYTES, offset)
            if not chunk:
                return
            view = memoryview(chunk)
            while view:
                view = view[os.write(target, view):]
            offset += len(chunk)

    def _failed(self, err: OSError) -> None:
        self.failure = err.with_traceback(None)  # its frames would keep the rows alive
        if not self._warned_failure:
            self._warned_failure = True
            self._notify(
                f"the {self.name} {self.path} cannot be written ({type(err).__name__}: {err}); the newest rows "
                f"(up to {self.MAX_PENDING_BYTES // 1024:,} KiB) wait in memory and are written when it can be, "
                "older ones are dropped; the other outputs go on"
            )

    def _notify(self, message: str) -> None:
        warn_user(message, OutputWarning, self.log)

    def __del__(self) -> None:
        fd = getattr(self, "_fd", None)
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass


class CsvLog:
    """The run's main CSV file: one row per reported iteration, written as it is reported.

    Args:
        folder: where the file goes (created if missing).
        weight_names: the parameter names, which become columns.
        unit: the unit of the figures (a key of :data:`~pytorch_mem_profiler.units.UNITS`).
        stem: the file name's start; the date and time follow.
        name_suffix: what the name ends with before ``.csv`` (each rank's
            ``_rank<r>_<host>`` under ``torch.distributed``).
        log: where its warnings are also logged.
    """

    def __init__(
        self,
        folder: str | os.PathLike,
        weight_names: Sequence[str],
        unit: str = "MB",
        stem: str = "memory_stats",
        name_suffix: str = "",
        log: Any = None,
    ) -> None:
        self.folder = prepare_output_dir(folder, "csv_dir")
        self.weight_names = list(weight_names)
        self.unit = unit
        self.path = new_run_path(self.folder, stem, f"{name_suffix}.csv")
        # the header now, so the file is a valid CSV from the start
        self.file = CsvFile(self.path, record_columns(self.weight_names), name="CSV file", log=log)
        self._u = _in_unit(unit)
        self._segments: dict[str, tuple[dict[str, int], str]] = {}

    def add(self, record: IterationRecord) -> None:
        """Write ``record``'s row now."""
        self.file.add_line(self.line(record))

    def line(self, record: IterationRecord) -> str:
        """``record``'s row as a CSV line: the cells of :func:`record_values`, made faster.

        The parameters' columns (most of a row in a large model) are formatted
        once and used again while the parameters' and gradients' bytes stay the
        same, which they do from one iteration to the next.
        """
        u = self._u
        cells = self.file.cells
        flat = flat_metrics(record)
        parts = [cells.join(_values(flat, _HEAD, u, self.unit))]
        if self.weight_names:
            parts.append(self._segment("weights", record.weights_by_name))
        parts.append(cells.join([u(flat["gradients"])]))
        if self.weight_names:
            parts.append(self._segment("gradients", record.gradients_by_name))
        parts.append(cells.join(_values(flat, _TAIL, u, self.unit)))
        return ",".join(parts) + "\n"

    def _segment(self, which: str, by_name: Mapping[str, int]) -> str:
        """The cells of the parameters' columns for ``by_name``, from the last row when it is equal."""
        cached = self._segments.get(which)
        if cached is not None and cached[0] == by_name:
            return cached[1]
        div = UNITS[self.unit]
        text = self.file.cells.join([by_name.get(name, 0) / div for name in self.weight_names])
        self._segments[which] = (dict(by_name), text)
        return text

    @property
    def pending(self) -> int:
        return self.file.pending

    def flush(self) -> int:
        """``fsync`` the file; returns the rows that could not be written yet."""
        return self.file.flush()

    def close(self) -> None:
        self.file.close()


#: Columns of the per-layer file, one row per (iteration, module, category), in long format
#: for spreadsheet pivots. ``bytes`` is in bytes whatever the run's unit.
LAYER_COLUMNS = ("epoch", "iteration", "step", "module", "category", "calls", "bytes")


def layer_values(record: IterationRecord) -> list[list[Any]]:
    """The per-layer rows of one record as lists in :data:`LAYER_COLUMNS`' order (see :func:`layer_rows`)."""
    layers = record.layers
    if layers is None:
        return []
    epoch, iteration, step = record.epoch, record.iteration, record.step
    calls = layers.calls
    rows = [
        [epoch, iteration, step, module, category, calls.get(module), n]
        for (module, category), n in sorted(layers.by_module.items(), key=lambda kv: -kv[1])
    ]
    for module, n in (
        ("(not saved by a module)", layers.unattributed),
        ("(total by layer)", layers.total),
        ("(allocator delta)", record.feature_maps),
    ):
        rows.append([epoch, iteration, step, module, "total", None, n])
    return rows


def layer_rows(record: IterationRecord) -> list[dict[str, Any]]:
    """The per-layer rows of one record: each module's saved bytes, then the totals.

    Totals are under module names in parentheses: ``(input)``, ``(not saved by a
    module)``, ``(total by layer)``, ``(allocator delta)``.
    """
    return [dict(zip(LAYER_COLUMNS, values)) for values in layer_values(record)]


class LayerCsv:
    """The run's per-layer file, beside the main one: ``<main file stem>_layers.csv``.

    Each reported record's rows go in one ``write()``, as they are reported.
    """

    def __init__(self, main_path: Path, log: Any = None) -> None:
        self.path = main_path.with_name(main_path.stem + "_layers.csv")
        with open(self.path, "x", encoding="utf-8"):
            pass
        self.file = CsvFile(self.path, LAYER_COLUMNS, name="per-layer CSV file", log=log)

    def add(self, record: IterationRecord) -> None:
        """Write ``record``'s per-layer rows now, in one ``write()``."""
        self.file.extend_values(layer_values(record))

    @property
    def pending(self) -> int:
        return self.file.pending

    def flush(self) -> int:
        return self.file.flush()

    def close(self) -> None:
        self.file.close()
