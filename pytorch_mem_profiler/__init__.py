"""pytorch_mem_profiler: where a PyTorch training loop's device memory goes, layer by layer.

Example::

    >>> from pytorch_mem_profiler import memory_profiler
    >>> memory_profiler is MemoryProfiler
    True
"""

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
    "__version__",
]
