"""OOM post-mortems: what the device held when a CUDA allocation failed, written to a folder.

:func:`dump_on_oom` attaches to the CUDA caching allocator's out-of-memory
observer. When an allocation fails it writes one small folder,
``oom_<host>_<time>/`` (``..._rank<r>`` under torch.distributed), holding

- ``oom.json``: what failed: device, bytes asked for, the limit (the memory
  fraction's, or the device's total), bytes the driver still had free, time,
  host, pid, rank, and the list of files written;
- ``allocator_stats.json``: ``torch.cuda.memory_stats`` at that moment, and
  ``memory_summary.txt``, its table;
- with a profiler (``memory_profiler(..., oom_dir=...)`` or ``profiler=``):
  ``report.txt``, the last printed report, and ``record.json``, the failing
  iteration's number and phase with the last full record;
- ``snapshot.pickle`` when the allocator's history was being recorded (for
  https://pytorch.org/memory_viz).

Under torch.distributed each file name ends in ``_rank<r>`` as well. Then
the ``torch.cuda.OutOfMemoryError`` propagates as it would have.

One OOM writes one folder, although the observer can fire more than once for
it (cuDNN and other callers catch an OOM and retry with less): with a
profiler, a second OOM in the same iteration writes nothing; without one, an
OOM within ``min_interval_s`` of the last post-mortem writes nothing.
``max_dumps`` caps the folders a run can write.

torch offers no way to detach an observer, so this module attaches one
dispatcher per process, once, and :meth:`OomPostmortem.remove` takes a
post-mortem out of its list.

Example::

    >>> import tempfile, warnings
    >>> with warnings.catch_warnings(record=True):
    ...     with dump_on_oom(tempfile.mkdtemp()) as postmortem:
    ...         pass                                   # train here
    >>> postmortem.dumps
    []
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import logging
import os
import pickle
import socket
import threading
import time
import warnings
import weakref
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from ..measure.allocator import allocator_stats, allocator_summary, attach_oom_observer, cuda_available
from ..options import check_int
from ..paths import distributed_rank, free_path, host_time_stem, prepare_output_dir
from .snapshot import SNAPSHOT_PICKLE_PROTOCOL, history_recording, take_snapshot

__all__ = ["OomPostmortem", "dump_on_oom", "plain_data"]

_log = logging.getLogger("pytorch_mem_profiler")

_handles: list[OomPostmortem] = []
_registry_lock = threading.Lock()
_observer_attached = False


def plain_data(obj: Any) -> Any:
    """``obj`` as JSON-ready data: dataclasses and named tuples become dicts, mappings dicts,
    sequences lists; numbers, strings, booleans and ``None`` stay; anything else becomes ``str``.

    Like ``dataclasses.asdict``, but it also takes the read-only mappings of a
    frozen record.

    Example::

        >>> from pytorch_mem_profiler.stats import IterationRecord
        >>> plain_data(IterationRecord(epoch=1, iteration=2, step=2, device="cpu", allocated=8))["allocated"]
        8
    """
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: plain_data(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return {name: plain_data(value) for name, value in zip(obj._fields, obj)}
    if isinstance(obj, Mapping):
        return {str(key): plain_data(value) for key, value in obj.items()}
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [plain_data(value) for value in obj]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    return str(obj)


def _attach_observer() -> bool:
    """Attach this module's dispatcher to the CUDA allocator, once per process."""
    global _observer_attached
    with _registry_lock:
        if _observer_attached:
            return True
        _observer_attached = attach_oom_observer(_on_out_of_memory)
        return _observer_attached


def _on_out_of_memory(device: int, requested: int, limit: int, free: int) -> None:
    """The allocator's observer: ``(device, bytes asked, allowed or total bytes, free bytes)``.

    Called by the allocator (without its lock, with the GIL) just before it
    raises. An exception leaving here would replace the OOM error, so none does.
    """
    with _registry_lock:
        handles = list(_handles)
    for handle in handles:
        try:
            handle._on_oom(device, requested, limit, free)
        except Exception as exc:  # noqa: BLE001 - the OOM error must propagate unchanged
            _log.error("pytorch_mem_profiler: the OOM post-mortem failed: %s", exc, exc_info=exc)


