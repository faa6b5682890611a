"""Bad input fails when the profiler is made, with a message naming the argument; nothing is left behind."""

from __future__ import annotations

import io
import os
import sys
import warnings

import pytest
import torch
import torch.distributed as dist
from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from pytorch_mem_profiler import MemoryProfiler


@pytest.fixture
def model():
    return torch.nn.Linear(4, 4)


@pytest.fixture(autouse=True)
def nothing_left_installed():
    """A refused profiler leaves no dispatch mode, optimizer hook or module hook behind."""
    modes = _get_current_dispatch_mode_stack()
    pre, post = len(_global_optimizer_pre_hooks), len(_global_optimizer_post_hooks)
    yield
    assert _get_current_dispatch_mode_stack() == modes
    assert (len(_global_optimizer_pre_hooks), len(_global_optimizer_post_hooks)) == (pre, post)


def _refused(model, error, argname, **kwargs):
    with pytest.raises(error, match=argname):
        MemoryProfiler(model, **kwargs)
    assert model._forward_hooks == {} and model._forward_pre_hooks == {}


def test_an_empty_csv_folder_is_refused(model, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # "" would silently mean this folder
    _refused(model, ValueError, "csv_dir", csv=True, csv_dir="")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("device", ["meta", "xla", "hpu"])
def test_a_device_this_process_has_not_is_refused(model, device):
    _refused(model, ValueError, f"device='{device}'", device=device)


def test_cuda_without_a_driver_is_refused_not_profiled_as_zero(model, monkeypatch):
    """PyTorch's default wheel on a machine without a GPU: CUDA is built in, not available."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    for device in ("cuda", "cuda:0", torch.device("cuda", 1)):
        _refused(model, ValueError, r"device=.*CUDA is not available", device=device)


def test_a_closed_stream_is_refused(model, tmp_path):
    closed = open(tmp_path / "report.txt", "w")
    closed.close()
    _refused(model, ValueError, "stream is closed", stream=closed)


def test_a_read_only_file_is_refused(model, tmp_path):
    (tmp_path / "report.txt").write_text("")
    with open(tmp_path / "report.txt") as read_only:
        _refused(model, ValueError, "stream is not open for writing", stream=read_only)


def test_standard_input_is_refused(model):
    # Under pytest sys.stdin is its capture object; sys.__stdin__ is the real one (None when closed).
    for stdin in (sys.stdin, sys.__stdin__):
        if stdin is not None:
            _refused(model, (ValueError, TypeError), "stream", stream=stdin)


def test_a_binary_or_writeless_stream_is_refused(model):
    with open(os.devnull, "wb") as binary:
        _refused(model, TypeError, "stream must be a text stream", stream=binary)
    _refused(model, TypeError, "stream must have a write", stream=object())


def test_a_writable_stream_is_accepted(model):
    out = io.StringIO()
    with MemoryProfiler(model, stream=out) as profiler:
        model(torch.randn(2, 4)).sum().backward()
        profiler.record_stats()
    assert "Memory Usage for Iteration 1 of Epoch 1" in out.getvalue()


def test_print_ranks_beyond_a_single_process_warns(model):
    with pytest.warns(UserWarning, match=r"print_ranks=3 names rank\(s\) \[3\] beyond the world size.*single process"):
        MemoryProfiler(model, print_ranks=3, stream=io.StringIO()).close()
    with pytest.warns(UserWarning, match=r"print_ranks='0,2' names rank\(s\) \[2\].*only rank\(s\) \[0\] print"):
        MemoryProfiler(model, print_ranks="0,2", stream=io.StringIO()).close()


def test_print_ranks_within_the_world_do_not_warn(model):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for ranks in (0, [0], "all", []):
            MemoryProfiler(model, print_ranks=ranks, stream=io.StringIO()).close()


def test_print_ranks_beyond_the_world_size_under_torch_distributed_warns(model):
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        with pytest.warns(UserWarning, match=r"print_ranks=\[0, 4\] names rank\(s\) \[4\].*1 rank\(s\), 0 to 0"):
            profiler = MemoryProfiler(model, print_ranks=[0, 4], stream=io.StringIO())
        profiler.close()
    finally:
        dist.destroy_process_group()
