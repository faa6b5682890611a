"""``MemoryProfiler`` (also ``memory_profiler``): the per-iteration training-loop memory report.

Lifecycle and wiring only: the settings are validated by
:class:`~pytorch_mem_profiler.options.ProfilerOptions`, a
:class:`~pytorch_mem_profiler.measure.meter.Meter` measures each iteration and
makes its :class:`~pytorch_mem_profiler.stats.IterationRecord`, and every
reported record goes to each output (:mod:`pytorch_mem_profiler.outputs.sinks`)
in turn: ``record_stats()`` reads "meter.finish() -> record -> each sink".

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
import dataclasses
import logging
import os
import sys
import weakref
from collections import deque
from pathlib import Path
from typing import IO, Any, ContextManager, Iterable

import torch

from .distributed import CrossRankExchange, CrossRankSummary, rank_info
from .faults import FaultGuard
from .measure.budget import CostBudget, richest_level
from .measure.hooks import PhaseBlock
from .measure.meter import Meter, Position
from .options import ProfilerOptions
from .outputs.notices import MisuseWarning, warn_user
from .outputs.rank_table import format_cross_rank
from .outputs.sinks import CsvSink, HeadroomSink, LayerCsvSink, LeakSink, ReportSink, Sink, TensorBoardSink
from .stats import IterationRecord

__all__ = ["MemoryProfiler", "memory_profiler"]


#: :attr:`MemoryProfiler._state`: measuring; switched off by a fault (the outputs stay); closed.
MEASURING, STOPPED, CLOSED = "measuring", "stopped", "closed"


class MemoryProfiler:
    """Reports, every few training iterations, where the device memory goes.

    Add it to a training loop: make it once, call :meth:`record_stats` after
    each iteration and :meth:`epoch_end` after each epoch. Hooks on the model
    and optimizer find forward, backward and the optimizer step by themselves,
    also when a framework calls a child of the model rather than its
    ``forward`` and runs them inside ``optimizer.step(closure)``; a framework
    that knows its phases can mark them with :meth:`phase`.

    Args:
        model: the model being trained.
        print_period: print the report every this many iterations (an int >= 1).
        csv: write a row per reported iteration to a CSV file in ``csv_dir``.
        optimizer: the optimizer (or a list of them) whose state to count;
            ``None`` finds those that step the model's parameters.
        device: the device to profile; default: the model's first parameter's.
        csv_dir: the CSV folder, created if missing.
        stream: where the report goes; ``None`` means standard output. While a
            ``tqdm`` progress bar is open the report is written through
            ``tqdm.write``, so it never lands inside the bar's line.
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
        report: the report's layout: ``"full"`` (the default: the original
            tool's layout, every parameter, then the peak, what is alive at it,
            headroom and feature maps by layer), ``"compact"`` (a few lines: the
            peak and headroom, the categories, the top 5 layers, the phase) or
            ``"line"`` (one line per report, for long runs).
        log: a :class:`logging.Logger` the reports go to (``INFO``, one record per
            report) instead of ``stream``; the profiler's warnings are logged there too.
        overhead: the largest share of the run's time the profiler may cost (default
            ``0.03``: 3%; ``None``: no limit). The profiler measures its own cost in the
            run and gives each reported iteration the richest level of detail
            (:data:`~pytorch_mem_profiler.stats.DETAIL_LEVELS`) that keeps it within
            the budget: ``"phases"`` (phase peaks, feature maps, weight and
            intermediate gradients, the peak's make-up) or, with ``by_layer=True``,
            ``"full"`` (and the per-layer figures); else ``"light"`` (one allocator
            read). The first reported iteration gets the richest level; each record
            says its level (``record.detail``), and the report why a figure is missing
            (see :mod:`~pytorch_mem_profiler.measure.budget`).

    Rows reach the CSV files as they are reported (one ``write()`` per row, no
    buffering in memory), so a run killed by SIGTERM or SIGKILL loses none.
    Warnings (:class:`~pytorch_mem_profiler.outputs.leaks.LeakWarning`,
    :class:`~pytorch_mem_profiler.outputs.headroom.HeadroomWarning` past 90% of
    the device's memory) are ``UserWarning`` subclasses that point at the
    :meth:`record_stats` line.

    Under ``torch.distributed`` (an initialized default process group) each
    rank profiles its own device, its CSV file's name ends with
    ``_rank<r>_<host>``, and :meth:`epoch_end` is a collective: every rank must
    call it, as often as the others.

    Weights and buffers are counted when the profiler is made and again at
    each :meth:`epoch_end` (a buffer a module replaces in its forward, a cache
    built at the first call, at the next fully measured iteration); gradients,
    feature maps and the rest every iteration.

    On CUDA the profiler resets the allocator's peak statistics at each phase
    boundary of a reported iteration and once at ``record_stats()`` of the others
    (``torch.cuda.reset_peak_memory_stats``): read peaks from its records
    (``peak_allocated``) rather than ``torch.cuda.max_memory_allocated()``.
    Iterations that are not reported cost one read of the counters: their
    record (``reported=False``) leaves the figures that need the phase
    boundaries ``None`` (see :class:`~pytorch_mem_profiler.stats.IterationRecord`).

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
        report: str = "full",
        log: logging.Logger | logging.LoggerAdapter | None = None,
        overhead: float | None = 0.03,
    ) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        #: the validated settings
        self.options = options = ProfilerOptions(
            print_period=print_period,
            csv=csv,
            optimizer=optimizer,
            device=device,
            csv_dir=csv_dir,
            stream=stream,
            units=units,
            strict=strict,
            history=history,
            by_layer=by_layer,
            leak_window=leak_window,
            oom_dir=oom_dir,
            tensorboard=tensorboard,
            print_ranks=print_ranks,
            report=report,
            log=log,
            overhead=overhead,
        )
        if any(p.device.type == "meta" for p in model.parameters()):
            raise ValueError(
                "model has parameters on the meta device, which hold no memory to profile; "
                "materialize them first, e.g. model.to_empty(device='cuda')"
            )
        self.model = model
        #: this process's rank under torch.distributed; ``None`` in a single process
        self.rank_info = rank_info()
        self._guard = FaultGuard(options.strict)
        self._meter = Meter(
            model,
            device=options.device,
            optimizers=options.optimizer,
            by_layer=options.by_layer,
            guard=self._guard,
            rank_info=self.rank_info,
            overhead=options.overhead,
        )
        #: chooses each reported iteration's level of detail within ``overhead``
        self._budget = CostBudget(options.overhead, richest_level(options.by_layer))
        # Outputs are made before any hook is installed: a CSV folder that cannot
        # be written fails here, leaving nothing behind.
        self._report, self._sinks = self._make_sinks()
        # What each reported record goes to: (the fault-guard part, the sink's on_record), made once
        # (the part's name is not formatted, nor the method looked up, at every report).
        self._record_outputs = [
            (f"output: {sink.name}", sink.on_record) for sink in self._sinks if type(sink).on_record is not Sink.on_record
        ]

        self.epoch = 1
        self.iteration = 0
        self.step = 0
        #: The reported records, the latest ``history`` of them (the CSV file has them all).
        self.records: deque[IterationRecord] = deque(maxlen=options.history)
        #: The first reported record, kept so the latest can be compared with it.
        self.first_record: IterationRecord | None = None
        self.last_record: IterationRecord | None = None
        self._ranks = CrossRankExchange(self.rank_info) if self.rank_info is not None else None
        # the misuses warned about already (each once per profiler)
        self._warned: set[str] = set()
        # MEASURING; STOPPED once a fault switched record_stats() off (nothing is measured from then
        # on, the outputs stay); CLOSED after close()
        self._state = MEASURING
        self.oom_postmortem = None
        if options.oom_dir is not None:
            from .tools.oom import OomPostmortem  # its folder is made (and checked) now

            self.oom_postmortem = OomPostmortem(options.oom_dir, profiler=self)

        self._meter.start()
        self._meter.prepare(self._next_level())
        if self.oom_postmortem is not None:
            self.oom_postmortem.attach()
        self._atexit = _flush_at_exit(self)
        atexit.register(self._atexit)
        self._budget.restart()

    def _make_sinks(self) -> tuple[ReportSink, list[Sink]]:
        options = self.options
        rank = self.rank_info.rank if self.rank_info is not None else 0
        printing = options.print_ranks
        prefix = (
            f"[rank {rank}] " if self.rank_info is not None and printing != frozenset({0}) else ""
        )
        given = options.stream
        report = ReportSink(
            # Asked at each write, so a swapped sys.stdout is followed; refers to no
            # profiler, so a closed profiler is freed without the cycle collector.
            lambda: given if given is not None else sys.stdout,
            units=options.units,
            prints=printing is None or rank in printing,
            prefix=prefix,
            mode=options.report,
            log=options.log,
        )
        sinks: list[Sink] = [report]
        if options.tensorboard is not None:
            sinks.append(TensorBoardSink(options.tensorboard, options.units))
        if options.csv:
            from .outputs.export import CsvLog, LayerCsv

            log = CsvLog(
                options.csv_dir,
                self._meter.parameter_names,
                unit=options.units,
                name_suffix=self.file_tag,
                log=options.log,
            )
            sinks.append(CsvSink(log))
            if options.by_layer:
                sinks.append(LayerCsvSink(LayerCsv(log.path, log=options.log)))
        sinks.append(LeakSink(options.leak_window, options.units, options.log))
        sinks.append(HeadroomSink(options.units, options.log))
        return report, sinks

    def _sink(self, kind: type) -> Any:
        return next((s for s in self._sinks if type(s) is kind), None)

    # -- the settings, as given (validated: :attr:`options`) ------------------------
    @property
    def print_period(self) -> int:
        """The report is printed every this many iterations."""
        return self.options.print_period

    @property
    def csv(self) -> bool:
        """Whether a row per reported iteration goes to a CSV file (:attr:`csv_path`)."""
        return self.options.csv

    @property
    def units(self) -> str:
        """The unit of the report's and the CSV file's amounts (``"MB"``, ``"GiB"``, ...)."""
        return self.options.units

    @property
    def strict(self) -> bool:
        """Whether the profiler's own faults are raised instead of switching the faulty part off."""
        return self.options.strict

    @property
    def by_layer(self) -> bool:
        """Whether feature maps are attributed to the modules that saved them."""
        return self.options.by_layer

    @property
    def file_tag(self) -> str:
        """What this rank's file names end with: ``_rank<r>_<host>`` (empty in a single process)."""
        return self.rank_info.file_tag if self.rank_info is not None else ""

    @property
    def csv_path(self) -> Path | None:
        """The CSV file the rows go to (``None`` without ``csv``)."""
        sink = self._sink(CsvSink)
        return sink.path if sink is not None else None

    @property
    def layers_csv_path(self) -> Path | None:
        """The CSV file of feature maps by layer (``None`` without ``csv`` and ``by_layer``)."""
        sink = self._sink(LayerCsvSink)
        return sink.path if sink is not None else None

    @property
    def cross_rank_summary(self) -> CrossRankSummary | None:
        """The latest cross-rank summary (every rank has it after :meth:`epoch_end`; ``None`` in a
        single process, before the first, or once the process group is gone)."""
        return self._ranks.latest if self._ranks is not None else None

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran."""
        return self._state is CLOSED

    # -- the public loop API ---------------------------------------------------
    @property
    def device(self) -> torch.device:
        """The profiled device."""
        return self._meter.device

    @property
    def stream(self) -> IO[str]:
        """Where the report goes: the ``stream`` given, else standard output (as it is now)."""
        return self.options.stream if self.options.stream is not None else sys.stdout

    @property
    def last_report(self) -> str | None:
        """The text of the last report made."""
        return self._report.last_report

    def record_stats(self) -> IterationRecord | None:
        """Count one iteration; print the report every ``print_period`` iterations.

        Returns the iteration's record (all figures in bytes), the same one the
        report and the CSV row are made from; ``None`` if the profiler failed
        and switched itself off (a fault in this method, or in the CPU counter
        every figure on the CPU comes from): nothing is measured then. A call
        whose iteration the hooks watched and saw nothing in (the model not
        entered, not even without gradients; no backward, no optimizer step: called
        twice in a row, or before training began) is no iteration: it is not counted
        nor reported, its record (the figures as they are) carries the last counted
        iteration and ``reported=False``, and a
        :class:`~pytorch_mem_profiler.outputs.notices.MisuseWarning` says so once.
        """
        # A door the user calls: every line inside the try (so are epoch_end's and close's);
        # contained as FaultGuard.call("record_stats", ...) would, inline. It runs every
        # iteration: one function, whose common case (an iteration the hooks slept through,
        # not reported or reported at the "light" level) calls the meter, the budget and, when
        # reported, the outputs, and nothing else.
        try:
            if "record_stats" in self._guard.disabled:
                return None
            if self._state is not MEASURING:
                if self._state is CLOSED:
                    raise RuntimeError("record_stats() called after close()")
                return None
            meter = self._meter
            if meter.counter.failed:
                # The counter every figure comes from stopped counting (its fault is logged): the
                # figures would be frozen, so none is given, and nothing is measured any more.
                self._stop_measuring()
                return None
            budget = self._budget
            budget.entered()
            iteration, step = self.iteration + 1, self.step + 1
            period = self.options.print_period
            reported = iteration % period == 0
            # the light path (the hooks slept through the iteration) first, the meter's others if not
            record = meter.finish_slept(self.epoch, iteration, step, reported)
            slept = record is not None
            if not slept:
                record = meter.finish(Position(self.epoch, iteration, step), reported)
                # with a part's hooks off (a fault), a phase may go unseen: no iteration is refused then
                if meter.idle and not self._guard.disabled:
                    # Watched, and no training step in it: counting it would shift every later iteration.
                    budget.restart()  # no step to account for: the next is timed from here
                    meter.prepare(self._next_level())
                    self._misuse(
                        "record_stats",
                        "record_stats() saw no forward (the model was not called), no backward and no optimizer step "
                        "since the last call (called twice in a row, or before training began): not counted as an iteration",
                    )
                    # The figures as they are, marked as no iteration: the last counted position, not reported.
                    return dataclasses.replace(record, iteration=self.iteration, step=self.step, reported=False)
            self.iteration = iteration
            self.step = step
            self.last_record = record
            if self._ranks is not None:
                self._ranks.observe(record)
            if reported:
                self._output(record)
            # Accounted before the next level is chosen; getting the next iteration ready is timed
            # with its step (a detailed one's set-up is part of what the detail costs).
            budget.left(record.detail)
            level = budget.choose() if (iteration + 1) % period == 0 else "light"
            if level != "light" or not slept or self._guard.disabled:
                # (after an iteration the hooks slept through, another light one needs nothing new)
                meter.prepare(level)
            return record
        except Exception as exc:  # noqa: BLE001 - never raise into the training loop
            self._guard.fault("record_stats", exc)
            self._stop_measuring()
            return None

    def epoch_end(self) -> None:
        """Print ``Epoch N finished``, write the epoch's rows, and start the next epoch.

        An ``epoch_end()`` with no :meth:`record_stats` iteration since the last one
        (or since the start) counts no epoch: a
        :class:`~pytorch_mem_profiler.outputs.notices.MisuseWarning` says so once.

        Under ``torch.distributed`` also gather every rank's peaks (one small
        all-gather) into :attr:`cross_rank_summary` and print the cross-rank
        table: every rank must call it.
        """
        try:
            epoch = self.epoch
            self._guard.call("epoch_end", self._epoch_end)
        except Exception as exc:  # noqa: BLE001 - never raise into the training loop
            self._guard.fault("epoch_end", exc)
            epoch = self.epoch
        try:
            if self.rank_info is not None:
                # Apart from the rest of epoch_end, so that a fault there never
                # keeps this rank out of the collective the others wait in.
                self._guard.call("cross-rank summary", self._cross_rank_summary, epoch)
        except Exception as exc:  # noqa: BLE001 - never raise into the training loop
            self._guard.fault("cross-rank summary", exc)

    def phase(self, name: str) -> ContextManager[Any]:
        """A ``with`` block in which the phase ``name`` runs, for frameworks that know their phases.

        ``name`` is ``"forward"``, ``"backward"`` or ``"optimizer"`` (``ValueError``
        otherwise). The block is that phase: its peak is the phase's peak, a
        ``"forward"`` block is one forward pass (its feature maps are what it
        leaves allocated), a ``"backward"`` block one backward pass (gradients
        are measured at its end), an ``"optimizer"`` block one optimizer step
        (forwards and backwards of a closure inside it count as such, and the
        update is what runs after the last backward). The automatic hooks that
        fire inside a block do not count the phase a second time, so marking
        phases that the hooks also find changes no figure. A block inside a
        block of the same phase is ignored. After :meth:`close` it does nothing (nor after a fault
        switched :meth:`record_stats` off).

        Example::

            >>> import io, torch
            >>> model = torch.nn.Linear(8, 2)
            >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
            >>> profiler = MemoryProfiler(model, stream=io.StringIO())
            >>> with profiler.phase("optimizer"):          # e.g. one step of a framework
            ...     with profiler.phase("forward"):
            ...         loss = model(torch.randn(4, 8)).sum()
            ...     with profiler.phase("backward"):
            ...         loss.backward()
            ...     opt.step()                             # the update
            >>> record = profiler.record_stats()
            >>> record.forward_passes, record.backward_passes, record.optimizer_steps
            (1, 1, 1)
            >>> profiler.close()
        """
        return self._meter.phase_block(name) if self._state is MEASURING else _closed_phase(name)

    @property
    def current_phase(self) -> str | None:
        """The phase running now: ``"forward"``, ``"backward"``, ``"optimizer"`` or ``"other"``
        (``None`` once closed, or once a fault switched :meth:`record_stats` off)."""
        return self._meter.phase if self._state is MEASURING else None

    def close(self) -> None:
        """Remove every hook, write pending rows and stop counting. Safe to call twice."""
        try:
            self._close()
        except Exception as first:  # noqa: BLE001 - never raise into the training loop
            try:
                self._close()  # once more: its steps are safe to repeat
            except Exception as exc:  # noqa: BLE001
                first = exc
            self._guard.fault("close", first)

    def _close(self) -> None:
        if self._state is CLOSED:
            return
        # Each removal in its own try, run even when an earlier one failed
        # (and once more if it raised): nothing is left installed.
        steps = [self._stop_measuring]
        if self.oom_postmortem is not None:
            steps.insert(0, self.oom_postmortem.remove)
        if self._ranks is not None:
            steps.append(self._ranks.release)
        steps.extend(sink.close for sink in self._sinks)
        steps.append(lambda: atexit.unregister(self._atexit))
        self._guard.clean_up("close", *steps)
        self._state = CLOSED

    def _stop_measuring(self) -> None:
        """Remove the meter's hooks and stop its counter, once: at :meth:`close`, or as soon as a
        fault switches :meth:`record_stats` off or stops the counter (nothing would be recorded, so
        nothing is measured: the per-layer hooks and the CPU counter's dispatch mode would tax
        every later iteration). The outputs stay until :meth:`close`; :meth:`epoch_end` still
        writes their rows."""
        if self._state is MEASURING:
            self._state = STOPPED
            self._guard.clean_up("close", self._meter.close)

    def flush(self) -> None:
        """Write the rows recorded so far to the CSV files."""
        try:
            for sink in self._sinks:
                self._guard.call(f"output: {sink.name}", sink.flush)
        except Exception as exc:  # noqa: BLE001 - never raise into the caller
            self._guard.fault("flush", exc)

    def max_batch_size(
        self, *, batch_size: int, device_memory: int | None = None, margin: float = 0.1
    ) -> int:
        """The largest batch size that would fit, predicted from this run's records.

        ``batch_size``: the batch the recorded iterations ran at; ``device_memory``:
        bytes (default: the device's total). See
        :func:`~pytorch_mem_profiler.estimate.records.max_batch_from_records`.
        """
        from .estimate.records import max_batch_from_records

        recorded = [*self.records, self.last_record]
        return max_batch_from_records(recorded, batch_size, device_memory, margin)

    def postmortem(self) -> dict[str, Any]:
        """What an OOM post-mortem writes about the run: plain data, ready for JSON.

        ``epoch``, ``iteration`` and ``step`` of the iteration in progress (the
        one that failed), its ``phase``, the measurements made in it so far
        (``in_progress``), the ``last_record`` completed (bytes), and the text
        of the last printed ``report``.
        """
        from .tools.oom import plain_data

        return {
            "device": str(self.device),
            "epoch": self.epoch,
            "iteration": self.iteration + 1,
            "step": self.step + 1,
            "phase": self._meter.phase,
            "in_progress": plain_data(self._meter.current),
            "last_record": plain_data(self.last_record),
            "report": self.last_report,
        }

    def __enter__(self) -> MemoryProfiler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals -------------------------------------------------------------
    def _next_reported(self) -> bool:
        return (self.iteration + 1) % self.options.print_period == 0

    def _next_level(self) -> str:
        """The coming iteration's level of detail: the budget's choice if it will be reported."""
        return self._budget.choose() if self._next_reported() else "light"

    def _output(self, record: IterationRecord) -> None:
        """A reported record to every output, each contained as ``FaultGuard.call(part, ...)``
        would, inline: one that fails is switched off alone, the others go on."""
        first = self.first_record is None
        if first:
            self.first_record = record
        self.records.append(record)
        guard = self._guard
        disabled = guard.disabled
        for part, on_record in self._record_outputs:
            try:
                if part not in disabled:
                    on_record(record)
            except Exception as exc:  # noqa: BLE001 - this output switches off, the others go on
                guard.fault(part, exc)
        if first and self.csv_path is not None:
            guard.call("output: report", self._report.write, self._csv_notice())

    def _csv_notice(self) -> str:
        """Where the rows go and in which unit, said once, at the first row written."""
        text = f"CSV: a row per report in {self.csv_path} (amounts in {self.units}, as its unit column says)"
        if self.layers_csv_path is not None:
            text += f"; feature maps by layer in {self.layers_csv_path.name} (amounts in bytes, its bytes column)"
        return text

    def _misuse(self, call: str, message: str) -> None:
        """Warn once per profiler about a misuse of ``call`` (not counted; the run goes on)."""
        if call not in self._warned:
            self._warned.add(call)
            warn_user(message, MisuseWarning, self.options.log)

    def _epoch_end(self) -> None:
        # (with record_stats() switched off by a fault no iteration is counted: epochs still are)
        if self.iteration == 0 and self._state is MEASURING and "record_stats" not in self._guard.disabled:
            self._misuse(
                "epoch_end",
                f"epoch_end() with no record_stats() iteration since the last epoch_end() "
                f"(or the start): no epoch counted, the next is still epoch {self.epoch}",
            )
            return
        for sink in self._sinks:
            self._guard.call(f"output: {sink.name}", sink.on_epoch_end, self.epoch)
        if self._state is MEASURING:
            self._meter.refresh()
        self.epoch += 1
        self.iteration = 0
        if self._state is MEASURING:
            self._meter.prepare(self._next_level())
        self._budget.restart()  # the epoch's end is neither a step nor an iteration's cost

    def _cross_rank_summary(self, epoch: int) -> None:
        assert self._ranks is not None
        summary = self._ranks.gather(epoch, self.device, lambda exc: self._guard.fault("cross-rank figures", exc))
        # the lowest printing rank prints the table
        if summary is not None and self._report.prints and self.rank_info.rank == min(self.options.print_ranks or {0}):
            self._report.write(format_cross_rank(summary, self.units))


def _closed_phase(name: str) -> PhaseBlock:
    """The block :meth:`MemoryProfiler.phase` gives once closed: checks ``name``, marks nothing."""
    return PhaseBlock(None, name)


def _flush_at_exit(profiler: MemoryProfiler) -> Any:
    """An exit handler that writes the profiler's rows without keeping it alive."""
    ref = weakref.ref(profiler)

    def flush() -> None:
        try:
            alive = ref()
            if alive is not None:
                alive.flush()
        except Exception:  # noqa: BLE001 - at exit, nothing is left to tell
            pass

    return flush


#: The original tool's name for :class:`MemoryProfiler`.
memory_profiler = MemoryProfiler
