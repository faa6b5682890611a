"""Misuse named, counts kept right, and the words a newcomer reads: an optimizer over another model's
parameters, an empty epoch, a record_stats() that saw no step; the CPU report without cache lines,
the model named by its class, the CSV folder named once."""

from __future__ import annotations

import copy
import io
import warnings

import pandas as pd
import pytest
import torch
from torch import nn

from pytorch_mem_profiler import MemoryProfiler
from pytorch_mem_profiler.measure.saved_tensors import can_chain
from pytorch_mem_profiler.outputs.notices import MisuseWarning

from .helpers import mlp, train_step


class Net(nn.Module):
    """Saves a tensor in its own forward (``tanh`` keeps its output), outside its submodules."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x))


def test_an_optimizer_over_another_models_parameters_is_a_value_error():
    model, other = mlp(), mlp()
    foreign = torch.optim.Adam(other.parameters())
    before = torch._C._len_torch_dispatch_stack()
    with pytest.raises(ValueError, match=r"^optimizer: this Adam steps none of the model's parameters"):
        MemoryProfiler(model, stream=io.StringIO(), optimizer=foreign)
    with pytest.raises(ValueError, match=r"^optimizer\[1\]: "):
        MemoryProfiler(model, stream=io.StringIO(), optimizer=[torch.optim.SGD(model.parameters(), lr=0.1), foreign])
    assert torch._C._len_torch_dispatch_stack() == before  # nothing was installed
    # one over part of the model is the model's
    MemoryProfiler(model, stream=io.StringIO(), optimizer=torch.optim.SGD(model[0].parameters(), lr=0.1)).close()


def test_another_optimizer_stepping_is_not_the_given_ones_step():
    model, other = mlp(), mlp()
    opt, opt_other = torch.optim.Adam(model.parameters()), torch.optim.Adam(other.parameters())
    with MemoryProfiler(model, stream=io.StringIO(), optimizer=opt) as profiler:
        for _ in range(2):
            train_step(model, opt, torch.randn(4, 32))
            train_step(other, opt_other, torch.randn(4, 32))
            record = profiler.record_stats()
    expected = sum(t.untyped_storage().nbytes() for s in opt.state.values() for t in s.values())
    assert record.optimizer_steps == 1 and record.optimizer_state == expected


def test_an_empty_epoch_end_warns_once_and_counts_no_epoch():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = io.StringIO()
    with MemoryProfiler(model, stream=out) as profiler:
        train_step(model, opt, torch.randn(4, 32))
        profiler.record_stats()
        profiler.epoch_end()
        with pytest.warns(MisuseWarning, match=r"epoch_end\(\) with no record_stats\(\) iteration"):
            profiler.epoch_end()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            profiler.epoch_end()  # said once: no second warning
        train_step(model, opt, torch.randn(4, 32))
        record = profiler.record_stats()
    assert (record.epoch, record.iteration, record.step) == (2, 1, 2)
    assert out.getvalue().count("finished") == 1 and "Memory Usage for Iteration 1 of Epoch 2" in out.getvalue()


def test_a_record_stats_that_saw_no_step_warns_once_and_is_not_an_iteration(tmp_path):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with MemoryProfiler(model, 1, True, csv_dir=tmp_path, stream=io.StringIO()) as profiler:
        with pytest.warns(MisuseWarning, match=r"record_stats\(\) saw no forward"):
            early = profiler.record_stats()  # before any forward, backward or step
        assert early.reported is False and early.iteration == 0
        train_step(model, opt, torch.randn(4, 32))
        first = profiler.record_stats()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            again = profiler.record_stats()  # twice in a row: not counted, and said once only
        train_step(model, opt, torch.randn(4, 32))
        second = profiler.record_stats()
    assert (first.iteration, again.iteration, second.iteration) == (1, 1, 2)
    assert list(pd.read_csv(profiler.csv_path)["iteration"]) == [1, 2]
    # an evaluation step (the model run without gradients) is no misuse
    with MemoryProfiler(model, stream=io.StringIO()) as profiler, warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.no_grad():
            model(torch.randn(4, 32))
        assert profiler.record_stats().iteration == 1


def test_a_deep_copy_of_a_profiled_model_works():
    model = mlp()
    with MemoryProfiler(model, stream=io.StringIO()):
        ema = copy.deepcopy(model)
    assert all(torch.equal(a, b) for a, b in zip(ema.parameters(), model.parameters()))


def test_the_cpu_report_reads_without_the_docs(tmp_path):
    model = Net()
    opt = torch.optim.Adam(model.parameters())
    out = io.StringIO()
    with MemoryProfiler(model, 1, True, csv_dir=tmp_path, stream=out, by_layer=True) as profiler:
        for _ in range(2):
            train_step(model, opt, torch.randn(8, 32))
            profiler.record_stats()
    text = out.getvalue()
    assert "cached" not in text.lower() and "Cache slack" not in text  # the CPU caches nothing
    # the model's own forward saved tanh(x) for backward: named by its class (by layer: torch 2.8 or later)
    own = any(line.startswith("  Net (its own forward)") and "(model)" not in line for line in text.splitlines())
    assert own == can_chain()
    # the CSV files named once, at the first row, with their units
    notices = [line for line in text.splitlines() if line.startswith("CSV: ")]
    assert notices == [
        f"CSV: a row per report in {profiler.csv_path} (amounts in MB, as its unit column says); "
        f"feature maps by layer in {profiler.layers_csv_path.name} (amounts in bytes, its bytes column)"
    ]
    assert "between phases (outside forward, backward and the step" in str(
        __import__("pytorch_mem_profiler.stats", fromlist=["PHASE_LABELS"]).PHASE_LABELS["other"]
    )
