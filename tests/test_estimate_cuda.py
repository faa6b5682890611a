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


def step_peak(build, make_input, optimizer, autocast=None, phases=None, segments=None) -> int:
    """Bytes allocated at the peak of two training steps above what was allocated before the model.

    ``make_input(batch)``; ``phases``, a dict, gets each phase's peak above the same base;
    ``segments``, a dict, gets ``"base"``: the segments held before the model, each ``(address, bytes,
    small, [(block bytes, allocated), ...])`` (the libraries' workspaces, and blocks earlier tests
    left), and ``"made"``: the address of each segment the two steps made, in order (from the
    allocator's history, recorded without stacks while they run)."""
    _warm_up(build, make_input, optimizer, autocast)
    _fresh()
    base = torch.cuda.memory_allocated()
    if segments is not None:
        segments["base"] = [
            (int(seg["address"]), int(seg["total_size"]), seg["segment_type"] == "small",
             [(int(block["size"]), block["state"] == "active_allocated") for block in seg["blocks"]])
            for seg in torch.cuda.memory._snapshot()["segments"]
        ]  # fmt: skip
        torch.cuda.memory._record_memory_history(enabled="all", context=None, stacks="python", max_entries=1_000_000)
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
    if segments is not None:
        trace = torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()]
        torch.cuda.memory._record_memory_history(enabled=None)
        segments["made"] = [int(entry["addr"]) for entry in trace if entry["action"] == "segment_alloc"]
    del model, opt, x
    _fresh()
    return peak


def peak_from_the_devices_segments(estimate, segments: dict) -> int:
    """The estimate's requests replayed from the segments the device held before the model (its
    workspaces, and blocks earlier tests left, in place of the estimate's workspaces) with each new
    segment where the device put it: the most bytes of whole blocks above that base."""
    from pytorch_mem_profiler.estimate.allocator import AllocatorReplay

    replay = AllocatorReplay(addresses=segments["made"])
    held = 0
    for address, size, small, blocks in segments["base"]:
        replay.add_segment(size, [(nbytes, -(held := held + 1) if used else None) for nbytes, used in blocks], small=small, address=address)
    base = replay.allocated
    replay.run([(key, nbytes) for key, nbytes in estimate.step_events.events if key >= 0])
    return replay.peak_allocated - base


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


@pytest.mark.parametrize("optimizer", [
    functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9, fused=True),
    functools.partial(torch.optim.AdamW, lr=torch.tensor(1e-3), fused=True),
    functools.partial(torch.optim.Adam, lr=torch.tensor(1e-3)),
    functools.partial(torch.optim.Adam, capturable=True),
    functools.partial(torch.optim.NAdam, capturable=True),
], ids=["sgd-fused", "adamw-fused-tensor-lr", "adam-tensor-lr", "adam-capturable", "nadam-capturable"])  # fmt: skip
def test_fused_capturable_and_tensor_lr_optimizers_equal_the_allocators_peak(optimizer):
    """torch's fused steps (in place, some without a fake kernel), a learning rate given as a tensor
    and capturable steps (their counts on the device): on fake CUDA tensors to the byte, and emulated
    on the CPU with the same optimizer state and the peak within 2%."""
    estimate = estimate_memory(mlp(), torch.zeros(64, 256), optimizer=optimizer, device="cuda", fit=False)
    measured = step_peak(mlp, lambda b: torch.randn(b or 64, 256, device=CUDA), optimizer)
    assert estimate.peak == measured
    emulated = estimate_memory(mlp(), torch.zeros(64, 256), optimizer=optimizer, device="cuda", fit=False, emulate=True)
    assert emulated.optimizer_state == estimate.optimizer_state
    assert abs(emulated.peak - measured) <= 0.02 * measured, (emulated.peak, measured)


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


#: The processes a largest batch is asked for (``batch_search(process=...)``), each run as it is: a
#: new process's first steps (a user's run), and steps after a warm-up step at a batch of one.
PROCESSES = ("fresh", "warmed")


@pytest.mark.parametrize("process", PROCESSES)
def test_the_predicted_largest_batch_fits_a_small_card_and_ten_percent_more_does_not(process):
    build, _ = SMALL_CARD_MODELS["feed_forward_stack"]
    estimate = estimate_memory(build(), torch.zeros(4, 256, 512), device="cuda")
    total = torch.cuda.get_device_properties(CUDA).total_memory
    fraction = (1 << 30) / total  # a 1 GiB card, as far as the allocator is concerned
    limit = int(fraction * total)  # the bytes the allocator allows, computed as it computes them
    predicted = estimate.max_batch_size(limit, margin=0, outside=0, process=process)
    assert predicted > 4
    assert _runs_on_a_small_card("feed_forward_stack", predicted, fraction, limit, process)


