"""The offline snapshot view: its figures from a snapshot scripted by hand, its page (html.parser,
always), a real browser with the network cut off (headless Chromium, when installed), the
pickle protocol of every snapshot written, and its command line without torch.

The scripted snapshot plays a caching allocator: each allocation gets an address, the trace
gets the events torch records (``segment_alloc``, ``alloc``, ``free_requested`` then
``free_completed``, ``oom``) with innermost-first frames and times, and the snapshot's
segments hold the blocks alive at the end. The expected figures are the script's own sums.
"""

from __future__ import annotations

import base64
import os
import pickle
import re
import subprocess
import sys
import types
from html.parser import HTMLParser
from pathlib import Path

import pytest
import torch

from pytorch_mem_profiler.tools import snapshot as snapshot_module
from pytorch_mem_profiler.tools import snapshot_view
from pytorch_mem_profiler.tools.snapshot_view import (
    BEFORE_ALIVE,
    BEFORE_FREED,
    CONTENT_SECURITY_POLICY,
    RECORDED,
    allocator_rounded,
    device_histories,
    load_snapshot,
    render_snapshot_view,
    write_snapshot_view,
)
from pytorch_mem_profiler.units import format_amount

CHROMIUM = "/usr/bin/chromium"
MIB = 2**20
ROOT = Path(__file__).resolve().parent.parent

TRAIN = "/home/user/project/train.py"
LINEAR = "/opt/venv/lib/python3.11/site-packages/torch/nn/modules/linear.py"

# The script's allocations (requested bytes), none a multiple of 512 where it matters.
W1 = 3_000_000  # a weight, made before recording, alive at the end
W2 = 1_000  # a bias, made before recording, alive at the end
P = 300_000  # made before recording, freed during it
A1 = 1_000_000  # activations, line 10
A2 = 2_500_000  # activations, line 11
G = 4_000_000  # a gradient, line 20, alive at the end
T = 700_001  # a temporary, line 30
OOM_ASK = 10**12

#: The peak: P is freed before G is made, and A1 before T, so the most alive at once is here.
PEAK = W1 + W2 + A1 + A2 + G
#: What is alive at the peak, largest first, with the line that made each (None: before recording).
AT_PEAK = [(G, 20), (W1, None), (A2, 11), (A1, 10), (W2, None)]


def user_frames(line: int, name: str = "step") -> list[dict]:
    """An innermost-first stack: torch's Linear.forward called from the user's line."""
    return [
        {"filename": LINEAR, "line": 125, "name": "forward"},
        {"filename": TRAIN, "line": line, "name": name},
        {"filename": TRAIN, "line": 99, "name": "<module>"},
    ]


class ScriptedAllocator:
    """Hands out addresses in one 20 MiB segment and records torch's events for them."""

    BASE = 0x7F00_0000_0000
    SEGMENT = 20 * MIB

    def __init__(self, device: int = 0) -> None:
        self.device = device
        self.trace: list[dict] = []
        self.offset = 0
        self.time_us = 1_700_000_000_000_000
        self.blocks: dict[int, dict] = {}  # address -> block, in allocation order
        self.alive: set[int] = set()

    def _event(self, action: str, addr: int, size: int, frames: list[dict], **extra) -> None:
        self.time_us += 250
        self.trace.append(
            {"action": action, "addr": addr, "size": size, "stream": 0, "frames": frames,
             "time_us": self.time_us, "device_free": 0, **extra}
        )
        if action != "oom":
            self.trace[-1].pop("device_free")

    def _place(self, size: int, frames: list[dict]) -> int:
        address = self.BASE + self.offset
        self.offset += allocator_rounded(size)
        self.blocks[address] = {"size": allocator_rounded(size), "requested_size": size, "frames": frames}
        self.alive.add(address)
        return address

    def before_recording(self, size: int) -> int:
        """An allocation made before history was recorded: no event, no frames."""
        return self._place(size, [])

    def start(self) -> None:
        self._event("segment_alloc", self.BASE, self.SEGMENT, [])

    def alloc(self, size: int, line: int) -> int:
        frames = user_frames(line)
        address = self._place(size, frames)
        self._event("alloc", address, size, frames)
        return address

    def free(self, address: int, line: int = 50) -> None:
        size = self.blocks[address]["requested_size"]
        frames = user_frames(line, "free_site")
        self._event("free_requested", address, size, frames)
        self._event("free_completed", address, size, frames)
        self.alive.discard(address)

    def oom(self, size: int) -> None:
        self._event("oom", 0, size, user_frames(40), device_free=123_456)

    def segment(self) -> dict:
        blocks, cursor = [], self.BASE
        for address, block in self.blocks.items():
            state = "active_allocated" if address in self.alive else "inactive"
            blocks.append({"address": address, "state": state, **block})
            cursor = address + block["size"]
        blocks.append({"address": cursor, "size": self.BASE + self.SEGMENT - cursor,
                       "requested_size": 0, "state": "inactive", "frames": []})
        allocated = sum(b["size"] for b in blocks if b["state"] == "active_allocated")
        return {
            "device": self.device, "address": self.BASE, "total_size": self.SEGMENT, "stream": 0,
            "segment_type": "large", "segment_pool_id": (0, 0), "allocated_size": allocated,
            "active_size": allocated, "requested_size": 0, "blocks": blocks,
        }


