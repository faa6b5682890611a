"""Integrations with training frameworks, each a thin adapter over the profiler's public API.

- :mod:`.lightning`: ``MemoryProfilerCallback``, a Lightning ``Callback``
  (``lightning.pytorch``, else ``pytorch_lightning``); :mod:`.pytorch_lightning` the
  same for the ``pytorch_lightning`` package explicitly;
- :mod:`.transformers`: ``MemoryProfilerCallback``, a Hugging Face ``TrainerCallback``.

Each module imports its framework when it is imported (never the package's
``__init__``), so no framework is a dependency; a missing one raises an
``ImportError`` that says what to install. They drive
:class:`~pytorch_mem_profiler.MemoryProfiler` through its public API only and may
import the top-level modules and each other (:mod:`._common`), nothing else.
"""
