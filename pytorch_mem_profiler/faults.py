"""Keep profiler faults away from the user's training run.

A part of the profiler that raises is logged once and switched off; the
training loop goes on. With ``strict=True`` the exception propagates instead
(tests use it, so a bug cannot hide).

Example::

    >>> guard = FaultGuard(strict=False)
    >>> def broken():
    ...     raise RuntimeError("boom")
    >>> safe = guard.wrap("demo", broken)
    >>> safe() is None and guard.disabled == {"demo"}
    True
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable, TypeVar

__all__ = ["FaultGuard", "twice", "TracebacksAsText"]

_log = logging.getLogger("pytorch_mem_profiler")


class TracebacksAsText(logging.Filter):
    """Makes a log record's exception text before any handler sees it.

    A record's ``exc_info``, and an exception among its arguments, hold the
    traceback, whose frames hold the tensors of the iteration the fault
    interrupted (a forward's output holds its whole autograd graph): a handler
    that keeps records (``MemoryHandler``, a test's log capture, a buffering log
    shipper) would keep them allocated. This filter, on the package's logger,
    formats the traceback into ``exc_text`` (which formatters print as they
    would ``exc_info``) and the exception arguments into their text, and drops
    the objects.

    Example::

        >>> record = logging.LogRecord("demo", logging.WARNING, __file__, 1, "failed: %s", None, None)
        >>> try:
        ...     raise RuntimeError("boom")
        ... except RuntimeError as exc:
        ...     record.args, record.exc_info = (exc,), (type(exc), exc, exc.__traceback__)
        >>> TracebacksAsText().filter(record)
        True
        >>> record.exc_info, record.args, record.exc_text.splitlines()[-1]
        (None, ('boom',), 'RuntimeError: boom')
    """

    _formatter = logging.Formatter()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info:
            if not record.exc_text:
                record.exc_text = self._formatter.formatException(record.exc_info)
            record.exc_info = None
        args = record.args
        if isinstance(args, tuple) and any(isinstance(a, BaseException) for a in args):
            record.args = tuple(str(a) if isinstance(a, BaseException) else a for a in args)
        return True


# Every module of the package logs through this one logger; the package's __init__ imports this
# module, so the filter is on it before any of them can log.
if not any(isinstance(f, TracebacksAsText) for f in _log.filters):
    _log.addFilter(TracebacksAsText())

F = TypeVar("F", bound=Callable[..., Any])


class FaultGuard:
    """Runs profiler code so that its exceptions never reach the user's loop."""

    def __init__(self, strict: bool = False) -> None:
        self.strict = strict
        self.disabled: set[str] = set()

    def wrap(self, part: str, fn: F) -> F:
        """``fn`` made safe: after its first exception it does nothing and returns ``None``."""
        disabled = self.disabled

        @functools.wraps(fn)
        def guarded(*args: Any, **kwargs: Any) -> Any:
            # Torch and the user call this directly: every line of it is inside the try.
            try:
                if part in disabled:
                    return None
                return fn(*args, **kwargs)
            except Exception as exc:  # noqa: BLE001 - any profiler fault must be contained
                self.fault(part, exc)
                return None

        return guarded  # type: ignore[return-value]

    def call(self, part: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ``fn`` now, contained as :meth:`wrap` would (no wrapper made)."""
        try:
            if part in self.disabled:
                return None
            return fn(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - any profiler fault must be contained
            self.fault(part, exc)
            return None

    def clean_up(self, part: str, *steps: Callable[[], Any]) -> None:
        """Run every clean-up step (a removal), each in its own try, even when ``part`` is off.

        A step that raises is run once more (removing twice is harmless; a
        transient fault then still leaves nothing installed), then the fault is
        logged; the steps after it run all the same. When strict, the first
        fault is re-raised after every step ran. A fault in this bookkeeping
        itself (or in logging a step's fault) still runs every step: the
        clean-up is what must not fail.
        """
        try:
            first = self._clean_up(part, steps)
        except Exception as exc:  # noqa: BLE001 - the bookkeeping failed: every step once more, bare
            first = exc
            for step in steps:
                try:
                    twice(step)
                except Exception:  # noqa: BLE001 - the next steps must run
                    pass
        if first is not None and self.strict:
            raise first

    def _clean_up(self, part: str, steps: tuple[Callable[[], Any], ...]) -> BaseException | None:
        first: BaseException | None = None
        for step in steps:
            try:
                twice(step)
            except Exception as exc:  # noqa: BLE001 - the other steps must run
                first = first or exc
                if not self.strict:
                    self.fault(part, exc)
        return first

    def fault(self, part: str, exc: BaseException) -> None:
        """Record a fault in ``part``: re-raise when strict, else log once and switch it off.

        Never raises when not strict: it runs inside the ``except`` of every hook,
        where an exception would reach torch or the training loop. Switching the
        part off comes first and cannot be lost to a failed log record.
        """
        try:
            strict = self.strict
            first = part not in self.disabled
        except Exception:  # noqa: BLE001 - switching off must happen whatever failed here
            strict, first = self.strict, False
        if strict:
            raise exc
        self.disabled.add(part)
        if first:
            _log_fault(part, exc)


def _log_fault(part: str, exc: BaseException) -> None:
    """Log a part's fault once; a failing handler, filter or formatter loses the line, nothing else."""
    try:
        _log.warning(
            "pytorch_mem_profiler: %s failed and is switched off; training continues (%s: %s)",
            part,
            type(exc).__name__,
            exc,
            exc_info=exc,
        )
    except Exception:  # noqa: BLE001 - a log line is not worth the training run
        pass


def twice(step: Callable[[], Any]) -> Any:
    """Run an idempotent clean-up ``step``; if it raises, once more (its second fault propagates).

    Example::

        >>> faults = iter([RuntimeError("transient")])
        >>> def remove():
        ...     fault = next(faults, None)
        ...     if fault is not None:
        ...         raise fault
        ...     return "removed"
        >>> twice(remove)
        'removed'
    """
    try:
        return step()
    except Exception:  # noqa: BLE001 - tried once more below
        return step()
