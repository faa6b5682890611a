"""The profiler's settings, validated in one place, and the checks every argument goes through.

:class:`ProfilerOptions` holds every keyword of
:class:`~pytorch_mem_profiler.MemoryProfiler` after validation: a wrong type or
value fails when the profiler is made, with a message naming the argument, never
an hour into training. The small checks (:func:`check_int`, :func:`check_bool`,
:func:`check_path`) are shared with the tools and the command line; this module
imports torch only inside the checks that need it, so the command line can use
them without torch.

Example::

    >>> options = ProfilerOptions(print_period=5, units="MiB")
    >>> options.print_period, options.units, options.csv
    (5, 'MiB', False)
    >>> ProfilerOptions(print_period=0)
    Traceback (most recent call last):
    ...
    ValueError: print_period must be an integer >= 1, got 0
"""

from __future__ import annotations

import io
import logging
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from .outputs.report import REPORT_MODES
from .measure.budget import check_overhead
from .units import check_unit

__all__ = ["ProfilerOptions", "check_int", "check_bool", "check_path", "check_stream", "check_choice", "check_logger", "REPORT_MODES"]


def check_int(value: object, name: str, minimum: int = 1) -> int:
    """``value`` if it is an integer (not a bool) of at least ``minimum``; ``ValueError`` naming ``name``.

    Example::

        >>> check_int(3, "print_period")
        3
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def check_bool(value: object, name: str) -> bool:
    """``value`` if it is ``True`` or ``False``; ``TypeError`` naming ``name``."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")
    return value


def check_path(value: object, name: str) -> Path:
    """``value`` as a :class:`~pathlib.Path` if it is a non-empty ``str`` or ``os.PathLike``.

    Raises:
        TypeError: not a path; the message names ``name``.
        ValueError: an empty path (``""`` would silently mean the working folder).
    """
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"{name} must be a str or os.PathLike, got {type(value).__name__}")
    if os.fspath(value) == "":
        raise ValueError(f"{name} must name a folder, got an empty path")
    return Path(value)


def check_stream(stream: object, name: str = "stream") -> Any:
    """``stream`` if text can be written to it now; ``TypeError``/``ValueError`` naming ``name``.

    Refuses what would fail at the first report: no ``write()``, a closed file, a
    file opened for reading (``sys.stdin``), a binary file.
    """
    if stream is None:
        return None
    if not callable(getattr(stream, "write", None)):
        raise TypeError(f"{name} must have a write() method, got {type(stream).__name__}")
    if getattr(stream, "closed", False):
        raise ValueError(f"{name} is closed")
    writable = getattr(stream, "writable", None)
    if callable(writable):
        try:
            ok = writable()
        except (ValueError, OSError) as err:
            raise ValueError(f"{name} cannot be written: {err}") from err
        if not ok:
            raise ValueError(f"{name} is not open for writing (mode {getattr(stream, 'mode', '?')!r})")
    if isinstance(stream, (io.RawIOBase, io.BufferedIOBase)):
        raise TypeError(f"{name} must be a text stream, got the binary {type(stream).__name__}")
    return stream


def _unwrap_optimizer(optimizer: Any) -> Any:
    """The optimizer that really steps and holds the state: accelerate's ``AcceleratedOptimizer``
    and Lightning's ``LightningOptimizer`` wrap one as ``.optimizer`` (the former without the
    hook machinery of ``torch.optim.Optimizer``, so hooks on it would fail)."""
    import torch

    seen = 0
    while seen < 8:
        inner = getattr(optimizer, "optimizer", None)
        if not isinstance(inner, torch.optim.Optimizer) or inner is optimizer:
            return optimizer
        optimizer, seen = inner, seen + 1
    return optimizer


def check_choice(value: object, name: str, choices: tuple[str, ...]) -> str:
    """``value`` if it is one of ``choices``; ``ValueError`` naming ``name`` and the choices.

    Example::

        >>> check_choice("line", "report", REPORT_MODES)
        'line'
    """
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(repr(c) for c in choices)}; got {value!r}")
    return value


def check_logger(log: object, name: str = "log") -> Any:
    """``log`` if it is ``None``, a :class:`logging.Logger` or a :class:`logging.LoggerAdapter`."""
    if log is not None and not isinstance(log, (logging.Logger, logging.LoggerAdapter)):
        raise TypeError(
            f"{name} must be a logging.Logger (e.g. logging.getLogger(__name__)) or None, got {type(log).__name__}"
        )
    return log


