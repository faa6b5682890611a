"""save_memory_snapshot and the record/export/stop functions, on any machine.

The allocator's history needs CUDA; here the recording logic (nesting,
exceptions, files) runs against a stand-in allocator that keeps the state
torch's would, and the no-CUDA paths run against torch itself. The GPU side
is in test_snapshot_cuda.py.
"""

from __future__ import annotations

import base64
import inspect
import json
import logging
import pickle
import re
import socket

import pytest
import torch

from pytorch_mem_profiler import (
    export_memory_snapshot,
    save_memory_snapshot,
    start_record_memory_history,
    stop_record_memory_history,
)
from pytorch_mem_profiler.tools import snapshot as snapshot_module


def embedded_snapshot(html: str) -> dict:
    """The snapshot that torch's _memory_viz embeds in its HTML page, unpickled."""
    match = re.search(r'"base64": "([A-Za-z0-9+/=]+)"', html)
    assert match, "no embedded snapshot in the HTML"
    return pickle.loads(base64.b64decode(match.group(1)))


class FakeHistory:
    """Stands in for the CUDA allocator's history API, keeping its on/off state."""

    def __init__(self, recording: bool = False, can_query: bool = True) -> None:
        self.recording = recording
        self.can_query = can_query
        self.calls: list[tuple] = []
        self.events = 0
        self.fail_snapshot = False

    def available(self) -> bool:
        return True

    def is_recording(self):
        return self.recording if self.can_query else None

    def start(self, *, max_entries, stacks):
        self.calls.append(("start", max_entries, stacks))
        self.recording = True

    def stop(self):
        self.calls.append(("stop",))
        self.recording = False

    def allocate(self, size: int) -> None:
        self.events += 1
        self.last_size = size

    def snapshot(self):
        if self.fail_snapshot:
            raise RuntimeError("snapshot failed")
        traces = [{"action": "alloc", "addr": 4096 * i, "size": 512, "frames": []} for i in range(self.events)]
        return {"segments": [], "device_traces": [traces if self.recording else []]}


@pytest.fixture
def fake(monkeypatch):
    history = FakeHistory()
    monkeypatch.setattr(snapshot_module, "_history", history)
    monkeypatch.setattr(snapshot_module, "_own_depth", 0)
    monkeypatch.setattr(snapshot_module, "_started_by_function", False)
    return history


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


# -- without CUDA ------------------------------------------------------------------
def test_without_cuda_one_warning_and_the_block_runs(tmp_path, no_cuda):
    ran = []
    with pytest.warns(UserWarning) as warned:
        with save_memory_snapshot(tmp_path / "snap") as snap:
            ran.append(torch.ones(4).sum().item())
    assert ran == [4.0]
    assert len(warned) == 1
    assert "CUDA is not available" in str(warned[0].message)
    assert "runs unprofiled" in str(warned[0].message)
    assert snap.recorded is False
    assert list((tmp_path / "snap").iterdir()) == []


def test_without_cuda_the_block_exception_propagates(tmp_path, no_cuda):
    with pytest.warns(UserWarning):
        with pytest.raises(KeyError, match="boom"):
            with save_memory_snapshot(tmp_path / "snap"):
                raise KeyError("boom")


def test_without_cuda_the_functions_only_log(tmp_path, monkeypatch, no_cuda, caplog):
    monkeypatch.chdir(tmp_path)
    caplog.set_level(logging.INFO, logger="pytorch_mem_profiler")
    start_record_memory_history(max_entries=1000)
    assert export_memory_snapshot() is None
    assert export_memory_snapshot(tmp_path / "named") is None
    stop_record_memory_history()
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 4
    assert all("CUDA is not available" in m for m in messages)
    assert list(tmp_path.iterdir()) == []


def test_cpu_build_calls_are_never_reached_without_cuda(tmp_path, no_cuda, monkeypatch):
    # On torch's CPU build these raise AttributeError; availability is checked first.
    def boom(*args, **kwargs):
        raise AssertionError("called the CUDA history API without CUDA")

    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", boom)
    monkeypatch.setattr(torch.cuda.memory, "_snapshot", boom)
    with pytest.warns(UserWarning):
        with save_memory_snapshot(tmp_path):
            pass
    start_record_memory_history()
    export_memory_snapshot(tmp_path / "x")
    stop_record_memory_history()
    assert snapshot_module.history_recording() is False


# -- arguments and paths -------------------------------------------------------------
def test_str_and_path_are_accepted_and_parents_created(tmp_path, fake):
    for folder in (tmp_path / "a" / "b", str(tmp_path / "c" / "d")):
        with save_memory_snapshot(folder) as snap:
            fake.allocate(512)
        assert snap.snapshot_path.is_file()
        assert snap.snapshot_path.parent == type(snap.folder)(folder)


