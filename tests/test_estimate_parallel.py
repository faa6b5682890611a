"""Each rank's memory under DDP and FSDP2, estimated in one process, against real runs.

A real two-process ``torchrun`` on the CPU (gloo with one worker thread, each collective
let go of before the caller goes on; ``tests/parallel_estimate_worker.py``) trains DDP
(with and without ``gradient_as_bucket_view``, under bf16 autocast, with BatchNorm's
buffers, with position tables as buffers broadcast or not, with buckets rebuilt at two
caps) and FSDP2 (resharding after forward or not, float32 or bf16 parameters with float32
reduction) and measures each rank's peak over two steps, each step's and each phase's,
with the CPU counter started before the model was built; the estimate for that rank
(``parallel=..., world_size=2, rank=r``) must give the same bytes. Consistency at 2, 4
and 8 ranks, DDP's bucket assignment and rebuild, the largest batch per rank and the
fake process group's clean-up are checked in-process.
"""

from __future__ import annotations

import functools
import json
import math

import pytest
import torch
import torch.distributed as dist

from pytorch_mem_profiler.estimate import EstimateUnsupported, estimate_memory
from pytorch_mem_profiler.torch_versions import FSDP2_ON_CPU
from pytorch_mem_profiler.estimate.parallel import DDP, FIRST_BUCKET_BYTES, FSDP2, _EmulatedReducer, bucket_assignment, parse_parallel

from .parallel_estimate_worker import BATCH, SCENARIOS, SEQ, VOCAB, build, loss_fn
from .torchrun_helper import ROOT, run_command

needs_fsdp2_cpu = pytest.mark.skipif(not FSDP2_ON_CPU, reason="FSDP2 on the CPU needs torch >= 2.6")
#: the scenarios this torch runs for real on the CPU
RUN = [name for name, scenario in SCENARIOS.items() if scenario.parallel == "ddp" or FSDP2_ON_CPU]


def tokens(batch: int) -> torch.Tensor:
    return torch.zeros(batch, SEQ, dtype=torch.long)


def estimate_rank(name: str, world_size: int = 2, rank: int = 0, **kwargs):
    scenario = SCENARIOS[name]
    kwargs = {"batch_size": BATCH, "fit": False, **kwargs}
    return estimate_memory(
        functools.partial(build, **scenario.model), tokens, loss_fn=loss_fn, targets=tokens, optimizer=torch.optim.AdamW,
        device="cpu", parallel=scenario.plan(), world_size=world_size, rank=rank, autocast=scenario.autocast, **kwargs,
    )  # fmt: skip


def phase_peaks(rows: list[dict]) -> dict[str, int]:
    """Each phase's peak over the steps, from the worker's rows."""
    peaks: dict[str, int] = {}
    for row in rows:
        peaks[row["phase"]] = max(peaks.get(row["phase"], 0), row["peak"])
    return peaks


@pytest.fixture(scope="module")
def real_ranks(tmp_path_factory):
    import sys

    out = tmp_path_factory.mktemp("parallel_estimate")
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone",
        str(ROOT / "tests" / "parallel_estimate_worker.py"), "--out", str(out), "--scenarios", ",".join(RUN),
    ]  # fmt: skip
    proc = run_command(cmd, 240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = {r: json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)}
    for r in (0, 1):
        for name in RUN:
            assert "error" not in ranks[r][name], ranks[r][name]["error"]
    return ranks


@pytest.mark.distributed
@pytest.mark.parametrize("name", RUN)
def test_each_ranks_peak_is_the_real_runs_to_the_byte(real_ranks, name):
    for r in (0, 1):
        real = real_ranks[r][name]
        est = estimate_rank(name, 2, r)
        # shards (FSDP2: rank 1's last ones shorter), buffers and AdamW's state, from the real storages
        assert (est.weights, est.buffers, est.optimizer_state) == (real["weights"], real["buffers"], real["optimizer_state"])
        assert est.peak == real["peak"]
        # the first step (no optimizer state before its step; DDP's first-iteration bucket) and the next
        assert list(est.step_peaks) == real["step_peaks"]
        assert dict(est.phases) == phase_peaks(real["phases"])