def _runs_on_a_small_card(name: str, predicted: int, fraction: float, limit: int, process: str) -> bool:
    """The predicted batch runs under the allocator's limit, and one 10% larger does not (or comes within 5% of it).

    Each run is a fresh process's, as a user's run is: in this one, what earlier tests left (cuBLAS's
    workspaces of other threads and streams, cuDNN's state, a tensor a test keeps) would lie under
    the same limit, which the estimate of a training step does not count. ``process``: whether it
    trains at once (``"fresh"``) or after a warm-up step (``"warmed"``)."""
    assert run_in_a_new_process(name, predicted, fraction, process) is not None, predicted
    larger = run_in_a_new_process(name, math.ceil(predicted * 1.1), fraction, process)
    assert larger is None or larger >= 0.95 * limit, (predicted, larger)
    return True


def run_in_a_new_process(name: str, batch: int, fraction: float, process: str) -> int | None:
    """:func:`_run_at` in a new process: the most bytes reserved, ``None`` out of memory."""
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    command = [sys.executable, str(Path(__file__).resolve()), name, str(batch), repr(fraction), process]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"the run at batch {batch} failed (exit {done.returncode}): {done.stderr.strip()[-600:]}")
    return json.loads(lines[-1])["reserved"]


def _run_at(name: str, batch: int, fraction: float, process: str) -> dict[str, int | None]:
    """Two training steps of ``SMALL_CARD_MODELS[name]`` at ``batch`` under the allocator limit
    ``fraction``, in this process, as its first CUDA work (``"fresh"``) or after a warm-up step
    (``"warmed"``): the most bytes reserved, ``None`` out of memory."""
    build, make_input = SMALL_CARD_MODELS[name]
    torch.cuda.set_per_process_memory_fraction(fraction)
    try:
        if process == "warmed":
            phases: dict[str, int] = {}
            step_peak(build, lambda b: make_input(b or batch), torch.optim.Adam, phases=phases)
            return {"reserved": phases[RESERVED]}
        model = build().to(CUDA)
        opt = torch.optim.Adam(model.parameters())
        x = make_input(batch)
        for _ in range(2):
            model(x).float().sum().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        return {"reserved": torch.cuda.max_memory_reserved()}
    except torch.cuda.OutOfMemoryError:
        return {"reserved": None}


@pytest.mark.parametrize("process", PROCESSES)
def test_the_largest_batch_is_verified_where_the_peak_moves_to_another_moment(process):
    build, _ = SMALL_CARD_MODELS["peak_moving_mlp"]
    estimate = estimate_memory(build, torch.zeros(8, 256), device="cuda")
    total = torch.cuda.get_device_properties(CUDA).total_memory
    fraction = (512 << 20) / total
    limit = int(fraction * total)
    search = estimate.batch_search(limit, margin=0, outside=0, process=process)
    assert search.largest > 100 and search.tried and search.process == process
    assert _runs_on_a_small_card("peak_moving_mlp", search.largest, fraction, limit, process)


@pytest.mark.parametrize("limited", [False, True])
def test_a_fresh_process_reserves_what_the_replay_with_workspaces_at_first_use_reserves(limited):
    # A new process makes each thread's cuBLAS workspace when its first matrix product calls cuBLAS,
    # after that product's output: the replay so placed reserves what the process does, to the byte
    build, _ = SMALL_CARD_MODELS["peak_moving_mlp"]
    estimate = estimate_memory(build, torch.zeros(8, 256), device="cuda")
    total = torch.cuda.get_device_properties(CUDA).total_memory
    card = (512 << 20) / total  # the fraction of the small card, whose largest batch is run
    card_limit = int(card * total)
    batch = estimate.batch_search(card_limit, margin=0, outside=0).largest
    fraction, limit = (card, card_limit) if limited else (1.0, None)
    assert run_in_a_new_process("peak_moving_mlp", batch, fraction, "fresh") == estimate.reserved_at(batch, limit, process="fresh")


