"""The cross-rank table printed at each epoch end under ``torch.distributed``: a text view of
:class:`~pytorch_mem_profiler.distributed.CrossRankSummary`.

Example::

    >>> from pytorch_mem_profiler.distributed import CrossRankSummary, RankSummary
    >>> summary = CrossRankSummary(epoch=1, ranks=(
    ...     RankSummary(rank=0, host="node1", device="cuda:0", peak_cached=8_000_000),
    ...     RankSummary(rank=1, host="node1", device="cuda:1", peak_cached=9_000_000),
    ... ))
    >>> print(format_cross_rank(summary).splitlines()[1])
    Memory across 2 ranks, Epoch 1
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from ..units import UNITS, format_amount
from .report import REPORT_WIDTH

if TYPE_CHECKING:  # the table reads a summary's fields; it needs no torch.distributed
    from ..distributed.exchange import CrossRankSummary

__all__ = ["format_cross_rank"]


def format_cross_rank(summary: CrossRankSummary, unit: str = "MB") -> str:
    """The cross-rank table: peaks per rank, min / max / mean, and the rank that peaks highest.

    Example::

        >>> from pytorch_mem_profiler.distributed import CrossRankSummary, RankSummary
        >>> s = CrossRankSummary(epoch=2, ranks=(RankSummary(rank=0, peak_cached=2_000_000),))
        >>> "Highest peak: rank 0" in format_cross_rank(s)
        True
    """
    fmt = lambda n: format_amount(n, unit)  # noqa: E731
    n = len(summary.ranks)
    header = ("rank", "host", "device", "peak cached", "peak allocated", "largest category")
    rows = []
    for r in summary.ranks:
        largest = r.largest_category
        rows.append(
            (
                str(r.rank),
                r.host or "?",
                r.device or "?",
                fmt(r.peak_cached),
                fmt(r.peak_allocated),
                f"{largest[0]} {fmt(largest[1])}" if largest else "n/a",
            )
        )
    stats = {name: summary.stat(name) for name in ("peak_cached", "peak_allocated")}
    for i, label in enumerate(("min", "max", "mean")):
        cells = []
        for name in ("peak_cached", "peak_allocated"):
            s = stats[name]
            cells.append(fmt(None if s is None else s[i]))
        rows.append((label, "", "", cells[0], cells[1], ""))
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(header)]
    right = {0, 3, 4}

    def line(cells: Sequence[str]) -> str:
        out = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))]
        return "  ".join(out).rstrip()

    table = [line(header)] + [line(row) for row in rows[:n]] + [line(row) for row in rows[n:]]
    width = max(REPORT_WIDTH, *(len(t) for t in table))
    stars = "*" * width
    out = [stars, f"Memory across {n} rank{'s' if n != 1 else ''}, Epoch {summary.epoch}", stars]
    out += table
    top = summary.highest
    if top is not None:
        where = ", ".join(x for x in (top.host, top.device) if x)
        text = f"Highest peak: rank {top.rank}" + (f" ({where})" if where else "")
        text += f", {fmt(top.peak_cached)} cached, {fmt(top.peak_allocated)} allocated"
        largest = top.largest_category
        if largest is not None:
            text += f"; largest category: {largest[0]}, {fmt(largest[1])}"
        out.append(text)
    out.append(f"({unit} = {UNITS[unit]:,} bytes; peaks since the profiler started)")
    return "\n".join(out)
