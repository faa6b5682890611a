"""On a CUDA GPU: snapshots, block usage, memory_stats and OOM post-mortems against the real allocator.

Run with ``PYTHONPATH=. python3 -m pytest -m cuda -q``. The OOM tests shrink
this process's memory fraction to what it holds plus 1 GiB and ask for 2 GiB:
the allocator refuses before calling cudaMalloc, so the shared GPU is never
exhausted; the fraction is restored afterwards.
"""

from __future__ import annotations

import base64
import contextlib
import gc
import inspect
import io
import json
import pickle
import re
import socket
from html.parser import HTMLParser

import pytest
import torch

from pytorch_mem_profiler import (
    export_memory_snapshot,
    dump_on_oom,
    memory_profiler,
    memory_stats,
    memory_usage,
    print_cuda_memory_usage,
    save_memory_snapshot,
    start_record_memory_history,
    stop_record_memory_history,
)
from pytorch_mem_profiler.tools import oom as oom_module
from pytorch_mem_profiler.tools.snapshot_view import RECORDED, allocator_rounded, device_histories, load_snapshot

pytestmark = pytest.mark.cuda

MIB = 2**20
GIB = 2**30


def history_on() -> bool:
    return bool(torch._C._cuda_isHistoryEnabled())


@pytest.fixture(autouse=True)
def no_recording_left_over():
    torch.cuda.memory._record_memory_history(enabled=None)
    yield
    torch.cuda.memory._record_memory_history(enabled=None)


def embedded_snapshot(html: str) -> dict:
    match = re.search(r'"base64": "([A-Za-z0-9+/=]+)"', html)
    assert match, "no embedded snapshot in the HTML"
    return pickle.loads(base64.b64decode(match.group(1)))


def traces(snapshot: dict, device: int) -> list[dict]:
    return snapshot["device_traces"][device]


def alloc_events(snapshot: dict, tensor: torch.Tensor) -> list[dict]:
    return [
        e
        for e in traces(snapshot, tensor.device.index)
        if e["action"] == "alloc" and e["addr"] == tensor.data_ptr()
    ]


def live_block(snapshot: dict, tensor: torch.Tensor) -> dict | None:
    """The allocator's block at the tensor's address (block addresses follow from segment offsets)."""
    for segment in snapshot["segments"]:
        address = segment["address"]
        for block in segment["blocks"]:
            if address == tensor.data_ptr() and block["state"] == "active_allocated":
                return block
            address += block["size"]
    return None


def cuda_bytes(n: int) -> torch.Tensor:
    return torch.empty(n, dtype=torch.uint8, device="cuda")


@contextlib.contextmanager
def memory_limit(extra: int):
    """Limit this process to the memory it reserves now plus ``extra`` bytes; yields the limit."""
    torch.cuda.empty_cache()
    device = torch.cuda.current_device()
    total = torch.cuda.mem_get_info(device)[1]  # the total the allocator's fraction is taken of
    getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    old = float(getter(device)) if getter is not None else 1.0
    fraction = min(1.0, (torch.cuda.memory_reserved(device) + extra) / total)
    torch.cuda.set_per_process_memory_fraction(fraction, device)
    try:
        yield int(fraction * total)
    finally:
        torch.cuda.set_per_process_memory_fraction(old, device)


# -- snapshots ---------------------------------------------------------------------------
def test_snapshot_files_hold_the_blocks_allocations(tmp_path):
    assert not history_on()
    with save_memory_snapshot(tmp_path / "snap", segment_plot=True) as snap:
        assert history_on()
        x = cuda_bytes(6 * MIB + 3 * 512)
    assert not history_on(), "recording was left on"
    assert snap.recorded and snap.owns_recording
    assert sorted(p.name for p in snap.folder.iterdir()) == [
        "memory_view.html",
        "segment_plot.html",
        "snapshot.pickle",
        "trace_plot.html",
    ]
    assert snap.snapshot_path.read_bytes()[:2] == b"\x80\x04"  # pickle protocol 4
    data = pickle.loads(snap.snapshot_path.read_bytes())
    events = alloc_events(data, x)
    assert events, "the block's allocation is not in the recorded history"
    assert events[-1]["size"] >= x.numel()
    frames = events[-1]["frames"]
    assert any(f["filename"].endswith("test_snapshot_cuda.py") for f in frames), "no Python stack"
    block = live_block(data, x)
    assert block is not None and block["requested_size"] == x.numel()
    for html_path in (snap.trace_plot_path, snap.segment_plot_path):
        embedded = embedded_snapshot(html_path.read_text())
        assert embedded["device_traces"] == data["device_traces"]