class GroupedAttention(nn.Module):
    """Grouped-query attention in float32 with a float causal mask: CUDA's math path (no fused kernel
    takes grouped heads in float32), as Qwen2's and Llama's layers run it."""

    def __init__(self, width: int = 256, heads: int = 8, groups: int = 2) -> None:
        super().__init__()
        self.heads, self.groups, self.size = heads, groups, width // heads
        self.q, self.o = nn.Linear(width, width), nn.Linear(width, width)
        self.kv = nn.Linear(width, 2 * groups * self.size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, width = x.shape
        q = self.q(x).view(b, n, self.heads, self.size).transpose(1, 2)
        k, v = self.kv(x).view(b, n, 2, self.groups, self.size).permute(2, 0, 3, 1, 4)
        mask = torch.full((n, n), float("-inf"), device=x.device).triu(1)
        out = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        return self.o(out.transpose(1, 2).reshape(b, n, width))


def _allocations(run) -> list[int]:
    """The bytes of each allocation the caching allocator saw while ``run`` ran (its history)."""
    torch.cuda.memory._record_memory_history(max_entries=100_000)
    try:
        run()
        torch.cuda.synchronize()
        trace = torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()]
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    return [entry["size"] for entry in trace if entry["action"] == "alloc"]


@pytest.mark.skipif(not hasattr(torch.ops.aten, "_safe_softmax"), reason="torch 2.4's math attention runs softmax")
def test_math_attention_with_a_mask_makes_the_matrices_the_device_makes():
    # ATen's math attention adds the mask in place on the device (out of place for fake tensors) and
    # _safe_softmax takes a bool of the matrix and one of its rows beside its output: the estimate's
    # step makes what the allocator's history shows, and its peak is the allocator's to the byte
    build, batch, n = GroupedAttention, 8, 512
    estimate = estimate_memory(build, torch.zeros(batch, n, 256), device="cuda", fit=False)
    measured = step_peak(build, lambda b: torch.randn(b or batch, n, 256, device=CUDA), torch.optim.Adam)
    assert estimate.peak == measured
    matrix = batch * 8 * n * n * 4
    model, x = build().to(CUDA), torch.randn(batch, n, 256, device=CUDA)
    made = _allocations(lambda: model(x).sum().backward())
    births = [nbytes for _, nbytes in estimate.step_events.events if nbytes > 0]
    steps = 2  # the estimate's two steps
    for size in (matrix, matrix // 4):  # the scores, the softmax's output and their gradients; the -inf entries
        assert births.count(size) == steps * made.count(size), (size, births.count(size), made.count(size))
    assert made.count(matrix // 4) >= 1


@pytest.mark.parametrize("how", ["gather", "index_select"])
def test_a_gather_or_index_select_backward_makes_one_gradient_as_the_device_does(how):
    # their backward adds the output's gradient into zeros of the input's shape, in place on the device
    # (out of place for fake tensors): 64 MB once, not twice, at batch 4096
    from .test_estimate_backward_formulas import Picks

    batch = 4096
    estimate = estimate_memory(lambda: Picks(how), torch.zeros(batch, 256), device="cuda", fit=False)
    measured = step_peak(lambda: Picks(how), lambda b: torch.randn(b or batch, 256, device=CUDA), torch.optim.Adam)
    assert estimate.peak == measured


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


if __name__ == "__main__":  # one run of :func:`run_in_a_new_process`: model name, batch, fraction, process
    print(json.dumps(_run_at(sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4])))


def _eleven_mib_layers() -> nn.Module:
    # each weight and its gradient 1,408 x 2,048 x 4 B = 11 MiB: a new 12 MiB segment, 1 MiB not split off
    return nn.Sequential(nn.Linear(1408, 2048, bias=False), nn.ReLU(), nn.Linear(2048, 1408, bias=False), nn.ReLU(),
                         nn.Linear(1408, 2048, bias=False))  # fmt: skip


def test_the_peak_counts_whole_blocks_as_the_allocator_does():
    """``torch.cuda.max_memory_allocated()`` counts each block whole, and a block is split only where
    more than 1 MiB would remain: weights and gradients of 11 MiB each hold 12 MiB. The estimate's peak
    counts them so (``whole_blocks``, in ``other``): its requests replayed from the device's own
    segments give the device's peak to the byte, and in a fresh process (the H200, 2026-11-29) the
    estimate itself did; in this one earlier tests' segments may take a request elsewhere (1 MiB
    apart, ``tests/test_estimate_attention_backward_cuda.py``). The requests alone are below the
    allocator's figure by those remainders."""
    segments: dict = {}
    measured = step_peak(_eleven_mib_layers, lambda b: torch.randn(64 if b is None else b, 1408, device=CUDA), SGD, segments=segments)
    for emulate in (False, True):
        est = estimate_memory(_eleven_mib_layers, torch.zeros(64, 1408), optimizer=SGD, device="cuda", emulate=emulate, fit=False)
        assert est.whole_blocks >= 3 << 20, est.whole_blocks
        assert peak_from_the_devices_segments(est, segments) == measured, (emulate, est.peak, measured, est.whole_blocks)
        assert abs(est.peak - measured) <= 0.02 * measured, (emulate, est.peak, measured)
        assert est.peak - est.whole_blocks < measured
