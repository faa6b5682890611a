"""``torch.compile``'d models on a GPU: the compiled step's peak against the estimate of it, phase by phase.

    python benchmarks/compiled_estimate.py --out results/           # on a GPU: a few minutes on an H100
    python benchmarks/compiled_estimate.py --out results/ --code    # also Inductor's code and the estimate's plans
    python benchmarks/compiled_estimate.py --device cpu --quick     # the CPU's compiled step, small sizes

For each model (the zoo's ``compiled_mlp`` at its real size, a stack of transformer blocks in
float32 and under bf16 autocast, a BatchNorm CNN with max pooling, two layers with a graph break
between them):

- **measured**: ``torch.cuda.max_memory_allocated()`` over two training steps (forward, loss,
  backward, AdamW, ``zero_grad``) of the compiled model above what was allocated before it, each
  phase's peak apart; a compiled model of the same class has run a step at the same batch first
  (dynamo's code and Inductor's kernels exist, the libraries' workspaces too). On the CPU the
  CPU allocator's reports through ``torch.profiler`` (as tests/test_estimate_compiled.py measures);
- **estimated**: ``estimate_memory`` of the same step on fake CUDA tensors and emulated (fake CPU
  tensors standing in), each phase's peak, its notes and error bounds; and the uncompiled
  estimate, for what compiling changes.

With ``--ablation`` the compiled estimate is also made with the planning's steps taken away one by
one (``op_by_op``: the partitioned graphs run operator by operator, every result allocated, freed
after its last use; ``fused``: Inductor's fusion; ``planned``: and its reuse of dead buffers and
in-place writes; the full estimate adds its reordering for peak memory): what each step is worth.

Writes ``compiled_estimate.json`` (one object per model, bytes) and ``compiled_estimate.md`` into
``--out`` (default: ``$OUT``); with ``--code``, ``inductor/<model>.txt`` (Inductor's generated code,
its peak-memory reordering log) and ``plans/<model>.txt`` (the estimate's kernels, fused values and
buffers, graph by graph, in the order it runs them). Send all back: where the estimate misses,
the two files side by side show which buffer Inductor did not make or kept longer.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchutil import environment_line, markdown_table, output_dir  # noqa: E402

from benchmarks.zoo import ZOO  # noqa: E402
from benchmarks.zoo.training import call, tensors_of, to_device  # noqa: E402
from pytorch_mem_profiler import estimate_memory  # noqa: E402

ADAMW = functools.partial(torch.optim.AdamW, lr=1e-4)


class Block(nn.Module):
    """A pre-norm transformer block: LayerNorm, multi-head attention with dropout, a GELU MLP."""

    def __init__(self, dim: int, heads: int, p: float = 0.1) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, dropout=p, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Dropout(p), nn.Linear(4 * dim, dim))
        self.drop = nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.drop(self.attn(h, h, h, need_weights=False)[0])
        return x + self.drop(self.mlp(self.ln2(x)))


class Transformer(nn.Module):
    def __init__(self, vocab: int, dim: int, heads: int, layers: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


class PoolingCNN(nn.Module):
    """VGG-style stages (convolution, BatchNorm, ReLU, twice), max pooling between them, a linear head."""

    def __init__(self, channels: int, stages: int, classes: int = 1000) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        c_in = 3
        for stage in range(stages):
            c_out = channels * 2**stage
            for _ in range(2):
                layers += [nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU()]
                c_in = c_out
            layers.append(nn.MaxPool2d(2))
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(c_in, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).mean(dim=(2, 3)))


class Broken(nn.Module):
    """Two linear layers with a graph break between them: estimated uncompiled, with a bound."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.a(x))
        torch._dynamo.graph_break()
        return self.b(h)


def token_loss(out: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, 1).float(), targets.flatten())


def _zoo(name: str, size: str) -> dict[str, Any]:
    """A zoo model as a case: compiled per run (the zoo's compiled MLP is unwrapped first)."""
    entry = ZOO[name]
    return {
        "build": lambda: getattr(built := entry.build(size), "_orig_mod", built),
        "inputs": entry.inputs(size),
        "targets": entry.targets(size),
        "loss": entry.loss,
        "batch": entry.batch[size],
        "autocast": entry.autocast,
    }


