"""Optimizer state: counted at every record from every optimizer known, never a false zero."""

from __future__ import annotations

import gc
import io

import pandas as pd
import torch
from torch import nn

from pytorch_mem_profiler import MemoryProfiler

from .helpers import mlp, train_step


def state_bytes(*optimizers: torch.optim.Optimizer) -> int:
    """Bytes of the optimizers' state tensors: unique storages, counted apart from the profiler."""
    storages = {}
    for opt in optimizers:
        for per_param in opt.state.values():
            for value in per_param.values():
                if torch.is_tensor(value):
                    storage = value.untyped_storage()
                    storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def make(model, **kw) -> MemoryProfiler:
    return MemoryProfiler(model, kw.pop("print_period", 1), stream=io.StringIO(), strict=True, **kw)


def test_records_before_the_first_step_of_an_epoch_keep_the_state():
    """Gradient accumulation: the first iteration of epoch 2 steps no optimizer."""
    model = mlp()
    opt = torch.optim.Adam(model.parameters())
    seen = []
    with make(model) as profiler:
        for _epoch in range(2):
            for i in range(4):
                model(torch.randn(4, 32)).pow(2).mean().backward()
                if i % 2 == 1:  # a step every second iteration
                    opt.step()
                    opt.zero_grad()
                seen.append(profiler.record_stats())
            profiler.epoch_end()
    expected = state_bytes(opt)
    # exp_avg and exp_avg_sq per parameter, and a float32 step per parameter (on the CPU)
    params = list(model.parameters())
    assert expected == 2 * sum(p.nbytes for p in params) + 4 * len(params)
    assert seen[0].optimizer_state is None  # nothing has stepped the model yet: unknown, not 0
    assert [r.optimizer_steps for r in seen] == [0, 1, 0, 1] * 2
    # From the first step on, every record counts it: in epoch 2 before its first step too.
    assert [r.optimizer_state for r in seen[1:]] == [expected] * 7


def test_a_profiler_made_mid_training_reads_none_until_it_sees_a_step():
    model = mlp()
    opt = torch.optim.Adam(model.parameters())
    for _ in range(3):
        train_step(model, opt, torch.randn(4, 32))
    expected = state_bytes(opt)
    assert expected > 0
    with make(model) as profiler:
        model(torch.randn(4, 32)).pow(2).mean().backward()
        before = profiler.record_stats()
        opt.step()
        opt.zero_grad()
        after = profiler.record_stats()
        later = profiler.record_stats()
    assert before.optimizer_state is None
    assert after.optimizer_state == later.optimizer_state == expected


def test_a_given_optimizer_counts_from_the_first_record_and_its_state_is_allocated():
    model = mlp()
    opt = torch.optim.Adam(model.parameters())
    train_step(model, opt, torch.randn(4, 32))  # Adam's state exists now; gradients are None
    weights = sum(p.untyped_storage().nbytes() for p in model.parameters())
    expected = state_bytes(opt)
    with make(model, optimizer=opt) as profiler:
        record = profiler.record_stats()  # no iteration has run under the profiler
    assert record.optimizer_state == expected
    # The CPU counter adopted the state made before it started: nothing else is alive.
    assert record.allocated == weights + expected


def test_a_given_optimizer_before_its_first_step_reads_a_true_zero():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with make(model, optimizer=opt) as profiler:
        first = profiler.record_stats()
        train_step(model, opt, torch.randn(4, 32))
        second = profiler.record_stats()
    assert first.optimizer_state == 0  # known, and it has no state yet
    assert second.optimizer_state == state_bytes(opt) == sum(p.nbytes for p in model.parameters())


def test_every_optimizer_seen_stepping_the_model_counts():
    model = mlp()
    first_layer, last_layer = model[0], model[2]
    adam = torch.optim.Adam(first_layer.parameters())
    sgd = torch.optim.SGD(last_layer.parameters(), lr=0.1, momentum=0.9)
    unrelated = torch.optim.Adam([nn.Parameter(torch.zeros(1000))])
    with make(model) as profiler:
        model(torch.randn(4, 32)).pow(2).mean().backward()
        adam.step()
        sgd.step()
        unrelated.param_groups[0]["params"][0].grad = torch.ones(1000)
        unrelated.step()
        record = profiler.record_stats()
        profiler.epoch_end()
        next_epoch = profiler.record_stats()
    assert record.optimizer_state == next_epoch.optimizer_state == state_bytes(adam, sgd)
    assert state_bytes(adam, sgd) < state_bytes(adam, sgd, unrelated)


def test_optimizers_are_held_weakly_and_forgotten_when_gone():
    model = mlp()
    opt = torch.optim.Adam(model.parameters())
    with make(model) as profiler:
        train_step(model, opt, torch.randn(4, 32))
        assert profiler.record_stats().optimizer_state == state_bytes(opt)
        del opt
        gc.collect()
        assert profiler.record_stats().optimizer_state is None


def test_unknown_state_is_n_a_in_the_report_and_empty_in_the_csv(csv_dir):
    model = mlp()
    opt = torch.optim.Adam(model.parameters())
    out = io.StringIO()
    with MemoryProfiler(model, 1, True, csv_dir=csv_dir, stream=out, strict=True) as profiler:
        model(torch.randn(4, 32)).pow(2).mean().backward()
        profiler.record_stats()
        opt.step()
        profiler.record_stats()
        profiler.epoch_end()
    reports = out.getvalue().split("Memory Usage for Iteration")
    assert "Optimizer state.........................n/a" in reports[1]
    assert "Optimizer state.........................n/a" not in reports[2]
    frame = pd.read_csv(profiler.csv_path)
    assert pd.isna(frame.loc[0, "optimizer_state"])
    assert frame.loc[1, "optimizer_state"] * 1e6 == state_bytes(opt)
