"""OOM post-mortems on any machine: arguments, the folder's contents, once per OOM, ranks.

A real OOM needs a GPU (test_snapshot_cuda.py); here the post-mortem is
driven through the observer's entry point with the numbers the allocator
would pass it.
"""

from __future__ import annotations

import io
import json
import logging

import pytest
import torch

from pytorch_mem_profiler import MemoryProfiler, dump_on_oom, memory_profiler
from pytorch_mem_profiler.tools import oom as oom_module
from pytorch_mem_profiler.tools.oom import OomPostmortem, plain_data
from pytorch_mem_profiler.stats import IterationRecord

GIB = 2**30


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.fixture
def fake_observer(monkeypatch):
    """CUDA 'available' and the allocator's observer 'attached', with an empty registry."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(oom_module, "_attach_observer", lambda: True)
    monkeypatch.setattr(oom_module, "_handles", [])


def folders(path):
    return sorted(p for p in path.iterdir() if p.is_dir())


def read_event(folder):
    (event_file,) = folder.glob("oom*.json")
    return json.loads(event_file.read_text())


def train_one(model, opt, profiler):
    model(torch.randn(8, 16)).sum().backward()
    opt.step()
    opt.zero_grad()
    return profiler.record_stats()


# -- arguments, and no CUDA -------------------------------------------------------------
def test_without_cuda_it_warns_and_watches_nothing(tmp_path, no_cuda):
    with pytest.warns(UserWarning, match="CUDA is not available: no OOM post-mortems") as warned:
        handle = dump_on_oom(tmp_path / "oom" / "deep")
    assert len(warned) == 1
    assert not handle.active
    assert (tmp_path / "oom" / "deep").is_dir()
    assert handle not in oom_module._handles


def test_unwritable_folder_fails_at_once(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ValueError, match=r"oom_dir=.*file.*cannot be created or written"):
        dump_on_oom(blocker / "oom")
    with pytest.raises(TypeError, match="oom_dir must be a str or os.PathLike, got int"):
        dump_on_oom(5)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"max_dumps": 0}, ValueError, "max_dumps must be an integer >= 1, got 0"),
        ({"min_interval_s": -1}, ValueError, "min_interval_s must be a number >= 0, got -1"),
        ({"profiler": object()}, TypeError, "profiler must have a postmortem"),
    ],
)
def test_bad_arguments(tmp_path, kwargs, error, match):
    with pytest.raises(error, match=match):
        dump_on_oom(tmp_path, **kwargs)


def test_profiler_validates_oom_dir_before_anything_else(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="oom_dir="):
        memory_profiler(model, 1, False, oom_dir=blocker / "oom")
    assert model._forward_pre_hooks == {}, "a failed construction left hooks on the model"


def test_profiler_on_cpu_warns_that_oom_dir_is_for_cuda(tmp_path, fake_observer):
    with pytest.warns(UserWarning, match="oom_dir is for CUDA out-of-memory errors"):
        profiler = memory_profiler(torch.nn.Linear(2, 2), 1, False, oom_dir=tmp_path, stream=io.StringIO())
    assert not profiler.oom_postmortem.active
    profiler.close()


# -- what a post-mortem holds ----------------------------------------------------------------
def test_standalone_postmortem_folder(tmp_path):
    handle = OomPostmortem(tmp_path)  # made, not attached: driven by hand below
    folder = handle._on_oom(0, 2 * GIB, GIB, 5 * GIB)
    assert folder is not None and folders(tmp_path) == [folder]
    assert folder.name.startswith("oom_")
    event = read_event(folder)
    assert event["requested_bytes"] == 2 * GIB
    assert event["device_limit_bytes"] == GIB
    assert event["device_free_bytes"] == 5 * GIB
    assert event["device"] == "cuda:0"
    assert event["rank"] is None
    assert event["errors"] == []
    assert sorted(event["files"]) == sorted(p.name for p in folder.iterdir())
    assert {"oom.json", "allocator_stats.json"} <= set(event["files"])
    assert "report.txt" not in event["files"] and "record.json" not in event["files"]
    assert handle.dumps == [folder]


def test_once_per_oom_without_a_profiler(tmp_path):
    handle = OomPostmortem(tmp_path, min_interval_s=3600)
    assert handle._on_oom(0, GIB, GIB, 0) is not None
    assert handle._on_oom(0, GIB, GIB, 0) is None  # the same OOM, retried
    assert len(folders(tmp_path)) == 1
    handle.min_interval_s = 0.0
    assert handle._on_oom(0, GIB, GIB, 0) is not None
    assert len(folders(tmp_path)) == 2


def test_max_dumps_caps_the_folders(tmp_path, caplog):
    handle = OomPostmortem(tmp_path, max_dumps=2, min_interval_s=0)
    results = [handle._on_oom(0, GIB, GIB, 0) for _ in range(4)]
    assert [r is not None for r in results] == [True, True, False, False]
    assert len(folders(tmp_path)) == 2
    assert caplog.text.count("writing no more") == 1


def test_profiler_postmortem_has_report_and_failing_iteration(tmp_path, fake_observer):
    model = torch.nn.Linear(16, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = io.StringIO()
    with pytest.warns(UserWarning, match="oom_dir is for CUDA"):
        profiler = MemoryProfiler(model, print_period=1, stream=out, oom_dir=tmp_path, strict=True)
    handle = profiler.oom_postmortem
    last = train_one(model, opt, profiler)
    model(torch.randn(8, 16))  # the next iteration fails after its forward
    folder = handle._on_oom(0, 3 * GIB, GIB, 0)
    names = {p.name for p in folder.iterdir()}
    assert {"oom.json", "allocator_stats.json", "report.txt", "record.json"} <= names
    assert (folder / "report.txt").read_text() == profiler.last_report
    assert profiler.last_report in out.getvalue()
    record = json.loads((folder / "record.json").read_text())
    assert (record["epoch"], record["iteration"], record["step"]) == (1, 2, 2)
    assert record["device"] == "cpu"
    assert record["phase"] == "other"
    assert record["last_record"]["iteration"] == 1
    assert record["last_record"]["weights"] == (16 * 4 + 4) * 4 == last.weights
    assert record["last_record"]["weights_by_name"] == {"weight": 256, "bias": 16}
    assert record["in_progress"]["forward_passes"] == 1
    assert record["in_progress"]["feature_maps"] == 8 * 4 * 4
    # A second OOM in the same iteration is the same OOM; the next iteration's is new.
    assert handle._on_oom(0, 3 * GIB, GIB, 0) is None
    train_one(model, opt, profiler)
    assert handle._on_oom(0, 3 * GIB, GIB, 0) is not None
    assert len(folders(tmp_path)) == 2
    profiler.close()


def test_postmortem_before_any_report(tmp_path):
    with pytest.warns(UserWarning):
        profiler = memory_profiler(torch.nn.Linear(2, 2), 5, False, oom_dir=tmp_path, stream=io.StringIO())
    post = profiler.postmortem()
    assert post["report"] is None and post["last_record"] is None
    assert (post["epoch"], post["iteration"]) == (1, 1)
    folder = profiler.oom_postmortem._on_oom(0, GIB, GIB, 0)
    assert (folder / "report.txt").read_text() == "No report was printed before the OOM.\n"
    json.dumps(post)  # plain data throughout
    profiler.close()


def test_file_names_carry_the_rank_under_torch_distributed(tmp_path):
    import torch.distributed as dist

    if not dist.is_available():
        pytest.skip("torch.distributed is not built in")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        handle = OomPostmortem(tmp_path / "oom")
        folder = handle._on_oom(0, GIB, GIB, 0)
    finally:
        dist.destroy_process_group()
    assert folder.name.endswith("_rank0")
    names = sorted(p.name for p in folder.iterdir())
    assert names and all(name.split(".")[0].endswith("_rank0") for name in names)
    assert read_event(folder)["rank"] == 0


# -- the observer and its registry -------------------------------------------------------------
def test_observer_dispatches_to_attached_handles_until_removed(tmp_path, fake_observer):
    with dump_on_oom(tmp_path / "a") as first, dump_on_oom(tmp_path / "b") as second:
        assert first.active and second.active
        assert oom_module._handles == [first, second]
        oom_module._on_out_of_memory(0, GIB, GIB, 0)
        assert len(first.dumps) == len(second.dumps) == 1
    assert oom_module._handles == []
    assert not first.active
    oom_module._on_out_of_memory(0, GIB, GIB, 0)
    assert len(folders(tmp_path / "a")) == 1


def test_observer_never_raises(tmp_path, fake_observer, caplog):
    handle = dump_on_oom(tmp_path)

    def broken(*args):
        raise OSError("disk full")

    handle._on_oom = broken
    oom_module._on_out_of_memory(0, GIB, GIB, 0)  # must not raise: the OOM error goes on unchanged
    assert "the OOM post-mortem failed: disk full" in caplog.text
    handle.remove()


def test_a_dropped_profiler_takes_its_postmortem_with_it(tmp_path, fake_observer):
    import gc

    class CudaProfilerLike:
        device = "cuda:0"

        def postmortem(self):
            return {"epoch": 1, "iteration": 1}

    profiler = CudaProfilerLike()
    handle = dump_on_oom(tmp_path, profiler=profiler)
    assert handle.active and handle in oom_module._handles
    del profiler
    gc.collect()
    assert not handle.active and handle not in oom_module._handles


def test_plain_data_takes_frozen_records():
    record = IterationRecord(
        epoch=1,
        iteration=2,
        step=2,
        device="cpu",
        allocated=100,
        weights_by_name={"fc.weight": 64},
    )
    data = plain_data(record)
    assert data["weights_by_name"] == {"fc.weight": 64}
    assert json.loads(json.dumps(data))["allocated"] == 100
    assert plain_data(torch.device("cuda", 1)) == "cuda:1"


def test_errors_in_one_file_leave_the_others(tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.ERROR, logger="pytorch_mem_profiler")

    def stats_fail(device):
        raise RuntimeError("stats unavailable")

    monkeypatch.setattr(oom_module, "allocator_stats", stats_fail)
    folder = OomPostmortem(tmp_path)._on_oom(0, GIB, GIB, 0)
    event = read_event(folder)
    assert event["errors"] == ["allocator_stats.json: RuntimeError: stats unavailable"]
    assert "allocator_stats.json" not in {p.name for p in folder.iterdir()}


def test_a_torch_without_the_observer_gets_a_warning(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delattr(torch._C, "_cuda_attach_out_of_memory_observer", raising=False)
    monkeypatch.setattr(oom_module, "_observer_attached", False)
    monkeypatch.setattr(oom_module, "_handles", [])
    with pytest.warns(UserWarning, match="offers no out-of-memory observer"):
        handle = dump_on_oom(tmp_path)
    assert not handle.active and oom_module._handles == []


def test_the_observer_is_attached_once_per_process(tmp_path, monkeypatch):
    attached = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch._C, "_cuda_attach_out_of_memory_observer", attached.append, raising=False)
    monkeypatch.setattr(oom_module, "_observer_attached", False)
    monkeypatch.setattr(oom_module, "_handles", [])
    with dump_on_oom(tmp_path / "a"), dump_on_oom(tmp_path / "b"):
        pass
    with dump_on_oom(tmp_path / "c"):
        pass
    assert attached == [oom_module._on_out_of_memory]