class OomPostmortem:
    """Writes a post-mortem folder when a CUDA allocation fails; made by :func:`dump_on_oom`.

    Attributes:
        folder: where the post-mortem folders go.
        dumps: the post-mortem folders written so far.
        active: whether it is attached (``False`` without CUDA, or after :meth:`remove`).
    """

    def __init__(
        self,
        oom_dir: str | os.PathLike,
        *,
        profiler: Any = None,
        max_dumps: int = 10,
        min_interval_s: float = 5.0,
    ) -> None:
        if profiler is not None and not callable(getattr(profiler, "postmortem", None)):
            raise TypeError(
                f"profiler must have a postmortem() method (a MemoryProfiler), got {type(profiler).__name__}"
            )
        check_int(max_dumps, "max_dumps")
        if isinstance(min_interval_s, bool) or not isinstance(min_interval_s, (int, float)) or min_interval_s < 0:
            raise ValueError(f"min_interval_s must be a number >= 0, got {min_interval_s!r}")
        self.folder = prepare_output_dir(oom_dir, "oom_dir")
        self.max_dumps = max_dumps
        self.min_interval_s = float(min_interval_s)
        self.dumps: list[Path] = []
        self.active = False
        self._profiler: Callable[[], Any] | None = None
        if profiler is not None:
            self._profiler = weakref.ref(profiler)
            # A profiler dropped without close() takes its post-mortem with it.
            weakref.finalize(profiler, self.remove)
        self._lock = threading.RLock()
        self._writing = False
        self._last_key: Any = None
        self._last_time: float | None = None
        self._cap_logged = False

    def attach(self) -> OomPostmortem:
        """Start watching for OOMs; without CUDA, warn and stay inactive."""
        if self.active:
            return self
        device = getattr(self._profiler() if self._profiler else None, "device", None)
        if not cuda_available():
            warnings.warn(
                f"CUDA is not available: no OOM post-mortems will be written to {str(self.folder)!r}",
                UserWarning,
                stacklevel=3,
            )
            return self
        if device is not None and torch.device(device).type != "cuda":
            warnings.warn(
                f"oom_dir is for CUDA out-of-memory errors, and the profiler watches {device}: "
                "no OOM post-mortems will be written",
                UserWarning,
                stacklevel=3,
            )
            return self
        try:
            attached = _attach_observer()
        except RuntimeError as err:  # an allocator backend without observers
            attached = False
            _log.warning("pytorch_mem_profiler: cannot watch for CUDA OOMs: %s", err)
        if not attached:
            warnings.warn(
                f"torch {torch.__version__} offers no out-of-memory observer: "
                "no OOM post-mortems will be written",
                UserWarning,
                stacklevel=3,
            )
            return self
        with _registry_lock:
            _handles.append(self)
        self.active = True
        return self

    def remove(self) -> None:
        """Stop watching; the folders already written stay. Safe to call twice."""
        with _registry_lock:
            if self in _handles:
                _handles.remove(self)
        self.active = False

    def __enter__(self) -> OomPostmortem:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    # -- on an OOM ---------------------------------------------------------------
    def _postmortem(self) -> dict[str, Any] | None:
        if self._profiler is None:
            return None
        profiler = self._profiler()
        if profiler is None:
            return None
        try:
            return profiler.postmortem()
        except Exception as exc:  # noqa: BLE001 - the allocator's part of the post-mortem still counts
            _log.error("pytorch_mem_profiler: the profiler's part of the OOM post-mortem failed: %s", exc)
            return None

    def _on_oom(self, device: int, requested: int, limit: int, free: int) -> Path | None:
        """Write the post-mortem of one OOM, unless it repeats the last one; its folder or ``None``."""
        post = self._postmortem()
        key = None if post is None else (post.get("epoch"), post.get("iteration"))
        now = time.monotonic()
        with self._lock:
            if self._writing:  # an OOM while writing the post-mortem of another
                return None
            if key is not None:
                if key == self._last_key:
                    return None
            elif self._last_time is not None and now - self._last_time < self.min_interval_s:
                return None
            if len(self.dumps) >= self.max_dumps:
                if not self._cap_logged:
                    self._cap_logged = True
                    _log.warning(
                        "pytorch_mem_profiler: %d OOM post-mortems written to %s; writing no more",
                        self.max_dumps,
                        self.folder,
                    )
                return None
            self._last_key, self._last_time = key, now
            self._writing = True
        try:
            folder = self._write(device, requested, limit, free, post)
        finally:
            with self._lock:
                self._writing = False
        self.dumps.append(folder)
        _log.error(
            "pytorch_mem_profiler: CUDA out of memory on cuda:%d asking for %d bytes; "
            "post-mortem written to %s",
            device,
            requested,
            folder,
        )
        return folder

    def _write(
        self, device: int, requested: int, limit: int, free: int, post: dict[str, Any] | None
    ) -> Path:
        rank = distributed_rank()
        suffix = "" if rank is None else f"_rank{rank}"
        folder = free_path(self.folder, f"oom_{host_time_stem()}", claim="folder")
        files: list[str] = []
        errors: list[str] = []

        def write(stem: str, ext: str, make: Callable[[], bytes | str | None]) -> None:
            # Each part on its own: one that fails leaves the others written.
            name = f"{stem}{suffix}{ext}"
            try:
                data = make()
                if data is None:
                    return
                (folder / name).write_bytes(data.encode("utf-8") if isinstance(data, str) else data)
                files.append(name)
            except Exception as exc:  # noqa: BLE001 - collect, never raise from the observer
                errors.append(f"{name}: {type(exc).__name__}: {exc}")

        cuda = torch.device("cuda", device)
        write("allocator_stats", ".json", lambda: _json(allocator_stats(cuda)))
        write("memory_summary", ".txt", lambda: allocator_summary(cuda))
        if post is not None:
            report = post.get("report")
            write("report", ".txt", lambda: report if report else "No report was printed before the OOM.\n")
            write("record", ".json", lambda: _json({k: v for k, v in post.items() if k != "report"}))
        recording = history_recording()
        if recording:
            write("snapshot", ".pickle", lambda: pickle.dumps(take_snapshot(), protocol=SNAPSHOT_PICKLE_PROTOCOL))
        event = {
            "time": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "rank": rank,
            "device": str(cuda),
            "requested_bytes": int(requested),
            "device_limit_bytes": int(limit),
            "device_free_bytes": int(free),
            "history_recorded": recording,
            "torch_version": torch.__version__,
            "files": [f"oom{suffix}.json"] + files,
            "errors": errors,
        }
        (folder / f"oom{suffix}.json").write_text(_json(event), encoding="utf-8")
        return folder


