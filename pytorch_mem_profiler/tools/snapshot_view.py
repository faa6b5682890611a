"""A memory snapshot as one self-contained HTML page: memory over the recorded events, and the
largest allocations alive at the peak with the Python stacks that made them.

PyTorch's own viewers (https://pytorch.org/memory_viz, and the ``trace_plot.html`` that
``torch.cuda._memory_viz.trace_plot`` writes) run ``MemoryViz.js``, which the page loads from
a CDN: without a network they show a blank page. This page needs nothing: the chart is inline
SVG, the style is inline, there is no script, and a Content-Security-Policy forbids loading
anything, so it opens offline, attached to a ticket, or years later.

It reads the dict that ``torch.cuda.memory._snapshot()`` returns (or its pickle):

- ``device_traces``: per device, the allocator's events, each a dict with ``action``
  (``alloc``, ``free_requested``, ``free_completed``, ``segment_alloc``, ``oom``, ...),
  ``addr``, ``size`` (the bytes the caller asked for), ``frames`` (innermost first:
  ``filename``, ``line``, ``name``) and, in recent torch, ``time_us``;
- ``segments``: what the allocator held when the snapshot was taken, with their ``blocks``.

Memory is replayed as MemoryViz replays it, so the two agree: an ``alloc`` adds its size, a
``free_completed`` takes it away; a free with no ``alloc`` before it in the trace (made
before recording started, or pushed out of the ring buffer) and a block still allocated
at the end with no ``alloc`` in the trace were alive from the start. Keys that a torch
version lacks are taken as absent (no ``time_us``, no ``frames``, no block ``address``).

Nothing here calls a device or imports torch: it renders data. Only open snapshots you
trust; :func:`load_snapshot` refuses pickles that hold anything but plain data.

From a shell, without importing torch::

    python -m pytorch_mem_profiler.tools.snapshot_view snapshot.pickle [-o view.html]

Example::

    >>> frames = [{"filename": "train.py", "line": 12, "name": "step"}]
    >>> snapshot = {"segments": [], "device_traces": [[
    ...     {"action": "alloc", "addr": 0, "size": 1000, "frames": frames},
    ...     {"action": "alloc", "addr": 4096, "size": 3000, "frames": frames},
    ...     {"action": "free_completed", "addr": 0, "size": 1000, "frames": []},
    ... ]]}
    >>> (history,) = device_histories(snapshot)
    >>> history.allocated, history.peak, [a.size for a in history.at_peak]
    ((0, 1000, 4000, 3000), 4000, [3000, 1000])
    >>> history.at_peak[0].rounded_size, history.at_peak[0].frames[0].line
    (3072, 12)
    >>> page = render_snapshot_view(snapshot)
    >>> "<svg" in page and "://" not in page
    True
"""

from __future__ import annotations

import argparse
import datetime as _dt
import math
import os
import pickle
import re
import sys
from dataclasses import dataclass
from html import escape
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from ..units import UNITS, check_unit, format_amount

__all__ = [
    "Frame",
    "Allocation",
    "DeviceHistory",
    "device_histories",
    "allocator_rounded",
    "load_snapshot",
    "render_snapshot_view",
    "write_snapshot_view",
    "CONTENT_SECURITY_POLICY",
    "main",
]

#: Nothing may be fetched; style only inline. (The chart is inline SVG: markup, not a load.)
CONTENT_SECURITY_POLICY = "default-src 'none'; img-src data:; style-src 'unsafe-inline'"

#: The caching allocator hands out blocks in multiples of this many bytes.
BLOCK_ROUNDING = 512

#: Events that free an allocation. ``free`` is the name older allocators used; newer ones
#: record ``free_requested`` (the caller let go) and then ``free_completed`` (the memory is
#: reusable, once other streams are done with it). Like MemoryViz, count the completion.
_FREES = ("free", "free_completed")

#: Where an allocation alive at the peak came from.
RECORDED = "recorded"
BEFORE_FREED = "before recording (freed later; stack of its free)"
BEFORE_ALIVE = "before recording (still allocated at the snapshot)"

