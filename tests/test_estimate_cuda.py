"""On a GPU: estimate_memory against the caching allocator, and the largest batch against a small card."""

from __future__ import annotations

import functools
import gc
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from pytorch_mem_profiler import estimate_memory

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from optimizations import FeedForwardStack  # noqa: E402

pytestmark = pytest.mark.cuda

CUDA = torch.device("cuda")
SGD = functools.partial(torch.optim.SGD, lr=0.1)


def _fresh() -> None:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


#: the key of ``step_peak``'s ``phases`` for the most bytes reserved (segments, workspaces' included)
RESERVED = "max reserved"


def _warm_up(build, make_input, optimizer, autocast) -> None:
    """One step of the same model and precision at a batch of one, then everything dropped: every
    library's workspace (cuBLAS's and cuBLASLt's, for fp32 and for bf16, on the forward's thread
    and on autograd's) exists before the measured steps, so that what they measure is the tensors."""
    model = build().to(CUDA)
    opt = optimizer(model.parameters())
    x = make_input(1)
    with torch.autocast("cuda", dtype=autocast, enabled=autocast is not None):
        out = model(x)
    out.float().sum().backward()
    opt.step()
    del model, opt, x, out
    torch.cuda.synchronize()


def step_peak(build, make_input, optimizer, autocast=None, phases=None) -> int:
    """Bytes allocated at the peak of two training steps above what was allocated before the model.

    ``make_input(batch)``; ``phases``, a dict, gets each phase's peak above the same base."""
    _warm_up(build, make_input, optimizer, autocast)
    _fresh()
    base = torch.cuda.memory_allocated()
    phases = {} if phases is None else phases
    phases["persistent (workspaces)"] = base

    def phase(name: str) -> None:
        torch.cuda.synchronize()
        phases[name] = max(phases.get(name, 0), torch.cuda.max_memory_allocated() - base)
        phases[RESERVED] = max(phases.get(RESERVED, 0), torch.cuda.max_memory_reserved())
        torch.cuda.reset_peak_memory_stats()

    model = build().to(CUDA)
    opt = optimizer(model.parameters())
    x = make_input(None)
    phase("other")
    for _ in range(2):
        with torch.autocast("cuda", dtype=autocast, enabled=autocast is not None):
            out = model(x)
        phase("forward")
        loss = out.float().sum()
        phase("other")
        loss.backward()
        phase("backward")
        opt.step()
        phase("optimizer")
        opt.zero_grad(set_to_none=True)
        del out, loss
        phase("other")
    peak = max(v for k, v in phases.items() if k not in ("persistent (workspaces)", RESERVED))
    del model, opt, x
    _fresh()
    return peak


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 256))


def test_the_estimate_runs_on_the_gpus_own_device_type():
    estimate = estimate_memory(mlp(), torch.zeros(32, 256), device="cuda", fit=False)
    assert not estimate.emulated
    _fresh()
    before = torch.cuda.memory_allocated()
    estimate_memory(lambda: nn.Linear(4096, 4096), torch.zeros(8, 4096), device="cuda", fit=False)
    assert torch.cuda.max_memory_allocated() == before  # fake tensors: not one byte on the device


def test_an_mlp_estimate_equals_the_allocators_peak_to_the_byte():
    estimate = estimate_memory(mlp(), torch.zeros(64, 256), optimizer=SGD, device="cuda", fit=False)
    assert estimate.peak == step_peak(mlp, lambda b: torch.randn(b or 64, 256, device=CUDA), SGD)


@pytest.mark.parametrize("autocast", [None, torch.bfloat16])
def test_a_transformer_block_stack_estimate_is_within_three_percent(autocast):
    build = lambda: FeedForwardStack(512, 4)  # noqa: E731
    estimate = estimate_memory(build(), torch.zeros(8, 256, 512), device="cuda", autocast=autocast, fit=False)
    phases: dict[str, int] = {}
    measured = step_peak(build, lambda b: torch.randn(b or 8, 256, 512, device=CUDA), torch.optim.Adam, autocast, phases)
    # on failure: which phase differs, and what the libraries kept (workspaces) before the model
    detail = (
        f"estimated {estimate.peak:,} (kernel scratch {estimate.kernel_scratch:,}) by phase {dict(estimate.phases)}; "
        f"measured {measured:,} by phase {phases}"
    )
    assert abs(estimate.peak - measured) <= 0.03 * measured, detail