def scripted_snapshot() -> tuple[dict, dict[str, int]]:
    """A snapshot of one training step on device 0, and one allocation on device 1."""
    gpu = ScriptedAllocator()
    w1 = gpu.before_recording(W1)
    w2 = gpu.before_recording(W2)
    p = gpu.before_recording(P)
    gpu.start()
    a1 = gpu.alloc(A1, 10)
    a2 = gpu.alloc(A2, 11)
    gpu.free(p)
    g = gpu.alloc(G, 20)
    gpu.free(a1)
    t = gpu.alloc(T, 30)
    gpu.free(t)
    gpu.free(a2)
    gpu.oom(OOM_ASK)
    other = ScriptedAllocator(device=1)
    other.start()
    other.alloc(777, 60)
    snapshot = {
        "segments": [gpu.segment(), other.segment()],
        "device_traces": [gpu.trace, other.trace],
        "allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": ""},
    }
    return snapshot, {"w1": w1, "w2": w2, "p": p, "a1": a1, "a2": a2, "g": g, "t": t}


def as_older_torch(snapshot: dict) -> dict:
    """The same snapshot as an older torch writes it: no times, no block addresses, no device
    on segments (one device), frames without names."""
    older = pickle.loads(pickle.dumps(snapshot))
    older["segments"] = [s for s in older["segments"] if s["device"] == 0]
    older["device_traces"] = older["device_traces"][:1]
    for segment in older["segments"]:
        del segment["device"]
        for block in segment["blocks"]:
            del block["address"]
    for event in older["device_traces"][0]:
        event.pop("time_us")
        for frame in event["frames"]:
            frame.pop("name", None)  # frames are shared between a free's two events
    return older


# -- the figures -----------------------------------------------------------------------------------
def test_peak_and_the_allocations_alive_at_it():
    snapshot, addr = scripted_snapshot()
    first, second = device_histories(snapshot)
    assert first.device == 0 and second.device == 1
    assert first.initial == W1 + W2 + P
    assert first.peak == PEAK
    assert first.allocated[-1] == W1 + W2 + G
    assert first.events == len(snapshot["device_traces"][0])
    # The peak is reached by G's alloc event, and stays until A1's free.
    trace = snapshot["device_traces"][0]
    g_event = next(i for i, e in enumerate(trace) if e["action"] == "alloc" and e["addr"] == addr["g"])
    assert first.peak_event == g_event
    assert first.peak_time_us == trace[g_event]["time_us"]
    assert [(a.size, a.user_frame.line if a.origin == RECORDED else None) for a in first.at_peak] == AT_PEAK
    assert sum(a.size for a in first.at_peak) == PEAK
    largest = first.at_peak[0]
    assert (largest.address, largest.event, largest.origin) == (addr["g"], g_event, RECORDED)
    assert largest.rounded_size == 4_000_256  # 7,813 blocks of 512 bytes
    assert [str(f) for f in largest.frames] == [f"{LINEAR}:125 in forward", f"{TRAIN}:20 in step", f"{TRAIN}:99 in <module>"]
    assert str(largest.user_frame) == f"{TRAIN}:20 in step"
    assert {a.address: a.origin for a in first.at_peak if a.event is None} == {
        addr["w1"]: BEFORE_ALIVE,
        addr["w2"]: BEFORE_ALIVE,
    }
    assert first.ooms == ((len(trace) - 1, OOM_ASK, 123_456),)
    assert first.reserved == 20 * MIB
    assert first.allocated_at_snapshot == sum(allocator_rounded(n) for n in (W1, W2, G))
    assert (second.peak, [a.size for a in second.at_peak]) == (777, [777])