#: Chart size in CSS pixels; a series longer than twice the plot's width is drawn as
#: per-pixel minimum and maximum, so the peak is never lost.
_CHART_WIDTH, _CHART_HEIGHT = 960, 320
_MARGIN_LEFT, _MARGIN_RIGHT, _MARGIN_TOP, _MARGIN_BOTTOM = 90, 20, 20, 40

_TORCH_FRAME = re.compile(r"[/\\]torch[/\\]")


@dataclass(frozen=True)
class Frame:
    """One Python (or C++) frame of an allocation's stack."""

    filename: str
    line: int
    name: str

    def __str__(self) -> str:
        return f"{self.filename}:{self.line} in {self.name}"


@dataclass(frozen=True)
class Allocation:
    """One allocation alive at the peak.

    Attributes:
        address: its address on the device.
        size: the bytes requested (as the trace records it, and MemoryViz shows it).
        rounded_size: ``size`` rounded up as the allocator rounds it (:func:`allocator_rounded`).
        frames: its stack, innermost first (for :data:`BEFORE_FREED`, the stack of its free).
        event: the index of its ``alloc`` event in the device's trace; ``None`` if it was
            made before recording started.
        origin: :data:`RECORDED`, :data:`BEFORE_FREED` or :data:`BEFORE_ALIVE`.
        time_us: the time of its ``alloc`` event, where the trace has one.
        stream: the stream it was allocated on, where known.
    """

    address: int
    size: int
    rounded_size: int
    frames: tuple[Frame, ...]
    event: int | None
    origin: str
    time_us: int | None = None
    stream: int | None = None

    @property
    def user_frame(self) -> Frame | None:
        """The innermost Python frame outside torch's own package, else the innermost frame."""
        for frame in self.frames:
            if frame.filename.endswith(".py") and not _TORCH_FRAME.search(frame.filename):
                return frame
        return self.frames[0] if self.frames else None


@dataclass(frozen=True)
class DeviceHistory:
    """One device's memory over its recorded events.

    Attributes:
        device: the device index.
        events: the number of events in its trace (all actions).
        allocated: the requested bytes alive before the first event, then after each
            ``alloc`` and ``free_completed`` event.
        event_index: for each point of ``allocated`` after the first, the index of its event
            in the trace (``event_index[i]`` belongs to ``allocated[i + 1]``).
        initial: ``allocated[0]``: bytes alive before recording started (as far as the
            trace and the snapshot's blocks show).
        peak: the largest value of ``allocated``.
        peak_point: the first index of ``allocated`` at the peak.
        at_peak: every allocation alive at the peak, largest first.
        ooms: the trace's ``oom`` events: ``(event index, bytes requested, bytes the driver
            had free or None)``.
        reserved: bytes the allocator held from the device when the snapshot was taken.
        allocated_at_snapshot: bytes in allocated blocks when the snapshot was taken.
        times_us: each event's ``time_us`` (``None`` where the trace has none), by event index.
    """

    device: int
    events: int
    allocated: tuple[int, ...]
    event_index: tuple[int, ...]
    initial: int
    peak: int
    peak_point: int
    at_peak: tuple[Allocation, ...]
    ooms: tuple[tuple[int, int, int | None], ...]
    reserved: int
    allocated_at_snapshot: int
    times_us: tuple[int | None, ...] = ()

    @property
    def peak_event(self) -> int | None:
        """The trace index of the event that reached the peak; ``None`` if the peak is the start."""
        return self.event_index[self.peak_point - 1] if self.peak_point else None

    @property
    def peak_time_us(self) -> int | None:
        event = self.peak_event
        return self.times_us[event] if event is not None and event < len(self.times_us) else None


