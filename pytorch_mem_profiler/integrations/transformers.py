"""Hugging Face: ``MemoryProfilerCallback``, a ``transformers.TrainerCallback`` that profiles ``Trainer.train``.

A record per optimizer step (with ``gradient_accumulation_steps=N``, the N
forwards and backwards of one step are one record), ``epoch_end`` per epoch, and
the main figures added to the Trainer's ``logs`` (``memory/iteration_peak_MB``,
...), so they appear in ``trainer.state.log_history`` and in what the Trainer's
reporting callbacks (TensorBoard, W&B, ...) send. The Trainer runs its own
callbacks before those passed with ``callbacks=``: to have the reporting
callbacks see the figures too, add this one with :meth:`MemoryProfilerCallback.add_to`.

Example::

    >>> from pytorch_mem_profiler.integrations.transformers import MemoryProfilerCallback
    >>> callback = MemoryProfilerCallback(print_period=10, csv=True)
    >>> # trainer = transformers.Trainer(model, args, ...); callback.add_to(trainer); trainer.train()
"""

from __future__ import annotations

from typing import Any

try:
    from transformers import TrainerCallback
    from transformers.utils import is_torch_available
except ImportError as err:
    raise ImportError(
        "the Hugging Face integration needs transformers: pip install 'pytorch_mem_profiler[transformers]'"
    ) from err

if not is_torch_available():
    # transformers imports without the torch it refuses (its Trainer and models are then stand-ins
    # that fail at first use): say so here, where the fix can be named.
    import torch as _torch
    import transformers as _transformers

    raise ImportError(
        f"transformers {_transformers.__version__} refuses torch {_torch.__version__} (it needs a newer "
        "torch): upgrade torch, or install a transformers that supports it "
        "(for torch older than 2.6: pip install 'transformers<5')"
    )

from ..profiler import MemoryProfiler
from ._common import check_profiler_arguments, logger_metrics

__all__ = ["MemoryProfilerCallback"]


class MemoryProfilerCallback(TrainerCallback):
    """Profiles a Hugging Face ``Trainer``: a record per optimizer step, ``epoch_end`` per epoch.

    Args:
        print_period: report every this many optimizer steps.
        csv: write the records to CSV files (``csv_dir``, one file per rank).
        add_to_logs: add each reported record's main figures to the Trainer's logs.
        **profiler_kwargs: any keyword of :class:`~pytorch_mem_profiler.MemoryProfiler`
            (``by_layer``, ``units``, ``csv_dir``, ...), checked now; ``report``
            defaults to ``"compact"``.
    """

    def __init__(self, print_period: int = 1, csv: bool = False, *, add_to_logs: bool = True, **profiler_kwargs: Any) -> None:
        # A framework's console has a progress bar and logs of its own: a few lines a report.
        profiler_kwargs.setdefault("report", "compact")
        check_profiler_arguments(print_period, csv, profiler_kwargs)
        self.print_period = print_period
        self.csv = csv
        self.add_to_logs = add_to_logs
        self.profiler_kwargs = profiler_kwargs
        #: the profiler of the running ``train`` (``None`` before it starts)
        self.profiler: MemoryProfiler | None = None
        self._pending: dict[str, float] = {}

    def add_to(self, trainer: Any) -> MemoryProfilerCallback:
        """Add this callback to ``trainer`` ahead of its other callbacks, so that the reporting
        ones (TensorBoard, W&B, ...) log the memory figures too. Returns the callback."""
        trainer.callback_handler.callbacks.insert(0, self)
        return self

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None, **kwargs: Any) -> None:
        self._close()
        profiler_kwargs = dict(self.profiler_kwargs)
        if "optimizer" not in profiler_kwargs and optimizer is not None:
            profiler_kwargs["optimizer"] = optimizer
        self.profiler = MemoryProfiler(model, self.print_period, self.csv, **profiler_kwargs)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        profiler = self.profiler
        if profiler is None:
            return
        record = profiler.record_stats()
        if record is not None and self.add_to_logs and record.iteration % profiler.print_period == 0:
            self._pending = logger_metrics(record, profiler.units)

    def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, **kwargs: Any) -> None:
        if not self._pending or logs is None:
            return
        logs.update(self._pending)
        # The Trainer keeps a copy of each log in its history, made before the callbacks ran.
        if state.log_history and all(state.log_history[-1].get(k) == v for k, v in logs.items() if k not in self._pending):
            state.log_history[-1].update(self._pending)
        self._pending = {}

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.profiler is not None:
            self.profiler.epoch_end()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._close()

    def _close(self) -> None:
        if self.profiler is not None:
            self.profiler.close()
