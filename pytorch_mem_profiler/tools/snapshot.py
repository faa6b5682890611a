"""Memory-history snapshots of the CUDA caching allocator, and the pages that show them.

While history is recorded, the allocator keeps every allocation and free with
the Python stack that made it. :func:`save_memory_snapshot` writes, into a folder:

- ``snapshot.pickle``: the snapshot, for PyTorch's viewer at
  https://pytorch.org/memory_viz (drop the file on the page; it is read in the
  browser, nothing is uploaded). Pickled with protocol 4, the newest that
  the viewer's JavaScript unpickler reads (Python 3.14 defaults to 5);
- ``memory_view.html``: this package's offline view
  (:mod:`~pytorch_mem_profiler.tools.snapshot_view`): memory over the recorded
  events and the largest allocations alive at the peak with their stacks. It
  loads nothing: it opens without a network;
- ``trace_plot.html``: torch's ``_memory_viz.trace_plot`` page, the
  interactive timeline with the snapshot embedded. It imports ``MemoryViz.js``
  from a CDN (cdn.jsdelivr.net) when opened: without a network it is blank.

Two ways to get one:

- :func:`save_memory_snapshot`, a context manager that records while its block
  runs and writes the files into a folder;
- :func:`start_record_memory_history`, :func:`export_memory_snapshot` and
  :func:`stop_record_memory_history`, the three steps of PyTorch's guide to GPU
  memory, for code that cannot be wrapped in one block (``write_snapshot_view``
  then renders the exported pickle).

Without CUDA each warns or logs and does nothing else.

Example::

    >>> import tempfile, warnings, torch
    >>> with warnings.catch_warnings(record=True):
    ...     with save_memory_snapshot(tempfile.mkdtemp()) as snap:
    ...         x = torch.ones(1024, device="cuda" if torch.cuda.is_available() else "cpu")
    >>> snap.recorded == torch.cuda.is_available()
    True
"""

from __future__ import annotations

import base64
import logging
import os
import pickle
import re
import threading
import warnings
from pathlib import Path
from typing import Any

import torch

from ..faults import FaultGuard
from ..options import check_int
from ..measure.allocator import history as allocator_history
from ..paths import check_path_type, free_path, host_time_stem, prepare_output_dir
from .snapshot_view import write_snapshot_view

__all__ = [
    "SnapshotRecorder",
    "save_memory_snapshot",
    "start_record_memory_history",
    "export_memory_snapshot",
    "stop_record_memory_history",
    "history_recording",
    "write_snapshot_files",
    "write_snapshot_view",
    "pickle_snapshot",
    "SNAPSHOT_PICKLE_PROTOCOL",
    "STACKS",
]

_log = logging.getLogger("pytorch_mem_profiler")

#: Accepted ``stacks`` values: Python frames only, or C++ frames too. C++ stacks
#: are far slower to symbolize when the snapshot is taken (torchtitan measured
#: 461 s instead of 4 s for a 16B-parameter job's dump), hence ``"python"`` by default.
STACKS = ("python", "all")

#: File names inside a :func:`save_memory_snapshot` folder.
SNAPSHOT_FILE = "snapshot.pickle"
TRACE_PLOT_FILE = "trace_plot.html"
SEGMENT_PLOT_FILE = "segment_plot.html"
MEMORY_VIEW_FILE = "memory_view.html"

#: The pickle protocol of every snapshot written here. MemoryViz.js (pytorch.org/memory_viz and
#: the trace_plot pages) reads protocols 2 to 4 and shows nothing for Python 3.14's default, 5
#: (pytorch/pytorch#183842).
SNAPSHOT_PICKLE_PROTOCOL = 4


#: The backend every function here goes through (a test may put another in its place).
_history = allocator_history
_lock = threading.Lock()
#: Recordings started by :class:`SnapshotRecorder` and not stopped yet: the
#: fallback answer to "is history recorded?" where torch cannot be asked.
_own_depth = 0
#: Whether :func:`start_record_memory_history` turned recording on (same fallback).
_started_by_function = False