def allocator_rounded(nbytes: int) -> int:
    """``nbytes`` rounded up as the CUDA caching allocator rounds a request: to a multiple of
    512 bytes, at least 512 (its default settings; ``roundup_power2_divisions`` rounds more).

    Example::

        >>> allocator_rounded(1), allocator_rounded(512), allocator_rounded(6 * 2**20 + 1)
        (512, 512, 6291968)
    """
    return max(BLOCK_ROUNDING, -(-int(nbytes) // BLOCK_ROUNDING) * BLOCK_ROUNDING)


# -- reading -----------------------------------------------------------------------------------
class _PlainUnpickler(pickle.Unpickler):
    """Loads dicts, lists, tuples, strings and numbers; refuses any class or function."""

    _ALLOWED = {
        ("builtins", "set"),
        ("builtins", "frozenset"),
        ("builtins", "complex"),
        ("builtins", "bytearray"),
        ("collections", "OrderedDict"),
    }

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self._ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(
            f"refusing to load {module}.{name}: a memory snapshot holds only plain data"
        )


def load_snapshot(path: str | os.PathLike) -> dict[str, Any]:
    """The snapshot dict in a pickle written by ``torch.cuda.memory._dump_snapshot``,
    :func:`~pytorch_mem_profiler.export_memory_snapshot` or ``save_memory_snapshot``.

    Raises:
        ValueError: the file is not a pickled snapshot (naming the file).
    """
    path = Path(path)
    with open(path, "rb") as handle:
        try:
            data = _PlainUnpickler(handle).load()
        except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError) as err:
            raise ValueError(f"{str(path)!r} is not a pickled memory snapshot: {err}") from err
    return _normalized(data, str(path))


def _normalized(data: Any, where: str = "snapshot") -> dict[str, Any]:
    if isinstance(data, list):  # the oldest format: the segments alone
        data = {"segments": data, "device_traces": []}
    if not isinstance(data, Mapping) or not ("segments" in data or "device_traces" in data):
        raise ValueError(
            f"{where} is not a memory snapshot: expected a dict with 'segments' and "
            f"'device_traces', got {type(data).__name__}"
        )
    return dict(data)


def _frames(raw: Any) -> tuple[Frame, ...]:
    out = []
    for frame in raw or ():
        if isinstance(frame, dict):
            out.append(
                Frame(
                    str(frame.get("filename", "?")),
                    int(frame.get("line", 0) or 0),
                    str(frame.get("name", "?")),
                )
            )
    return tuple(out)


def _optional_int(value: Any) -> int | None:
    return int(value) if type(value) in (int, float) else None


def _blocks_by_device(snapshot: Mapping[str, Any]) -> dict[int, list[tuple[int, Mapping, Mapping]]]:
    """``device -> [(block address, block, segment)]``; a segment without ``device`` belongs
    to device 0 (snapshots of one device); a block without ``address`` sits after the
    blocks before it in its segment."""
    out: dict[int, list[tuple[int, Mapping, Mapping]]] = {}
    for segment in snapshot.get("segments") or ():
        if not isinstance(segment, Mapping):
            continue
        device = int(segment.get("device", 0) or 0)
        address = int(segment.get("address", 0) or 0)
        for block in segment.get("blocks") or ():
            block_address = block.get("address", block.get("addr"))
            block_address = address if block_address is None else int(block_address)
            out.setdefault(device, []).append((block_address, block, segment))
            address = block_address + int(block.get("size", 0) or 0)
    return out


def device_histories(snapshot: Mapping[str, Any] | list) -> list[DeviceHistory]:
    """Replay each device's trace: memory after every event, and what is alive at the peak.

    Devices with neither events nor segments are left out.

    Args:
        snapshot: a dict from ``torch.cuda.memory._snapshot()`` (or its list-only ancestor).
    """
    snapshot = _normalized(snapshot)
    traces = list(snapshot.get("device_traces") or [])
    blocks = _blocks_by_device(snapshot)
    devices = sorted(set(range(len(traces))) | set(blocks))
    out = []
    for device in devices:
        trace = list(traces[device]) if device < len(traces) and traces[device] else []
        device_blocks = blocks.get(device, [])
        if not trace and not device_blocks:
            continue
        out.append(_replay(device, trace, device_blocks))
    return out


def _replay(device: int, trace: list[Mapping], blocks: list[tuple[int, Mapping, Mapping]]) -> DeviceHistory:
    # Pass 1: which allocations the trace makes, which it frees without having made them
    # (alive before it started), and the order of the alloc and free actions. An element is
    # (address, size, origin, the event or block it comes from, its trace index or None);
    # Allocation objects are made only for those alive at the peak.
    elements: list[tuple[int, int, str, Mapping, int | None]] = []
    initially: list[int] = []
    actions: list[tuple[int, int]] = []  # (trace index, element) for each alloc or free
    open_allocs: dict[int, int] = {}
    ooms = []
    for index, event in enumerate(trace):
        action = event.get("action")
        if action == "alloc":
            address = int(event.get("addr", 0) or 0)
            elements.append((address, int(event.get("size", 0) or 0), RECORDED, event, index))
            open_allocs[address] = len(elements) - 1
            actions.append((index, len(elements) - 1))
        elif action in _FREES:
            address = int(event.get("addr", 0) or 0)
            if address in open_allocs:
                actions.append((index, open_allocs.pop(address)))
            else:
                elements.append((address, int(event.get("size", 0) or 0), BEFORE_FREED, event, None))
                initially.append(len(elements) - 1)
                actions.append((index, len(elements) - 1))
        elif action == "oom":
            ooms.append((index, int(event.get("size", 0) or 0), _optional_int(event.get("device_free"))))

    reserved = 0
    allocated_at_snapshot = 0
    streams: dict[int, Any] = {}
    seen_segments = set()
    for address, block, segment in blocks:
        if id(segment) not in seen_segments:
            seen_segments.add(id(segment))
            reserved += int(segment.get("total_size", 0) or 0)
        if block.get("state") != "active_allocated":
            continue
        allocated_at_snapshot += int(block.get("size", 0) or 0)
        if address in open_allocs:
            continue
        size = int(block.get("requested_size", block.get("size", 0)) or 0)
        elements.append((address, size, BEFORE_ALIVE, block, None))
        streams[len(elements) - 1] = segment.get("stream")
        initially.append(len(elements) - 1)

    # Pass 2: bytes alive after each action. An element's first action adds it, its
    # second takes it away; one alive from the start is only ever taken away.
    alive = dict.fromkeys(initially, True)
    total = sum(elements[element][1] for element in initially)
    allocated = [total]
    event_index = []
    for index, element in actions:
        if alive.pop(element, False):
            total -= elements[element][1]
        else:
            alive[element] = True
            total += elements[element][1]
        allocated.append(total)
        event_index.append(index)
    peak = max(allocated)
    peak_point = allocated.index(peak)

    # Pass 3: what is alive at the peak.
    alive = dict.fromkeys(initially, True)
    for _, element in actions[:peak_point]:
        if not alive.pop(element, False):
            alive[element] = True
    at_peak = []
    for element in alive:
        address, size, origin, source, index = elements[element]
        at_peak.append(
            Allocation(
                address=address,
                size=size,
                rounded_size=allocator_rounded(size),
                frames=_frames(source.get("frames")),
                event=index,
                origin=origin,
                time_us=_optional_int(source.get("time_us")) if origin == RECORDED else None,
                stream=_optional_int(streams[element] if element in streams else source.get("stream")),
            )
        )
    at_peak.sort(key=lambda a: (-a.size, a.address))
    return DeviceHistory(
        device=device,
        events=len(trace),
        allocated=tuple(allocated),
        event_index=tuple(event_index),
        initial=allocated[0],
        peak=peak,
        peak_point=peak_point,
        at_peak=tuple(at_peak),
        ooms=tuple(ooms),
        reserved=reserved,
        allocated_at_snapshot=allocated_at_snapshot,
        times_us=tuple(_optional_int(event.get("time_us")) for event in trace),
    )


# -- the chart -----------------------------------------------------------------------------------
def _nice_ceiling(value: float) -> float:
    """The smallest of 1, 1.2, 1.5, 2, 2.5, 3, 4, 5, 6, 8 times a power of ten that is at least ``value``."""
    if value <= 0:
        return 1.0
    power = 10.0 ** math.floor(math.log10(value))
    for step in (1, 1.2, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 10):
        if step * power >= value:
            return step * power
    return 10 * power


def _chart_points(values: Sequence[int], width: int) -> list[tuple[float, int]]:
    """``(x in points, value)`` to draw: the step line itself when short enough, else per
    horizontal pixel its first, lowest, highest and last value, in the order they came."""
    n = len(values)
    if n == 1:
        return [(0.0, values[0]), (1.0, values[0])]
    if n <= 2 * width:
        points = []
        for i, value in enumerate(values):
            points += [(float(i), value), (float(i + 1), value)]
        return points
    points = []
    per_pixel = n / width
    for pixel in range(width):
        start, stop = int(pixel * per_pixel), int((pixel + 1) * per_pixel)
        chunk = values[start:stop]
        if not chunk:
            continue
        low = min(range(len(chunk)), key=chunk.__getitem__)
        high = max(range(len(chunk)), key=chunk.__getitem__)
        order = sorted({0, low, high, len(chunk) - 1})
        for k in order:
            points.append((start + k * (stop - start) / max(len(chunk), 1), chunk[k]))
    points.append((float(n), values[-1]))
    return points


def _chart(history: DeviceHistory, unit: str) -> str:
    """Inline SVG: requested bytes alive over the events, the peak marked, OOMs in red."""
    values = history.allocated
    n = len(values)
    plot_w = _CHART_WIDTH - _MARGIN_LEFT - _MARGIN_RIGHT
    plot_h = _CHART_HEIGHT - _MARGIN_TOP - _MARGIN_BOTTOM
    scale = UNITS[unit]
    top = _nice_ceiling(max(history.peak, 1) / scale) * scale
    x_of = lambda x: _MARGIN_LEFT + plot_w * x / max(n, 1)  # noqa: E731
    y_of = lambda v: _MARGIN_TOP + plot_h * (1 - v / top)  # noqa: E731
    parts = [
        f'<svg id="chart-{history.device}" class="chart" '
        f'width="{_CHART_WIDTH}" height="{_CHART_HEIGHT}" viewBox="0 0 {_CHART_WIDTH} {_CHART_HEIGHT}" '
        f'role="img" aria-labelledby="chart-title-{history.device}">',
        f'<title id="chart-title-{history.device}">Requested bytes alive on device '
        f"{history.device} over {n - 1} allocation and free events</title>",
        f'<rect x="{_MARGIN_LEFT}" y="{_MARGIN_TOP}" width="{plot_w}" height="{plot_h}" '
        'fill="#fafafa" stroke="#ccc"/>',
    ]
    for k in range(5):
        value = top * k / 4
        y = y_of(value)
        parts.append(
            f'<line x1="{_MARGIN_LEFT}" y1="{y:.1f}" x2="{_MARGIN_LEFT + plot_w}" y2="{y:.1f}" stroke="#e4e4e4"/>'
            f'<text x="{_MARGIN_LEFT - 6}" y="{y + 4:.1f}" text-anchor="end" class="tick">'
            f"{escape(format_amount(value, unit, digits=3))}</text>"
        )
    for k in range(5):
        x = (n - 1) * k / 4
        parts.append(
            f'<text x="{x_of(x):.1f}" y="{_MARGIN_TOP + plot_h + 16}" text-anchor="middle" class="tick">'
            f"{int(round(x)):,}</text>"
        )
    parts.append(
        f'<text x="{_MARGIN_LEFT + plot_w / 2}" y="{_CHART_HEIGHT - 6}" text-anchor="middle" class="tick">'
        "allocation and free events</text>"
    )
    for index, size, _ in history.ooms:
        point = next((i + 1 for i, e in enumerate(history.event_index) if e >= index), n - 1)
        x = x_of(point)
        parts.append(
            f'<line class="oom" x1="{x:.1f}" y1="{_MARGIN_TOP}" x2="{x:.1f}" y2="{_MARGIN_TOP + plot_h}" '
            f'stroke="#d62728" stroke-dasharray="4 3"><title>out of memory asking for {size:,} bytes'
            "</title></line>"
        )
    points = _chart_points(values, plot_w)
    path = " ".join(f"{x_of(x):.1f},{y_of(v):.1f}" for x, v in points)
    baseline = f"{x_of(points[-1][0]):.1f},{y_of(0):.1f} {x_of(points[0][0]):.1f},{y_of(0):.1f}"
    parts.append(f'<polygon class="area" points="{path} {baseline}" fill="#1f77b4" fill-opacity="0.18" stroke="none"/>')
    parts.append(f'<polyline class="series" points="{path}" fill="none" stroke="#1f77b4" stroke-width="1.5"/>')
    px, py = x_of(history.peak_point + 0.5), y_of(history.peak)
    label = f"peak {format_amount(history.peak, unit, digits=3)}"
    anchor = "end" if px > _MARGIN_LEFT + plot_w * 0.7 else "start"
    dx = -8 if anchor == "end" else 8
    parts.append(
        f'<circle class="peak" cx="{px:.1f}" cy="{py:.1f}" r="4" fill="#d62728"/>'
        f'<text class="peak-label" x="{px + dx:.1f}" y="{max(py - 6, _MARGIN_TOP + 12):.1f}" '
        f'text-anchor="{anchor}">{escape(label)}</text>'
    )
    parts.append("</svg>")
    return "".join(parts)


# -- the page ------------------------------------------------------------------------------------
_STYLE = """
body { font-family: system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; margin: 2rem auto;
       max-width: 1280px; padding: 0 1rem; color: #222; line-height: 1.4; }
h1 { font-size: 1.6rem; margin-bottom: 0.2rem; }
h2 { font-size: 1.25rem; margin-top: 2rem; border-bottom: 1px solid #ddd; padding-bottom: 0.2rem; }
h3 { font-size: 1.05rem; margin-top: 1.5rem; }
.sub, .note { color: #666; }
.note { font-size: 0.85rem; }
table { border-collapse: collapse; margin: 0.5rem 0 1rem; font-size: 0.9rem; }
th, td { border: 1px solid #ddd; padding: 0.25rem 0.6rem; text-align: left; vertical-align: top; }
th { background: #f4f4f4; }
td.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
code, pre { font-family: ui-monospace, Menlo, Consolas, monospace; font-size: 0.85rem; }
pre { margin: 0.3rem 0; white-space: pre-wrap; }
svg.chart { max-width: 100%; height: auto; display: block; }
svg .tick { font-size: 11px; fill: #555; }
svg .peak-label { font-size: 12px; fill: #d62728; font-weight: 600; }
details summary { cursor: pointer; }
"""


def _amount(nbytes: int, unit: str) -> str:
    return format_amount(nbytes, unit, digits=3)


def _row(cells: Iterable[tuple[str, bool]], attrs: str = "") -> str:
    """A table row of ``(already escaped HTML, numeric)`` cells."""
    body = "".join(f'<td class="num">{c}</td>' if num else f"<td>{c}</td>" for c, num in cells)
    return f"<tr{attrs}>{body}</tr>"


def _when(history: DeviceHistory) -> str:
    event = history.peak_event
    if event is None:
        return "before the first recorded event"
    text = f"at event {event:,} of {history.events:,}"
    start = next((t for t in history.times_us if t is not None), None)
    if history.peak_time_us is not None and start is not None:
        text += f", {(history.peak_time_us - start) / 1e6:.3f} s after the first"
    return text


def _stack(allocation: Allocation, max_frames: int = 40) -> str:
    if not allocation.frames:
        return '<span class="note">no stack recorded</span>'
    user = allocation.user_frame
    shown = allocation.frames[:max_frames]
    more = len(allocation.frames) - len(shown)
    lines = "\n".join(escape(str(f)) for f in shown) + (f"\n... {more} more" if more > 0 else "")
    return (
        f"<details><summary><code>{escape(str(user))}</code></summary>"
        f"<pre>{lines}</pre></details>"
    )


def _device_section(history: DeviceHistory, unit: str, top: int) -> list[str]:
    d = history.device
    parts = [f'<h2 id="device-{d}">Device {d}</h2>']
    moves = len(history.allocated) - 1
    if history.events == 0:
        parts.append(
            '<p class="note">No history was recorded for this device (history recording was off '
            "when the snapshot was taken): only the blocks allocated at that moment are shown.</p>"
        )
    facts = [
        ("Peak of requested bytes alive", f'<span id="peak-{d}" data-bytes="{history.peak}">'
         f"{escape(_amount(history.peak, unit))}</span> ({history.peak:,} bytes), {escape(_when(history))}"),
        ("Alive before recording started", f"{escape(_amount(history.initial, unit))} ({history.initial:,} bytes)"),
        ("Alive at the end", f"{escape(_amount(history.allocated[-1], unit))} ({history.allocated[-1]:,} bytes)"),
        ("Events recorded", f"{history.events:,} ({moves:,} allocations and frees)"),
        ("Allocated at the snapshot (block sizes)", f"{escape(_amount(history.allocated_at_snapshot, unit))} "
         f"({history.allocated_at_snapshot:,} bytes)"),
        ("Reserved at the snapshot (segments)", f"{escape(_amount(history.reserved, unit))} ({history.reserved:,} bytes)"),
    ]
    parts.append(
        f'<table id="facts-{d}"><tbody>'
        + "".join(f"<tr><th>{escape(k)}</th><td>{v}</td></tr>" for k, v in facts)
        + "</tbody></table>"
    )
    if moves:
        parts.append(f'<figure id="figure-{d}">{_chart(history, unit)}<figcaption class="note">'
                     "Bytes requested by live allocations after each allocation or free (as "
                     "MemoryViz's Active Memory Timeline counts them); the red dot is the peak"
                     + ("; dashed red lines are out-of-memory errors" if history.ooms else "")
                     + ".</figcaption></figure>")

    shown = history.at_peak[:top]
    rest = history.at_peak[top:]
    parts.append(f'<h3 id="at-peak-{d}">The largest allocations alive at the peak</h3>')
    header = ["#", "requested", "bytes", f"in {BLOCK_ROUNDING}-byte blocks", "allocated", "where (innermost frame outside torch; click for the stack)"]
    rows = []
    for rank, allocation in enumerate(shown, 1):
        made = (
            f"event {allocation.event:,}" if allocation.event is not None else escape(allocation.origin)
        )
        rows.append(
            _row(
                [
                    (str(rank), True),
                    (escape(_amount(allocation.size, unit)), True),
                    (f"{allocation.size:,}", True),
                    (f"{allocation.rounded_size:,}", True),
                    (made, False),
                    (_stack(allocation), False),
                ],
                f' data-bytes="{allocation.size}" data-address="{allocation.address}"',
            )
        )
    if rest:
        rest_bytes = sum(a.size for a in rest)
        rows.append(
            _row(
                [
                    ("", True),
                    (escape(_amount(rest_bytes, unit)), True),
                    (f"{rest_bytes:,}", True),
                    (f"{sum(a.rounded_size for a in rest):,}", True),
                    (f"{len(rest):,} more allocations", False),
                    ("", False),
                ],
                ' class="rest"',
            )
        )
    if rows:
        parts.append(
            f'<table id="allocations-{d}"><thead><tr>'
            + "".join(f"<th>{escape(h)}</th>" for h in header)
            + f"</tr></thead><tbody>{''.join(rows)}</tbody></table>"
        )
    else:
        parts.append('<p class="note">Nothing was allocated at the peak.</p>')

    if history.ooms:
        parts.append(f'<h3 id="ooms-{d}">Out-of-memory errors</h3>')
        parts.append(
            f'<table id="oom-table-{d}"><thead><tr><th>event</th><th>bytes asked for</th>'
            "<th>bytes the device had free</th></tr></thead><tbody>"
            + "".join(
                _row([(f"{i:,}", True), (f"{size:,}", True), ("n/a" if free is None else f"{free:,}", True)])
                for i, size, free in history.ooms
            )
            + "</tbody></table>"
        )
    return parts


def render_snapshot_view(
    snapshot: Mapping[str, Any] | list,
    *,
    title: str | None = None,
    source: str | None = None,
    unit: str = "MiB",
    top: int = 20,
) -> str:
    """The snapshot as one HTML document (a string) that loads nothing.

    Args:
        snapshot: a dict from ``torch.cuda.memory._snapshot()``.
        title: the page's title; default "Memory snapshot".
        source: where the snapshot came from (a file name), shown under the title.
        unit: the unit of the figures, one of :data:`~pytorch_mem_profiler.units.UNITS`;
            exact bytes are shown beside them.
        top: how many allocations alive at the peak to list (the rest are summed in one row).
    """
    from .. import __version__  # here: the package imports this module lazily

    unit = check_unit(unit, "unit")
    if isinstance(top, bool) or not isinstance(top, int) or top < 1:
        raise ValueError(f"top must be an integer >= 1, got {top!r}")
    histories = device_histories(snapshot)
    title = title or "Memory snapshot"
    made = _dt.datetime.now().strftime("%Y-%m-%d %H:%M:%S")
    where = f"{escape(source)} &middot; " if source else ""
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f'<meta http-equiv="Content-Security-Policy" content="{CONTENT_SECURITY_POLICY}">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>{escape(title)}</title><style>{_STYLE}</style></head><body>",
        f"<h1>{escape(title)}</h1>",
        f'<p class="sub">{where}figures in {escape(unit)} (1 {escape(unit)} = {UNITS[unit]:,} bytes) '
        f"&middot; made {made} by pytorch_mem_profiler {escape(__version__)}</p>",
        '<p class="note">Sizes are the bytes each allocation asked for, as the trace records them; '
        f"the caching allocator hands out blocks in multiples of {BLOCK_ROUNDING} bytes (and may give a "
        "large request a larger block), which is what <code>torch.cuda.memory_allocated()</code> counts. "
        "For the interactive timeline, drop the snapshot's pickle on pytorch.org/memory_viz "
        "(that page needs the network).</p>",
    ]
    if not histories:
        parts.append('<p id="empty">The snapshot holds no events and no segments: nothing was '
                     "allocated on the device, or CUDA was not initialized.</p>")
    for history in histories:
        parts += _device_section(history, unit, top)
    parts.append("</body></html>")
    return "\n".join(parts)