def _check_optimizers(optimizer: Any) -> tuple[Any, ...] | None:
    if optimizer is None:
        return None
    import torch

    optimizer = _unwrap_optimizer(optimizer)
    if isinstance(optimizer, torch.optim.Optimizer):
        return (optimizer,)
    try:
        opts = tuple(_unwrap_optimizer(o) for o in optimizer)
    except TypeError:
        opts = ()
    if not opts or not all(isinstance(o, torch.optim.Optimizer) for o in opts):
        raise TypeError(
            "optimizer must be a torch.optim.Optimizer or a list of them, "
            f"got {type(optimizer).__name__}"
        )
    return opts


def _warn_about_missing_ranks(given: Any, ranks: frozenset[int] | None) -> None:
    """A ``UserWarning`` when ``print_ranks`` names ranks this run does not have.

    In a single process (no ``torch.distributed`` process group) the process is
    rank 0 of 1; a rank that does not exist would print nothing, silently.
    """
    if not ranks:
        return
    from .distributed import rank_info

    info = rank_info()
    world = info.world_size if info is not None else 1
    missing = sorted(r for r in ranks if r >= world)
    if not missing:
        return
    where = (
        f"this run has {world} rank(s), 0 to {world - 1}"
        if info is not None
        else "this is a single process (no torch.distributed process group): rank 0 only"
    )
    printed = sorted(r for r in ranks if r < world)
    outcome = f"only rank(s) {printed} print" if printed else "no rank prints the report"
    warnings.warn(
        f"print_ranks={given!r} names rank(s) {missing} beyond the world size: {where}; {outcome}",
        UserWarning,
        stacklevel=5,
    )


@dataclass(frozen=True)
class ProfilerOptions:
    """Every setting of a :class:`~pytorch_mem_profiler.MemoryProfiler`, validated.

    See :class:`~pytorch_mem_profiler.MemoryProfiler` for what each one does.
    Normalized on the way in: ``optimizer`` becomes a tuple (or ``None``),
    ``device`` a ``torch.device`` (or ``None``: the model's), ``csv_dir`` and
    ``oom_dir`` paths, ``print_ranks`` a frozen set of ranks (``None``: all).
    """

    print_period: int = 1
    csv: bool = False
    optimizer: Any = None
    device: Any = None
    csv_dir: Any = "memory_csv_data"
    stream: IO[str] | None = None
    units: str = "MB"
    strict: bool = False
    history: int = 1000
    by_layer: bool = False
    leak_window: int = 5
    oom_dir: Any = None
    tensorboard: Any = None
    print_ranks: Any = 0
    report: str = "full"
    log: Any = None
    overhead: float | None = 0.03

    def __post_init__(self) -> None:
        check_int(self.print_period, "print_period")
        check_bool(self.csv, "csv")
        self._set("optimizer", _check_optimizers(self.optimizer))
        if self.device is not None:
            from .measure.devices import usable_device

            self._set("device", usable_device(self.device))
        self._set("csv_dir", check_path(self.csv_dir, "csv_dir"))
        check_stream(self.stream)
        check_unit(self.units, "units")
        check_bool(self.strict, "strict")
        check_int(self.history, "history")
        check_bool(self.by_layer, "by_layer")
        check_int(self.leak_window, "leak_window", minimum=2)
        if self.oom_dir is not None:
            self._set("oom_dir", check_path(self.oom_dir, "oom_dir"))
        if self.tensorboard is not None and not callable(getattr(self.tensorboard, "add_scalar", None)):
            raise TypeError(
                "tensorboard must be a writer with add_scalar(), e.g. "
                f"torch.utils.tensorboard.SummaryWriter(); got {type(self.tensorboard).__name__}"
            )
        from .distributed import parse_print_ranks

        given = self.print_ranks
        ranks = parse_print_ranks(given)
        self._set("print_ranks", ranks)
        _warn_about_missing_ranks(given, ranks)
        check_choice(self.report, "report", REPORT_MODES)
        check_logger(self.log)
        self._set("overhead", check_overhead(self.overhead))
        if self.log is not None and self.stream is not None:
            raise ValueError("give stream or log, not both: with log= the reports go through the logger")

    def _set(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)
