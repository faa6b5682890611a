"""The CUDA caching allocator's other faces: its statistics, its history recording, its OOM observer.

The tools (snapshots, OOM post-mortems) reach these through this module only, so
that every call of a device memory API stays in :mod:`pytorch_mem_profiler.measure`.
Nothing here initializes CUDA: on a machine without a GPU (PyTorch's default CUDA
wheel included) each answer is "none", "not recording" or ``False``.

Example::

    >>> import torch
    >>> allocator_stats(torch.device("cpu"))
    {}
    >>> history.is_recording() in (False, True, None)
    True
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from .devices import device_index

__all__ = [
    "allocator_stats",
    "allocator_summary",
    "CudaHistory",
    "history",
    "attach_oom_observer",
    "cuda_available",
    "OutOfMemoryError",
]

#: The exception a failed CUDA allocation raises (``RuntimeError`` on a torch without it).
OutOfMemoryError: type[BaseException] = getattr(torch.cuda, "OutOfMemoryError", RuntimeError)


def cuda_available() -> bool:
    """Whether a CUDA device can be used (``False`` on the CPU build and without a driver)."""
    return torch.cuda.is_available()


def allocator_stats(device: torch.device) -> dict[str, Any]:
    """The caching allocator's full statistics for ``device`` (``{}`` where it keeps none).

    On CUDA this is ``torch.cuda.memory_stats``: counts and bytes, current,
    peak, allocated and freed, for all, small and large pools, plus the number
    of OOMs and of cudaMalloc retries.
    """
    if device.type == "cuda" and torch.cuda.is_available() and torch.cuda.is_initialized():
        return dict(torch.cuda.memory_stats(device_index(device)))
    if device.type == "xpu" and hasattr(torch, "xpu") and hasattr(torch.xpu, "memory_stats"):
        return dict(torch.xpu.memory_stats(device_index(device)))
    return {}


def allocator_summary(device: torch.device) -> str | None:
    """``torch.cuda.memory_summary``'s table for ``device``; ``None`` off CUDA."""
    if device.type == "cuda" and torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.memory_summary(device_index(device))
    return None


class CudaHistory:
    """The CUDA allocator's history API: the one place that knows how torch spells it.

    Checked against torch 2.4 and 2.11/2.13: ``torch.cuda.memory._record_memory_history``
    takes ``enabled`` (``"all"``, or ``None`` to stop), ``context``, ``stacks`` and
    ``max_entries`` as keywords in all of them. Later versions add
    ``clear_history``, ``compile_context``, ``global_record_annotations`` and
    ``skip_actions``; none is used here, so one call fits every supported torch.
    (torch 2.0 took a bool ``enabled`` and ``trace_alloc_max_entries``; it is
    below the supported range.)

    Whether history is already recorded is asked of the allocator itself
    (``torch._C._cuda_isHistoryEnabled``, present from torch 2.1 to 2.13), so a
    recording started by the user or another tool is seen too. Should a torch
    lack it, :meth:`is_recording` answers ``None`` and the callers fall back to
    counting the recordings they started.
    """

    def available(self) -> bool:
        # On torch's CPU build the calls below raise AttributeError, not RuntimeError.
        return torch.cuda.is_available()

    def is_recording(self) -> bool | None:
        if not torch.cuda.is_available() or not torch.cuda.is_initialized():
            # Recording initializes CUDA: before that nothing can be recording, and
            # asking must not initialize it (it raises where no driver is present).
            return False
        query = getattr(torch._C, "_cuda_isHistoryEnabled", None)
        if query is None:
            return None
        return bool(query())

    def start(self, *, max_entries: int, stacks: str) -> None:
        torch.cuda.memory._record_memory_history(
            enabled="all", context="all", stacks=stacks, max_entries=max_entries
        )

    def stop(self) -> None:
        torch.cuda.memory._record_memory_history(enabled=None)

    def snapshot(self) -> dict[str, Any]:
        return torch.cuda.memory._snapshot()


#: The history backend the tools go through (a test may put another in its place).
history = CudaHistory()


def attach_oom_observer(observer: Callable[[int, int, int, int], None]) -> bool:
    """Attach ``observer(device, requested, limit, free)`` to the CUDA allocator's OOM hook.

    torch offers no way to detach one, so callers attach once per process.
    ``False`` where this torch has no such hook.
    """
    attach = getattr(torch._C, "_cuda_attach_out_of_memory_observer", None)
    if attach is None:
        return False
    attach(observer)
    return True
