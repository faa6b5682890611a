"""The torch.profiler memory timeline helper, on CPU with torch's real profiler."""

from __future__ import annotations

import gzip
import json
import socket
import warnings

import pytest
import torch
from torch.profiler import ProfilerActivity, profile, schedule

from pytorch_mem_profiler import memory_timeline_handler, save_memory_timeline
from pytorch_mem_profiler.tools import timeline as timeline_module
from pytorch_mem_profiler.tools.timeline import timeline_exporter_state


def run_profile(**overrides):
    flags = {"profile_memory": True, "record_shapes": True, "with_stack": True}
    flags.update(overrides)
    model = torch.nn.Linear(128, 128)
    with profile(activities=[ProfilerActivity.CPU], **flags) as prof:
        for _ in range(2):
            model(torch.randn(32, 128)).sum().backward()
    return prof


def trace_events(path):
    with gzip.open(path, "rt") as f:
        return json.load(f)["traceEvents"]


def exporter_class():
    return next(c for c in type(run_profile()).__mro__ if "export_memory_timeline" in vars(c))


def test_writes_trace_and_timeline(tmp_path):
    pytest.importorskip("matplotlib")
    prof = run_profile()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        files = save_memory_timeline(prof, tmp_path / "out", device="cpu", stem="run")
    assert files["trace"] == tmp_path / "out" / "run.json.gz"
    assert files["timeline"] == tmp_path / "out" / "run.html"
    assert any(e.get("name") == "aten::addmm" for e in trace_events(files["trace"]))
    html = files["timeline"].read_text()
    assert "data:image/png;base64," in html
    ours = [w for w in caught if "save_memory_snapshot" in str(w.message)]
    torchs = [w for w in caught if issubclass(w.category, FutureWarning)]
    assert torchs == [], "torch's own deprecation warning was not replaced by ours"
    if timeline_exporter_state(prof) == "deprecated":
        assert len(ours) == 1 and "deprecates export_memory_timeline" in str(ours[0].message)
    else:
        assert ours == []


def test_default_names_carry_host_and_time_and_never_collide(tmp_path):
    pytest.importorskip("matplotlib")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        first = save_memory_timeline(run_profile(), tmp_path, device="cpu")
        second = save_memory_timeline(run_profile(), tmp_path, device="cpu")
    for files in (first, second):
        assert files["trace"].name.startswith(socket.gethostname() + "_")
        assert files["timeline"].name == files["trace"].name.replace(".json.gz", ".html")
        assert files["timeline"].is_file()
    assert first["trace"] != second["trace"]


def test_missing_exporter_points_to_snapshots(tmp_path, monkeypatch):
    prof = run_profile()
    monkeypatch.delattr(exporter_class(), "export_memory_timeline")
    assert timeline_exporter_state(prof) == "missing"
    with pytest.warns(UserWarning, match="no export_memory_timeline.*save_memory_snapshot") as warned:
        files = save_memory_timeline(prof, tmp_path, stem="run")
    assert len(warned) == 1
    assert files == {"trace": tmp_path / "run.json.gz", "timeline": None}
    assert trace_events(files["trace"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.json.gz"]


def test_exporter_state_tells_deprecated_from_ok(monkeypatch):
    cls = exporter_class()
    plain = lambda self, path, device=None: None  # noqa: E731
    monkeypatch.setattr(cls, "export_memory_timeline", plain)
    assert timeline_exporter_state() == "ok"
    plain.__deprecated__ = "gone soon"
    assert timeline_exporter_state() == "deprecated"


def test_profile_without_the_needed_flags_is_refused(tmp_path):
    prof = run_profile(with_stack=False, record_shapes=False)
    with pytest.raises(ValueError, match="record_shapes=False, with_stack=False"):
        save_memory_timeline(prof, tmp_path)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(TypeError, match="prof must be a torch.profiler.profile, got str"):
        save_memory_timeline("trace.json", tmp_path)
    with pytest.raises(ValueError, match="stem must be a non-empty file name"):
        save_memory_timeline(run_profile(), tmp_path, stem="../escape")


def test_without_matplotlib_an_actionable_error(tmp_path, monkeypatch):
    real = timeline_module.importlib.util.find_spec
    monkeypatch.setattr(
        timeline_module.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "matplotlib" else real(name, *a),
    )
    if timeline_exporter_state() == "missing":
        pytest.skip("this torch has no timeline exporter, so matplotlib is not needed")
    with pytest.raises(ImportError, match=r"pip install 'pytorch_mem_profiler\[plot\]'"):
        memory_timeline_handler(tmp_path)
    with pytest.raises(ImportError, match="memory timeline HTML"):
        save_memory_timeline(run_profile(), tmp_path)


def test_handler_as_on_trace_ready(tmp_path):
    pytest.importorskip("matplotlib")
    handler = memory_timeline_handler(tmp_path / "timelines", device="cpu")
    assert (tmp_path / "timelines").is_dir()
    model = torch.nn.Linear(64, 64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with profile(
            activities=[ProfilerActivity.CPU],
            schedule=schedule(wait=0, warmup=0, active=2, repeat=1),
            profile_memory=True,
            record_shapes=True,
            with_stack=True,
            on_trace_ready=handler,
        ) as prof:
            for _ in range(3):
                model(torch.randn(8, 64)).sum().backward()
                prof.step()
    names = sorted(p.name for p in (tmp_path / "timelines").iterdir())
    assert len(names) == 2
    assert names[0].endswith(".html") and names[1].endswith(".json.gz")


def test_handler_checks_its_arguments_now(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ValueError, match="folder="):
        memory_timeline_handler(blocker / "sub")
    with pytest.raises(ValueError, match="device='gpu7'"):
        memory_timeline_handler(tmp_path, device="gpu7")