@pytest.mark.distributed
@needs_fsdp2_cpu
def test_fsdp2_ranks_differ_where_their_shards_do(real_ranks):
    for name in ("fsdp2", "fsdp2_keep", "fsdp2_bf16"):
        assert real_ranks[0][name]["optimizer_state"] > real_ranks[1][name]["optimizer_state"]
        assert estimate_rank(name, 2, 0).peak > estimate_rank(name, 2, 1).peak


@pytest.mark.distributed
@needs_fsdp2_cpu
def test_real_runs_order_the_strategies_as_the_estimate_does(real_ranks):
    names = ("fsdp2_bf16", "fsdp2", "fsdp2_keep", "ddp")
    real = [real_ranks[0][name]["peak"] for name in names]
    # keeping the gathered parameters through the forward costs; bf16 gathers cost less
    assert real == sorted(real)
    assert [estimate_rank(name).peak for name in names] == real


@pytest.mark.distributed
def test_ddp_broadcasts_the_buffers_in_one_flat_copy_each_forward(real_ranks):
    real, alone = real_ranks[0]["ddp_tables"], real_ranks[0]["ddp_tables_no_broadcast"]
    est = estimate_rank("ddp_tables")
    # both tables are float32: one bucket, copied flat before every forward, on top of everything else
    assert est.peak_phase == "forward" and est.parallel_parts["comm_buffers"] == real["buffers"]
    assert real["peak"] > alone["peak"] and est.peak == real["peak"]
    # without the broadcast the forward holds no copy of them
    assert estimate_rank("ddp_tables_no_broadcast").phases["forward"] == phase_peaks(alone["phases"])["forward"]
    assert "comm_buffers" not in estimate_rank("ddp_tables_no_broadcast").parallel_parts


@pytest.mark.distributed
@pytest.mark.parametrize("name", ["ddp", "ddp_wide", "ddp_wide_1mb"])
def test_ddp_buckets_are_rebuilt_as_ddp_rebuilds_them(real_ranks, name):
    # the emulated reducer on real tensors, over two steps: the real run's buckets after its rebuild
    scenario = SCENARIOS[name]
    model = build(**scenario.model)
    reducer = _EmulatedReducer(model, scenario.plan())
    sizes = lambda: [b.numel() * b.element_size() for b in reducer.buckets]  # noqa: E731
    whole = sum(p.numel() * p.element_size() for p in model.parameters())
    assert sizes() == [whole]  # the first iteration: every parameter in one bucket
    batch = torch.randint(0, VOCAB, (BATCH, SEQ))
    for _ in range(2):
        loss_fn(model(batch), batch).backward()
        model.zero_grad(set_to_none=True)
    assert sizes() == real_ranks[0][name]["bucket_sizes"] == real_ranks[1][name]["bucket_sizes"]
    if name != "ddp":
        assert len(sizes()) > 1


@pytest.mark.distributed
@needs_fsdp2_cpu
def test_fsdp2_peak_holds_the_prefetched_blocks_all_gather_buffer(real_ranks):
    est = estimate_rank("fsdp2")
    # one block's parameters, each padded in dim 0 to a multiple of the world, gathered flat
    block = build().blocks[0]
    padded = sum(math.ceil(p.shape[0] / 2) * 2 * p[0].numel() * p.element_size() for p in block.parameters())
    assert est.peak_phase == "backward" and est.parallel_parts["comm_buffers"] == padded
    assert est.peak == real_ranks[0]["fsdp2"]["peak"]


# -- in one process -------------------------------------------------------------------------
def wide_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])


