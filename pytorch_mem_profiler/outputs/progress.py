"""Writing beside progress bars: a report written while a ``tqdm`` bar is active goes through ``tqdm.write``.

A bar redraws its line with a carriage return and no newline; text written
straight to the terminal lands after the bar, inside its line, and the next
redraw overwrites it. ``tqdm.write`` clears the bars on that stream (and on
the other of standard output and standard error, which share a terminal),
writes, and redraws them below. tqdm is never imported here: it is used only
when the program has imported it and a bar is open.

Example::

    >>> import io
    >>> out = io.StringIO()
    >>> write_text(out, "report\\n")
    >>> out.getvalue()
    'report\\n'
"""

from __future__ import annotations

import sys
from typing import IO, Any

__all__ = ["active_bar_class", "write_text"]


def active_bar_class() -> Any:
    """tqdm's bar class when the program imported tqdm and a bar is open; else ``None``."""
    std = sys.modules.get("tqdm.std")
    if std is None:
        return None
    bar_class = getattr(std, "tqdm", None)
    instances = getattr(bar_class, "_instances", ())
    # Imported, no bar open (a report per iteration asks): the WeakSet's set of references is
    # empty (asked of the set itself, without the WeakSet's own length in Python).
    if not getattr(instances, "data", instances):
        return None
    try:
        bars = list(instances)
    except RuntimeError:  # the set changed while being read (a bar closing in a thread)
        return bar_class
    return bar_class if any(not getattr(bar, "disable", False) for bar in bars) else None


def write_text(stream: IO[str], text: str) -> None:
    """Write ``text`` to ``stream`` (through ``tqdm.write`` while a bar is open) and flush it.

    Flushed so that a report reaches a file being followed (``tail -f``) or a
    pipe at once, and so that a reader that went away (``| head``) is found here.
    """
    bar_class = active_bar_class()
    if bar_class is not None:
        bar_class.write(text, file=stream, end="")
    else:
        stream.write(text)
    flush = getattr(stream, "flush", None)
    if flush is not None:
        flush()
