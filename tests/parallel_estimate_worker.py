"""One rank of a real DDP or FSDP2 run, measured, for the per-rank estimate's tests and benchmark.

Started by ``torchrun`` (``python -m torch.distributed.run --nproc_per_node 2 --standalone
tests/parallel_estimate_worker.py --out DIR --scenarios ddp,fsdp2``) from
``tests/test_estimate_parallel.py`` (gloo, CPU) and ``benchmarks/parallel_estimate_accuracy.py``
(NCCL, two GPUs, one launch per scenario). Each rank writes ``DIR/rank<r>.json``: per
scenario, the peak over two training steps above what was allocated before the model was
built (the CPU counter, started before the model is built, on the CPU; the caching
allocator's peak on a GPU, where ``--warmup`` first runs two steps, waits for the device
and NCCL, and then measures two more: the steady state, DDP's bucket rebuild behind it),
each step's and each phase's peak, ``torch.cuda.memory_stats`` figures on a GPU, and
independent figures: the bytes of the rank's parameter shards and optimizer state, from
their storages.

On the CPU the collectives run on gloo with one worker thread, each followed by a flush
(:class:`GlooReleases`): gloo's thread drops a finished collective's tensors some time
after the caller has gone on, which on a busy machine put a whole all-gather buffer on
top of the next tensors now and then. The run measured is the one where gloo lets go at
once, the same on every run.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import inspect
import json
import os
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pytorch_mem_profiler.estimate.parallel import DDP, FSDP2, fully_shard_function  # noqa: E402
from pytorch_mem_profiler.measure.devices import CpuCounter  # noqa: E402
from tests.helpers import local_storage_bytes  # noqa: E402

BATCH = 8
STEPS = 2
VOCAB, WIDTH, HIDDEN, SEQ = 101, 48, 130, 12  # odd sizes: FSDP2 pads dim 0 to a multiple of the world


class TokenBatchNorm(torch.nn.BatchNorm1d):
    """Batch normalisation over every token of the batch: running statistics are buffers,
    which DDP broadcasts from rank 0 before each forward (``broadcast_buffers=True``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.flatten(0, 1)).view_as(x)


