"""Warnings that reach the user: shown under Python's default filters, pointing at their own code.

The profiler's warnings (:class:`~pytorch_mem_profiler.outputs.leaks.LeakWarning`,
:class:`~pytorch_mem_profiler.outputs.headroom.HeadroomWarning`,
:class:`OutputWarning`) are :class:`UserWarning` subclasses, so Python shows them
without ``-W``. :func:`warn_user` issues one at the first frame outside this
package: the line of the user's ``record_stats()`` (or ``epoch_end()``,
``close()``) call, not a line of the profiler. Each is also sent to a logger
(``pytorch_mem_profiler``, or the ``log=`` the profiler was given) when that
logger has somewhere to go: logging's last-resort handler would otherwise
print it a second time on standard error.

Example::

    >>> import warnings
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     warn_user("something to know", OutputWarning)
    >>> caught[0].category.__name__, str(caught[0].message)
    ('OutputWarning', 'pytorch_mem_profiler: something to know')
"""

from __future__ import annotations

import logging
import os
import sys
import warnings

__all__ = ["OutputWarning", "MisuseWarning", "warn_user", "package_logger", "PACKAGE_DIR"]

#: The package's folder: frames inside it are the profiler's, not the user's.
PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep

#: The package's logger; the fault guard and the warnings log through it.
package_logger = logging.getLogger("pytorch_mem_profiler")


class OutputWarning(UserWarning):
    """An output (the CSV file, the report's stream) failed, or was made again, while the run went on."""


class MisuseWarning(UserWarning):
    """The profiler was called in a way that would count wrong (an ``epoch_end()`` with no
    iteration since the last one, a ``record_stats()`` that saw no training step): the call is
    not counted, and the warning, shown once per profiler and kind, names it."""


def _user_stacklevel() -> int:
    """The ``stacklevel`` of the first caller outside the package, counted from :func:`warn_user`'s caller."""
    frame = sys._getframe(1)  # warn_user
    level = 1
    while frame is not None and frame.f_code.co_filename.startswith(PACKAGE_DIR):
        frame = frame.f_back
        level += 1
    return level


def warn_user(message: str, category: type[Warning], log: logging.Logger | logging.LoggerAdapter | None = None) -> None:
    """Warn at the user's line (the first frame outside this package) and log the message.

    Args:
        message: what happened; ``pytorch_mem_profiler: `` is put in front.
        category: a :class:`UserWarning` subclass.
        log: where the message is logged (``WARNING``), when it has handlers; the
            package logger when ``None``.
    """
    text = "pytorch_mem_profiler: " + message
    warnings.warn(text, category, stacklevel=_user_stacklevel())
    logger = log if log is not None else package_logger
    target = logger.logger if isinstance(logger, logging.LoggerAdapter) else logger
    if target.hasHandlers():
        logger.warning(text)
