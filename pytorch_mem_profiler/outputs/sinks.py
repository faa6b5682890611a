"""Sinks: the outputs a finished record goes to, each on its own.

The profiler hands every reported record to each sink in turn
(:meth:`Sink.on_record`), tells them when an epoch ends
(:meth:`Sink.on_epoch_end`), asks them to write what they hold
(:meth:`Sink.flush`) and closes them (:meth:`Sink.close`). It calls each under
its own fault-guard part, named by :attr:`Sink.name`: a sink that fails (a
broken TensorBoard writer) is switched off alone and the others go on. The
report and the CSV files handle their own expected failures without raising:
a closed pipe stops the report only; a vanished CSV folder is made again; a
full disk keeps a bounded buffer. A new output is a new sink, nothing else.

Example::

    >>> import io
    >>> from pytorch_mem_profiler.stats import IterationRecord
    >>> out = io.StringIO()
    >>> sink = ReportSink(lambda: out, units="MB")
    >>> sink.on_record(IterationRecord(epoch=1, iteration=2, step=2, device="cpu", allocated=0))
    >>> "Memory Usage for Iteration 2 of Epoch 1" in out.getvalue()
    True
"""

from __future__ import annotations

import logging
from typing import IO, Any, Callable

from ..stats import IterationRecord
from .headroom import HeadroomCheck, HeadroomWarning
from .leaks import LeakDetector
from .notices import OutputWarning, warn_user
from .progress import write_text
from .report import ReportFormatter
from .tensorboard import log_record

__all__ = ["Sink", "ReportSink", "CsvSink", "LayerCsvSink", "TensorBoardSink", "LeakSink", "HeadroomSink"]


class Sink:
    """An output of records. Every method does nothing unless a sink overrides it."""

    #: the name its faults are logged under ("output: <name>")
    name = "output"

    def on_record(self, record: IterationRecord) -> None:
        """A reported iteration's record."""

    def on_epoch_end(self, epoch: int) -> None:
        """Epoch ``epoch`` (from 1) has ended."""

    def flush(self) -> None:
        """Write out what is held."""

    def close(self) -> None:
        """The profiler is closing: write out and let go."""


class ReportSink(Sink):
    """The printed report: the record's text, written to a stream or a logger.

    Args:
        stream: returns the stream to write to, asked at each write (so standard
            output can be swapped, as test runners do).
        units: the unit of every amount.
        prints: whether this process prints (under torch.distributed, only some ranks do).
        prefix: put in front of every line (``"[rank 3] "``).
        mode: the layout, ``"full"``, ``"compact"`` or ``"line"`` (see :mod:`.report`).
        log: a :class:`logging.Logger` (or adapter) the reports go to, at ``INFO``,
            instead of the stream.

    While a ``tqdm`` bar is open, the text goes through ``tqdm.write`` (see
    :mod:`.progress`). A stream that fails (a reader gone away, ``| head``: a
    broken pipe; a closed file) stops the report alone, with one
    :class:`~pytorch_mem_profiler.outputs.notices.OutputWarning`.
    """

    name = "report"

    def __init__(
        self,
        stream: Callable[[], IO[str]],
        units: str = "MB",
        prints: bool = True,
        prefix: str = "",
        *,
        mode: str = "full",
        log: logging.Logger | logging.LoggerAdapter | None = None,
    ) -> None:
        self._stream = stream
        self.units = units
        self.prints = prints
        self.prefix = prefix
        self.mode = mode
        self.log = log
        # the last report made, with its newline (:attr:`last_report` is it without)
        self._last_line: str | None = None
        #: why the report stopped, once its stream failed
        self.stopped: str | None = None
        # keeps the text made from the figures while they stay the same (most iterations)
        self._format = ReportFormatter()

    @property
    def last_report(self) -> str | None:
        """The text of the last report made."""
        line = self._last_line
        return None if line is None else line[:-1]

    def write(self, text: str) -> None:
        """Write ``text`` if this process prints, every line with the prefix, in one write."""
        self._write_line(text + "\n")

    def _write_line(self, line: str) -> None:
        """:meth:`write` of ``line`` less its newline: a report, made with its newline, is written
        without a copy to add it."""
        if not self.prints or self.stopped is not None:
            return
        if self.prefix or self.log is not None:
            text = line[:-1]
            if self.prefix:
                text = self.prefix + text.replace("\n", "\n" + self.prefix)  # every line's, in one pass
            if self.log is not None:
                self.log.info(text)
                return
            line = text + "\n"
        try:
            write_text(self._stream(), line)
        except (OSError, ValueError) as err:  # BrokenPipeError under `| head`; a closed file
            self._stop(err)

    def _stop(self, err: Exception) -> None:
        """The stream failed: reports stop (said once), the other outputs go on."""
        reason = "its reader went away (broken pipe)" if isinstance(err, BrokenPipeError) else f"{type(err).__name__}: {err}"
        self.stopped = reason
        warn_user(f"the report's stream cannot be written ({reason}); reports stop, the other outputs go on", OutputWarning)

    def on_record(self, record: IterationRecord) -> None:
        line = self._last_line = self._format(record, self.units, self.mode, "\n")
        if self.prefix or self.log is not None or not self.prints or self.stopped is not None:
            self._write_line(line)
            return
        # _write_line's common case, inline (a report per iteration at print_period=1)
        try:
            write_text(self._stream(), line)
        except (OSError, ValueError) as err:  # BrokenPipeError under `| head`; a closed file
            self._stop(err)

    def on_epoch_end(self, epoch: int) -> None:
        self.write(f"Epoch {epoch} finished")


