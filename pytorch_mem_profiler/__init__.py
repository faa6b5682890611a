"""pytorch_mem_profiler: where a PyTorch training loop's device memory goes, layer by layer.

Example::

    >>> from pytorch_mem_profiler import memory_profiler
    >>> memory_profiler is MemoryProfiler
    True
"""

from .distributed import CrossRankSummary, RankInfo, RankSummary, format_cross_rank, rank_info
from .profiler import MemoryProfiler, memory_profiler
from .stats import IterationRecord, PhaseStats

__version__ = "0.1.0"

__all__ = [
    "MemoryProfiler",
    "memory_profiler",
    "IterationRecord",
    "PhaseStats",
    "CrossRankSummary",
    "RankSummary",
    "RankInfo",
    "rank_info",
    "format_cross_rank",
    "__version__",
]
