"""The CPU allocator's own account of a step: every allocation and free it reports to ``torch.profiler``.

The project's CPU counter is a dispatch mode, and dynamo runs no compiled code while one is on
(a ``torch.compile``'d model runs uncompiled under it). The CPU allocator reports each
allocation and free to the profiler when it records memory, Inductor's buffers included: that
is how a compiled step's memory on the CPU is measured here. What a kernel takes and gives back
inside one ATen operator is left out of :func:`live_tensor_peak`, as the CPU counter and the
estimate leave it out (their peak is that of live tensors).

Example::

    >>> import torch
    >>> def step():
    ...     a = torch.zeros(1000)   # 4000 bytes
    ...     b = torch.zeros(500)    # 2000 bytes
    ...     del a
    ...     c = torch.zeros(100)
    >>> live_tensor_peak(cpu_allocations(step))
    6000
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch

__all__ = ["cpu_allocations", "live_tensor_peak", "unique_bytes"]


def cpu_allocations(fn: Callable[[], object]) -> list[tuple[int, int, int, int | None]]:
    """``(time, address, bytes (negative: a free), end of the outermost ATen operator it happened in)``
    for each CPU allocation and free while ``fn`` runs, in time order."""
    from torch._C._profiler import _EventType

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = []
    stack = [(node, None) for node in prof.profiler.kineto_results.experimental_event_tree()]
    while stack:
        node, operator = stack.pop()
        if node.tag == _EventType.Allocation:
            fields = node.extra_fields
            if fields.device.type == "cpu":
                events.append((node.start_time_ns, fields.ptr, fields.alloc_size, operator))
            continue
        if operator is None and node.name.startswith("aten::"):
            operator = node.end_time_ns
        stack.extend((child, operator) for child in node.children)
    return sorted(events, key=lambda e: e[0])


def live_tensor_peak(events: list[tuple[int, int, int, int | None]]) -> int:
    """The most bytes alive at once above the start, an allocation freed inside the ATen operator
    that made it left out."""
    opened: dict[int, tuple[int, int | None]] = {}
    inside: set[tuple[int, int]] = set()
    for time, ptr, size, operator in events:
        if size > 0:
            opened[ptr] = (time, operator)
        elif ptr in opened:
            born, operator_end = opened.pop(ptr)
            if operator_end is not None and time <= operator_end:
                inside.add((ptr, born))
    live: dict[int, int] = {}
    now = peak = 0
    for time, ptr, size, _ in events:
        if size > 0:
            live[ptr] = 0 if (ptr, time) in inside else size
            now += live[ptr]
        elif ptr in live:
            now -= live.pop(ptr)
        peak = max(peak, now)
    return peak


def unique_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the tensors' unique storages."""
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())