def history_recording() -> bool:
    """Whether the CUDA allocator is recording its history now (``False`` without CUDA).

    Never initializes CUDA: before CUDA is initialized nothing can be recording.

    Example::

        >>> import torch
        >>> history_recording() in (True, False)
        True
    """
    if not _history.available():
        return False
    state = _history.is_recording()
    if state is None:
        return _own_depth > 0 or _started_by_function
    return state


def take_snapshot() -> dict[str, Any]:
    """The allocator's snapshot now (segments, blocks and, when recorded, the history)."""
    return _history.snapshot()


def _check_max_entries(max_entries: object) -> int:
    return check_int(max_entries, "max_entries")


def _check_stacks(stacks: object) -> str:
    if stacks not in STACKS:
        raise ValueError(f"stacks must be one of {', '.join(map(repr, STACKS))}; got {stacks!r}")
    return stacks  # type: ignore[return-value]


def pickle_snapshot(snapshot: Any) -> bytes:
    """``snapshot`` pickled with :data:`SNAPSHOT_PICKLE_PROTOCOL`, so that MemoryViz reads it.

    Example::

        >>> pickle_snapshot({"segments": []})[:2]
        b'\\x80\\x04'
    """
    return pickle.dumps(snapshot, protocol=SNAPSHOT_PICKLE_PROTOCOL)


#: Where torch's viewer pages hold the snapshot: base64 of its pickle, in a JSON list.
_EMBEDDED = re.compile(r'("base64": ")([A-Za-z0-9+/=]+)(")')


def _viz_page(render: Any, snapshot: dict[str, Any]) -> str:
    """A torch ``_memory_viz`` page of ``snapshot``, its embedded pickle in a protocol MemoryViz reads.

    torch pickles with the interpreter's default protocol, which MemoryViz cannot read on
    Python 3.14; the page is kept as torch writes it, only the embedded pickle is swapped.
    """
    page = render(snapshot)
    match = _EMBEDDED.search(page)
    if match is None:
        return page
    head = base64.b64decode(match.group(2)[:4])
    if head[:1] == b"\x80" and head[1] <= SNAPSHOT_PICKLE_PROTOCOL:
        return page
    buffer = pickle_snapshot(snapshot)
    buffer += b"\x00" * (3 - len(buffer) % 3)  # padded as torch pads it
    encoded = base64.b64encode(buffer).decode("ascii")
    return page[: match.start(2)] + encoded + page[match.end(2) :]


def _write_atomically(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that a crash never leaves half a file under that name."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def write_snapshot_files(
    snapshot: dict[str, Any],
    folder: str | os.PathLike,
    *,
    trace_plot: bool = True,
    segment_plot: bool = False,
    memory_view: bool = True,
    names: dict[str, str] | None = None,
) -> dict[str, Path]:
    """Write a snapshot as ``snapshot.pickle`` and its HTML pages into ``folder``.

    Args:
        snapshot: a dict from ``torch.cuda.memory._snapshot()``.
        folder: an existing, writable folder.
        trace_plot: write ``trace_plot.html`` (``torch.cuda._memory_viz.trace_plot``),
            the interactive active-memory timeline with the snapshot embedded; it
            loads MemoryViz.js from a CDN when opened, so it needs a network.
        segment_plot: write ``segment_plot.html`` (the allocator's segments over
            time; the same viewer, so the same need of a network).
        memory_view: write ``memory_view.html``, the offline view
            (:func:`~pytorch_mem_profiler.tools.snapshot_view.write_snapshot_view`).
        names: other file names, by key ``"snapshot"``, ``"trace_plot"``,
            ``"segment_plot"``, ``"memory_view"``.

    Returns:
        The written paths, by the same keys.

    Example::

        >>> import tempfile, pickle
        >>> paths = write_snapshot_files({"segments": [], "device_traces": [[]]}, tempfile.mkdtemp())
        >>> pickle.loads(paths["snapshot"].read_bytes())["device_traces"]
        [[]]
        >>> sorted(paths)
        ['memory_view', 'snapshot', 'trace_plot']
    """
    folder = Path(folder)
    chosen = dict(_FILES)
    chosen.update(names or {})
    asked = {"snapshot": True, "memory_view": memory_view, "trace_plot": trace_plot, "segment_plot": segment_plot}
    written: dict[str, Path] = {}
    for key, wanted in asked.items():
        if wanted:
            written[key] = _WRITERS[key](snapshot, folder / chosen[key])
    return written


