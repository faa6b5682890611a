"""Output folders and file names for snapshots, timelines and post-mortems.

A folder given by the user is created (parents too) and proven writable when
the tool is made, so a typo fails before the training run, not after it.
Default file names carry the host and the time, as PyTorch's own guide to GPU
memory names them, and the rank when torch.distributed runs, so that ranks
sharing a folder never overwrite each other.

Example::

    >>> import tempfile
    >>> folder = prepare_output_dir(tempfile.mkdtemp() + "/a/b", "path")
    >>> folder.is_dir()
    True
    >>> import socket
    >>> host_time_stem().startswith(socket.gethostname())
    True
"""

from __future__ import annotations

import datetime as _dt
import os
import socket
from pathlib import Path

__all__ = ["prepare_output_dir", "check_path_type", "host_time_stem", "distributed_rank", "free_path"]

#: The time format of PyTorch's guide to GPU memory (``Feb_21_13_45_07``).
TIME_FORMAT = "%b_%d_%H_%M_%S"


def check_path_type(path: object, arg_name: str) -> Path:
    """``path`` as a :class:`~pathlib.Path`; ``TypeError`` naming ``arg_name`` if it is no path."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"{arg_name} must be a str or os.PathLike, got {type(path).__name__}")
    return Path(path)


def prepare_output_dir(path: str | os.PathLike, arg_name: str) -> Path:
    """Create the folder ``path`` (parents too) and prove it writable.

    Raises:
        TypeError: ``path`` is not a ``str`` or ``os.PathLike``.
        ValueError: the folder cannot be created or written; the message names ``arg_name``.
    """
    folder = check_path_type(path, arg_name)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".pytorch_mem_profiler_probe_{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as err:
        raise ValueError(f"{arg_name}={str(path)!r} cannot be created or written: {err}") from err
    return folder


def distributed_rank() -> int | None:
    """This process's rank when torch.distributed is initialized, else ``None``."""
    from .distributed import rank_info  # torch.distributed is imported only when asked

    info = rank_info()
    return None if info is None else info.rank


def host_time_stem(now: _dt.datetime | None = None) -> str:
    """``<host>_<time>``, plus ``_rank<r>`` under torch.distributed."""
    stamp = (now or _dt.datetime.now()).strftime(TIME_FORMAT)
    stem = f"{socket.gethostname()}_{stamp}"
    rank = distributed_rank()
    return stem if rank is None else f"{stem}_rank{rank}"


def free_path(folder: Path, stem: str, suffix: str = "", *, claim: str | None = None) -> Path:
    """``folder/<stem><suffix>``, or ``<stem>-1<suffix>``... when that name is taken (same second).

    ``claim="file"`` creates the file empty and ``claim="folder"`` the folder, each
    exclusively, so that two runs or two processes never share a name; ``None``
    only checks that nothing has the name yet.

    Example::

        >>> import tempfile
        >>> folder = Path(tempfile.mkdtemp())
        >>> [free_path(folder, "run", ".csv", claim="file").name for _ in range(2)]
        ['run.csv', 'run-1.csv']
    """
    for n in range(10_000):
        candidate = folder / f"{stem}{'' if n == 0 else f'-{n}'}{suffix}"
        try:
            if claim == "file":
                with open(candidate, "x", encoding="utf-8"):
                    return candidate
            elif claim == "folder":
                candidate.mkdir()
                return candidate
            elif not candidate.exists():
                return candidate
        except FileExistsError:
            continue
    raise FileExistsError(f"no free name for {stem}{suffix} in {folder}")