def test_unwritable_path_fails_before_the_block_runs(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    ran = []
    with pytest.raises(ValueError, match=r"path=.*a_file.*cannot be created or written"):
        with save_memory_snapshot(blocker / "snap"):
            ran.append(1)
    assert ran == []


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"max_entries": 0}, ValueError, "max_entries must be an integer >= 1, got 0"),
        ({"max_entries": True}, ValueError, "max_entries"),
        ({"max_entries": 1.5}, ValueError, "max_entries"),
        ({"stacks": "cpp"}, ValueError, "stacks must be one of 'python', 'all'; got 'cpp'"),
        ({"segment_plot": "yes"}, TypeError, "segment_plot must be True or False"),
        ({"memory_view": 1}, TypeError, "memory_view must be True or False"),
    ],
)
def test_bad_arguments_name_themselves(tmp_path, kwargs, error, match):
    with pytest.raises(error, match=match):
        save_memory_snapshot(tmp_path, **kwargs)


def test_bad_path_type(tmp_path):
    with pytest.raises(TypeError, match="path must be a str or os.PathLike, got int"):
        save_memory_snapshot(3)
    with pytest.raises(TypeError, match="prefix must be a str or os.PathLike"):
        export_memory_snapshot(prefix=3.0)
    with pytest.raises(ValueError, match="max_entries"):
        start_record_memory_history(max_entries=-1)


def test_history_call_uses_keywords_this_torch_accepts():
    # The one call that differs between torch versions: its keywords must exist here.
    params = inspect.signature(torch.cuda.memory._record_memory_history).parameters
    for keyword in ("enabled", "context", "stacks", "max_entries"):
        assert keyword in params


# -- recording, with the stand-in allocator -----------------------------------------------
def test_writes_pickle_and_trace_plot_of_the_block(tmp_path, fake):
    with save_memory_snapshot(tmp_path / "snap", max_entries=5000, stacks="all") as snap:
        assert fake.recording
        fake.allocate(512)
        fake.allocate(512)
    assert fake.calls == [("start", 5000, "all"), ("stop",)]
    assert snap.recorded and snap.owns_recording
    data = pickle.loads(snap.snapshot_path.read_bytes())
    assert len(data["device_traces"][0]) == 2
    html = snap.trace_plot_path.read_text()
    assert embedded_snapshot(html) == data
    assert snap.segment_plot_path is None
    assert sorted(p.name for p in snap.folder.iterdir()) == ["memory_view.html", "snapshot.pickle", "trace_plot.html"]
    assert snap.snapshot_path.read_bytes()[:2] == b"\x80\x04"  # protocol 4: MemoryViz reads it
    view = snap.memory_view_path.read_text()
    assert f'id="peak-0" data-bytes="{2 * 512}"' in view  # the stand-in's two 512-byte blocks


def test_defaults_are_bounded_python_stacks(tmp_path, fake):
    with save_memory_snapshot(tmp_path):
        pass
    assert fake.calls[0] == ("start", 100_000, "python")


def test_segment_plot_on_request(tmp_path, fake):
    with save_memory_snapshot(tmp_path, segment_plot=True) as snap:
        fake.allocate(512)
    assert embedded_snapshot(snap.segment_plot_path.read_text())["device_traces"][0][0]["size"] == 512


def test_files_written_when_the_block_raises_then_it_reraises(tmp_path, fake):
    with pytest.raises(ZeroDivisionError):
        with save_memory_snapshot(tmp_path / "snap") as snap:
            fake.allocate(512)
            1 / 0
    assert not fake.recording
    assert len(pickle.loads(snap.snapshot_path.read_bytes())["device_traces"][0]) == 1
    assert snap.trace_plot_path.is_file()


@pytest.mark.parametrize("can_query", [True, False], ids=["asks-torch", "own-depth-count"])
def test_nested_recording_leaves_the_outer_one_running(tmp_path, fake, can_query):
    fake.can_query = can_query
    with save_memory_snapshot(tmp_path / "outer") as outer:
        fake.allocate(512)
        with save_memory_snapshot(tmp_path / "inner") as inner:
            fake.allocate(512)
        assert fake.recording, "the inner snapshot stopped the outer recording"
        fake.allocate(512)
    assert not fake.recording
    assert fake.calls == [("start", 100_000, "python"), ("stop",)]
    assert outer.owns_recording and not inner.owns_recording
    assert len(pickle.loads(inner.snapshot_path.read_bytes())["device_traces"][0]) == 2
    assert len(pickle.loads(outer.snapshot_path.read_bytes())["device_traces"][0]) == 3


def test_a_recording_started_by_the_user_keeps_running(tmp_path, fake):
    start_record_memory_history(max_entries=77)
    with save_memory_snapshot(tmp_path) as snap:
        fake.allocate(512)
    assert fake.recording
    assert not snap.owns_recording and snap.recorded
    stop_record_memory_history()
    assert fake.calls == [("start", 77, "python"), ("stop",)]


