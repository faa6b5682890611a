"""pytorch_mem_profiler: where a PyTorch training loop's device memory goes, layer by layer.

Example::

    >>> from pytorch_mem_profiler import memory_profiler
    >>> memory_profiler is MemoryProfiler
    True
"""

from __future__ import annotations

import importlib
from typing import Any

from .distributed import CrossRankSummary, RankInfo, RankSummary, format_cross_rank, rank_info
from .oom import OomPostmortem, dump_on_oom
from .profiler import MemoryProfiler, memory_profiler
from .snapshot import (
    SnapshotRecorder,
    export_memory_snapshot,
    save_memory_snapshot,
    start_record_memory_history,
    stop_record_memory_history,
)
from .stats import IterationRecord, PhaseStats
from .timeline import memory_timeline_handler, save_memory_timeline
from .usage import MemoryUsage, memory_stats, memory_usage, print_cuda_memory_usage

__version__ = "0.1.0"

#: Names whose modules import pandas or matplotlib: loaded on first use, so that
#: ``import pytorch_mem_profiler`` stays as light as the profiler itself.
_LAZY = {
    "Run": "runs",
    "RunFileError": "runs",
    "load_run": "runs",
    "format_summary": "summary",
    "Comparison": "compare",
    "compare_runs": "compare",
    "format_markdown": "compare",
    "plot_memory": "plot",
    "write_html": "html_report",
    "log_record": "tensorboard",
}

__all__ = [
    "MemoryProfiler",
    "memory_profiler",
    "IterationRecord",
    "PhaseStats",
    "save_memory_snapshot",
    "SnapshotRecorder",
    "start_record_memory_history",
    "export_memory_snapshot",
    "stop_record_memory_history",
    "memory_usage",
    "print_cuda_memory_usage",
    "MemoryUsage",
    "memory_stats",
    "save_memory_timeline",
    "memory_timeline_handler",
    "dump_on_oom",
    "OomPostmortem",
    "CrossRankSummary",
    "RankSummary",
    "RankInfo",
    "rank_info",
    "format_cross_rank",
    "__version__",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