def cases(quick: bool) -> dict[str, dict[str, Any]]:
    """The models, at GPU sizes (a few GB each on an H100) or ``quick`` ones (the CPU's)."""
    vocab, dim, heads, layers, seq, batch = (512, 128, 4, 2, 64, 8) if quick else (32_000, 768, 12, 6, 512, 16)
    tokens = lambda b: torch.randint(0, vocab, (b, seq))  # noqa: E731
    transformer = {
        "build": lambda: Transformer(vocab, dim, heads, layers), "inputs": tokens, "targets": tokens,
        "loss": token_loss, "batch": batch, "autocast": None,
    }  # fmt: skip
    side, channels, cnn_batch = (32, 16, 8) if quick else (224, 64, 32)
    width = 256 if quick else 2048
    return {
        "compiled_mlp": _zoo("compiled_mlp", "small" if quick else "real"),
        # transformers' GPT-2 small under bf16 autocast: tied embeddings, its key-value cache in the output
        "gpt2": _zoo("gpt2", "small" if quick else "real"),
        # transformers' Llama (grouped-query attention, RoPE) under bf16 autocast, and BERT-base in fp32
        "llama": _zoo("llama", "small" if quick else "real"),
        "bert": _zoo("bert", "small" if quick else "real"),
        "transformer": transformer,
        "transformer_bf16": {**transformer, "autocast": torch.bfloat16},
        "pooling_cnn": {
            "build": lambda: PoolingCNN(channels, 2 if quick else 4), "inputs": lambda b: torch.randn(b, 3, side, side),
            "targets": lambda b: torch.randint(0, 1000, (b,)), "loss": F.cross_entropy, "batch": cnn_batch, "autocast": None,
        },
        "graph_break": {
            "build": lambda: Broken(width), "inputs": lambda b: torch.randn(b, 512, width),
            "targets": lambda b: torch.randn(b, 512, width), "loss": F.mse_loss, "batch": 4 if quick else 32, "autocast": None,
        },
    }  # fmt: skip


