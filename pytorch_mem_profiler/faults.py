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

__all__ = ["FaultGuard"]

_log = logging.getLogger("pytorch_mem_profiler")

F = TypeVar("F", bound=Callable[..., Any])


class FaultGuard:
    """Runs profiler code so that its exceptions never reach the user's loop."""

    def __init__(self, strict: bool = False) -> None:
        self.strict = strict
        self.disabled: set[str] = set()

    def wrap(self, part: str, fn: F) -> F:
        """``fn`` made safe: after its first exception it does nothing and returns ``None``."""

        @functools.wraps(fn)
        def guarded(*args: Any, **kwargs: Any) -> Any:
            return self.call(part, fn, *args, **kwargs)

        return guarded  # type: ignore[return-value]

    def call(self, part: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ``fn`` now, contained as :meth:`wrap` would (no wrapper made)."""
        if part in self.disabled:
            return None
        try:
            return fn(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - any profiler fault must be contained
            self.fault(part, exc)
            return None

    def fault(self, part: str, exc: BaseException) -> None:
        """Record a fault in ``part``: re-raise when strict, else log once and switch it off."""
        if self.strict:
            raise exc
        if part not in self.disabled:
            self.disabled.add(part)
            _log.warning(
                "pytorch_mem_profiler: %s failed and is switched off; training continues (%s: %s)",
                part,
                type(exc).__name__,
                exc,
                exc_info=exc,
            )