def test_ddp_buckets_follow_bucket_cap():
    params = [torch.empty(1024, 256) for _ in range(4)]  # 1 MiB each
    assert bucket_assignment(params, [FIRST_BUCKET_BYTES, 25 * 2**20]) == [[0], [1, 2, 3]]  # 1 MiB first, then 25 MiB
    assert bucket_assignment(params, [2 * 2**20]) == [[0, 1], [2, 3]]


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not built")
@pytest.mark.parametrize("limits", [[FIRST_BUCKET_BYTES, 25 * 2**20], [2**20], [3 * 2**19, 2**21], [2**62]])
def test_bucket_assignment_is_ddps(limits):
    # mixed dtypes: each dtype fills its own buckets, each with its own run of limits
    sizes = [(300, torch.float32), (200, torch.float16), (700, torch.float32), (900, torch.float16), (40, torch.float64),
             (1500, torch.float32), (10, torch.float16), (800, torch.float64), (600, torch.float32)]  # fmt: skip
    tensors = [torch.empty(n, 1024, dtype=dtype) for n, dtype in sizes]
    found = dist._compute_bucket_assignment_by_size(tensors, limits, [False] * len(tensors))
    ddp = found[0] if isinstance(found, tuple) else found  # torch 2.1+ also returns each bucket's limit
    assert sorted(map(sorted, ddp)) == sorted(map(sorted, bucket_assignment(tensors, limits)))


@needs_fsdp2_cpu
@pytest.mark.parametrize("world", [2, 4, 8])
def test_fsdp2_sharded_figures_are_one_nth_of_the_whole(world):
    whole = estimate_memory(wide_model(), torch.zeros(8, 64), device="cpu", fit=False, optimizer=torch.optim.AdamW)
    est = estimate_memory(
        wide_model(), torch.zeros(8, 64), device="cpu", fit=False, optimizer=torch.optim.AdamW,
        parallel="fsdp2", world_size=world,
    )  # fmt: skip
    params = 4 * (64 * 64 + 64) * 4
    assert whole.weights == params
    assert est.weights * world == params  # 64 rows split evenly: no padding
    moments = 2 * params
    assert est.optimizer_state == moments // world + 4 * 8  # and a float32 step per parameter
    assert est.gradients * world == params
    # one block gathered at the backward's peak at least
    assert est.parallel_parts["regrown"] >= (64 * 64 + 64) * 4
    # the mesh's rank map: one integer per rank, on the CPU
    assert est.parallel_parts["device_mesh"] == world * torch.empty(0, dtype=torch.int).element_size()


@needs_fsdp2_cpu
@pytest.mark.parametrize("world", [2, 4, 8])
def test_fsdp2_on_an_emulated_gpu_shards_to_one_nth_in_the_allocators_blocks(world):
    # 1024 rows of 4 KiB and 4 KiB biases: each shard a whole number of the allocator's 512-byte blocks
    model = lambda: torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(4)])  # noqa: E731
    run = functools.partial(estimate_memory, model, torch.zeros(8, 1024), device="cuda", emulate=True, fit=False, optimizer=torch.optim.AdamW)
    whole, est = run(), run(parallel="fsdp2", world_size=world)
    assert whole.weights == 4 * (1024 * 1024 + 1024) * 4
    assert est.weights * world == whole.weights and est.gradients * world == whole.gradients
    # AdamW's two moments are sharded (its step counts, one per parameter, are not)
    assert (whole.optimizer_state - est.optimizer_state) * world == (world - 1) * 2 * whole.weights
    # the rank map lives on the CPU: none of the GPU's memory
    assert "device_mesh" not in est.parallel_parts


