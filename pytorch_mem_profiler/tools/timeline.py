"""The torch.profiler memory timeline: a Chrome trace and a memory-by-category plot per run.

Given a ``torch.profiler.profile`` run with ``profile_memory=True,
record_shapes=True, with_stack=True``, :func:`save_memory_timeline` writes

- ``<host>_<time>.json.gz``: the Chrome trace (open it at https://ui.perfetto.dev
  or ``chrome://tracing``);
- ``<host>_<time>.html``: the memory timeline, memory over time stacked by
  category (torch's own: parameter, optimizer state, activation, gradient...), drawn
  with matplotlib (``pip install 'pytorch_mem_profiler[plot]'``).

:func:`memory_timeline_handler` gives the same as an ``on_trace_ready``
callback. Recent torch releases deprecate ``export_memory_timeline`` in
favour of memory snapshots (torch 2.4 does not; 2.13 does): where it is
deprecated the HTML is still written, with a warning that points to
:func:`~pytorch_mem_profiler.save_memory_snapshot`; where it is gone only the
trace is written, with the same pointer.

Example::

    >>> import tempfile, warnings, torch
    >>> from torch.profiler import profile
    >>> model = torch.nn.Linear(64, 64)
    >>> with profile(profile_memory=True, record_shapes=True, with_stack=True) as prof:
    ...     model(torch.randn(8, 64)).sum().backward()
    >>> with warnings.catch_warnings(record=True):
    ...     files = save_memory_timeline(prof, tempfile.mkdtemp(), device="cpu")
    >>> files["trace"].name.endswith(".json.gz")
    True
"""

from __future__ import annotations

import importlib.util
import logging
import os
import warnings
from pathlib import Path
from typing import Any, Callable

import torch

from ..measure.devices import accelerator_device
from ..paths import free_path, host_time_stem, prepare_output_dir

__all__ = ["save_memory_timeline", "memory_timeline_handler", "timeline_exporter_state"]

_log = logging.getLogger("pytorch_mem_profiler")

_SNAPSHOT_HINT = (
    "record a memory snapshot instead: pytorch_mem_profiler.save_memory_snapshot(folder) "
    "around the code, then open snapshot.pickle at https://pytorch.org/memory_viz"
)

#: The profile flags the memory timeline needs.
_NEEDED_FLAGS = ("profile_memory", "record_shapes", "with_stack")


def timeline_exporter_state(prof: Any = None) -> str:
    """``"ok"``, ``"deprecated"`` or ``"missing"``: how this torch offers ``export_memory_timeline``.

    The one place that tells torch versions apart: 2.4 has the method, recent
    releases (2.13 among them) mark it deprecated (``typing_extensions.deprecated`` sets
    ``__deprecated__`` on it), a future torch may drop it.

    Example::

        >>> timeline_exporter_state() in ("ok", "deprecated", "missing")
        True
    """
    owner = prof if prof is not None else torch.profiler.profile
    method = getattr(owner, "export_memory_timeline", None)
    if method is None:
        return "missing"
    if getattr(method, "__deprecated__", None) is not None:
        return "deprecated"
    return "ok"


def _check_profile(prof: Any) -> None:
    from torch.profiler import profile

    if not isinstance(prof, profile):
        raise TypeError(f"prof must be a torch.profiler.profile, got {type(prof).__name__}")
    missing = [flag for flag in _NEEDED_FLAGS if not getattr(prof, flag, False)]
    if missing:
        raise ValueError(
            "the memory timeline needs torch.profiler.profile(profile_memory=True, "
            f"record_shapes=True, with_stack=True); this profile has "
            + ", ".join(f"{flag}=False" for flag in missing)
        )


def _check_matplotlib() -> None:
    if importlib.util.find_spec("matplotlib") is None:
        # torch's exporter would print a line and write no file; say what to do instead.
        raise ImportError("pip install 'pytorch_mem_profiler[plot]' to write the memory timeline HTML")


def _default_device() -> str:
    cuda = accelerator_device("cuda")
    return str(cuda) if cuda is not None else "cpu"