def _json(data: Any) -> str:
    return json.dumps(plain_data(data), indent=2) + "\n"


def dump_on_oom(
    oom_dir: str | os.PathLike,
    *,
    profiler: Any = None,
    max_dumps: int = 10,
    min_interval_s: float = 5.0,
) -> OomPostmortem:
    """Write a post-mortem folder into ``oom_dir`` whenever a CUDA allocation fails.

    Watching starts now. Use the result as a context manager, or call its
    ``remove()``, to stop. The OOM error itself propagates unchanged.

    Args:
        oom_dir: the folder for the post-mortems, created with its parents now;
            an unwritable one raises ``ValueError``.
        profiler: a :class:`~pytorch_mem_profiler.MemoryProfiler` whose last
            report and failing iteration go into the post-mortem (what
            ``memory_profiler(..., oom_dir=...)`` does).
        max_dumps: the most post-mortem folders to write.
        min_interval_s: without a profiler, an OOM this soon after the last
            post-mortem is taken as the same OOM retried and writes nothing.

    Record the allocator's history too (:func:`~pytorch_mem_profiler.start_record_memory_history`
    or :func:`~pytorch_mem_profiler.save_memory_snapshot`) and each post-mortem
    holds a snapshot of what led to the OOM.

    Without CUDA it warns and watches nothing.

    Example::

        with dump_on_oom("oom_postmortems"):
            train()          # an OOM here leaves oom_postmortems/oom_<host>_<time>/
    """
    return OomPostmortem(
        oom_dir, profiler=profiler, max_dumps=max_dumps, min_interval_s=min_interval_s
    ).attach()