def _fresh(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def measure(case: dict[str, Any], device: torch.device) -> dict[str, int]:
    """The compiled step's peak above what was allocated before the model was made (its weights
    counted, as the estimate counts them), by phase (``"step"``: the most)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    warm = case["build"]().to(device)
    _steps(torch.compile(warm), warm, case, device, 1)  # compiles; makes the libraries' workspaces
    del warm
    _fresh(device)
    # the base is taken before the model exists: its weights are the step's, as the estimate counts them
    base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    model = case["build"]().to(device)
    compiled = torch.compile(model)
    if device.type == "cuda":
        phases = _steps(compiled, model, case, device, 2)
        phases = {k: v - base for k, v in phases.items()}
    else:
        phases = _cpu_steps(compiled, model, case, device)
    phases["step"] = max(phases.values())
    del model, compiled
    _fresh(device)
    return phases


def _steps(run: nn.Module, model: nn.Module, case: dict[str, Any], device: torch.device, count: int) -> dict[str, int]:
    x = to_device(case["inputs"](case["batch"]), device)
    y = to_device(case["targets"](case["batch"]), device)
    optimizer = ADAMW(model.parameters())
    phases: dict[str, int] = {}

    def phase(name: str) -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            phases[name] = max(phases.get(name, 0), torch.cuda.max_memory_allocated(device))
            torch.cuda.reset_peak_memory_stats(device)

    autocast = case["autocast"]
    phase("other")
    for _ in range(count):
        with torch.autocast(device.type, dtype=autocast or torch.bfloat16, enabled=autocast is not None):
            out = call(run, x)
        phase("forward")
        loss = case["loss"](out, y)
        phase("other")
        loss.backward()
        phase("backward")
        optimizer.step()
        phase("optimizer")
        optimizer.zero_grad(set_to_none=True)
        del out, loss
        phase("other")
    return phases


def _cpu_steps(run: nn.Module, model: nn.Module, case: dict[str, Any], device: torch.device) -> dict[str, int]:
    """The CPU's step through the CPU allocator's reports (:mod:`cpu_allocations`)."""
    from cpu_allocations import cpu_allocations, live_tensor_peak, unique_bytes

    x, y = case["inputs"](case["batch"]), case["targets"](case["batch"])
    base = unique_bytes([*model.parameters(), *model.buffers(), *tensors_of((x, y))])
    fixed = {**case, "inputs": lambda b: x, "targets": lambda b: y}
    return {"step": base + live_tensor_peak(cpu_allocations(lambda: _steps(run, model, fixed, device, 2)))}


def estimated(case: dict[str, Any], device: torch.device, *, emulate: bool | None, compiled: bool = True) -> dict[str, Any]:
    build = case["build"]
    kwargs = dict(
        targets=case["targets"], loss_fn=case["loss"], optimizer=ADAMW, batch_size=case["batch"],
        autocast=case["autocast"], device=device, fit=False,
    )  # fmt: skip
    if device.type == "cuda":
        kwargs["emulate"] = emulate
    try:
        est = estimate_memory((lambda: torch.compile(build())) if compiled else build, case["inputs"], **kwargs)
    except Exception as err:  # noqa: BLE001 - recorded in the results, the other models go on
        return {"error": f"{type(err).__name__}: {err}"}
    return {
        "peak": est.peak,
        "peak_allocated": est.peak_allocated,
        "phases": dict(est.phases),
        "peak_phase": est.peak_phase,
        "notes": list(est.notes),
        "error_bound": est.error_bound,
        "emulated": est.emulated,
    }


ABLATIONS = ("op_by_op", "fused", "planned")


@contextlib.contextmanager
def ablated(step: str) -> Iterator[None]:
    """The estimate's graph planning without the steps after ``step`` (see the module)."""
    from pytorch_mem_profiler.estimate import inductor_plan as plan

    kind, reorders, planner = plan._node_kind, plan._inductor_reorders, plan.plan_graph

    def unfused(node, device_type=None):  # type: ignore[no-untyped-def]
        k = kind(node, device_type)
        return "kernel" if k in ("fused", "reduction", "scatter") else k

    def unplanned(*args, **kwargs):  # type: ignore[no-untyped-def]
        made = planner(*args, **kwargs)
        made.reuse.clear()
        made.in_place.clear()
        return made

    from pytorch_mem_profiler.estimate import compiled as compiled_module

    plan._inductor_reorders = lambda: False
    if step == "op_by_op":
        plan._node_kind = unfused
    if step in ("op_by_op", "fused"):
        compiled_module.plan_graph = unplanned
    try:
        yield
    finally:
        plan._node_kind, plan._inductor_reorders, compiled_module.plan_graph = kind, reorders, planner


@contextlib.contextmanager
def inductor_code(path: Path | None) -> Iterator[None]:
    """Inductor's generated code and its peak-memory reordering's log, into ``path``, for the block."""
    if path is None:
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path, mode="w")
    loggers = [logging.getLogger("torch._inductor.codecache.__output_code"), logging.getLogger("torch._inductor.memory")]
    levels = [lg.level for lg in loggers]
    torch._logging.set_logs(output_code=True)
    for lg in loggers:
        lg.addHandler(handler)
        lg.setLevel(logging.DEBUG if lg.name.endswith("__output_code") else logging.INFO)
    from torch._inductor import config

    try:
        with config.patch(force_disable_caches=True):  # a cached graph is not generated again, nor logged
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.removeHandler(handler)
            lg.setLevel(level)
        handler.close()
        torch._logging.set_logs()


