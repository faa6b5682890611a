"""How much device memory a block of code adds, and the device's figures in GB.

:func:`memory_usage` measures a block on any device the core can count
(CUDA, MPS, XPU, CPU) and prints, when the block ends, what it added and the
peak it reached above its start::

    CUDA memory usage [forward]: 0.37 GB (peak 0.52 GB above start)

:func:`print_cuda_memory_usage` is the same on the current CUDA device, for
users of the snippet of that name. :func:`memory_stats` returns allocated,
reserved and peak allocated memory in GB, for printing after forward,
backward, the optimizer step and ``zero_grad()``.

GB here is 10^9 bytes; the objects hold bytes.

Example::

    >>> import io, torch
    >>> out = io.StringIO()
    >>> with memory_usage("ones", device="cpu", stream=out) as usage:
    ...     x = torch.ones(1000, 1000)                 # 4 MB of float32
    >>> usage.added == x.numel() * x.element_size()
    True
    >>> out.getvalue()
    'CPU memory usage [ones]: 0.00 GB (peak 0.00 GB above start)\\n'
"""

from __future__ import annotations

import logging
import sys
import threading
import warnings
from typing import IO, Any

import torch

from ..units import format_amount
from ..measure.devices import MemoryCounter, accelerator_device, Reading, current_device, make_counter, parse_device

__all__ = ["MemoryUsage", "memory_usage", "print_cuda_memory_usage", "memory_stats", "GB"]

_log = logging.getLogger("pytorch_mem_profiler")

#: Bytes per GB in what this module prints and returns (decimal, as the report's MB).
GB = 10**9

_nesting = threading.local()


def _amount(nbytes: int) -> str:
    return format_amount(nbytes, "GB", decimals=2)

_DEVICE_NAMES = {"cuda": "CUDA", "cpu": "CPU", "mps": "MPS", "xpu": "XPU"}


def _resolve(device: Any) -> torch.device:
    return current_device() if device is None else parse_device(device)


class MemoryUsage:
    """Measures the memory a block adds on one device; prints it when the block ends.

    Made by :func:`memory_usage`; see there. After the block its attributes
    hold the numbers, in bytes.

    Attributes:
        label: the name printed in brackets, or ``None``.
        device: the measured device.
        allocated_before: bytes allocated when the block started (on CPU: 0,
            since only tensors made inside the block are counted).
        allocated_after: bytes allocated when it ended (``None`` before that).
        peak_allocated: the most bytes allocated during the block (``None``
            where the device keeps no peak, as on MPS).
        raised: whether the block ended with an exception.
        text: the printed line.
    """

    def __init__(
        self,
        label: str | None = None,
        device: torch.device | str | int | None = None,
        *,
        stream: IO[str] | None = None,
    ) -> None:
        if label is not None and not isinstance(label, str):
            raise TypeError(f"label must be a str or None, got {type(label).__name__}")
        if stream is not None and not callable(getattr(stream, "write", None)):
            raise TypeError(f"stream must have a write() method, got {type(stream).__name__}")
        self.label = label
        self.device = _resolve(device)
        self._counter: MemoryCounter = make_counter(self.device)
        self._stream = stream
        self._depth = 0
        self._running = False
        self.allocated_before = 0
        self.allocated_after: int | None = None
        self.peak_allocated: int | None = None
        self.raised = False
        self.text: str | None = None

    @property
    def added(self) -> int | None:
        """Bytes allocated at the block's end minus at its start (negative if it freed more)."""
        if self.allocated_after is None:
            return None
        return self.allocated_after - self.allocated_before

    @property
    def peak_above_start(self) -> int | None:
        """The block's peak minus what was allocated at its start."""
        if self.peak_allocated is None:
            return None
        return self.peak_allocated - self.allocated_before

    def __enter__(self) -> MemoryUsage:
        if self._running:
            raise RuntimeError("this memory_usage block is already running; make a new one to nest")
        self.allocated_after = self.peak_allocated = self.text = None
        self.raised = False
        self._counter.start()  # the CPU counter counts storages only while started
        # mark(), not read(): it starts this block's peak interval, and first
        # folds the device's peak so far into every other counter of the device
        # (an enclosing MemoryProfiler or memory_usage), so their peaks stay right.
        start = self._counter.mark()
        self.allocated_before = start.allocated
        self._depth = getattr(_nesting, "depth", 0)
        _nesting.depth = self._depth + 1
        self._running = True
        return self

    def __exit__(self, exc_type: type | None, exc: object, tb: object) -> None:
        self._running = False
        _nesting.depth = self._depth
        self.raised = exc_type is not None
        try:
            end: Reading = self._counter.read()
            if not self._counter.failed:  # a counter stopped by a fault gives frozen figures: n/a
                self.allocated_after = end.allocated
                self.peak_allocated = end.peak_allocated
        except Exception as err:  # noqa: BLE001 - measuring must never end the user's run
            _log.warning("pytorch_mem_profiler: memory_usage could not read %s: %s", self.device, err)
        finally:
            self._counter.stop()
        self.text = self._format(exc_type)
        stream = self._stream if self._stream is not None else sys.stdout
        stream.write(self.text + "\n")

    def _format(self, exc_type: type | None) -> str:
        name = _DEVICE_NAMES.get(self.device.type, self.device.type.upper())
        label = f" [{self.label}]" if self.label else ""
        added = self.added
        line = f"{'  ' * self._depth}{name} memory usage{label}: "
        line += _amount(added) if added is not None else "n/a"
        peak = self.peak_above_start
        if peak is not None:
            line += f" (peak {_amount(peak)} above start)"
        if exc_type is not None:
            line += f"; the block raised {exc_type.__name__}"
        return line


