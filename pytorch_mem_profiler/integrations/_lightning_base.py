"""The Lightning callback's behaviour, apart from the package it subclasses.

``lightning.pytorch`` and ``pytorch_lightning`` each check that callbacks subclass
their own ``Callback``, so :mod:`.lightning` and :mod:`.pytorch_lightning` each make
a class of this mixin and their package's ``Callback``. No framework is imported here.
"""

from __future__ import annotations

from typing import Any

from ..profiler import MemoryProfiler
from ._common import check_profiler_arguments, logger_metrics

__all__ = ["LightningMemoryProfiling"]


class LightningMemoryProfiling:
    """Profiles a Lightning ``fit``: a record per training batch, ``epoch_end`` per training epoch.

    Args:
        print_period: report every this many training batches.
        csv: write the records to CSV files (``csv_dir``, one file per rank).
        log_to_loggers: send each reported record's main figures to the trainer's
            loggers under ``memory/`` (``memory/iteration_peak_MB``, ...).
        **profiler_kwargs: any keyword of :class:`~pytorch_mem_profiler.MemoryProfiler`
            (``by_layer``, ``units``, ``csv_dir``, ``print_ranks``, ...), checked now;
            ``report`` defaults to ``"compact"``.
    """

    def __init__(self, print_period: int = 1, csv: bool = False, *, log_to_loggers: bool = True, **profiler_kwargs: Any) -> None:
        # A framework's console has a progress bar and logs of its own: a few lines a report.
        profiler_kwargs.setdefault("report", "compact")
        check_profiler_arguments(print_period, csv, profiler_kwargs)
        self.print_period = print_period
        self.csv = csv
        self.log_to_loggers = log_to_loggers
        self.profiler_kwargs = profiler_kwargs
        #: the profiler of the running ``fit`` (``None`` before it starts)
        self.profiler: MemoryProfiler | None = None

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._close()
        kwargs = dict(self.profiler_kwargs)
        # The trainer's optimizers are known now: their state counts from the first record.
        if "optimizer" not in kwargs and trainer.optimizers:
            kwargs["optimizer"] = list(trainer.optimizers)
        # The LightningModule itself, so that names read as the user wrote them (net.0.weight).
        self.profiler = MemoryProfiler(pl_module, self.print_period, self.csv, **kwargs)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        profiler = self.profiler
        if profiler is None:
            return
        record = profiler.record_stats()
        if record is None or not self.log_to_loggers or record.iteration % profiler.print_period:
            return
        step = getattr(getattr(trainer.fit_loop, "epoch_loop", None), "_batches_that_stepped", trainer.global_step)
        for logger in trainer.loggers:
            separator = getattr(logger, "group_separator", "/")
            logger.log_metrics(logger_metrics(record, profiler.units, "memory", separator), step=step)

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        if self.profiler is not None:
            self.profiler.epoch_end()

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._close()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._close()

    def _close(self) -> None:
        if self.profiler is not None:
            self.profiler.close()
