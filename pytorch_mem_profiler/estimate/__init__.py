"""Estimating: a training step's memory before it runs, and the largest batch that fits.

:func:`~pytorch_mem_profiler.estimate.api.estimate_memory` runs one training step
(forward, loss, backward, optimizer step, twice so that lazy optimizer state exists)
under ``torch._subclasses.FakeTensorMode``: no memory is allocated and no GPU is
needed, while the profiler's own storage counter (:mod:`.counter`, a
:class:`~pytorch_mem_profiler.measure.devices.CpuCounter` that counts fake tensors
of any device) counts what would be alive. :mod:`.fake` makes the fake model,
inputs and optimizer; :mod:`.cpu_kernels` gives operators the outputs the CPU's
kernels make where the fake kernels differ; :mod:`.step` runs the step and puts
what was alive at the peak down to categories and layers; :mod:`.compiled` runs a ``torch.compile``'d module as
Inductor would (its graphs planned by :mod:`.inductor_plan`, graph breaks found by
:mod:`.graph_breaks`); :mod:`.allocator` rounds as the CUDA caching allocator does; :mod:`.result` holds the :class:`MemoryEstimate` (report, fit,
largest batch); :mod:`.records` makes the same prediction from a real run's
records; :mod:`.cli` is the ``estimate`` command. May import torch, the top-level
modules (:mod:`~pytorch_mem_profiler.stats`, :mod:`~pytorch_mem_profiler.units`)
and :mod:`~pytorch_mem_profiler.measure`; never ``outputs``, ``tools``,
``analysis`` or ``profiler``.
"""

from __future__ import annotations

import importlib
from typing import Any

#: Public names by the module that defines them, loaded on first use: the command
#: line builds its ``estimate`` arguments from :mod:`.cli` without importing torch.
_LAZY = {
    "estimate_memory": "api",
    "OPTIMIZATIONS": "api",
    "EstimateUnsupported": "step",
    "MemoryEstimate": "result",
}

__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value
