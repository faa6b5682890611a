"""``pytorch_lightning``: the same ``MemoryProfilerCallback`` as :mod:`.lightning`, for that package.

Example::

    >>> from pytorch_mem_profiler.integrations.pytorch_lightning import MemoryProfilerCallback
    >>> callback = MemoryProfilerCallback(print_period=50)
"""

from __future__ import annotations

try:
    from pytorch_lightning import Callback
except ImportError as err:
    raise ImportError(
        "this integration needs pytorch_lightning: pip install pytorch_lightning "
        "(or use pytorch_mem_profiler.integrations.lightning with the lightning package)"
    ) from err

from ._lightning_base import LightningMemoryProfiling

__all__ = ["MemoryProfilerCallback"]


class MemoryProfilerCallback(LightningMemoryProfiling, Callback):
    __doc__ = LightningMemoryProfiling.__doc__
