"""Memory outside PyTorch: what ``nvidia-smi`` shows beyond the caching allocator.

The device's used memory comes from NVML (the ``nvidia-ml-py`` package, extra
``nvml``) when it is installed, else from ``torch.cuda.mem_get_info``. Used
minus the allocator's reserved bytes is what lives outside PyTorch's cache:
the CUDA context (300-700 MB), cuBLAS/cuDNN and NCCL workspaces, other
libraries, other processes on the same GPU. NVML also gives this process's
own share where it can match the process id (not always inside containers).

Neither source creates a CUDA context: NVML talks to the driver without one,
and ``mem_get_info`` is only asked once this process has initialized CUDA on
the profiled device.

Example::

    >>> import torch
    >>> reader = DeviceMemoryReader(torch.device("cpu"))
    >>> reader.read() is None          # only CUDA devices have this view
    True
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, NamedTuple

import torch

__all__ = ["DeviceUsage", "DeviceMemoryReader"]

_log = logging.getLogger("pytorch_mem_profiler")


class DeviceUsage(NamedTuple):
    """Bytes in use on the whole device, and by this process where known."""

    device_used: int
    process_used: int | None
    source: str  # "nvml" or "mem_get_info"


class DeviceMemoryReader:
    """Reads a CUDA device's used memory, at most once per ``min_interval_s``.

    The driver calls cost tens of microseconds to milliseconds; memory outside
    PyTorch changes rarely, so a reading is reused for ``min_interval_s``.
    """

    def __init__(self, device: torch.device, min_interval_s: float = 1.0) -> None:
        self.device = device
        self.min_interval_s = min_interval_s
        self._nvml: Any = None
        self._handle: Any = None
        self._tried_nvml = False
        self._last: DeviceUsage | None = None
        self._last_time = float("-inf")

    def read(self) -> DeviceUsage | None:
        now = time.monotonic()
        if self._last is not None and now - self._last_time < self.min_interval_s:
            return self._last  # only a CUDA device has one: checked when it was read
        if self.device.type != "cuda" or not torch.cuda.is_available():
            return None
        usage = self._read_nvml() or self._read_torch()
        self._last, self._last_time = usage, now
        return usage

    def _read_nvml(self) -> DeviceUsage | None:
        if not self._tried_nvml:
            self._tried_nvml = True
            self._open_nvml()
        if self._handle is None:
            return None
        nvml = self._nvml
        info = nvml.nvmlDeviceGetMemoryInfo(self._handle)
        process = None
        try:
            pid = os.getpid()
            for proc in nvml.nvmlDeviceGetComputeRunningProcesses(self._handle):
                if proc.pid == pid and proc.usedGpuMemory is not None:
                    process = int(proc.usedGpuMemory)
        except nvml.NVMLError:
            process = None
        return DeviceUsage(int(info.used), process, "nvml")

    def _open_nvml(self) -> None:
        try:
            import pynvml  # the nvidia-ml-py package
        except ImportError:
            return
        try:
            pynvml.nvmlInit()
            index = self.device.index or 0
            uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
            if uuid is not None:
                text = str(uuid)
                if not text.startswith("GPU-"):
                    text = "GPU-" + text
                self._handle = pynvml.nvmlDeviceGetHandleByUUID(text)
            else:  # without a UUID, CUDA_VISIBLE_DEVICES could remap indices: trust only an unset one
                if os.environ.get("CUDA_VISIBLE_DEVICES") is None:
                    self._handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            self._nvml = pynvml
        except Exception as err:  # noqa: BLE001 - NVML missing or refusing: fall back to torch
            _log.info("pytorch_mem_profiler: NVML not usable (%s); using torch.cuda.mem_get_info", err)
            self._handle = None

    def _read_torch(self) -> DeviceUsage | None:
        if not torch.cuda.is_initialized():
            return None
        free, total = torch.cuda.mem_get_info(self.device.index or 0)
        return DeviceUsage(int(total - free), None, "mem_get_info")