def test_a_free_of_an_allocation_made_before_recording_counts_from_the_start():
    snapshot, addr = scripted_snapshot()
    (history, _) = device_histories(snapshot)
    # Before A1 is made, P is alive (it is freed later, with no alloc in the trace).
    assert history.allocated[:4] == (W1 + W2 + P, W1 + W2 + P + A1, W1 + W2 + P + A1 + A2, W1 + W2 + A1 + A2)
    early = snapshot_view._replay(0, snapshot["device_traces"][0][:3], [])
    assert early.initial == 0 and early.peak == A1 + A2  # no segments: only what the trace shows
    truncated = snapshot_view._replay(0, snapshot["device_traces"][0][4:], [])
    # The ring buffer lost the first four events: the frees of P, A1 and A2 make them alive
    # from the start (with the stack of their free); P's is the first event left.
    assert truncated.initial == P + A1 + A2
    assert truncated.peak == A1 + A2 + G
    assert [(a.size, a.origin, a.user_frame.name) for a in truncated.at_peak] == [
        (G, RECORDED, "step"),
        (A2, BEFORE_FREED, "free_site"),
        (A1, BEFORE_FREED, "free_site"),
    ]


def test_an_older_torch_snapshot_gives_the_same_figures():
    snapshot, _ = scripted_snapshot()
    (newer, _) = device_histories(snapshot)
    (older,) = device_histories(as_older_torch(snapshot))
    assert (older.peak, older.initial, older.allocated) == (newer.peak, newer.initial, newer.allocated)
    assert [a.size for a in older.at_peak] == [a.size for a in newer.at_peak]
    assert older.peak_time_us is None
    assert str(older.at_peak[0].user_frame) == f"{TRAIN}:20 in ?"
    assert "at event" in render_snapshot_view(as_older_torch(snapshot))


def test_a_snapshot_without_history_shows_the_blocks_alive():
    snapshot, _ = scripted_snapshot()
    snapshot["device_traces"] = [[], []]
    first, second = device_histories(snapshot)
    assert first.events == 0 and first.allocated == (W1 + W2 + G,) and first.peak == W1 + W2 + G
    assert second.peak == 777
    assert "No history was recorded" in render_snapshot_view(snapshot)
    assert device_histories({"segments": [], "device_traces": [[], []]}) == []
    assert device_histories([]) == []  # the oldest format: segments only


def test_not_a_snapshot_is_refused_naming_the_argument(tmp_path):
    with pytest.raises(ValueError, match="not a memory snapshot"):
        device_histories({"rows": []})
    with pytest.raises(ValueError, match="html_path is needed"):
        write_snapshot_view({"segments": []})
    with pytest.raises(TypeError, match="snapshot must be a snapshot dict or a path, got int"):
        write_snapshot_view(3, tmp_path / "x.html")
    with pytest.raises(ValueError, match="unit must be one of"):
        render_snapshot_view({"segments": []}, unit="MBytes")
    with pytest.raises(ValueError, match="top must be an integer >= 1, got 0"):
        render_snapshot_view({"segments": []}, top=0)


def test_load_snapshot_refuses_pickles_that_hold_code(tmp_path):
    evil = tmp_path / "evil.pickle"
    evil.write_bytes(pickle.dumps({"segments": [], "device_traces": [[]], "x": os.system}))
    with pytest.raises(ValueError, match=r"evil\.pickle.*refusing to load (posix|os|nt)\.system"):
        load_snapshot(evil)
    junk = tmp_path / "junk.pickle"
    junk.write_bytes(b"not a pickle")
    with pytest.raises(ValueError, match="junk.pickle' is not a pickled memory snapshot"):
        load_snapshot(junk)
    snapshot, _ = scripted_snapshot()
    good = tmp_path / "good.pickle"
    good.write_bytes(pickle.dumps(snapshot, protocol=4))
    assert load_snapshot(good) == snapshot