@needs_fsdp2_cpu
@pytest.mark.parametrize("name", ["ddp", "fsdp2", "fsdp2_bf16"])
def test_the_largest_batch_per_rank_fits_and_a_tenth_more_does_not(name):
    est = estimate_rank(name, 2, 0, fit=True)
    budget = est.peak + 40 * int(est.fit.per_sample)
    batch = est.max_batch_size(budget, margin=0)
    assert batch > BATCH
    # the answer's own fake step (one rank of two, that batch per rank) fits; a tenth more does not
    assert estimate_rank(name, 2, 0, batch_size=batch).peak <= budget
    assert estimate_rank(name, 2, 0, batch_size=math.ceil(1.1 * batch)).peak > budget


@needs_fsdp2_cpu
def test_the_largest_batch_per_rank_grows_with_what_is_sharded():
    def largest(parallel, world_size):
        est = estimate_memory(
            wide_model(), torch.zeros(8, 64), device="cpu", optimizer=torch.optim.AdamW, parallel=parallel, world_size=world_size,
        )  # fmt: skip
        return est.max_batch_size(budget, margin=0)

    one = estimate_memory(wide_model(), torch.zeros(8, 64), device="cpu", optimizer=torch.optim.AdamW)
    budget = one.peak + 20 * int(one.fit.per_sample)
    alone = one.max_batch_size(budget, margin=0)
    # DDP's buckets take room from the batch; FSDP2's shards give some back, more the more ranks
    assert largest("ddp", 2) < alone < largest("fsdp2", 2) < largest("fsdp2", 8)


@needs_fsdp2_cpu
def test_fsdp2_pads_dim_0_to_a_multiple_of_the_world():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 10), torch.nn.Linear(10, 8))  # 10 rows over 4 ranks
    est = {r: estimate_memory(model, torch.zeros(2, 8), device="cpu", fit=False, parallel="fsdp2", world_size=4, rank=r) for r in (0, 3)}
    # each rank's shard storage holds ceil(rows / 4) rows
    padded = (math.ceil(10 / 4) * 8 + math.ceil(10 / 4) + 2 * 10 + 2 * 1) * 4
    assert est[0].weights == padded == est[3].weights
    # rank 3 holds 1 of the 10 rows of the first layer: its optimizer state is smaller
    assert est[3].optimizer_state < est[0].optimizer_state


@needs_fsdp2_cpu
def test_no_process_group_is_left_and_a_users_group_is_refused():
    assert not dist.is_initialized()
    # what the class held before (nothing, or what another tool left there): the same after
    before = torch.UntypedStorage.__dict__.get("resize_")
    estimate_memory(wide_model(), torch.zeros(8, 64), device="cpu", fit=False, parallel="fsdp2", world_size=2)
    assert not dist.is_initialized()
    assert torch.UntypedStorage.__dict__.get("resize_") is before
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        with pytest.raises(ValueError, match="already initialised"):
            estimate_memory(wide_model(), torch.zeros(8, 64), device="cpu", fit=False, parallel="fsdp2", world_size=2)
        assert dist.get_world_size() == 1  # the user's group is untouched
        # DDP is emulated: no process group needed, none touched
        est = estimate_memory(wide_model(), torch.zeros(8, 64), device="cpu", fit=False, parallel="ddp", world_size=2)
        assert est.parallel_parts["ddp_buckets"] == 4 * (64 * 64 + 64) * 4
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(FSDP2_ON_CPU, reason="this torch runs FSDP2 on the CPU")
def test_fsdp2_on_fake_cpu_tensors_is_refused_by_name_before_torch_2_6():
    # torch 2.4 and 2.5 make CUDA streams for FSDP2 whatever the device: refused before anything runs
    for device in ("cpu", "cuda"):  # emulated CUDA runs on fake CPU tensors too
        with pytest.raises(EstimateUnsupported, match=r"parallel='fsdp2' .* needs torch 2\.6 or later: torch 2\.[45]"):
            estimate_memory(
                wide_model(), torch.zeros(8, 64), device=device, emulate=True if device == "cuda" else None, fit=False,
                parallel="fsdp2", world_size=2,
            )
    assert not dist.is_initialized()
    est = estimate_memory(wide_model(), torch.zeros(8, 64), device="cpu", fit=False, parallel="ddp", world_size=2)
    assert est.parallel_parts["ddp_buckets"] == 4 * (64 * 64 + 64) * 4  # every gradient, in one flat bucket


