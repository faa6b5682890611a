"""The model zoo: at least twenty models of different families, built from code and configs
(never downloaded), each with its inputs, loss, optimizer, precision and batch sizes.

One registry (:data:`ZOO`, name -> :class:`ZooModel`) serves the CPU tests
(``tests/test_zoo.py``, small sizes), the GPU tests (``tests/test_zoo_cuda.py``)
and the GPU conformance run (``benchmarks/zoo_conformance.py``, real sizes).

Example::

    >>> from benchmarks.zoo import ZOO
    >>> len(ZOO) >= 20
    True
"""

from .registry import ADAMW, SGD_MOMENTUM, SIZES, ZOO, ZooModel, compile_unavailable, missing_package
from .training import SavedStorages, Training, optimizer_state_tensors, storage_bytes


def registries() -> dict[str, dict[str, ZooModel]]:
    """Every registry by name: the zoo, the held-back text and vision sets and the sweep (imported
    here, when asked for, not with the zoo).

    Example::

        >>> from benchmarks.zoo import registries
        >>> list(registries())
        ['zoo', 'holdout_text', 'holdout_vision', 'sweep']
    """
    from .holdout_text import HOLDOUT_TEXT
    from .holdout_vision import HOLDOUT_VISION
    from .sweep import SWEEP

    return {"zoo": ZOO, "holdout_text": HOLDOUT_TEXT, "holdout_vision": HOLDOUT_VISION, "sweep": SWEEP}

__all__ = [
    "ADAMW",
    "SGD_MOMENTUM",
    "SIZES",
    "ZOO",
    "ZooModel",
    "SavedStorages",
    "Training",
    "compile_unavailable",
    "missing_package",
    "optimizer_state_tensors",
    "registries",
    "storage_bytes",
]