def save_memory_timeline(
    prof: Any,
    folder: str | os.PathLike = ".",
    *,
    device: torch.device | str | None = None,
    stem: str | None = None,
) -> dict[str, Path | None]:
    """Write a finished profile's Chrome trace and memory timeline HTML into ``folder``.

    Args:
        prof: a ``torch.profiler.profile`` made with ``profile_memory=True,
            record_shapes=True, with_stack=True``, after it stopped.
        folder: the output folder, created with its parents.
        device: the device whose memory to plot; default: the current CUDA
            device, else ``"cpu"``.
        stem: the file names without suffix; default ``<host>_<time>`` (plus
            ``_rank<r>`` under torch.distributed).

    Returns:
        ``{"trace": <.json.gz path>, "timeline": <.html path, or None where this
        torch has no export_memory_timeline>}``.

    Raises:
        TypeError, ValueError: ``prof`` is no profile, or lacks a needed flag.
        ImportError: matplotlib, needed for the HTML, is not installed.

    Example::

        with torch.profiler.profile(
            activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
            profile_memory=True, record_shapes=True, with_stack=True,
        ) as prof:
            train_a_few_steps()
        save_memory_timeline(prof, "memory_timeline")
    """
    _check_profile(prof)
    if stem is not None and (not isinstance(stem, str) or not stem or "/" in stem):
        raise ValueError(f"stem must be a non-empty file name without '/', got {stem!r}")
    state = timeline_exporter_state(prof)
    if state != "missing":
        _check_matplotlib()
    out = prepare_output_dir(folder, "folder")
    name = stem if stem is not None else host_time_stem()
    trace = free_path(out, name, ".json.gz")
    name = trace.name[: -len(".json.gz")]
    prof.export_chrome_trace(str(trace))
    _log.info("pytorch_mem_profiler: wrote the Chrome trace %s", trace)
    if state == "missing":
        warnings.warn(
            f"torch {torch.__version__} has no export_memory_timeline; only the Chrome trace "
            f"was written. To see memory over time, {_SNAPSHOT_HINT}",
            UserWarning,
            stacklevel=2,
        )
        return {"trace": trace, "timeline": None}
    timeline = out / f"{name}.html"
    dev = str(torch.device(device)) if device is not None else _default_device()
    with warnings.catch_warnings():
        # Replaced by the warning below, which says what to use instead.
        warnings.simplefilter("ignore", FutureWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        prof.export_memory_timeline(str(timeline), device=dev)
    if state == "deprecated":
        warnings.warn(
            f"torch {torch.__version__} deprecates export_memory_timeline (the HTML was still "
            f"written). To keep seeing memory over time, {_SNAPSHOT_HINT}",
            UserWarning,
            stacklevel=2,
        )
    _log.info("pytorch_mem_profiler: wrote the memory timeline %s", timeline)
    return {"trace": trace, "timeline": timeline}


def memory_timeline_handler(
    folder: str | os.PathLike = ".",
    *,
    device: torch.device | str | None = None,
) -> Callable[[Any], dict[str, Path | None]]:
    """An ``on_trace_ready`` callback that calls :func:`save_memory_timeline` for each trace.

    The folder is created, and matplotlib looked for, now, before profiling starts.

    Example::

        with torch.profiler.profile(
            activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
            schedule=torch.profiler.schedule(wait=0, warmup=1, active=5, repeat=1),
            profile_memory=True, record_shapes=True, with_stack=True,
            on_trace_ready=memory_timeline_handler("memory_timeline"),
        ) as prof:
            for _ in range(6):
                train_one_step()
                prof.step()
    """
    out = prepare_output_dir(folder, "folder")
    if device is not None:
        try:
            torch.device(device)
        except (RuntimeError, TypeError) as err:
            raise ValueError(f"device={device!r} is not a device torch understands: {err}") from err
    if timeline_exporter_state() != "missing":
        _check_matplotlib()

    def handler(prof: Any) -> dict[str, Path | None]:
        return save_memory_timeline(prof, out, device=device)

    return handler