def test_a_long_trace_is_drawn_with_its_peak():
    # 60,000 events: drawn as per-pixel low and high, the single-event peak still on the line.
    trace, address = [], 0
    for i in range(30_000):
        size = 1_000 + (i % 7) * 512 + (5_000_000 if i == 12_345 else 0)
        trace.append({"action": "alloc", "addr": address, "size": size, "frames": []})
        trace.append({"action": "free_completed", "addr": address, "size": size, "frames": []})
        address += 4096
    (history,) = device_histories({"segments": [], "device_traces": [trace]})
    assert history.peak == 5_000_000 + 1_000 + (12_345 % 7) * 512
    svg = snapshot_view._chart(history, "MiB")
    points = re.search(r'<polyline class="series" points="([^"]+)"', svg).group(1).split()
    assert len(points) < 4 * 870  # bounded by the plot's width, not the trace's length
    ys = [float(p.split(",")[1]) for p in points]
    top = snapshot_view._nice_ceiling(history.peak / MIB) * MIB
    plot_h = snapshot_view._CHART_HEIGHT - snapshot_view._MARGIN_TOP - snapshot_view._MARGIN_BOTTOM
    assert min(ys) == pytest.approx(snapshot_view._MARGIN_TOP + plot_h * (1 - history.peak / top), abs=0.06)


# -- the page ---------------------------------------------------------------------------------------
class Page(HTMLParser):
    """Elements with their attributes, text by element id, and rows of each table."""

    def __init__(self, text: str) -> None:
        super().__init__(convert_charrefs=True)
        self.elements: list[tuple[str, dict]] = []
        self.text_by_id: dict[str, str] = {}
        self.tables: dict[str, list[tuple[dict, list[str]]]] = {}
        self.styles: list[str] = []
        self._open_ids: list[tuple[str, str, int]] = []
        self._chunks: list[str] = []
        self._table = None
        self._cell: list[str] | None = None
        self._in_style = False
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.elements.append((tag, attrs))
        if "id" in attrs:
            self._open_ids.append((tag, attrs["id"], len(self._chunks)))
        if tag == "table":
            self._table = attrs.get("id")
            self.tables[self._table] = []
        elif tag == "tr" and self._table is not None:
            self.tables[self._table].append((attrs, []))
        elif tag in ("td", "th"):
            self._cell = []
        elif tag == "style":
            self._in_style = True

    def handle_endtag(self, tag):
        if tag in ("td", "th") and self._cell is not None and self._table is not None:
            self.tables[self._table][-1][1].append("".join(self._cell).strip())
            self._cell = None
        elif tag == "table":
            self._table = None
        elif tag == "style":
            self._in_style = False
        if self._open_ids and self._open_ids[-1][0] == tag:
            _, element_id, start = self._open_ids.pop()
            self.text_by_id[element_id] = "".join(self._chunks[start:])

    def handle_data(self, data):
        self._chunks.append(data)
        if self._cell is not None:
            self._cell.append(data)
        if self._in_style:
            self.styles.append(data)


def external_references(text: str) -> list[str]:
    """Everything in the page that a browser could fetch: src, href, srcset, xlink:href,
    url(...) in style, @import; and any ``scheme://`` anywhere in the text."""
    page = Page(text)
    found = []
    for _, attrs in page.elements:
        for name in ("src", "href", "xlink:href", "srcset", "action", "data", "poster"):
            value = attrs.get(name)
            if value is not None and not value.startswith("#") and not value.startswith("data:"):
                found.append(f"{name}={value}")
        found += re.findall(r"url\(([^)]*)\)", attrs.get("style") or "")
    css = "".join(page.styles)
    found += re.findall(r"url\(([^)]*)\)", css) + re.findall(r"@import[^;]*", css)
    found += re.findall(r"[a-z][a-z0-9+.-]*://[^\s\"'<>]*", text)
    return found


@pytest.fixture
def scripted_page(tmp_path):
    snapshot, addr = scripted_snapshot()
    path = write_snapshot_view(snapshot, tmp_path / "memory_view.html", unit="MB", top=3)
    return path, snapshot, addr