class Block(torch.nn.Module):
    def __init__(self, width: int, hidden: int, norm: str = "layer") -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(width) if norm == "layer" else TokenBatchNorm(width)
        self.up = torch.nn.Linear(width, hidden)
        self.down = torch.nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class Net(torch.nn.Module):
    """An embedding, repeated blocks and a head: the shape FSDP2 users wrap block by block.

    ``positions``: the length of fixed cosine and sine position tables kept as buffers (as
    rotary embeddings keep their caches), added to the embeddings; 0 for none.
    """

    def __init__(
        self, width: int = WIDTH, hidden: int = HIDDEN, layers: int = 3, norm: str = "layer", positions: int = 0
    ) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, width)
        self.blocks = torch.nn.ModuleList(Block(width, hidden, norm) for _ in range(layers))
        self.head = torch.nn.Linear(width, VOCAB)
        if positions:
            angle = torch.arange(positions).unsqueeze(1) / 100 ** (torch.arange(width) / width)
            self.register_buffer("cos_table", angle.cos())
            self.register_buffer("sin_table", angle.sin())

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        if hasattr(self, "cos_table"):
            x = x + self.cos_table[: tokens.shape[1]] + self.sin_table[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(x).flatten(0, 1)


def build(width: int = WIDTH, hidden: int = HIDDEN, layers: int = 3, norm: str = "layer", positions: int = 0) -> Net:
    torch.manual_seed(0)
    return Net(width, hidden, layers, norm, positions)


def loss_fn(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(output.float(), targets.flatten())


@dataclass(frozen=True)
class Scenario:
    """One way of training the model on each rank.

    Attributes:
        parallel: ``"ddp"`` or ``"fsdp2"``.
        settings: the keyword arguments of :class:`DDP` or :class:`FSDP2`.
        model: keyword arguments of :func:`build` (the norm, position tables).
        autocast: the forward under ``torch.autocast`` in this dtype (``"bf16"``), or ``None``.
    """

    parallel: str
    settings: dict = field(default_factory=dict)
    model: dict = field(default_factory=dict)
    autocast: str | None = None

    def plan(self) -> DDP | FSDP2:
        return DDP(**self.settings) if self.parallel == "ddp" else FSDP2(**self.settings)


#: A position table large enough that DDP's flat broadcast of the buffers is the step's peak.
TABLE_POSITIONS = 4096

SCENARIOS = {
    "ddp": Scenario("ddp"),
    "ddp_view": Scenario("ddp", {"gradient_as_bucket_view": True}),
    "ddp_bf16": Scenario("ddp", autocast="bf16"),
    "ddp_bn": Scenario("ddp", model={"norm": "batch"}),
    # a model of 3.2 MB: DDP's rebuilt buckets, 1 MiB then up to 25 MiB, or 1 MiB each
    "ddp_wide": Scenario("ddp", model={"width": 256, "hidden": 512}),
    "ddp_wide_1mb": Scenario("ddp", {"bucket_cap_mb": 1}, model={"width": 256, "hidden": 512}),
    "ddp_tables": Scenario("ddp", model={"positions": TABLE_POSITIONS}),
    "ddp_tables_no_broadcast": Scenario("ddp", {"broadcast_buffers": False}, model={"positions": TABLE_POSITIONS}),
    "fsdp2": Scenario("fsdp2"),
    "fsdp2_keep": Scenario("fsdp2", {"reshard_after_forward": False}),
    "fsdp2_bf16": Scenario("fsdp2", {"mixed_precision": "bf16"}),
}


# -- gloo on the CPU, with its collectives' tensors let go of before the caller goes on ----------
ONE_THREAD_GLOO = "gloo_one_thread"

#: The collectives FSDP2 (each torch's name for them) and DDP (its buffers' broadcast) call.
COLLECTIVES = ("all_gather_into_tensor", "reduce_scatter_tensor", "all_gather_single", "reduce_scatter_single", "_broadcast_coalesced")


def _one_thread_gloo(store: Any, rank: int, size: int, timeout: Any) -> Any:
    from torch.distributed import ProcessGroupGloo

    options = ProcessGroupGloo._Options()
    options._timeout = timeout
    options._devices = [ProcessGroupGloo.create_default_device()]
    options._threads = 1
    return ProcessGroupGloo(store, rank, size, options)


class GlooReleases:
    """Each collective returns only once gloo's worker thread has dropped its work.

    Gloo runs a collective on a worker thread, and that thread drops the finished work
    object, with the tensors it was handed (FSDP2's all-gather output, DDP's flat copy of
    its buffers), a little after the caller has gone on: at once on an idle machine, some
    milliseconds later on a busy one, while the caller's next tensors count on top. With
    one worker thread taking the collectives in order, an all-reduce of a tensor the counter
    does not see (its dispatch mode off for it) returns only after that thread let go of
    every collective before it. :meth:`flush` is called before and after every collective
    FSDP2 and DDP make from Python (``COLLECTIVES``), after DDP's pre-forward (its bucket
    rebuild's broadcasts are C++) and at each phase's end.
    """

    def __init__(self) -> None:
        self.flag = torch.zeros(1)
        self._saved: dict[str, Callable[..., Any]] = {}

    def flush(self) -> None:
        from torch.utils._python_dispatch import _disable_current_modes

        with _disable_current_modes():
            dist.all_reduce(self.flag)

    def _released(self, call: Callable[..., Any]) -> Callable[..., Any]:
        def released(*args: Any, **kwargs: Any) -> Any:
            self.flush()  # the collectives before it, C++'s too (DDP's bucket rebuild), let go of first
            out = call(*args, **kwargs)
            if out is None:  # a synchronous collective: done, and now let go of
                self.flush()
            return out

        return released

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        for name in COLLECTIVES:
            if hasattr(dist, name):
                self._saved[name] = getattr(dist, name)
                setattr(dist, name, self._released(self._saved[name]))
        try:
            yield
        finally:
            for name, call in self._saved.items():
                setattr(dist, name, call)
            self._saved.clear()


#: ``torch.cuda.memory_stats`` keys kept for each phase and at the end (bytes, since the last reset)
CUDA_STATS = (
    "allocated_bytes.all.current", "allocated_bytes.all.peak", "active_bytes.all.peak",
    "requested_bytes.all.peak", "reserved_bytes.all.peak", "num_alloc_retries",
)  # fmt: skip


def _cuda_drained(device: torch.device) -> None:
    """Wait until nothing of an earlier step is still held: the device idle, Python's cycles
    collected, and ProcessGroupNCCL's watchdog past its next round (it drops the finished
    collectives' work objects, and with them the tensors they kept alive: every 100 ms in
    recent versions, every second in older ones' cleanup thread)."""
    torch.cuda.synchronize(device)
    gc.collect()
    dist.barrier()
    time.sleep(1.1)
    gc.collect()
    torch.cuda.synchronize(device)


class _Phases:
    """Each phase's peak (bytes above ``base``): on CUDA the allocator's peak since the phase
    began (reset at each boundary), on the CPU the counter's peak since the last boundary
    (after a flush of gloo's finished collectives, which a late thread would otherwise free
    in the next phase)."""

    def __init__(self, device: torch.device, base: int, counter: CpuCounter | None, gloo: GlooReleases | None) -> None:
        self.device, self.base, self.counter, self.gloo = device, base, counter, gloo
        self.rows: list[dict] = []
        self.peak = 0

    def reset(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self.counter is not None:
            self.counter.mark()
        self.peak = 0

    def mark(self, step: int, phase: str) -> None:
        if self.device.type != "cuda":
            if self.gloo is not None:
                self.gloo.flush()
            reading = self.counter.mark()
            self.peak = max(self.peak, reading.peak_allocated)
            self.rows.append({"step": step, "phase": phase, "peak": reading.peak_allocated, "allocated": reading.allocated})
            return
        stats = torch.cuda.memory_stats(self.device)
        peak = stats["allocated_bytes.all.peak"] - self.base
        self.peak = max(self.peak, peak)
        row = {"step": step, "phase": phase, "peak": peak, "allocated": stats["allocated_bytes.all.current"] - self.base}
        row.update({k: stats.get(k, 0) for k in CUDA_STATS})
        self.rows.append(row)
        torch.cuda.reset_peak_memory_stats(self.device)

    def step_peaks(self, steps: range) -> list[int]:
        return [max(r["peak"] for r in self.rows if r["step"] == i) for i in steps]


def _wrap(scenario: Scenario, model: torch.nn.Module, device: torch.device, gloo: GlooReleases | None) -> torch.nn.Module:
    """``model`` under DDP or FSDP2 (each repeated block, then the root), as the scenario says."""
    plan = scenario.plan()
    if isinstance(plan, DDP):
        from torch.nn.parallel import DistributedDataParallel

        kwargs: dict[str, Any] = {}
        if not plan.broadcast_buffers:
            # torch 2.14 names it forward_sync_buffers (broadcast_buffers warns there)
            known = inspect.signature(DistributedDataParallel.__init__).parameters
            kwargs["forward_sync_buffers" if "forward_sync_buffers" in known else "broadcast_buffers"] = False
        wrapped = DistributedDataParallel(
            model,
            device_ids=[device.index] if device.type == "cuda" else None,
            gradient_as_bucket_view=plan.gradient_as_bucket_view,
            bucket_cap_mb=None if plan.bucket_cap_mb == 25.0 else plan.bucket_cap_mb,  # None: DDP's default, 1 MiB first
            **kwargs,
        )
        if gloo is not None:
            # after DDP's pre-forward (its bucket rebuild broadcasts from C++), before the model's
            model.register_forward_pre_hook(lambda module, args: gloo.flush())
        return wrapped
    from torch.distributed.device_mesh import init_device_mesh

    from pytorch_mem_profiler.estimate.parallel import _dtype, _mixed_precision_policy

    fully_shard = fully_shard_function()
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    kwargs = {"mesh": mesh, "reshard_after_forward": plan.reshard_after_forward}
    if plan.mixed_precision is not None:
        kwargs["mp_policy"] = _mixed_precision_policy(_dtype(plan.mixed_precision))
    for block in model.blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model


def run(name: str, device: torch.device, sizes: dict, warmup: bool = False, gloo: GlooReleases | None = None) -> dict:
    """One scenario: build, wrap, (with ``warmup``: ``STEPS`` steps first), then ``STEPS`` measured steps.

    On CUDA everything is measured from ``base``, what was allocated before the model was
    built (with a previous scenario's tensors collected): the cuBLAS workspaces a first
    matmul takes count, as the estimate counts them. After the warm-up steps the run waits
    for the device and NCCL's watchdog (:func:`_cuda_drained`) so that the measured steps
    are the steady state the estimate's two steps model (DDP rebuilds its buckets before
    its second forward; the first step's may live on in NCCL's work objects for a while).
    On the CPU the first two steps are measured, each step's and phase's peak apart.
    """
    scenario = SCENARIOS[name]
    counter = CpuCounter() if device.type == "cpu" else None
    if counter is not None:
        counter.start()
    if device.type == "cuda":
        gc.collect()
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    try:
        with torch.device(device):
            model = build(**{**scenario.model, **sizes})
        wrapped = _wrap(scenario, model, device, gloo)
        opt = torch.optim.AdamW(wrapped.parameters())
        g = torch.Generator().manual_seed(dist.get_rank())
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g).to(device)
        targets = tokens.clone()  # the estimate's targets are a tensor of their own
        phases = _Phases(device, base, counter, gloo)
        cuda = device.type == "cuda"
        if cuda:
            _cuda_drained(device)  # DDP's broadcast of the weights at wrapping: its buffers gone
        elif gloo is not None:
            gloo.flush()
        before = torch.cuda.memory_allocated(device) - base if cuda else counter.read().allocated
        autocast = (
            torch.autocast(device.type, dtype=torch.bfloat16) if scenario.autocast == "bf16" else contextlib.nullcontext()
        )

        def step(i: int) -> None:
            # the step as the estimate runs it: the output and the loss kept until the step ends
            with autocast:
                output = wrapped(tokens)
            phases.mark(i, "forward")
            loss = loss_fn(output, targets)
            phases.mark(i, "other")
            loss.backward()
            phases.mark(i, "backward")
            opt.step()
            phases.mark(i, "optimizer")
            opt.zero_grad(set_to_none=True)
            del output, loss
            phases.mark(i, "other")

        phases.reset()
        first_steps_peak = None
        measured = range(STEPS)
        if warmup:
            for i in range(STEPS):
                step(i)  # the first steps as a user's run has them (DDP's bucket rebuild and all)
            if cuda:
                torch.cuda.synchronize(device)
                first_steps_peak = phases.peak
                _cuda_drained(device)
            phases.reset()
            measured = range(STEPS, 2 * STEPS)
        for i in measured:
            step(i)
        if cuda:
            torch.cuda.synchronize(device)
            phases.mark(-1, "end")
            end = torch.cuda.memory_allocated(device) - base
        else:
            end = counter.read().allocated
        peak = phases.peak
        params = list(wrapped.parameters())
        state = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        result = {
            "peak": peak,
            "end": end,
            "before_steps": before,
            "base": base,
            "warmup_steps": STEPS if warmup else 0,
            "first_steps_peak": first_steps_peak,
            "step_peaks": phases.step_peaks(measured),
            "phases": phases.rows,
            "weights": local_storage_bytes(params),
            "optimizer_state": local_storage_bytes(state),
            "buffers": local_storage_bytes(list(wrapped.buffers())),
            "device": str(device),
            "gpu": torch.cuda.get_device_name(device) if cuda else None,
        }
        if hasattr(wrapped, "reducer"):
            # the buckets as DDP has them after its rebuild, in bytes (zeros like them: made after the figures)
            result["bucket_sizes"] = [
                b.buffer().numel() * b.buffer().element_size() for b in wrapped.reducer._get_zeros_like_grad_buckets()
            ]
        if cuda:
            result["memory_stats"] = {k: v for k, v in torch.cuda.memory_stats(device).items() if k.endswith(".all.current") or k.endswith(".all.peak") or k.startswith("num_")}
        del wrapped, model, opt, params, state
        return result
    finally:
        if counter is not None:
            counter.stop()
        if device.type == "cuda":
            gc.collect()
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--backend", default="gloo", choices=("gloo", "nccl"))
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--sizes", default="{}", help="JSON keyword arguments of build()")
    parser.add_argument(
        "--warmup", action="store_true",
        help="run STEPS steps first (their peak kept as first_steps_peak), wait for the device, then measure",
    )  # fmt: skip
    args = parser.parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    gloo = None
    if args.backend == "nccl":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl")
    else:
        device = torch.device("cpu")
        dist.Backend.register_backend(ONE_THREAD_GLOO, _one_thread_gloo, devices=["cpu"])
        dist.init_process_group(ONE_THREAD_GLOO)
        gloo = GlooReleases()
    rank = dist.get_rank()
    sizes = json.loads(args.sizes)
    results: dict = {"rank": rank, "world_size": dist.get_world_size(), "torch": torch.__version__}
    with gloo.installed() if gloo is not None else contextlib.nullcontext():
        for name in args.scenarios.split(","):
            started = time.perf_counter()
            try:
                results[name] = run(name, device, sizes, args.warmup, gloo)
            except Exception:  # noqa: BLE001 - reported to the test, which fails with it
                results[name] = {"error": traceback.format_exc()}
                print(f"[rank {rank}] {name} failed:\n{results[name]['error']}", file=sys.stderr)
            results[name]["seconds"] = time.perf_counter() - started
            dist.barrier()
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(results, indent=1))
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # gloo's threads sometimes abort the interpreter's finalization


if __name__ == "__main__":
    main()