#: The models run on a small card, by name (a fresh process builds one: :func:`_run_at`): the
#: builder and the input at a batch, trained with Adam.
SMALL_CARD_MODELS = {
    "feed_forward_stack": (lambda: FeedForwardStack(512, 4), lambda b: torch.randn(b, 256, 512, device=CUDA)),
    # Adam's step holds the peak at small batches, backward at large ones
    "peak_moving_mlp": (
        lambda: nn.Sequential(nn.Linear(256, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 10)),
        lambda b: torch.randn(b, 256, device=CUDA),
    ),
}


def test_the_predicted_largest_batch_fits_a_small_card_and_ten_percent_more_does_not():
    build, _ = SMALL_CARD_MODELS["feed_forward_stack"]
    estimate = estimate_memory(build(), torch.zeros(4, 256, 512), device="cuda")
    total = torch.cuda.get_device_properties(CUDA).total_memory
    fraction = (1 << 30) / total  # a 1 GiB card, as far as the allocator is concerned
    limit = int(fraction * total)  # the bytes the allocator allows, computed as it computes them
    predicted = estimate.max_batch_size(limit, margin=0, outside=0)
    assert predicted > 4
    assert _runs_on_a_small_card("feed_forward_stack", predicted, fraction, limit)


def _runs_on_a_small_card(name: str, predicted: int, fraction: float, limit: int) -> bool:
    """The predicted batch runs under the allocator's limit, and one 10% larger does not (or comes within 5% of it).

    Each run is a fresh process's, as a user's run is: in this one, what earlier tests left (cuBLAS's
    workspaces of other threads and streams, cuDNN's state, a tensor a test keeps) would lie under
    the same limit, which the estimate of a training step does not count."""

    def run(batch: int) -> int | None:
        root = Path(__file__).resolve().parents[1]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
        command = [sys.executable, str(Path(__file__).resolve()), name, str(batch), repr(fraction)]
        done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        if done.returncode != 0 or not lines:
            raise RuntimeError(f"the run at batch {batch} failed (exit {done.returncode}): {done.stderr.strip()[-600:]}")
        return json.loads(lines[-1])["reserved"]

    assert run(predicted) is not None, predicted
    larger = run(math.ceil(predicted * 1.1))
    assert larger is None or larger >= 0.95 * limit, (predicted, larger)
    return True


def _run_at(name: str, batch: int, fraction: float) -> dict[str, int | None]:
    """Two training steps of ``SMALL_CARD_MODELS[name]`` at ``batch`` under the allocator limit
    ``fraction``, in this process: the most bytes reserved, ``None`` out of memory."""
    build, make_input = SMALL_CARD_MODELS[name]
    torch.cuda.set_per_process_memory_fraction(fraction)
    phases: dict[str, int] = {}
    try:
        step_peak(build, lambda b: make_input(b or batch), torch.optim.Adam, phases=phases)
        return {"reserved": phases[RESERVED]}
    except torch.cuda.OutOfMemoryError:
        return {"reserved": None}


def test_the_largest_batch_is_verified_where_the_peak_moves_to_another_moment():
    build, _ = SMALL_CARD_MODELS["peak_moving_mlp"]
    estimate = estimate_memory(build, torch.zeros(8, 256), device="cuda")
    total = torch.cuda.get_device_properties(CUDA).total_memory
    fraction = (512 << 20) / total
    limit = int(fraction * total)
    search = estimate.batch_search(limit, margin=0, outside=0)
    assert search.largest > 100 and search.tried
    assert _runs_on_a_small_card("peak_moving_mlp", search.largest, fraction, limit)


@pytest.mark.parametrize("rows, cols", [(512, 3072), (1024, 256), (2048, 64), (2048, 2048), (8192, 1024), (65536, 3072)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_column_reduction_rule_gives_this_gpus_scratch(rows, cols, dtype):
    from pytorch_mem_profiler.estimate.step import kernel_scratch

    x = torch.randn(rows, cols, device=CUDA, dtype=dtype)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = x.sum(0)
    torch.cuda.synchronize()
    measured = torch.cuda.max_memory_allocated() - max(before, torch.cuda.memory_allocated())
    del out, x
    predicted = sum(kernel_scratch(CUDA)(torch.ops.aten.sum.dim_IntList, (torch.empty(rows, cols, device="meta", dtype=dtype), [0]), {}))
    assert predicted == measured


if __name__ == "__main__":  # one run of :func:`_runs_on_a_small_card`: model name, batch, fraction
    print(json.dumps(_run_at(sys.argv[1], int(sys.argv[2]), float(sys.argv[3]))))
