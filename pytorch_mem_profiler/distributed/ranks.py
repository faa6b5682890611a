"""Rank identity under ``torch.distributed``: which rank this process is, and which ranks print.

Example::

    >>> info = RankInfo(rank=1, world_size=2, local_rank=1, host="node 1")
    >>> info.file_tag
    '_rank1_node-1'
    >>> parse_print_ranks("0,1")
    frozenset({0, 1})
"""

from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping

__all__ = ["RankInfo", "rank_info", "parse_print_ranks"]

# Backends that run collectives on an accelerator and nowhere else.
_ACCELERATOR_BACKENDS = {"nccl": "cuda", "xccl": "xpu", "hccl": "hpu"}


@dataclass(frozen=True)
class RankInfo:
    """Where this process sits in the job.

    Attributes:
        rank: the global rank, from 0.
        world_size: how many ranks the job has.
        local_rank: the rank on this host (``LOCAL_RANK``, set by ``torchrun``); ``None`` if unset.
        host: this host's name.
        backends: the process group's backend by device type, e.g. ``{"cpu": "gloo", "cuda": "nccl"}``.
    """

    rank: int
    world_size: int
    local_rank: int | None
    host: str
    backends: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))

    @property
    def file_tag(self) -> str:
        """What a rank's file names end with: ``_rank<r>_<host>``, distinct for each rank."""
        return f"_rank{self.rank}_{_safe_name(self.host)}"


def _safe_name(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "-", text)[:64] or "host"


def _backends() -> dict[str, str]:
    """The default group's backend per device type, from ``"cpu:gloo,cuda:nccl"`` or ``"nccl"``."""
    import torch.distributed as dist

    getter = getattr(dist, "get_backend_config", None)  # torch >= 2.1; older: one name
    text = str(getter() if getter is not None else dist.get_backend()).lower()
    result: dict[str, str] = {}
    for part in text.split(","):
        part = part.strip()
        if ":" in part:
            device, backend = part.split(":", 1)
            result[device] = backend
        elif part in _ACCELERATOR_BACKENDS:
            result[_ACCELERATOR_BACKENDS[part]] = part
        elif part:
            result.setdefault("cpu", part)
    return result


def rank_info() -> RankInfo | None:
    """This process's rank, or ``None`` when no default process group is initialized.

    Example::

        >>> rank_info() is None   # no torch.distributed.init_process_group() here
        True
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    local = os.environ.get("LOCAL_RANK")
    return RankInfo(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        local_rank=int(local) if local is not None and local.isdigit() else None,
        host=socket.gethostname(),
        backends=MappingProxyType(_backends()),
    )


def parse_print_ranks(value: Any) -> frozenset[int] | None:
    """The ranks that print, from ``print_ranks``; ``None`` means every rank.

    Accepts ``"all"``, a rank number, a list of them, or a string of them
    (``"0"``, ``"0,3"``, handy from an environment variable).

    Example::

        >>> parse_print_ranks(0), parse_print_ranks("0,2"), parse_print_ranks("all")
        (frozenset({0}), frozenset({0, 2}), None)
    """
    error = ValueError(
        "print_ranks must be 'all', a rank number >= 0 or a list of them, " f"got {value!r}"
    )
    if isinstance(value, str):
        text = value.strip().lower()
        if text == "all":
            return None
        parts = [p.strip() for p in text.split(",") if p.strip()]
        if not parts or not all(p.isdigit() for p in parts):
            raise error
        return frozenset(int(p) for p in parts)
    if isinstance(value, bool):
        raise error
    if isinstance(value, int):
        if value < 0:
            raise error
        return frozenset({value})
    try:
        items = list(value)
    except TypeError:
        raise error from None
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in items):
        raise error
    return frozenset(items)