def test_nested_snapshot_leaves_the_outer_recording_running(tmp_path):
    with save_memory_snapshot(tmp_path / "outer") as outer:
        a = cuda_bytes(2 * MIB)
        with save_memory_snapshot(tmp_path / "inner") as inner:
            b = cuda_bytes(3 * MIB)
        assert history_on(), "the inner snapshot stopped the outer recording"
        c = cuda_bytes(4 * MIB)
    assert not history_on()
    assert outer.owns_recording and not inner.owns_recording
    inner_data = pickle.loads(inner.snapshot_path.read_bytes())
    outer_data = pickle.loads(outer.snapshot_path.read_bytes())
    assert alloc_events(inner_data, a) and alloc_events(inner_data, b)
    assert alloc_events(outer_data, a) and alloc_events(outer_data, b) and alloc_events(outer_data, c)


def test_snapshot_is_written_when_the_block_raises(tmp_path):
    with pytest.raises(RuntimeError, match="step failed"):
        with save_memory_snapshot(tmp_path) as snap:
            x = cuda_bytes(5 * MIB)
            raise RuntimeError("step failed")
    assert not history_on()
    assert alloc_events(pickle.loads(snap.snapshot_path.read_bytes()), x)
    assert snap.trace_plot_path.is_file()


def test_record_export_stop_functions(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    start_record_memory_history(max_entries=10_000)
    try:
        assert history_on()
        x = cuda_bytes(2 * MIB)
        with save_memory_snapshot(tmp_path / "inside") as snap:
            y = cuda_bytes(3 * MIB)
        assert history_on() and not snap.owns_recording
        path = export_memory_snapshot()
    finally:
        stop_record_memory_history()
    assert not history_on()
    assert path.parent == tmp_path and path.suffix == ".pickle"
    assert path.name.startswith(socket.gethostname() + "_")
    assert path.read_bytes()[:2] == b"\x80\x04"  # pickle protocol 4
    data = pickle.loads(path.read_bytes())
    assert alloc_events(data, x) and alloc_events(data, y)


class _Attributes(HTMLParser):
    """The attributes of every element with an id, and the data-bytes of table rows."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.by_id: dict[str, dict] = {}
        self.rows: dict[str, list[int]] = {}
        self._table = None
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if "id" in attrs:
            self.by_id[attrs["id"]] = attrs
        if tag == "table":
            self._table = attrs.get("id")
            self.rows[self._table] = []
        if tag == "tr" and "data-bytes" in attrs:
            self.rows[self._table].append(int(attrs["data-bytes"]))


def test_memory_view_shows_the_peak_and_the_tensors_alive_at_it(tmp_path):
    """The offline view's peak and largest allocations against tensors made here.

    Sizes are the bytes each tensor asked for; the view counts what was alive before
    the recording as the allocator's blocks say (their requested sizes), measured here
    before the block starts."""
    gc.collect()
    torch.cuda.synchronize()
    device = torch.cuda.current_device()
    before = sum(
        block["requested_size"]
        for segment in torch.cuda.memory._snapshot()["segments"]
        if segment.get("device", device) == device
        for block in segment["blocks"]
        if block["state"] == "active_allocated"
    )
    big_n, mid_n, small_n = 6 * MIB + 3 * 512 + 100, 2 * MIB + 1, 300_001
    with save_memory_snapshot(tmp_path / "snap") as snap:
        mid = cuda_bytes(mid_n)
        small = cuda_bytes(small_n)
        big, big_line = torch.empty(big_n, dtype=torch.uint8, device="cuda"), inspect.currentframe().f_lineno
        del mid  # the peak is behind: a smaller tensor follows
        later = cuda_bytes(MIB)
    assert snap.memory_view_path.is_file()
    data = load_snapshot(snap.snapshot_path)
    (history,) = [h for h in device_histories(data) if h.device == device]
    assert history.initial == before
    assert history.peak == before + mid_n + small_n + big_n
    assert history.allocated[-1] == before + small_n + big_n + MIB
    # Largest first; what the test made, among what was alive before it (other tests' leftovers).
    assert [a.size for a in history.at_peak] == sorted((a.size for a in history.at_peak), reverse=True)
    recorded = [a for a in history.at_peak if a.origin == RECORDED]
    assert [a.size for a in recorded] == [big_n, mid_n, small_n]
    largest = recorded[0]
    assert largest.address == big.data_ptr()
    assert largest.rounded_size == allocator_rounded(big_n) == 6 * MIB + 4 * 512
    frame = largest.user_frame
    assert (frame.filename.rsplit("/", 1)[-1], frame.line, frame.name) == (
        "test_snapshot_cuda.py", big_line, "test_memory_view_shows_the_peak_and_the_tensors_alive_at_it"
    )
    # The allocator's own block for the small tensor (the small pool always splits) is the
    # view's rounding of its request.
    assert live_block(data, small)["size"] == allocator_rounded(small_n) == 300_032
    page = _Attributes(snap.memory_view_path.read_text(encoding="utf-8"))
    assert int(page.by_id[f"peak-{device}"]["data-bytes"]) == history.peak
    # The table is the view's top rows of what was alive at the peak, largest first; other tests'
    # leftovers (a failed or xfailed test's traceback keeps its frames' tensors) may push this
    # test's tensors below them, so where they stand is read from the history.
    rows = page.rows[f"allocations-{device}"]
    sizes = [a.size for a in history.at_peak]
    assert rows and rows == sizes[: len(rows)]
    assert (big_n in rows) == (sizes.index(big_n) < len(rows))
    if history.initial == 0:
        assert big_n in rows
    if big_n in rows:  # its row names the line that made it
        assert f"test_snapshot_cuda.py:{big_line} in test_memory_view" in snap.memory_view_path.read_text(encoding="utf-8")
    del later


# -- block usage and memory_stats ----------------------------------------------------------
def test_block_usage_equals_the_allocator_delta(stream):
    older = cuda_bytes(MIB)
    before = torch.cuda.memory_allocated()
    with memory_usage("blk", stream=stream) as usage:
        kept = cuda_bytes(5 * MIB + 512)
        temp = cuda_bytes(20 * MIB)
        at_peak = torch.cuda.memory_allocated()
        del temp
        del older  # made before the block: its free shows on CUDA
    after = torch.cuda.memory_allocated()
    assert usage.device == torch.device("cuda", torch.cuda.current_device())
    assert usage.allocated_before == before
    assert usage.added == after - before
    assert usage.peak_above_start == at_peak - before
    assert stream.getvalue() == (
        f"CUDA memory usage [blk]: {(after - before) / 1e9:.2f} GB "
        f"(peak {(at_peak - before) / 1e9:.2f} GB above start)\n"
    )
    assert kept.numel() == 5 * MIB + 512


def test_print_cuda_memory_usage_prints_gb_with_two_decimals(stream):
    before = torch.cuda.memory_allocated()
    with print_cuda_memory_usage(stream=stream) as usage:
        x = cuda_bytes(370_000_000)
    assert usage.added == torch.cuda.memory_allocated() - before
    assert stream.getvalue().startswith("CUDA memory usage: 0.37 GB (peak 0.37 GB above start)")
    del x


def test_an_inner_block_keeps_the_outer_peak(stream):
    before = torch.cuda.memory_allocated()
    with memory_usage("outer", stream=stream) as outer:
        big = cuda_bytes(64 * MIB)
        at_peak = torch.cuda.memory_allocated()
        del big
        inner_before = torch.cuda.memory_allocated()
        with memory_usage("inner", stream=stream) as inner:
            small = cuda_bytes(MIB)
        inner_after = torch.cuda.memory_allocated()
        # The inner block reset the device's peak: only the fold keeps the outer one.
        assert torch.cuda.max_memory_allocated() < at_peak
    assert inner.added == inner.peak_above_start == inner_after - inner_before
    assert outer.peak_above_start == at_peak - before
    assert outer.added == torch.cuda.memory_allocated() - before
    assert stream.getvalue().splitlines()[0].startswith("  CUDA memory usage [inner]: ")
    del small


def test_inside_a_profiler_the_iteration_peaks_stay_right():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 1024)).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    batch = torch.randn(512, 1024, device="cuda")
    records = []
    with memory_profiler(model, 1, False, stream=io.StringIO(), strict=True) as profiler:
        for wrapped in (False, True, False, True):
            block = memory_usage("step", stream=io.StringIO()) if wrapped else contextlib.nullcontext()
            with block:
                model(batch).sum().backward()
            opt.step()
            opt.zero_grad()
            records.append(profiler.record_stats())
    plain, wrapped = records[2], records[3]
    assert wrapped.iteration_peak_allocated == plain.iteration_peak_allocated
    assert wrapped.phases["backward"].peak_allocated == plain.phases["backward"].peak_allocated
    assert wrapped.feature_maps == plain.feature_maps > 0


def test_memory_stats_match_the_allocator():
    x = cuda_bytes(3 * MIB)
    stats = memory_stats()
    assert stats == {
        "allocated_gb": torch.cuda.memory_allocated() / 1e9,
        "reserved_gb": torch.cuda.memory_reserved() / 1e9,
        "peak_allocated_gb": torch.cuda.max_memory_allocated() / 1e9,
    }
    assert stats["allocated_gb"] >= x.numel() / 1e9


# -- OOM post-mortems ---------------------------------------------------------------------
def test_an_oom_writes_exactly_one_postmortem(tmp_path):
    with dump_on_oom(tmp_path / "oom") as handle:
        assert handle.active
        with memory_limit(GIB) as limit:
            with pytest.raises(torch.cuda.OutOfMemoryError):
                cuda_bytes(2 * GIB)
    assert handle not in oom_module._handles
    folders = list((tmp_path / "oom").iterdir())
    assert len(folders) == 1 and handle.dumps == folders
    folder = folders[0]
    assert sorted(p.name for p in folder.iterdir()) == [
        "allocator_stats.json",
        "memory_summary.txt",
        "oom.json",
    ]
    event = json.loads((folder / "oom.json").read_text())
    assert event["requested_bytes"] == 2 * GIB
    # The fraction's limit, not the device's total (torch takes the fraction of
    # cudaMemGetInfo's total in some versions, of totalGlobalMem in others).
    assert abs(event["device_limit_bytes"] - limit) <= 0.01 * limit
    assert event["device"] == f"cuda:{torch.cuda.current_device()}"
    assert event["history_recorded"] is False and event["errors"] == []
    stats = json.loads((folder / "allocator_stats.json").read_text())
    assert stats["num_ooms"] >= 1
    assert "CUDA OOMs" in (folder / "memory_summary.txt").read_text()


class AsksTooMuch(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(64, 64)
        self.ask = 0

    def forward(self, x):
        if self.ask:
            torch.empty(self.ask, dtype=torch.uint8, device=x.device)
        return self.fc(x)


def test_profiler_oom_dir_with_history_and_report(tmp_path):
    model = AsksTooMuch().cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    profiler = memory_profiler(model, 1, False, oom_dir=tmp_path / "oom", stream=io.StringIO())
    handle = profiler.oom_postmortem
    try:
        assert handle.active
        with save_memory_snapshot(tmp_path / "snap"):
            model(torch.randn(8, 64, device="cuda")).sum().backward()
            opt.step()
            opt.zero_grad()
            profiler.record_stats()
            model.ask = 2 * GIB
            with memory_limit(GIB):
                with pytest.raises(torch.cuda.OutOfMemoryError):
                    model(torch.randn(8, 64, device="cuda"))
    finally:
        profiler.close()
    assert handle not in oom_module._handles, "close() left the post-mortem attached"
    (folder,) = list((tmp_path / "oom").iterdir())
    assert sorted(p.name for p in folder.iterdir()) == [
        "allocator_stats.json",
        "memory_summary.txt",
        "oom.json",
        "record.json",
        "report.txt",
        "snapshot.pickle",
    ]
    report = (folder / "report.txt").read_text()
    assert report == profiler.last_report and "Memory Usage for Iteration 1 of Epoch 1" in report
    record = json.loads((folder / "record.json").read_text())
    assert (record["epoch"], record["iteration"], record["phase"]) == (1, 2, "forward")
    assert record["last_record"]["weights"] == (64 * 64 + 64) * 4
    assert (folder / "snapshot.pickle").read_bytes()[:2] == b"\x80\x04"  # pickle protocol 4
    snapshot = pickle.loads((folder / "snapshot.pickle").read_bytes())
    device = torch.cuda.current_device()
    ooms = [e for e in traces(snapshot, device) if e["action"] == "oom"]
    assert ooms and ooms[-1]["size"] >= 2 * GIB
    assert json.loads((folder / "oom.json").read_text())["history_recorded"] is True