def write_snapshot_view(
    snapshot: Mapping[str, Any] | str | os.PathLike,
    html_path: str | os.PathLike | None = None,
    *,
    unit: str = "MiB",
    top: int = 20,
    title: str | None = None,
) -> Path:
    """Write the offline view of a snapshot (a dict, or the path of its pickle) to ``html_path``.

    Args:
        snapshot: a snapshot dict, or the path of a pickled one.
        html_path: the HTML file; default the pickle's path with ``.html``.
        unit: the unit of the figures (exact bytes are shown beside them).
        top: how many allocations alive at the peak to list.
        title: the page's title.

    Returns:
        The path written.

    Example::

        >>> import tempfile, os
        >>> page = write_snapshot_view({"segments": [], "device_traces": [[]]},
        ...                            os.path.join(tempfile.mkdtemp(), "view.html"))
        >>> page.name
        'view.html'
    """
    source = None
    if isinstance(snapshot, (str, os.PathLike)):
        path = Path(snapshot)
        source = path.name
        data = load_snapshot(path)
        if html_path is None:
            html_path = path.with_suffix(".html")
    elif isinstance(snapshot, (Mapping, list)):
        data = snapshot
        if html_path is None:
            raise ValueError("html_path is needed when snapshot is a dict, not a file")
    else:
        raise TypeError(f"snapshot must be a snapshot dict or a path, got {type(snapshot).__name__}")
    if not isinstance(html_path, (str, os.PathLike)):
        raise TypeError(f"html_path must be a str or os.PathLike, got {type(html_path).__name__}")
    page = render_snapshot_view(data, title=title, source=source, unit=unit, top=top)
    html_path = Path(html_path)
    tmp = html_path.with_name(f".{html_path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(page, encoding="utf-8")
        os.replace(tmp, html_path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return html_path


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m pytorch_mem_profiler.tools.snapshot_view SNAPSHOT.pickle [-o FILE.html]``.

    Returns 0, or 2 with one line on standard error when the file cannot be read or written.
    """
    parser = argparse.ArgumentParser(
        prog="python -m pytorch_mem_profiler.tools.snapshot_view",
        description="Write a memory snapshot's offline view: memory over the recorded events "
        "and the largest allocations alive at the peak, in one HTML file that loads nothing.",
    )
    parser.add_argument("snapshot", help="a pickled snapshot (snapshot.pickle, export_memory_snapshot's file)")
    parser.add_argument("-o", "--output", help="the HTML file (default: the snapshot's path with .html)")
    parser.add_argument("--units", default="MiB", choices=list(UNITS), help="the unit of the figures (default: MiB)")
    parser.add_argument("--top", type=int, default=20, help="allocations listed at the peak (default: 20)")
    args = parser.parse_args(argv)
    try:
        path = write_snapshot_view(args.snapshot, args.output, unit=args.units, top=args.top)
    except (OSError, ValueError) as err:
        print(f"{parser.prog}: error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