def memory_usage(
    label: str | None = None,
    device: torch.device | str | int | None = None,
    *,
    stream: IO[str] | None = None,
) -> MemoryUsage:
    """A context manager that prints how much memory its block added, and its peak.

    When the block ends, also by an exception (which then propagates), it prints
    ``<DEVICE> memory usage [label]: 0.37 GB (peak 0.52 GB above start)``, in GB
    of 10^9 bytes with two decimals. Nested blocks are indented by two spaces
    per level. The returned :class:`MemoryUsage` keeps the numbers in bytes.

    Args:
        label: a name printed in brackets.
        device: the device to measure; default: the current CUDA, MPS or XPU
            device, else the CPU.
        stream: where the line goes; default standard output.

    On CUDA the block starts a new peak interval of the device
    (``torch.cuda.reset_peak_memory_stats``); a :class:`MemoryProfiler` or an
    enclosing ``memory_usage`` keeps its own peak right, but code reading
    ``torch.cuda.max_memory_allocated()`` itself sees the reset. On CPU only
    tensors made inside the block are counted (PyTorch keeps no CPU counters),
    so frees of older tensors do not show.

    Example::

        >>> import io, torch
        >>> out = io.StringIO()
        >>> with memory_usage("outer", "cpu", stream=out) as outer:
        ...     a = torch.zeros(250_000)                   # 1 MB
        ...     with memory_usage("inner", "cpu", stream=out) as inner:
        ...         b = torch.zeros(500_000)               # 2 MB
        >>> inner.added, outer.added
        (2000000, 3000000)
        >>> print(out.getvalue(), end="")
          CPU memory usage [inner]: 0.00 GB (peak 0.00 GB above start)
        CPU memory usage [outer]: 0.00 GB (peak 0.00 GB above start)
    """
    return MemoryUsage(label, device, stream=stream)


def print_cuda_memory_usage(
    label: str | None = None,
    device: torch.device | str | int | None = None,
    *,
    stream: IO[str] | None = None,
) -> MemoryUsage:
    """:func:`memory_usage` on the current CUDA device: prints ``CUDA memory usage: 0.37 GB ...``.

    For users of the snippet of this name. Without CUDA it warns and measures
    the CPU instead, so the block still runs.

    Example::

        with print_cuda_memory_usage("forward") as usage:
            out = model(batch)
        usage.added          # bytes the forward pass left allocated
    """
    if device is None:
        device = accelerator_device("cuda")
        if device is None:
            warnings.warn(
                "CUDA is not available: print_cuda_memory_usage measures the CPU instead",
                UserWarning,
                stacklevel=2,
            )
            device = torch.device("cpu")
    return MemoryUsage(label, device, stream=stream)


def memory_stats(device: torch.device | str | int | None = None) -> dict[str, float | None]:
    """Allocated, reserved and peak allocated memory of a device, in GB (10^9 bytes).

    Args:
        device: default: the current CUDA, MPS or XPU device, else the CPU.

    Returns:
        ``{"allocated_gb": ..., "reserved_gb": ..., "peak_allocated_gb": ...}``.
        The peak is the device's since its last reset (``MemoryProfiler`` and
        :func:`memory_usage` reset it at their boundaries). A figure the device
        does not keep is ``None``: on CPU, where PyTorch keeps no counters, all
        three are (measure a block with :func:`memory_usage` instead).

    Example::

        >>> import torch
        >>> sorted(memory_stats("cpu"))
        ['allocated_gb', 'peak_allocated_gb', 'reserved_gb']
        >>> memory_stats("cpu")["allocated_gb"] is None
        True
    """
    resolved = _resolve(device)
    if resolved.type == "cpu":
        return {"allocated_gb": None, "reserved_gb": None, "peak_allocated_gb": None}
    reading = make_counter(resolved).read()

    def gb(nbytes: int | None) -> float | None:
        return None if nbytes is None else nbytes / GB

    return {
        "allocated_gb": gb(reading.allocated),
        "reserved_gb": gb(reading.reserved),
        "peak_allocated_gb": gb(reading.peak_allocated),
    }