def test_the_page_shows_the_peak_and_the_allocations_at_it(scripted_page):
    path, _, addr = scripted_page
    text = path.read_text(encoding="utf-8")
    page = Page(text)
    peak = next(attrs for tag, attrs in page.elements if attrs.get("id") == "peak-0")
    assert int(peak["data-bytes"]) == PEAK
    assert page.text_by_id["peak-0"] == format_amount(PEAK, "MB", digits=3) == "10.5 MB"
    rows = page.tables["allocations-0"]
    header, listed, rest = rows[0][1], rows[1:4], rows[4]
    assert header[:4] == ["#", "requested", "bytes", "in 512-byte blocks"]
    assert [int(attrs["data-bytes"]) for attrs, _ in listed] == [size for size, _ in AT_PEAK[:3]]
    assert [int(attrs["data-address"]) for attrs, _ in listed] == [addr["g"], addr["w1"], addr["a2"]]
    assert [cells[2] for _, cells in listed] == [f"{G:,}", f"{W1:,}", f"{A2:,}"]
    assert [cells[3] for _, cells in listed] == [f"{allocator_rounded(n):,}" for n in (G, W1, A2)]
    assert listed[0][1][5].startswith(f"{TRAIN}:20 in step")  # the user's line, then the stack
    assert f"{LINEAR}:125 in forward" in listed[0][1][5]
    assert listed[1][1][4] == BEFORE_ALIVE and listed[1][1][5] == "no stack recorded"
    assert rest[1][2] == f"{A1 + W2:,}" and rest[1][4] == "2 more allocations"
    assert [cells for _, cells in page.tables["oom-table-0"][1:]] == [[f"{len(scripted_snapshot()[0]['device_traces'][0]) - 1}", f"{OOM_ASK:,}", "123,456"]]
    assert int(next(a for _, a in page.elements if a.get("id") == "peak-1")["data-bytes"]) == 777
    # one chart per device, with the peak marked
    assert [a["id"] for t, a in page.elements if t == "svg"] == ["chart-0", "chart-1"]
    assert "peak 10.5 MB" in page.text_by_id["chart-0"]


def test_the_page_loads_nothing(scripted_page):
    text = scripted_page[0].read_text(encoding="utf-8")
    assert external_references(text) == []
    assert "<script" not in text.lower()
    meta = [a for t, a in Page(text).elements if t == "meta" and a.get("http-equiv") == "Content-Security-Policy"]
    assert [m["content"] for m in meta] == [CONTENT_SECURITY_POLICY]
    assert "default-src 'none'" in CONTENT_SECURITY_POLICY
    # the check finds references where there are some
    assert external_references('<img src="https://x.example/a.png"><p style="background:url(b.png)">') == [
        "src=https://x.example/a.png",
        "b.png",
        "https://x.example/a.png",
    ]


def test_frames_and_file_names_are_escaped(tmp_path):
    frames = [{"filename": "/tmp/<b>evil</b>.py", "line": 1, "name": "f&g"}]
    snapshot = {"segments": [], "device_traces": [[{"action": "alloc", "addr": 1, "size": 2048, "frames": frames}]]}
    text = render_snapshot_view(snapshot)
    assert "<b>evil" not in text and "/tmp/&lt;b&gt;evil&lt;/b&gt;.py:1 in f&amp;g" in text
    assert Page(text).tables["allocations-0"][1][1][5].startswith("/tmp/<b>evil</b>.py:1 in f&g")


# -- in a browser, without a network ----------------------------------------------------------------
def chromium(url: str, profile: Path, *extra: str) -> subprocess.CompletedProcess:
    """Headless Chromium with every network request failing: names resolve to nothing and
    the only proxy is a closed port."""
    return subprocess.run(
        [
            CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
            "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={profile}",
            "--host-resolver-rules=MAP * ~NOTFOUND", "--proxy-server=127.0.0.1:9",
            "--enable-logging=stderr", "--v=0", "--virtual-time-budget=5000", *extra, url,
        ],
        capture_output=True, text=True, timeout=120,
    )


def console(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if ":CONSOLE" in line]


needs_chromium = pytest.mark.skipif(
    not os.path.exists(CHROMIUM), reason="needs Chromium (Debian package 'chromium') at /usr/bin/chromium"
)