@contextlib.contextmanager
def estimate_plans(path: Path | None) -> Iterator[None]:
    """Each graph the estimate runs, as it runs it (kernels, fused values, buffers and their bytes), into ``path``."""
    if path is None:
        yield
        return
    from pytorch_mem_profiler.estimate import compiled as compiled_module

    path.parent.mkdir(parents=True, exist_ok=True)
    lines: list[str] = []
    original = compiled_module.GraphRun.__init__

    def keep(self, gm, counter, **kwargs):  # type: ignore[no-untyped-def]
        original(self, gm, counter, **kwargs)
        lines.append(f"# graph {len([x for x in lines if x.startswith('# graph')])}: {len(self.nodes)} nodes")
        for i, node in enumerate(self.nodes):
            value = node.meta.get("val")
            size = value.untyped_storage().nbytes() if isinstance(value, torch.Tensor) else ""
            extra = ""
            if i in self.plan.in_place:
                extra += f" in place of {self.plan.in_place[i]}"
            if i in self.plan.reuse:
                extra += f" reuses {self.plan.reuse[i]}"
            lines.append(f"{i} {self.plan.kinds[node.name]} {node.name} {node.target if node.op == 'call_function' else node.op} {size} free after {self.plan.free_at[node.name]}{extra}")

    compiled_module.GraphRun.__init__ = keep
    try:
        yield
    finally:
        compiled_module.GraphRun.__init__ = original
        path.write_text("\n".join(lines) + "\n")


def pct(estimate: int | None, measured: int) -> float | None:
    return None if estimate is None or not measured else 100.0 * (estimate - measured) / measured


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="folder for compiled_estimate.json and .md (default: $OUT)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="small sizes")
    parser.add_argument("--code", action="store_true", help="also Inductor's code and the estimate's plans")
    parser.add_argument("--only", nargs="*", default=None, help="model names (default: all)")
    parser.add_argument("--ablation", action="store_true", help="also the estimate without its planning's steps")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    out = output_dir(args.out)
    rows: list[dict[str, Any]] = []
    started = time.perf_counter()
    for name, case in cases(args.quick or device.type == "cpu").items():
        if args.only and name not in args.only:
            continue
        row: dict[str, Any] = {"model": name, "batch": case["batch"], "autocast": str(case["autocast"])}
        code = out / "inductor" / f"{name}.txt" if args.code and out is not None else None
        plans = out / "plans" / f"{name}.txt" if args.code and out is not None else None
        with inductor_code(code):
            row["measured"] = measure(case, device)
        with estimate_plans(plans):
            row["fake"] = estimated(case, device, emulate=False if device.type == "cuda" else None)
        if device.type == "cuda":
            row["emulated"] = estimated(case, device, emulate=True)
        row["uncompiled"] = estimated(case, device, emulate=False if device.type == "cuda" else None, compiled=False)
        for step in ABLATIONS if args.ablation else ():
            with ablated(step):
                row[step] = estimated(case, device, emulate=False if device.type == "cuda" else None)
        for key in ("fake", "emulated", "uncompiled", *ABLATIONS):
            if key in row and "peak" in row[key]:
                row[key]["peak_error_pct"] = pct(row[key]["peak"], row["measured"]["step"])
        rows.append(row)
        if out is not None:  # after each model: a run cut short keeps what it measured
            (out / "compiled_estimate.json").write_text(json.dumps({"environment": environment_line(device), "rows": rows}, indent=1))
        print(name, json.dumps({k: row[k] for k in row if k != "model"}, default=str)[:600], flush=True)

    def cell(est: dict[str, Any]) -> str:
        if "error" in est:
            return est["error"][:80]
        bound = f" (±{100 * est['error_bound'] / max(1, est['peak']):.1f}% stated)" if est.get("error_bound") else ""
        return f"{est['peak_error_pct']:+.2f}%{bound}"

    steps = list(ABLATIONS) if args.ablation else []
    headers = ["model", "batch", "measured (MB)", "fake CUDA" if device.type == "cuda" else "estimated", "emulated",
               "uncompiled", *steps, "notes"]  # fmt: skip
    table = [
        [
            r["model"], r["batch"], f"{r['measured']['step'] / 1e6:,.1f}", cell(r["fake"]),
            cell(r["emulated"]) if "emulated" in r else "-", cell(r["uncompiled"]), *(cell(r[s]) for s in steps),
            "; ".join(r["fake"].get("notes", [])),
        ]
        for r in rows
    ]  # fmt: skip
    text = f"{environment_line(device)}; {time.perf_counter() - started:.0f} s\n\n{markdown_table(headers, table)}\n"
    print(text)
    if out is not None:
        (out / "compiled_estimate.md").write_text(text)
    return rows


if __name__ == "__main__":
    main()
