"""Memory-history snapshots of the CUDA caching allocator, and their HTML trace plots.

While history is recorded, the allocator keeps every allocation and free with
the Python stack that made it. A snapshot of that history opens in PyTorch's
viewer at https://pytorch.org/memory_viz (it runs in the browser; nothing is
uploaded) or, written as ``trace_plot.html``, in any browser offline.

Two ways to get one:

- :func:`save_memory_snapshot`, a context manager that records while its block
  runs and writes ``snapshot.pickle`` and ``trace_plot.html`` into a folder;
- :func:`start_record_memory_history`, :func:`export_memory_snapshot` and
  :func:`stop_record_memory_history`, the three steps of PyTorch's guide to GPU
  memory, for code that cannot be wrapped in one block.

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

import logging
import os
import pickle
import threading
import warnings
from pathlib import Path
from typing import Any

import torch

from ..faults import FaultGuard
from ..options import check_int
from ..measure.allocator import history as allocator_history
from ..paths import check_path_type, free_path, host_time_stem, prepare_output_dir

__all__ = [
    "SnapshotRecorder",
    "save_memory_snapshot",
    "start_record_memory_history",
    "export_memory_snapshot",
    "stop_record_memory_history",
    "history_recording",
    "write_snapshot_files",
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
    names: dict[str, str] | None = None,
) -> dict[str, Path]:
    """Write a snapshot as ``snapshot.pickle`` and its HTML plots into ``folder``.

    Args:
        snapshot: a dict from ``torch.cuda.memory._snapshot()``.
        folder: an existing, writable folder.
        trace_plot: write ``trace_plot.html`` (``torch.cuda._memory_viz.trace_plot``),
            the active-memory timeline with the snapshot embedded.
        segment_plot: write ``segment_plot.html`` (the allocator's segments over time).
        names: other file names, by key ``"snapshot"``, ``"trace_plot"``, ``"segment_plot"``.

    Returns:
        The written paths, by the same keys.

    Example::

        >>> import tempfile, pickle
        >>> paths = write_snapshot_files({"segments": [], "device_traces": [[]]}, tempfile.mkdtemp())
        >>> pickle.loads(paths["snapshot"].read_bytes())["device_traces"]
        [[]]
    """
    from torch.cuda import _memory_viz  # pure Python: works on the CPU build too

    folder = Path(folder)
    chosen = {"snapshot": SNAPSHOT_FILE, "trace_plot": TRACE_PLOT_FILE, "segment_plot": SEGMENT_PLOT_FILE}
    chosen.update(names or {})
    written: dict[str, Path] = {}
    path = folder / chosen["snapshot"]
    _write_atomically(path, pickle.dumps(snapshot))
    written["snapshot"] = path
    if trace_plot:
        path = folder / chosen["trace_plot"]
        _write_atomically(path, _memory_viz.trace_plot(snapshot).encode("utf-8"))
        written["trace_plot"] = path
    if segment_plot:
        path = folder / chosen["segment_plot"]
        _write_atomically(path, _memory_viz.segment_plot(snapshot).encode("utf-8"))
        written["segment_plot"] = path
    return written


class SnapshotRecorder:
    """Records the CUDA allocator's history while a block runs, then writes it to a folder.

    Made by :func:`save_memory_snapshot` (see there for the arguments). A
    context manager, or :meth:`start` / :meth:`stop` for code that cannot be
    one block.

    Attributes:
        folder: the output folder (created when the recorder is made).
        snapshot_path: ``folder / "snapshot.pickle"``.
        trace_plot_path: ``folder / "trace_plot.html"``, or ``None`` if not asked for.
        segment_plot_path: ``folder / "segment_plot.html"``, or ``None`` if not asked for.
        recorded: whether the files were written (``False`` without CUDA, or
            before :meth:`stop`).
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
        strict: bool = False,
    ) -> None:
        check_path_type(path, "path")
        self.max_entries = _check_max_entries(max_entries)
        self.stacks = _check_stacks(stacks)
        for name, value in (("trace_plot", trace_plot), ("segment_plot", segment_plot), ("strict", strict)):
            if not isinstance(value, bool):
                raise TypeError(f"{name} must be True or False, got {value!r}")
        self.folder = prepare_output_dir(path, "path")
        self.snapshot_path = self.folder / SNAPSHOT_FILE
        self.trace_plot_path = self.folder / TRACE_PLOT_FILE if trace_plot else None
        self.segment_plot_path = self.folder / SEGMENT_PLOT_FILE if segment_plot else None
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
        written = self._guard.wrap("memory snapshot files", write_snapshot_files)(
            snapshot,
            self.folder,
            trace_plot=self.trace_plot_path is not None,
            segment_plot=self.segment_plot_path is not None,
        )
        if written:
            self.recorded = True
            _log.info(
                "pytorch_mem_profiler: wrote %s; open it at https://pytorch.org/memory_viz",
                ", ".join(str(p) for p in written.values()),
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
    strict: bool = False,
) -> SnapshotRecorder:
    """Record the CUDA allocator's history while a block runs; write it into ``path``.

    On exit (also when the block raises, which then re-raises) the folder holds
    ``snapshot.pickle``, for https://pytorch.org/memory_viz, and
    ``trace_plot.html``, the same timeline as a self-contained page.

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
        trace_plot: also write ``trace_plot.html``.
        segment_plot: also write ``segment_plot.html``, the allocator's segments over time.
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
        The file written, or ``None`` without CUDA or if writing failed (logged:
        a snapshot must not end a training run).

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
        _write_atomically(path, pickle.dumps(_history.snapshot()))
    except Exception as exc:  # noqa: BLE001 - a failed dump must not end the training run
        _log.error("pytorch_mem_profiler: failed to export the memory snapshot: %s", exc, exc_info=exc)
        return None
    return path