class CsvSink(Sink):
    """A row per reported record in the run's CSV file (see :mod:`.export`), written as it is reported.

    ``log``: a :class:`~pytorch_mem_profiler.outputs.export.CsvLog` (or anything with
    ``add``, ``flush`` and ``close``). Each epoch's end and closing ``fsync`` the file.
    """

    name = "csv"

    def __init__(self, log: Any) -> None:
        self.log = log

    @property
    def path(self) -> Any:
        return self.log.path

    def on_record(self, record: IterationRecord) -> None:
        self.log.add(record)

    def on_epoch_end(self, epoch: int) -> None:
        self.log.flush()

    def flush(self) -> None:
        self.log.flush()

    def close(self) -> None:
        self.log.close()


class LayerCsvSink(CsvSink):
    """The per-layer rows of each reported record in ``<run>_layers.csv``, written as they are reported."""

    name = "per-layer csv"


class TensorBoardSink(Sink):
    """Each reported record's figures as TensorBoard scalars (see :mod:`.tensorboard`)."""

    name = "tensorboard"

    def __init__(self, writer: Any, units: str = "MB") -> None:
        self.writer = writer
        self.units = units

    def on_record(self, record: IterationRecord) -> None:
        log_record(self.writer, record, self.units)


class LeakSink(Sink):
    """Warns once when allocated memory grows over ``window`` reported iterations in a row."""

    name = "leak check"

    def __init__(self, window: int = 5, units: str = "MB", log: Any = None) -> None:
        self.detector = LeakDetector(window)
        self.units = units
        self.log = log

    def on_record(self, record: IterationRecord) -> None:
        leak = self.detector.observe(record)
        if leak is not None:
            self.detector.warn(leak, self.units, self.log)


class HeadroomSink(Sink):
    """Warns once (:class:`~pytorch_mem_profiler.outputs.headroom.HeadroomWarning`) when a
    reported record's peak passed 90% of the device's memory."""

    name = "headroom check"

    def __init__(self, units: str = "MB", log: Any = None) -> None:
        self.check = HeadroomCheck()
        self.units = units
        self.log = log

    def on_record(self, record: IterationRecord) -> None:
        message = self.check.observe(record, self.units)
        if message is not None:
            warn_user(message, HeadroomWarning, self.log)
