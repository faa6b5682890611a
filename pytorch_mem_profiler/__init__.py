"""pytorch_mem_profiler: where a PyTorch training loop's device memory goes, layer by layer.

The module map (one level of subpackages; dependencies point one way, down this list):

- top level: :mod:`.stats` (the record and the shared vocabulary), :mod:`.units`
  (bytes to text), :mod:`.faults` (fault containment), :mod:`.options` (the
  profiler's validated settings), :mod:`.profiler` (``MemoryProfiler``: lifecycle and wiring only);
- :mod:`.measure`: every device-memory read (the readers), the hook set, the
  phase machine, the observers (phase intervals, peak breakdown, per-layer
  attribution, FSDP tracking) and the meter that plans each iteration;
- :mod:`.distributed`: rank identity and the cross-rank exchange;
- :mod:`.outputs`: sinks for finished records: the text report, CSV files,
  TensorBoard, leak warnings, the cross-rank table;
- :mod:`.tools`: snapshots, block usage, OOM post-mortems, the memory timeline
  (loaded on first use);
- :mod:`.analysis`: reading runs back, summary, comparison, plots, the HTML report
  and the command line, without torch (loaded on first use);
- :mod:`.estimate`: a training step's memory before it runs, under the fake mode
  (loaded on first use);
- :mod:`.integrations`: adapters for training frameworks (imported by the user).

Example::

    >>> from pytorch_mem_profiler import MemoryProfiler, memory_profiler
    >>> memory_profiler is MemoryProfiler
    True
"""

from __future__ import annotations

import importlib
from typing import Any

from . import faults as _faults  # noqa: F401 - puts its log filter on the package's logger first

__version__ = "0.2.0"

#: Every public name, by the module that defines it, loaded on first use: so that
#: ``import pytorch_mem_profiler`` costs nothing, the command line reads CSV files
#: without importing torch, and the tools and the analysis (pandas, matplotlib)
#: load only when asked for.
_LAZY = {
    "MemoryProfiler": "profiler",
    "memory_profiler": "profiler",
    "IterationRecord": "stats",
    "PhaseStats": "stats",
    "diff_records": "stats",
    "LeakWarning": "outputs.leaks",
    "HeadroomWarning": "outputs.headroom",
    "OutputWarning": "outputs.notices",
    "CrossRankSummary": "distributed",
    "RankSummary": "distributed",
    "RankInfo": "distributed",
    "rank_info": "distributed",
    "format_cross_rank": "outputs.rank_table",
    "save_memory_snapshot": "tools.snapshot",
    "SnapshotRecorder": "tools.snapshot",
    "start_record_memory_history": "tools.snapshot",
    "export_memory_snapshot": "tools.snapshot",
    "stop_record_memory_history": "tools.snapshot",
    "write_snapshot_view": "tools.snapshot_view",
    "memory_usage": "tools.usage",
    "print_cuda_memory_usage": "tools.usage",
    "MemoryUsage": "tools.usage",
    "memory_stats": "tools.usage",
    "save_memory_timeline": "tools.timeline",
    "memory_timeline_handler": "tools.timeline",
    "dump_on_oom": "tools.oom",
    "OomPostmortem": "tools.oom",
    "Run": "analysis.runs",
    "RunFileError": "analysis.runs",
    "load_run": "analysis.runs",
    "format_summary": "analysis.summary",
    "Comparison": "analysis.compare",
    "compare_runs": "analysis.compare",
    "format_markdown": "analysis.compare",
    "plot_memory": "analysis.plot",
    "write_html": "analysis.html_report",
    "log_record": "outputs.tensorboard",
    "estimate_memory": "estimate",
    "MemoryEstimate": "estimate",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