@needs_chromium
def test_chromium_offline_shows_the_peak_and_draws_the_chart(scripted_page, tmp_path):
    path = scripted_page[0]
    result = chromium(path.as_uri(), tmp_path / "profile-1", "--dump-dom")
    assert result.returncode == 0, result.stderr[-2000:]
    assert console(result.stderr) == []
    dom = Page(result.stdout)
    assert dom.text_by_id["peak-0"] == "10.5 MB"
    assert len(dom.tables["allocations-0"]) == 1 + 3 + 1

    # What the browser laid out: the policy is widened for one probe script only, which
    # writes the drawn sizes of the chart's line and its peak dot into the body.
    text = path.read_text(encoding="utf-8")
    probe = (
        "<script>window.addEventListener('load', () => { const s = document.querySelector('#chart-0 "
        ".series').getBBox(); const p = document.querySelector('#chart-0 .peak').getBBox(); "
        "document.body.setAttribute('data-drawn', [s.width, s.height, p.x + p.width / 2, p.y + p.height / 2]"
        ".map(v => v.toFixed(1)).join(',')); });</script></body>"
    )
    probed = tmp_path / "probed.html"
    probed.write_text(
        text.replace(CONTENT_SECURITY_POLICY, CONTENT_SECURITY_POLICY + "; script-src 'unsafe-inline'")
        .replace("</body>", probe),
        encoding="utf-8",
    )
    result = chromium(probed.as_uri(), tmp_path / "profile-2", "--dump-dom")
    assert result.returncode == 0 and console(result.stderr) == []
    body = next(attrs for tag, attrs in Page(result.stdout).elements if tag == "body")
    width, height, cx, cy = map(float, body["data-drawn"].split(","))
    circle = re.search(r'<circle class="peak" cx="([\d.]+)" cy="([\d.]+)"', text)
    assert (cx, cy) == pytest.approx((float(circle.group(1)), float(circle.group(2))), abs=0.11)
    # The line spans the plot's width, and its height from the lowest figure to the peak.
    plot_w = snapshot_view._CHART_WIDTH - snapshot_view._MARGIN_LEFT - snapshot_view._MARGIN_RIGHT
    plot_h = snapshot_view._CHART_HEIGHT - snapshot_view._MARGIN_TOP - snapshot_view._MARGIN_BOTTOM
    top = snapshot_view._nice_ceiling(PEAK / 1e6) * 1e6
    lowest = min(device_histories(scripted_page[1])[0].allocated)
    assert width == pytest.approx(plot_w, abs=0.11)
    assert abs(height - plot_h * (PEAK - lowest) / top) <= 1


@needs_chromium
def test_chromium_screenshot_has_the_line_and_the_peak_dot(scripted_page, tmp_path):
    image_module = pytest.importorskip("PIL.Image", reason="the pixel check needs Pillow")
    shot = tmp_path / "shot.png"
    result = chromium(
        scripted_page[0].as_uri(), tmp_path / "profile", f"--screenshot={shot}", "--window-size=1200,900",
        "--hide-scrollbars",
    )
    assert result.returncode == 0 and shot.is_file(), result.stderr[-2000:]
    image = image_module.open(shot).convert("RGB")
    pixels = [image.getpixel((x, y)) for y in range(image.height) for x in range(image.width)]
    blue = sum(1 for r, g, b in pixels if (r, g, b) == (0x1F, 0x77, 0xB4))
    red = sum(1 for r, g, b in pixels if (r, g, b) == (0xD6, 0x27, 0x28))
    assert blue > 300, "the memory line is not drawn"
    assert red > 20, "the peak dot is not drawn"


@needs_chromium
def test_torchs_trace_plot_is_blank_without_a_network(tmp_path):
    """What the README says of trace_plot.html: its script comes from a CDN, so offline the
    page stays empty (the view above, under the same browser, shows everything)."""
    snapshot, _ = scripted_snapshot()
    written = snapshot_module.write_snapshot_files(snapshot, tmp_path, memory_view=False)
    text = written["trace_plot"].read_text(encoding="utf-8")
    assert re.search(r'from "https://cdn\.jsdelivr\.net/[^"]*MemoryViz\.js"', text)
    result = chromium(written["trace_plot"].as_uri(), tmp_path / "profile", "--dump-dom")
    body = re.search(r"<body>(.*)</body>", result.stdout, re.S).group(1)
    assert result.returncode == 0, result.stderr[-2000:]
    # Nothing but the script that could not load its module: MemoryViz draws into the body.
    assert re.sub(r"<script.*?</script>", "", body, flags=re.S).strip() == ""


# -- pickle protocol ---------------------------------------------------------------------------------
def protocol_of(data: bytes) -> int:
    assert data[:1] == b"\x80", "not a protocol 2+ pickle"
    return data[1]