def test_snapshot_failure_is_logged_not_raised(tmp_path, fake, caplog):
    fake.fail_snapshot = True
    with save_memory_snapshot(tmp_path) as snap:
        pass
    assert not snap.recorded
    assert not fake.recording, "recording must stop even when the snapshot fails"
    assert "memory snapshot failed" in caplog.text
    fake.recording = False
    with pytest.raises(RuntimeError, match="snapshot failed"):
        with save_memory_snapshot(tmp_path, strict=True):
            pass
    assert not fake.recording


def test_record_export_stop(tmp_path, fake, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="pytorch_mem_profiler")
    monkeypatch.chdir(tmp_path)
    start_record_memory_history(max_entries=1234)
    fake.allocate(512)
    default = export_memory_snapshot()
    named = export_memory_snapshot(tmp_path / "runs" / "step_10")
    stop_record_memory_history()
    assert fake.calls == [("start", 1234, "python"), ("stop",)]
    assert default.parent == tmp_path
    assert default.name.startswith(socket.gethostname() + "_") and default.suffix == ".pickle"
    assert named == tmp_path / "runs" / "step_10.pickle"
    for path in (default, named):
        assert len(pickle.loads(path.read_bytes())["device_traces"][0]) == 1
        assert path.read_bytes()[:2] == b"\x80\x04"  # protocol 4: MemoryViz reads it
    again = export_memory_snapshot()
    assert again != default and again.is_file(), "a second export in the same second overwrote the first"
    text = caplog.text
    assert "starting to record CUDA memory history (max_entries=1234" in text
    assert f"saving the memory snapshot to {named}" in text
    assert "stopping the CUDA memory history recording" in text


def test_export_failure_is_logged_and_returns_none(tmp_path, fake, caplog):
    fake.fail_snapshot = True
    assert export_memory_snapshot(tmp_path / "x") is None
    assert "failed to export the memory snapshot" in caplog.text


def test_write_snapshot_files_takes_other_names(tmp_path):
    data = {"segments": [], "device_traces": [[{"action": "alloc", "addr": 1, "size": 512}]]}
    written = snapshot_module.write_snapshot_files(
        data, tmp_path, segment_plot=True, names={"snapshot": "s_rank1.pickle"}
    )
    assert written["snapshot"].name == "s_rank1.pickle"
    assert pickle.loads(written["snapshot"].read_bytes()) == data
    assert embedded_snapshot(written["segment_plot"].read_text()) == data
    assert json.loads(json.dumps(sorted(p.name for p in tmp_path.iterdir()))) == [
        "memory_view.html",
        "s_rank1.pickle",
        "segment_plot.html",
        "trace_plot.html",
    ]


def test_a_failure_to_start_recording_leaves_the_block_running(tmp_path, fake, caplog):
    def refuse(**kwargs):
        raise RuntimeError("allocator refuses")

    fake.start = refuse
    ran = []
    with save_memory_snapshot(tmp_path) as snap:
        ran.append(1)
    assert ran == [1] and not snap.recorded
    assert "memory history failed" in caplog.text and "allocator refuses" in caplog.text
    assert snapshot_module._own_depth == 0
    with pytest.raises(RuntimeError, match="allocator refuses"):
        with save_memory_snapshot(tmp_path, strict=True):
            pass


def test_pages_on_request(tmp_path, fake):
    with save_memory_snapshot(tmp_path / "none", trace_plot=False, memory_view=False) as snap:
        fake.allocate(512)
    assert snap.recorded and snap.memory_view_path is None and snap.trace_plot_path is None
    assert [p.name for p in snap.folder.iterdir()] == ["snapshot.pickle"]
    with save_memory_snapshot(tmp_path / "view", trace_plot=False) as snap:
        fake.allocate(512)
    assert sorted(p.name for p in snap.folder.iterdir()) == ["memory_view.html", "snapshot.pickle"]


def test_a_page_that_fails_leaves_the_pickle_and_the_other_pages(tmp_path, fake, monkeypatch, caplog):
    def broken(snapshot, path):
        raise KeyError("a key this torch lacks")

    monkeypatch.setitem(snapshot_module._WRITERS, "memory_view", broken)
    with save_memory_snapshot(tmp_path / "snap") as snap:
        fake.allocate(512)
    assert snap.recorded
    assert sorted(p.name for p in snap.folder.iterdir()) == ["snapshot.pickle", "trace_plot.html"]
    assert "memory snapshot memory_view failed" in caplog.text and "a key this torch lacks" in caplog.text
    with pytest.raises(KeyError, match="a key this torch lacks"):
        with save_memory_snapshot(tmp_path / "strict", strict=True):
            fake.allocate(512)
    assert not fake.recording
