"""``MemoryProfiler`` (also ``memory_profiler``): the per-iteration training-loop memory report.

The only module that knows all the others: it validates the arguments, picks
the device counter, installs the hooks, turns each iteration's measurements
into an :class:`~pytorch_mem_profiler.stats.IterationRecord`, prints the
report and hands rows to the CSV file.

Example::

    >>> import io, torch
    >>> from pytorch_mem_profiler import MemoryProfiler
    >>> model = torch.nn.Linear(16, 4)
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> out = io.StringIO()
    >>> with MemoryProfiler(model, print_period=2, stream=out) as profiler:
    ...     for _ in range(2):
    ...         model(torch.randn(8, 16)).sum().backward()
    ...         opt.step(); opt.zero_grad()
    ...         record = profiler.record_stats()
    ...     profiler.epoch_end()
    >>> record.weights == (16 * 4 + 4) * 4 and record.gradients == record.weights
    True
    >>> "Memory Usage for Iteration 2 of Epoch 1" in out.getvalue()
    True
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import time
import weakref
from collections import deque
from types import MappingProxyType
from typing import IO, Any, Iterable

import torch

from .measure.accounting import (
    buffer_bytes,
    gradient_bytes,
    optimizer_state_bytes,
    optimizer_state_tensors,
    unique_parameters,
    weight_bytes,
)
from .measure.data_parallel import FsdpGatherTracker, ddp_gradient_bucket_bytes
from .measure.devices import MemoryCounter, make_counter, resolve_device
from .distributed import (
    CrossRankSummary,
    GatherBuffers,
    RankPeakTracker,
    format_cross_rank,
    gather_summaries,
    parse_print_ranks,
    rank_device,
    rank_info,
    summarize_rank,
)
from .faults import FaultGuard
from .measure.hooks import StepMeasurements, TrainingStepHooks
from .measure.layers import LayerAttribution, LayerBreakdown, is_compiled
from .outputs.leaks import LeakDetector
from .measure.outside import DeviceMemoryReader
from .tools.oom import OomPostmortem, dump_on_oom, plain_data
from .outputs.report import UNITS, format_report
from .stats import IterationRecord, LayerFeatureMaps, PhaseStats
from .outputs.tensorboard import check_writer, log_record

__all__ = ["MemoryProfiler", "memory_profiler"]

_log = logging.getLogger("pytorch_mem_profiler")

#: Rows kept in memory before they are written even without ``epoch_end()``.
_FLUSH_EVERY_ROWS = 1000


def _check_optimizers(optimizer: Any) -> list[torch.optim.Optimizer] | None:
    if optimizer is None:
        return None
    opts = [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else None
    if opts is None:
        try:
            opts = list(optimizer)
        except TypeError:
            opts = []
        if not opts or not all(isinstance(o, torch.optim.Optimizer) for o in opts):
            raise TypeError(
                "optimizer must be a torch.optim.Optimizer or a list of them, "
                f"got {type(optimizer).__name__}"
            )
    return opts


class MemoryProfiler:
    """Reports, every few training iterations, where the device memory goes.

    Add it to a training loop: make it once, call :meth:`record_stats` after
    each iteration and :meth:`epoch_end` after each epoch. Hooks on the model
    and optimizer find forward, backward and the optimizer step by themselves.

    Args:
        model: the model being trained.
        print_period: print the report every this many iterations (an int >= 1).
        csv: write a row per reported iteration to a CSV file in ``csv_dir``.
        optimizer: the optimizer (or a list of them) whose state to count;
            ``None`` finds those that step the model's parameters.
        device: the device to profile; default: the model's first parameter's.
        csv_dir: the CSV folder, created if missing.
        stream: where the report goes; ``None`` means standard output.
        units: ``"MB"`` (10^6 bytes, the default), ``"MiB"``, ``"GB"``, ``"GiB"``,
            ``"KB"``, ``"KiB"`` or ``"B"``, for the report and the CSV.
        strict: re-raise the profiler's own faults instead of switching off the
            faulty part (meant for tests).
        history: how many reported records :attr:`records` keeps in memory.
        by_layer: attribute feature maps to the modules that saved them and find
            the module where each iteration peaked (on reported iterations only;
            adds a ``<run>_layers.csv`` file when ``csv`` is on).
        leak_window: warn (:class:`~pytorch_mem_profiler.outputs.leaks.LeakWarning`) when
            allocated memory grows in this many reported iterations in a row.
        oom_dir: on a CUDA out-of-memory error, write a post-mortem folder here
            (the last report, the failing iteration, the allocator's stats; see
            :func:`~pytorch_mem_profiler.dump_on_oom`).
        tensorboard: a ``torch.utils.tensorboard.SummaryWriter`` (or anything with
            ``add_scalar``) that gets each reported record's figures as scalars.
        print_ranks: under ``torch.distributed``, the ranks that print their
            report: ``0`` (the default), a list of ranks, or ``"all"``; with
            more than rank 0, each line starts with ``[rank r]``. The lowest of
            them also prints the cross-rank table at each :meth:`epoch_end`.

    Under ``torch.distributed`` (an initialized default process group) each
    rank profiles its own device, its CSV file's name ends with
    ``_rank<r>_<host>``, and :meth:`epoch_end` is a collective: every rank must
    call it, as often as the others.

    Weights and buffers are counted when the profiler is made and again at
    each :meth:`epoch_end`; gradients, feature maps and the rest every iteration.

    On CUDA the profiler resets the allocator's peak statistics at each phase
    boundary (``torch.cuda.reset_peak_memory_stats``): read peaks from its
    records (``peak_allocated``) rather than ``torch.cuda.max_memory_allocated()``.

    Example::

        >>> import torch
        >>> model = torch.nn.Linear(4, 4)
        >>> profiler = memory_profiler(model, 5, False, stream=open(os.devnull, "w"))
        >>> profiler.print_period
        5
        >>> profiler.close()
    """

    def __init__(
        self,
        model: torch.nn.Module,
        print_period: int = 1,
        csv: bool = False,
        *,
        optimizer: torch.optim.Optimizer | Iterable[torch.optim.Optimizer] | None = None,
        device: torch.device | str | int | None = None,
        csv_dir: str | os.PathLike = "memory_csv_data",
        stream: IO[str] | None = None,
        units: str = "MB",
        strict: bool = False,
        history: int = 1000,
        by_layer: bool = False,
        leak_window: int = 5,
        oom_dir: str | os.PathLike | None = None,
        tensorboard: Any = None,
        print_ranks: int | Iterable[int] | str = 0,
    ) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if isinstance(print_period, bool) or not isinstance(print_period, int) or print_period < 1:
            raise ValueError(f"print_period must be an integer >= 1, got {print_period!r}")
        if not isinstance(csv, bool):
            raise TypeError(f"csv must be True or False, got {csv!r}")
        if units not in UNITS:
            raise ValueError(f"units must be one of {', '.join(UNITS)}; got {units!r}")
        if stream is not None and not callable(getattr(stream, "write", None)):
            raise TypeError(f"stream must have a write() method, got {type(stream).__name__}")
        if not isinstance(strict, bool):
            raise TypeError(f"strict must be True or False, got {strict!r}")
        if isinstance(history, bool) or not isinstance(history, int) or history < 1:
            raise ValueError(f"history must be an integer >= 1, got {history!r}")
        if not isinstance(by_layer, bool):
            raise TypeError(f"by_layer must be True or False, got {by_layer!r}")
        if isinstance(leak_window, bool) or not isinstance(leak_window, int) or leak_window < 2:
            raise ValueError(f"leak_window must be an integer >= 2, got {leak_window!r}")
        if not isinstance(csv_dir, (str, os.PathLike)):
            raise TypeError(f"csv_dir must be a str or os.PathLike, got {type(csv_dir).__name__}")
        optimizers = _check_optimizers(optimizer)
        self._tensorboard = check_writer(tensorboard)
        printing_ranks = parse_print_ranks(print_ranks)
        if any(p.device.type == "meta" for p in model.parameters()):
            raise ValueError(
                "model has parameters on the meta device, which hold no memory to profile; "
                "materialize them first, e.g. model.to_empty(device='cuda')"
            )

        self.model = model
        self.print_period = print_period
        self.csv = csv
        self.units = units
        self.strict = strict
        #: this process's rank under torch.distributed; ``None`` in a single process
        self.rank_info = rank_info()
        self.device = self._model_device(device)
        rank = self.rank_info.rank if self.rank_info is not None else 0
        self._prints = printing_ranks is None or rank in printing_ranks
        # One rank prints the cross-rank table: the lowest that prints.
        self._prints_table = self._prints and rank == min(printing_ranks or {0})
        self._line_prefix = (
            f"[rank {rank}] "
            if self.rank_info is not None and printing_ranks != frozenset({0})
            else ""
        )
        #: what this rank's file names end with: ``_rank<r>_<host>`` (empty in a single process)
        self.file_tag = self.rank_info.file_tag if self.rank_info is not None else ""
        self._stream = stream
        self._guard = FaultGuard(strict)
        self._counter: MemoryCounter = make_counter(self.device)
        self._device_explicit = device is not None
        #: The text of the last printed report.
        self.last_report: str | None = None
        self.oom_postmortem: OomPostmortem | None = None
        if oom_dir is not None:
            self.oom_postmortem = dump_on_oom(oom_dir, profiler=self)

        self.by_layer = by_layer
        self._fsdp: FsdpGatherTracker | None = None
        self._ddp_buckets: int | None = None
        self._refresh_model_state()
        self._csv = None
        self._layers_csv = None
        if csv:
            from .outputs.export import CsvLog, LayerCsv  # pandas is imported only when CSV is asked for

            self._csv = CsvLog(
                csv_dir, [name for name, _ in self._params], unit=units, name_suffix=self.file_tag
            )
            if by_layer:
                self._layers_csv = LayerCsv(self._csv.path)
        self.csv_path = self._csv.path if self._csv is not None else None
        self.layers_csv_path = self._layers_csv.path if self._layers_csv is not None else None
        self._outside = DeviceMemoryReader(self.device)
        self._leaks = LeakDetector(leak_window)

        self.epoch = 1
        self.iteration = 0
        self.step = 0
        #: The reported records, the latest ``history`` of them (the CSV file has them all).
        self.records: deque[IterationRecord] = deque(maxlen=history)
        #: The first reported record, kept so the latest can be compared with it.
        self.first_record: IterationRecord | None = None
        self.last_record: IterationRecord | None = None
        self._closed = False
        self._optimizer_state_cache: dict[int, tuple[int, int]] = {}
        self._adopted: weakref.WeakSet = weakref.WeakSet()
        #: the latest cross-rank summary (every rank has it after :meth:`epoch_end`)
        self.cross_rank_summary: CrossRankSummary | None = None
        self._rank_peaks = RankPeakTracker() if self.rank_info is not None else None
        self._gather_buffers = GatherBuffers()
        self._counter.start()
        self._counter.adopt(p for _, p in self._params)
        self._counter.adopt(b for b in model.buffers())
        self._counter.adopt(p.grad for _, p in self._params if p.grad is not None)
        self._hooks = TrainingStepHooks(
            model,
            self._counter,
            self._params,
            optimizers,
            self._guard,
            on_optimizer_step=self._guard.wrap("optimizer state", self._optimizer_stepped),
            on_forward_first_call=self._guard.wrap("device check", self._check_device_once),
        )
        if by_layer:
            if is_compiled(model):
                _log.warning(
                    "pytorch_mem_profiler: the model runs through torch.compile; feature maps are "
                    "reported in total, not by layer"
                )
            else:
                self._hooks.attribution = LayerAttribution(
                    model,
                    self.device,
                    on_exit=self._guard.wrap("per-layer attribution", self._hooks.forward_location),
                    on_backward_enter=self._guard.wrap("per-layer attribution", self._hooks.backward_location),
                )
        self._hooks.install()
        self._update_detail()
        if self.rank_info is not None:
            self._fsdp = FsdpGatherTracker.attach(model, self._guard.wrap)
        self._last_time = time.perf_counter()
        self._atexit = _flush_at_exit(self)
        atexit.register(self._atexit)

    # -- the public loop API ---------------------------------------------------
    def record_stats(self) -> IterationRecord | None:
        """Count one iteration; print the report every ``print_period`` iterations.

        Returns the iteration's record (all figures in bytes), the same one the
        report and the CSV row are made from; ``None`` only if the profiler
        failed and switched itself off.
        """
        return self._guard.call("record_stats", self._record_stats)

    def epoch_end(self) -> None:
        """Print ``Epoch N finished``, write the epoch's rows, and start the next epoch.

        Under ``torch.distributed`` also gather every rank's peaks (one small
        all-gather) into :attr:`cross_rank_summary` and print the cross-rank
        table: every rank must call it.
        """
        epoch = self.epoch
        self._guard.call("epoch_end", self._epoch_end)
        if self.rank_info is not None:
            # Apart from the rest of epoch_end, so that a fault there never
            # keeps this rank out of the collective the others wait in.
            self._guard.call("cross-rank summary", self._cross_rank_summary, epoch)

    def close(self) -> None:
        """Remove every hook, write pending rows and stop counting. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        try:
            if self.oom_postmortem is not None:
                self.oom_postmortem.remove()
            self._hooks.release()
            if self._fsdp is not None:
                self._fsdp.remove()
            self._gather_buffers = GatherBuffers()
            self._counter.stop()
        finally:
            self.flush()
            atexit.unregister(self._atexit)

    def flush(self) -> None:
        """Write the rows recorded so far to the CSV files."""
        if self._csv is not None:
            self._guard.call("csv", self._csv.flush)
        if self._layers_csv is not None:
            self._guard.call("csv", self._layers_csv.flush)

    def postmortem(self) -> dict[str, Any]:
        """What an OOM post-mortem writes about the run: plain data, ready for JSON.

        ``epoch``, ``iteration`` and ``step`` of the iteration in progress (the
        one that failed), its ``phase``, the measurements made in it so far
        (``in_progress``), the ``last_record`` completed (bytes), and the text
        of the last printed ``report``.
        """
        hooks = getattr(self, "_hooks", None)
        return {
            "device": str(self.device),
            "epoch": getattr(self, "epoch", 1),
            "iteration": getattr(self, "iteration", 0) + 1,
            "step": getattr(self, "step", 0) + 1,
            "phase": getattr(hooks, "_phase", None),
            "in_progress": plain_data(getattr(hooks, "current", None)),
            "last_record": plain_data(getattr(self, "last_record", None)),
            "report": self.last_report,
        }

    def __enter__(self) -> MemoryProfiler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals -------------------------------------------------------------
    @property
    def stream(self) -> IO[str]:
        return self._stream if self._stream is not None else sys.stdout

    def _model_device(self, device: Any = None) -> torch.device:
        """The device to profile: ``device``, else the model's (each rank's own, distributed)."""
        if device is None and self.rank_info is not None:
            return rank_device(self.model, self.rank_info)
        return resolve_device(self.model, device)

    def _print(self, text: str) -> None:
        """Write ``text`` if this rank prints, each line with the rank prefix, in one write."""
        if not self._prints:
            return
        if self._line_prefix:
            text = "\n".join(self._line_prefix + line for line in text.split("\n"))
        self.stream.write(text + "\n")

    def _refresh_model_state(self) -> None:
        """Parameter list, weights and buffers: sizes that change only if the model does."""
        self._params = unique_parameters(self.model, self.device)
        weights = weight_bytes(self._params)
        self._weights_by_name = MappingProxyType(dict(weights))
        self._weights_total = sum(n for _, n in weights)
        self._buffers_total = sum(n for _, n in buffer_bytes(self.model, self.device))
        self._requires_grad = [p.requires_grad for _, p in self._params]
        self._last_gradient_sizes: list[int] | None = None
        self._gradients_by_name: Any = MappingProxyType({})
        if self.rank_info is not None:
            self._ddp_buckets = ddp_gradient_bucket_bytes(self.model, self.device)
            if self._fsdp is not None:
                self._fsdp.refresh()

    def _check_device_once(self) -> None:
        now = self._model_device()
        if self._device_explicit or now == self.device:
            return
        _log.warning(
            "pytorch_mem_profiler: the model moved from %s to %s after the profiler was made; "
            "profiling %s from now on (make the profiler after model.to(device))",
            self.device,
            now,
            now,
        )
        self._counter.stop()
        self.device = now
        self._counter = make_counter(now)
        self._counter.start()
        self._hooks.counter = self._counter
        self._hooks.device = now
        self._counter.mark()
        self._refresh_model_state()
        self._hooks.set_params(self._params)

    def _optimizer_stepped(self, optimizer: torch.optim.Optimizer) -> None:
        if optimizer not in self._adopted:
            # State made before the profiler started is invisible to the CPU counter.
            self._counter.adopt(optimizer_state_tensors([optimizer]))
            self._adopted.add(optimizer)

    def _optimizer_state(self, recount: bool = False) -> int:
        """Optimizer state bytes, counted again only when an optimizer's state changed in size.

        State tensors keep their sizes once made (Adam makes its moments at the
        first step), so the count is reused while ``len(optimizer.state)``
        holds; ``epoch_end()`` recounts everything.
        """
        total = 0
        for opt in self._hooks.discovered_optimizers():
            key = id(opt)
            size = len(opt.state)
            cached = self._optimizer_state_cache.get(key)
            if recount or cached is None or cached[0] != size:
                cached = (size, optimizer_state_bytes([opt], self.device))
                self._optimizer_state_cache[key] = cached
            total += cached[1]
        return total

    def _build_record(self, m: StepMeasurements, reported: bool) -> IterationRecord:
        now = time.perf_counter()
        elapsed, self._last_time = now - self._last_time, now
        final = m.final
        assert final is not None
        sizes = m.gradient_sizes
        if sizes is None or len(sizes) != len(self._params):
            # No backward reached the model this iteration: take the gradients as they are.
            sizes = gradient_bytes(self._params)
        if sizes != self._last_gradient_sizes:
            self._last_gradient_sizes = sizes
            self._gradients_by_name = MappingProxyType(
                {
                    name: n
                    for (name, _), n, trainable in zip(self._params, sizes, self._requires_grad)
                    if trainable or n
                }
            )
        phases = MappingProxyType(
            {
                phase: PhaseStats(
                    m.phase_end_allocated.get(phase), m.phase_peak.get(phase), m.phase_count[phase]
                )
                for phase in ("forward", "backward", "optimizer")
                if phase in m.phase_count
            }
        )
        has_peak = self._counter.has_peak
        usage = self._guard.call("device memory", self._outside.read) if reported else None
        outside = None
        if usage is not None and final.reserved is not None:
            outside = usage.device_used - final.reserved
        return IterationRecord(
            epoch=self.epoch,
            iteration=self.iteration,
            step=self.step,
            device=str(self.device),
            allocated=final.allocated,
            peak_allocated=self._hooks.max_allocated if has_peak else None,
            iteration_peak_allocated=m.iteration_peak,
            peak_phase=m.peak_phase,
            peak_cached=self._hooks.max_reserved if has_peak else None,
            current_cached=final.reserved,
            feature_maps=m.feature_maps,
            intermediate_gradients=m.intermediate_gradients if has_peak else None,
            weights=self._weights_total,
            weights_by_name=self._weights_by_name,
            gradients=sum(sizes),
            gradients_by_name=self._gradients_by_name,
            optimizer_state=self._optimizer_state(),
            buffers=self._buffers_total,
            forward_passes=m.forward_passes,
            backward_passes=m.backward_passes,
            optimizer_steps=m.optimizer_steps,
            iteration_time_s=elapsed,
            phases=phases,
            peak_location=m.peak_location,
            layers=_feature_maps_by_layer(m.layers, m.layers_kept) if reported else None,
            device_used=usage.device_used if usage is not None else None,
            process_used=usage.process_used if usage is not None else None,
            outside_pytorch=outside,
            ddp_gradient_buckets=self._ddp_buckets,
            fsdp_gathered_parameters=self._fsdp.finish_iteration() if self._fsdp else None,
            rank=self.rank_info.rank if self.rank_info is not None else None,
        )

    def _record_stats(self) -> IterationRecord:
        if self._closed:
            raise RuntimeError("record_stats() called after close()")
        self.iteration += 1
        self.step += 1
        reported = self.iteration % self.print_period == 0
        measurements = self._hooks.finish_iteration()
        record = self._build_record(measurements, reported)
        self.last_record = record
        self._update_detail()
        if self._rank_peaks is not None:
            self._rank_peaks.observe(record)
        if reported:
            if self.first_record is None:
                self.first_record = record
            self.records.append(record)
            self.last_report = format_report(record, self.units)
            self._print(self.last_report)
            if self._tensorboard is not None:
                self._guard.call("tensorboard", log_record, self._tensorboard, record, self.units)
            if self._csv is not None:
                self._csv.add(record)
                if self._layers_csv is not None:
                    self._layers_csv.add(record)
                if self._csv.pending >= _FLUSH_EVERY_ROWS:
                    self.flush()
            leak = self._leaks.observe(record)
            if leak is not None:
                self._leaks.warn(leak, UNITS[self.units], self.units)
        return record

    def _update_detail(self) -> None:
        """Per-layer hooks run only in iterations that will be reported."""
        next_reported = (self.iteration + 1) % self.print_period == 0
        self._hooks.detailed = self._hooks.attribution is not None and next_reported

    def _epoch_end(self) -> None:
        self._print(f"Epoch {self.epoch} finished")
        self.flush()
        self._refresh_model_state()
        self._hooks.set_params(self._params)
        self._optimizer_state(recount=True)
        self.epoch += 1
        self.iteration = 0
        self._update_detail()
        if self._hooks.attribution is not None:
            self._hooks.attribution.refresh()

    def _cross_rank_summary(self, epoch: int) -> None:
        info, tracker = self.rank_info, self._rank_peaks
        assert info is not None and tracker is not None
        if not torch.distributed.is_initialized():
            return  # the group was destroyed on every rank: nobody to gather from
        local = None
        try:
            local = summarize_rank(
                info.rank, info.host, tracker.latest, tracker.peak, str(self.device)
            )
        except Exception as exc:  # noqa: BLE001 - the collective below must run regardless
            self._guard.fault("cross-rank figures", exc)
        tracker.new_epoch()
        ranks = gather_summaries(local, info, self.device, self._gather_buffers)
        self.cross_rank_summary = CrossRankSummary(epoch=epoch, ranks=ranks)
        if self._prints_table:
            self.stream.write(format_cross_rank(self.cross_rank_summary, self.units) + "\n")


def _feature_maps_by_layer(breakdown: LayerBreakdown | None, kept: int) -> LayerFeatureMaps | None:
    if breakdown is None:
        return None
    total = breakdown.total
    return LayerFeatureMaps(
        by_module=MappingProxyType(dict(breakdown.by_module)),
        calls=MappingProxyType(dict(breakdown.calls)),
        total=total,
        inputs=breakdown.inputs,
        unattributed=kept - total,
    )


def _flush_at_exit(profiler: MemoryProfiler) -> Any:
    """An exit handler that writes the profiler's rows without keeping it alive."""
    ref = weakref.ref(profiler)

    def flush() -> None:
        alive = ref()
        if alive is not None:
            alive.flush()

    return flush


#: The original tool's name for :class:`MemoryProfiler`.
memory_profiler = MemoryProfiler
