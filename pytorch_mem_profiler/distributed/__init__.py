"""Rank awareness through ``torch.distributed``: rank identity and the cross-rank exchange.

Under ``torchrun`` every rank runs its own profiler on its own device.
:mod:`.ranks` knows which rank a process is (:func:`rank_info`) and which ranks
print (:func:`parse_print_ranks`); :mod:`.exchange` brings each rank's peaks to
every rank once an epoch (:class:`CrossRankExchange`, one small all-gather). The
table printed from them is an output:
:func:`pytorch_mem_profiler.outputs.rank_table.format_cross_rank`.

May import: itself, :mod:`..measure` (the device a collective runs on) and the
top-level bottom modules (stats, units, faults); never outputs, options or the profiler.

Example::

    >>> from pytorch_mem_profiler.distributed import rank_info
    >>> rank_info() is None   # no torch.distributed.init_process_group() here
    True
"""

from __future__ import annotations

import warnings
from typing import Any

from .exchange import (
    CATEGORIES,
    CrossRankExchange,
    CrossRankSummary,
    GatherBuffers,
    RankPeakTracker,
    RankSummary,
    decode_summary,
    encode_summary,
    gather_summaries,
    summarize_rank,
)
from .ranks import RankInfo, parse_print_ranks, rank_info

from . import exchange as _exchange

__all__ = ["RankInfo", "rank_info", "parse_print_ranks", *_exchange.__all__]


def __getattr__(name: str) -> Any:
    # The table moved to the outputs, where text is made; its old name still imports.
    if name == "format_cross_rank":
        warnings.warn(
            "pytorch_mem_profiler.distributed.format_cross_rank moved to "
            "pytorch_mem_profiler.outputs.rank_table.format_cross_rank",
            DeprecationWarning,
            stacklevel=2,
        )
        from ..outputs.rank_table import format_cross_rank

        # kept, so that one import warns once (``from ... import`` of a package asks twice)
        globals()[name] = format_cross_rank
        return format_cross_rank
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