def _write_pickle(snapshot: dict[str, Any], path: Path) -> Path:
    _write_atomically(path, pickle_snapshot(snapshot))
    return path


def _write_viz(kind: str) -> Any:
    """A writer of torch's ``_memory_viz.<kind>`` page."""

    def write(snapshot: dict[str, Any], path: Path) -> Path:
        from torch.cuda import _memory_viz  # pure Python: works on the CPU build too

        _write_atomically(path, _viz_page(getattr(_memory_viz, kind), snapshot).encode("utf-8"))
        return path

    return write


#: The files of a snapshot folder, in the order they are written (the pickle first).
_FILES = {
    "snapshot": SNAPSHOT_FILE,
    "memory_view": MEMORY_VIEW_FILE,
    "trace_plot": TRACE_PLOT_FILE,
    "segment_plot": SEGMENT_PLOT_FILE,
}
_WRITERS = {
    "snapshot": _write_pickle,
    "memory_view": write_snapshot_view,
    "trace_plot": _write_viz("trace_plot"),
    "segment_plot": _write_viz("segment_plot"),
}


class SnapshotRecorder:
    """Records the CUDA allocator's history while a block runs, then writes it to a folder.

    Made by :func:`save_memory_snapshot` (see there for the arguments). A
    context manager, or :meth:`start` / :meth:`stop` for code that cannot be
    one block.

    Attributes:
        folder: the output folder (created when the recorder is made).
        snapshot_path: ``folder / "snapshot.pickle"``.
        memory_view_path: ``folder / "memory_view.html"`` (the offline view), or
            ``None`` if not asked for.
        trace_plot_path: ``folder / "trace_plot.html"``, or ``None`` if not asked for.
        segment_plot_path: ``folder / "segment_plot.html"``, or ``None`` if not asked for.
        recorded: whether the snapshot was written (``False`` without CUDA, or
            before :meth:`stop`). A page that failed is logged and left out; the
            pickle is written first.
        owns_recording: whether this recorder switched recording on; ``False``
            when it ran inside another recording, which it then left running.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        max_entries: int = 100_000,
        stacks: str = "python",
        trace_plot: bool = True,
        segment_plot: bool = False,
        memory_view: bool = True,
        strict: bool = False,
    ) -> None:
        check_path_type(path, "path")
        self.max_entries = _check_max_entries(max_entries)
        self.stacks = _check_stacks(stacks)
        flags = {"trace_plot": trace_plot, "segment_plot": segment_plot, "memory_view": memory_view, "strict": strict}
        for name, value in flags.items():
            if not isinstance(value, bool):
                raise TypeError(f"{name} must be True or False, got {value!r}")
        self.folder = prepare_output_dir(path, "path")
        self.snapshot_path = self.folder / SNAPSHOT_FILE
        self.trace_plot_path = self.folder / TRACE_PLOT_FILE if trace_plot else None
        self.segment_plot_path = self.folder / SEGMENT_PLOT_FILE if segment_plot else None
        self.memory_view_path = self.folder / MEMORY_VIEW_FILE if memory_view else None
        self.recorded = False
        self.owns_recording = False
        self._guard = FaultGuard(strict)
        self._active = False
        self._counted = False

    def start(self) -> SnapshotRecorder:
        """Switch recording on, unless it already is; without CUDA, warn and do nothing."""
        global _own_depth
        if self._active:
            raise RuntimeError(f"the snapshot recorder for {str(self.folder)!r} is already running")
        self.recorded = False
        if not _history.available():
            warnings.warn(
                f"CUDA is not available: save_memory_snapshot({str(self.folder)!r}) records "
                "nothing and the block runs unprofiled",
                UserWarning,
                stacklevel=3,
            )
            return self
        try:
            with _lock:
                already = history_recording()
                if not already:
                    _history.start(max_entries=self.max_entries, stacks=self.stacks)
                self.owns_recording = not already
                _own_depth += 1
                self._counted = True
        except Exception as exc:  # noqa: BLE001 - the block runs unprofiled rather than not at all
            self._guard.fault("memory history", exc)
            return self
        self._active = True
        if already:
            _log.info(
                "pytorch_mem_profiler: CUDA memory history is already being recorded; "
                "the snapshot for %s uses that recording and leaves it running",
                self.folder,
            )
        else:
            _log.info(
                "pytorch_mem_profiler: recording CUDA memory history (max_entries=%d, stacks=%r) for %s",
                self.max_entries,
                self.stacks,
                self.folder,
            )
        return self

    def stop(self) -> None:
        """Take the snapshot, stop recording if this recorder started it, write the files.

        A failure to take or write the snapshot is logged and never raised
        (unless ``strict=True``): a snapshot must not end a training run.
        """
        global _own_depth
        if not self._active:
            return
        self._active = False
        snapshot = None
        try:
            snapshot = self._guard.wrap("memory snapshot", _history.snapshot)()
        finally:
            with _lock:
                if self._counted:
                    _own_depth -= 1
                    self._counted = False
                if self.owns_recording:
                    # Only the recorder that switched recording on switches it off, so an
                    # outer recording (ours, the user's, another tool's) keeps running.
                    self._guard.wrap("memory history", _history.stop)()
        if snapshot is None:
            return
        path = self._guard.wrap("memory snapshot file", _write_pickle)(snapshot, self.snapshot_path)
        if path is None:
            return
        self.recorded = True
        written = [path]
        # Each page apart: one that fails (a snapshot this torch writes differently, a
        # full disk) is logged and left out, never the pickle or the other pages.
        for key in ("memory_view", "trace_plot", "segment_plot"):
            page = getattr(self, f"{key}_path")
            if page is not None and self._guard.wrap(f"memory snapshot {key}", _WRITERS[key])(snapshot, page):
                written.append(page)
        _log.info(
            "pytorch_mem_profiler: wrote %s (memory_view.html opens offline; trace_plot.html and "
            "https://pytorch.org/memory_viz, given snapshot.pickle, need the network)",
            ", ".join(str(p) for p in written),
        )

    def __enter__(self) -> SnapshotRecorder:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        # Files are written even when the block raised; the exception then goes on.
        self.stop()


def save_memory_snapshot(
    path: str | os.PathLike,
    *,
    max_entries: int = 100_000,
    stacks: str = "python",
    trace_plot: bool = True,
    segment_plot: bool = False,
    memory_view: bool = True,
    strict: bool = False,
) -> SnapshotRecorder:
    """Record the CUDA allocator's history while a block runs; write it into ``path``.

    On exit (also when the block raises, which then re-raises) the folder holds
    ``snapshot.pickle``, for https://pytorch.org/memory_viz (pickle protocol 4,
    which the viewer reads on every Python); ``memory_view.html``, the offline
    view (memory over the recorded events, the largest allocations alive at the
    peak with their stacks; it loads nothing); and ``trace_plot.html``, torch's
    interactive timeline with the snapshot embedded, which loads its script
    (MemoryViz.js) from a CDN when opened and is blank without a network.

    Nested inside another recording (another ``save_memory_snapshot``,
    :func:`start_record_memory_history`, or the user's own
    ``_record_memory_history``) it records nothing new, writes the snapshot of
    that recording, and leaves it running with its own settings.

    Args:
        path: the output folder (``str`` or ``pathlib.Path``), created with its
            parents now; an unwritable one raises ``ValueError`` before the block runs.
        max_entries: the most allocation events kept (a ring buffer); each costs
            a few KB of host memory while recording.
        stacks: ``"python"`` (default) for Python frames, ``"all"`` to add C++
            frames (much slower to dump).
        trace_plot: also write ``trace_plot.html`` (needs a network to open).
        segment_plot: also write ``segment_plot.html``, the allocator's segments over
            time (the same viewer: needs a network to open).
        memory_view: also write ``memory_view.html``, the offline view.
        strict: raise snapshot faults instead of logging them (for tests).

    Returns:
        The :class:`SnapshotRecorder`, whose attributes give the paths.

    Without CUDA it warns once and the block runs unprofiled.

    Example::

        >>> import tempfile, warnings, torch
        >>> folder = tempfile.mkdtemp()
        >>> with warnings.catch_warnings(record=True):
        ...     with save_memory_snapshot(folder, max_entries=10_000) as snap:
        ...         y = torch.zeros(256, device="cuda" if torch.cuda.is_available() else "cpu")
        >>> snap.snapshot_path.name
        'snapshot.pickle'
    """
    return SnapshotRecorder(
        path,
        max_entries=max_entries,
        stacks=stacks,
        trace_plot=trace_plot,
        segment_plot=segment_plot,
        memory_view=memory_view,
        strict=strict,
    )


def start_record_memory_history(max_entries: int = 100_000, *, stacks: str = "python") -> None:
    """Start recording the CUDA allocator's history (step 1 of PyTorch's guide).

    Without CUDA it logs that it records nothing.

    Example::

        start_record_memory_history(max_entries=100_000)
        train_a_few_steps()                  # the code to look at
        export_memory_snapshot()             # -> ./<host>_<time>.pickle
        stop_record_memory_history()
    """
    global _started_by_function
    _check_max_entries(max_entries)
    _check_stacks(stacks)
    if not _history.available():
        _log.warning("pytorch_mem_profiler: CUDA is not available; not recording memory history")
        return
    _log.info(
        "pytorch_mem_profiler: starting to record CUDA memory history (max_entries=%d, stacks=%r)",
        max_entries,
        stacks,
    )
    with _lock:
        _history.start(max_entries=max_entries, stacks=stacks)
        _started_by_function = True


def stop_record_memory_history() -> None:
    """Stop recording the CUDA allocator's history (the guide's last step).

    Without CUDA it logs that there is nothing to stop.
    """
    global _started_by_function
    if not _history.available():
        _log.warning("pytorch_mem_profiler: CUDA is not available; no memory history to stop")
        return
    _log.info("pytorch_mem_profiler: stopping the CUDA memory history recording")
    with _lock:
        _history.stop()
        _started_by_function = False


def export_memory_snapshot(prefix: str | os.PathLike | None = None) -> Path | None:
    """Write the allocator's snapshot to ``<prefix>.pickle``.

    Args:
        prefix: the file's path without ``.pickle``; default ``<host>_<time>``
            (plus ``_rank<r>`` under torch.distributed) in the working folder.
            Missing parent folders are created.

    Returns:
        The file written (pickle protocol 4, which https://pytorch.org/memory_viz
        reads), or ``None`` without CUDA or if writing failed (logged: a snapshot
        must not end a training run). ``write_snapshot_view(path)`` renders it
        as an offline page.

    Example::

        export_memory_snapshot("snapshots/before_step")   # -> snapshots/before_step.pickle
    """
    if prefix is not None:
        check_path_type(prefix, "prefix")
    if not _history.available():
        _log.warning("pytorch_mem_profiler: CUDA is not available; no memory snapshot to export")
        return None
    try:
        if prefix is None:
            path = free_path(Path.cwd(), host_time_stem(), ".pickle")
        else:
            path = Path(prefix)
            if path.suffix != ".pickle":
                path = path.with_name(path.name + ".pickle")
            path.parent.mkdir(parents=True, exist_ok=True)
        _log.info("pytorch_mem_profiler: saving the memory snapshot to %s", path)
        _write_atomically(path, pickle_snapshot(_history.snapshot()))
    except Exception as exc:  # noqa: BLE001 - a failed dump must not end the training run
        _log.error("pytorch_mem_profiler: failed to export the memory snapshot: %s", exc, exc_info=exc)
        return None
    return path
