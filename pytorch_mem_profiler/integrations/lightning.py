"""Lightning: ``MemoryProfilerCallback``, a ``Callback`` that profiles ``Trainer.fit``.

Subclasses ``lightning.pytorch.Callback`` (the ``lightning`` package), or
``pytorch_lightning.Callback`` where only that package is installed; for a
``pytorch_lightning.Trainer`` beside ``lightning``, use
:mod:`pytorch_mem_profiler.integrations.pytorch_lightning`.

Example::

    >>> from pytorch_mem_profiler.integrations.lightning import MemoryProfilerCallback
    >>> callback = MemoryProfilerCallback(print_period=50, csv=True, by_layer=True)
    >>> # trainer = lightning.Trainer(callbacks=[callback]); trainer.fit(model)
"""

from __future__ import annotations

try:
    from lightning.pytorch import Callback
except ImportError:  # the older package name
    try:
        from pytorch_lightning import Callback
    except ImportError as err:
        raise ImportError(
            "the Lightning integration needs Lightning: pip install 'pytorch_mem_profiler[lightning]'"
        ) from err

from ._lightning_base import LightningMemoryProfiling

__all__ = ["MemoryProfilerCallback"]


class MemoryProfilerCallback(LightningMemoryProfiling, Callback):
    __doc__ = LightningMemoryProfiling.__doc__