def test_snapshot_files_are_pickled_with_protocol_4(tmp_path):
    snapshot, _ = scripted_snapshot()
    written = snapshot_module.write_snapshot_files(snapshot, tmp_path, segment_plot=True)
    assert snapshot_module.SNAPSHOT_PICKLE_PROTOCOL == 4
    assert protocol_of(written["snapshot"].read_bytes()) == 4
    for key in ("trace_plot", "segment_plot"):
        match = re.search(r'"base64": "([A-Za-z0-9+/=]+)"', written[key].read_text())
        embedded = base64.b64decode(match.group(1))
        assert protocol_of(embedded) <= 4
        assert pickle.loads(embedded) == snapshot


def test_torchs_page_gets_protocol_4_where_torch_pickles_with_5(tmp_path, monkeypatch):
    # Python 3.14's default protocol is 5: torch's page then embeds a pickle MemoryViz cannot
    # read. Played here by making torch's pickling use 5.
    from torch.cuda import _memory_viz

    shim = types.SimpleNamespace(dumps=lambda data: pickle.dumps(data, protocol=5))
    monkeypatch.setattr(_memory_viz, "pickle", shim)
    snapshot, _ = scripted_snapshot()
    plain = _memory_viz.trace_plot(snapshot)
    raw = base64.b64decode(re.search(r'"base64": "([A-Za-z0-9+/=]+)"', plain).group(1))
    assert protocol_of(raw) == 5  # the play works
    written = snapshot_module.write_snapshot_files(snapshot, tmp_path)
    page = written["trace_plot"].read_text()
    embedded = base64.b64decode(re.search(r'"base64": "([A-Za-z0-9+/=]+)"', page).group(1))
    assert protocol_of(embedded) == 4 and pickle.loads(embedded) == snapshot
    assert len(embedded) % 3 == 0  # padded as torch pads, so base64 has no '=' MemoryViz would misread
    assert page.replace(re.search(r'"base64": "([^"]+)"', page).group(1), "") == plain.replace(
        re.search(r'"base64": "([^"]+)"', plain).group(1), ""
    )


def test_oom_postmortem_snapshot_is_protocol_4(tmp_path, monkeypatch):
    from pytorch_mem_profiler.tools import oom as oom_module

    snapshot, _ = scripted_snapshot()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(oom_module, "_attach_observer", lambda: True)
    monkeypatch.setattr(oom_module, "_handles", [])
    monkeypatch.setattr(oom_module, "history_recording", lambda: True)
    monkeypatch.setattr(oom_module, "take_snapshot", lambda: snapshot)
    with oom_module.dump_on_oom(tmp_path) as handle:
        folder = handle._on_oom(0, 2**31, 2**30, 0)
    (written,) = folder.glob("snapshot*.pickle")
    assert protocol_of(written.read_bytes()) == 4 and pickle.loads(written.read_bytes()) == snapshot


# -- from a shell -------------------------------------------------------------------------------------
def test_command_line_writes_the_view_without_importing_torch(tmp_path):
    snapshot, _ = scripted_snapshot()
    pickled = tmp_path / "run.pickle"
    pickled.write_bytes(pickle.dumps(snapshot, protocol=4))
    code = (
        "import sys\n"
        "from pytorch_mem_profiler.tools.snapshot_view import main\n"
        f"status = main([{str(pickled)!r}, '--units', 'B'])\n"
        "print('TORCH' if 'torch' in sys.modules else 'NO TORCH', status)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [f"wrote {tmp_path / 'run.html'}", "NO TORCH 0"]
    page = Page((tmp_path / "run.html").read_text(encoding="utf-8"))
    assert page.text_by_id["peak-0"] == format_amount(PEAK, "B", digits=3)

    done = subprocess.run(
        [sys.executable, "-m", "pytorch_mem_profiler.tools.snapshot_view", str(tmp_path / "none.pickle")],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
    )
    assert done.returncode == 2 and "none.pickle" in done.stderr and done.stderr.count("\n") == 1


def test_main_writes_where_asked(tmp_path, capsys):
    snapshot, _ = scripted_snapshot()
    pickled = tmp_path / "s.pickle"
    pickled.write_bytes(pickle.dumps(snapshot, protocol=4))
    assert snapshot_view.main([str(pickled), "-o", str(tmp_path / "out.html"), "--top", "1"]) == 0
    rows = Page((tmp_path / "out.html").read_text()).tables["allocations-0"]
    assert len(rows) == 1 + 1 + 1 and rows[2][1][4] == "4 more allocations"
    assert capsys.readouterr().out == f"wrote {tmp_path / 'out.html'}\n"
