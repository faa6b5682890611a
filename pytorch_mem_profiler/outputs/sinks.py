"""Sinks: the outputs a finished record goes to, each on its own.

The profiler hands every reported record to each sink in turn
(:meth:`Sink.on_record`), tells them when an epoch ends
(:meth:`Sink.on_epoch_end`), asks them to write what they hold
(:meth:`Sink.flush`) and closes them (:meth:`Sink.close`). It calls each under
its own fault-guard part, named by :attr:`Sink.name`: a sink that fails (a
closed pipe, a vanished folder, a broken TensorBoard writer) is switched off
alone and the others go on. A new output is a new sink, nothing else.

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

from typing import IO, Any, Callable

from ..stats import IterationRecord
from .leaks import LeakDetector
from .report import format_report
from .tensorboard import log_record

__all__ = ["Sink", "ReportSink", "CsvSink", "LayerCsvSink", "TensorBoardSink", "LeakSink"]


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
    """The printed report: the record's text, written to a stream.

    Args:
        stream: returns the stream to write to, asked at each write (so standard
            output can be swapped, as test runners do).
        units: the unit of every amount.
        prints: whether this process prints (under torch.distributed, only some ranks do).
        prefix: put in front of every line (``"[rank 3] "``).
    """

    name = "report"

    def __init__(
        self, stream: Callable[[], IO[str]], units: str = "MB", prints: bool = True, prefix: str = ""
    ) -> None:
        self._stream = stream
        self.units = units
        self.prints = prints
        self.prefix = prefix
        #: the text of the last report made
        self.last_report: str | None = None

    def write(self, text: str) -> None:
        """Write ``text`` if this process prints, every line with the prefix, in one write."""
        if not self.prints:
            return
        if self.prefix:
            text = "\n".join(self.prefix + line for line in text.split("\n"))
        self._stream().write(text + "\n")

    def on_record(self, record: IterationRecord) -> None:
        self.last_report = format_report(record, self.units)
        self.write(self.last_report)

    def on_epoch_end(self, epoch: int) -> None:
        self.write(f"Epoch {epoch} finished")


class CsvSink(Sink):
    """A row per reported record in the run's CSV file (see :mod:`.export`)."""

    name = "csv"

    #: Rows kept in memory before they are written even without an epoch end.
    FLUSH_EVERY_ROWS = 1000

    def __init__(self, log: Any) -> None:
        self.log = log

    @property
    def path(self) -> Any:
        return self.log.path

    def on_record(self, record: IterationRecord) -> None:
        self.log.add(record)
        if self.log.pending >= self.FLUSH_EVERY_ROWS:
            self.log.flush()

    def on_epoch_end(self, epoch: int) -> None:
        self.log.flush()

    def flush(self) -> None:
        self.log.flush()

    close = flush


class LayerCsvSink(CsvSink):
    """The per-layer rows of each reported record in ``<run>_layers.csv``."""

    name = "per-layer csv"

    def on_record(self, record: IterationRecord) -> None:
        self.log.add(record)


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

    def __init__(self, window: int = 5, units: str = "MB") -> None:
        self.detector = LeakDetector(window)
        self.units = units

    def on_record(self, record: IterationRecord) -> None:
        leak = self.detector.observe(record)
        if leak is not None:
            self.detector.warn(leak, self.units)