def test_bad_parallel_arguments_are_named():
    model, x = wide_model(), torch.zeros(2, 64)
    with pytest.raises(ValueError, match="parallel must be"):
        estimate_memory(model, x, device="cpu", parallel="zero3", world_size=2)
    with pytest.raises(ValueError, match="needs world_size"):
        estimate_memory(model, x, device="cpu", parallel="ddp")
    with pytest.raises(ValueError, match="world_size must be"):
        estimate_memory(model, x, device="cpu", parallel="ddp", world_size=0)
    with pytest.raises(ValueError, match="rank must be"):
        estimate_memory(model, x, device="cpu", parallel="ddp", world_size=2, rank=2)
    with pytest.raises(ValueError, match="mixed_precision"):
        parse_parallel(FSDP2(mixed_precision="int8"))


@needs_fsdp2_cpu
def test_what_if_table_across_strategies_and_world_sizes():
    from pytorch_mem_profiler.estimate.parallel import what_ifs

    compare = what_ifs("ddp:2,fsdp2:2,fsdp2:8")
    est = estimate_memory(wide_model(), torch.zeros(8, 64), device="cpu", fit=False, compare=compare)
    table = est.format_comparison("B")
    for name in ("ddp x2", "fsdp2 x2", "fsdp2 x8"):
        assert f"| {name} | {est.alternatives[name].peak_allocated} " in table.replace(",", "")
    assert est.alternatives["fsdp2 x8"].peak < est.alternatives["fsdp2 x2"].peak < est.alternatives["ddp x2"].peak


@needs_fsdp2_cpu
def test_the_command_estimates_a_rank_and_the_what_ifs(tmp_path, capsys):
    from pytorch_mem_profiler.analysis.cli import main

    path = tmp_path / "model.py"
    path.write_text(
        "import torch\nfrom torch import nn\nbatch_size = 8\n"
        "def build_model():\n    return nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)])\n"
        "def example_inputs(batch_size):\n    return torch.randn(batch_size, 64)\n"
    )
    argv = ["estimate", str(path), "--device", "cpu", "--units", "B", "--parallel", "fsdp2", "--world-size", "4"]
    assert main([*argv, "--what-if", "ddp:2,fsdp2:8"]) == 0
    out = capsys.readouterr().out
    build = lambda: torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])  # noqa: E731
    expected = {
        name: estimate_memory(build, lambda b: torch.zeros(b, 64), batch_size=8, device="cpu", parallel=p, world_size=n, fit=False)
        for name, p, n in (("base", "fsdp2", 4), ("ddp x2", "ddp", 2), ("fsdp2 x8", "fsdp2", 8))
    }
    assert "Parallel: FSDP2, rank 0 of 4 (figures per rank)" in out
    assert f"Peak allocated{'.' * 3}" in out
    compact = out.replace(",", "")
    for name in ("ddp x2", "fsdp2 x8"):
        assert f"| {name} | {expected[name].peak_allocated} B |" in compact
    # the largest batch, per rank
    assert main([*argv, "--memory", "300000B", "--margin", "0"]) == 0
    out = capsys.readouterr().out
    per_rank = estimate_memory(build, lambda b: torch.zeros(b, 64), batch_size=8, device="cpu", parallel="fsdp2", world_size=4)
    batch = per_rank.max_batch_size(300_000, margin=0)
    assert f"Largest batch per rank on a device of 300000 B: {batch} ({4 * batch} across the 4 ranks;" in out.replace(",", "")
    assert main([*argv[:-2]]) == 2  # --parallel without --world-size
    assert "--parallel needs --world-size" in capsys.readouterr().err
