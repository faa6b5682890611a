"""cuDNN's recurrent layers on a GPU: their own buffers, measured, beside the estimate's rule.

    python benchmarks/rnn_rules.py --out results/      # on a GPU: about a minute on an H100
    python benchmarks/rnn_rules.py --quick --device cpu  # the estimate's side only, seconds: a smoke test
    python benchmarks/rnn_rules.py --grid 500 --out results/  # the rule against cuDNN's own answer, seconds on a GPU
    python benchmarks/rnn_rules.py --packed 60 --out results/  # layers over packed batches: run, and asked

For a grid of ``nn.LSTM``/``nn.GRU`` configurations (layers, hidden and input size,
sequence length, batch, bidirectional, ``batch_first``, fp32 and bf16 autocast), on
the GPU:

- **the layer alone**: one forward and backward of the real layer after a warm-up,
  from an empty cache: what the forward leaves allocated (output, final states,
  reserve space, weight buffer), the forward's and the backward's peaks above what
  was allocated before them (their workspaces on top), and, through a
  ``saved_tensors_hooks`` pack hook, every tensor the forward saved for backward
  (the ``uint8`` one is cuDNN's reserve space, a half-precision flat one under
  autocast its weight buffer);
- **the rule**: :func:`pytorch_mem_profiler.estimate.rnn.cudnn_rnn_buffers` for the
  same call;
- **the training step**: ``torch.cuda.max_memory_allocated()`` over two steps
  (forward, loss, backward, SGD) above what was allocated before the model, and
  ``estimate_memory(...).peak_allocated`` for the same step (fake CUDA tensors), with
  the difference.

Writes ``rnn_rules.json`` (one object per configuration, bytes) and ``rnn_rules.md``
(a table) into ``--out`` (default: ``$OUT``). Send both back: the reserve and
workspace columns are what the rule is fitted to.
"""

from __future__ import annotations

import argparse
import functools
import gc
import itertools
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchutil import environment_line, markdown_table, output_dir  # noqa: E402

from pytorch_mem_profiler import estimate_memory  # noqa: E402
from pytorch_mem_profiler.estimate.rnn import cudnn_rnn_buffers, dropout_state_bytes  # noqa: E402

BASE = {"mode": "lstm", "layers": 2, "hidden": 512, "input": 256, "seq": 128, "batch": 32, "bidirectional": False, "batch_first": False, "autocast": None}
VARIED = {
    "mode": ["lstm", "gru"],
    "layers": [1, 3],
    "hidden": [128, 1024],
    "input": [64, 1024],
    "seq": [16, 512],
    "batch": [4, 128],
    "bidirectional": [True],
    "batch_first": [True],
    "autocast": ["bf16"],
}
QUICK_BASE = {**BASE, "hidden": 32, "input": 16, "seq": 8, "batch": 4}


def configurations(quick: bool) -> list[dict[str, Any]]:
    """The base, each factor varied alone, and mode x autocast x bidirectional together."""
    base = QUICK_BASE if quick else BASE
    out = [dict(base)]
    for key, values in VARIED.items():
        out += [{**base, key: v} for v in values]
    for mode, autocast, bidirectional in itertools.product(("lstm", "gru"), (None, "bf16"), (False, True)):
        out.append({**base, "mode": mode, "autocast": autocast, "bidirectional": bidirectional, "layers": 1})
    unique = {json.dumps(c, sort_keys=True): c for c in out}
    return list(unique.values())[: 6 if quick else None]


def build(config: dict[str, Any]) -> nn.Module:
    kind = nn.LSTM if config["mode"] == "lstm" else nn.GRU
    return kind(config["input"], config["hidden"], config["layers"], bidirectional=config["bidirectional"], batch_first=config["batch_first"])


def example(config: dict[str, Any], device: torch.device) -> torch.Tensor:
    shape = (config["batch"], config["seq"], config["input"]) if config["batch_first"] else (config["seq"], config["batch"], config["input"])
    return torch.randn(shape, device=device)


def _autocast(config: dict[str, Any], device: torch.device):  # type: ignore[no-untyped-def]
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=config["autocast"] == "bf16")


def _fresh() -> None:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


def measure_layer(config: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """The real layer's forward and backward on the GPU (see the module)."""
    model = build(config).to(device)
    x = example(config, device).requires_grad_()
    for _ in range(2):  # warm-up: cuDNN's handles, dropout state, cuBLAS workspaces
        with _autocast(config, device):
            out = model(x)[0]
        out.float().sum().backward()
    model.zero_grad(set_to_none=True)
    x.grad = None
    del out
    _fresh()
    saved: list[dict[str, Any]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append({"shape": list(t.shape), "dtype": str(t.dtype), "bytes": t.untyped_storage().nbytes()})
        return t

    before = torch.cuda.memory_allocated()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), _autocast(config, device):
        out, states = model(x)
    torch.cuda.synchronize()
    after_forward = torch.cuda.memory_allocated()
    forward_peak = torch.cuda.max_memory_allocated()
    node = type(out.grad_fn).__name__ if out.grad_fn is not None else None
    loss = out.float().sum()
    del states
    torch.cuda.reset_peak_memory_stats()
    at_backward = torch.cuda.memory_allocated()
    loss.backward()
    torch.cuda.synchronize()
    backward_peak = torch.cuda.max_memory_allocated()
    reserve = [s for s in saved if s["dtype"] == "torch.uint8"]
    flat_half = [s for s in saved if s["dtype"] in ("torch.float16", "torch.bfloat16") and len(s["shape"]) == 1]
    result = {
        "grad_fn": node,
        "output_dtype": str(out.dtype),
        "forward_leaves": after_forward - before,
        "forward_workspace": forward_peak - after_forward,
        "backward_above_start": backward_peak - at_backward,
        "reserve": sum(s["bytes"] for s in reserve),
        "weight_buf": sum(s["bytes"] for s in flat_half),
        "saved": saved,
    }
    del model, x, out, loss
    return result


def rule(config: dict[str, Any]) -> dict[str, int]:
    element = 2 if config["autocast"] else 4
    buffers = cudnn_rnn_buffers(
        config["mode"], seq_len=config["seq"], batch=config["batch"], hidden=config["hidden"], proj=config["hidden"],
        layers=config["layers"], directions=2 if config["bidirectional"] else 1, element_size=element,
        input_size=config["input"],
    )  # fmt: skip
    return {"reserve": buffers.reserve, "workspace": buffers.workspace}


def step_peak(config: dict[str, Any], device: torch.device) -> int:
    """``max_memory_allocated()`` over two SGD training steps, above what was allocated before the model."""
    _fresh()
    base = torch.cuda.memory_allocated()
    model = build(config).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = example(config, device)
    for _ in range(2):
        with _autocast(config, device):
            out = model(x)[0]
        out.float().sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        del out
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del model, opt, x
    return peak


def estimated(config: dict[str, Any], device: torch.device) -> tuple[int, int]:
    est = estimate_memory(
        lambda: build(config),
        lambda b: example(config, torch.device("cpu")),
        batch_size=config["batch"],
        optimizer=functools.partial(torch.optim.SGD, lr=0.1),
        loss_fn=lambda out: out[0].float().sum(),
        autocast=torch.bfloat16 if config["autocast"] else None,
        device=device if device.type == "cuda" else "cuda",
        workspace=0,
        fit=False,
    )
    return est.peak_allocated, est.error_bound


#: The grid's axes (``--grid``): every layer kind cuDNN runs, the sizes of language and speech models.
GRID_AXES = {
    "mode": ["lstm", "gru", "rnn_tanh"], "layers": [1, 2, 3, 4], "hidden": [64, 128, 256, 512, 768, 1024, 2048],
    "input": [32, 128, 256, 512, 1024], "seq": [8, 16, 32, 64, 128, 256, 512], "batch": [1, 4, 8, 16, 32, 64, 128, 256],
    "bidirectional": [False, True], "dtype": [torch.float32, torch.float32, torch.float16], "dropout": [0.0, 0.0, 0.1],
}  # fmt: skip


def grid_configurations(count: int, seed: int = 0) -> list[dict[str, Any]]:
    """``count`` configurations drawn from :data:`GRID_AXES` (the same for the same seed)."""
    import random

    draw = random.Random(seed)
    return [{key: draw.choice(values) for key, values in GRID_AXES.items()} for _ in range(count)]


def grid(device: torch.device, count: int, seed: int = 0) -> dict[str, Any]:
    """The rule (:func:`cudnn_rnn_buffers`) against cuDNN's own answer (:func:`rnn_temp_sizes`, as
    ATen asks it) over :func:`grid_configurations`: how often the rule's workspace bound holds, and the
    reserve rule's exactness. Seconds on a GPU: nothing runs, cuDNN is asked."""
    from pytorch_mem_profiler.measure.cudnn_sizes import rnn_temp_sizes

    rows, outside, reserve_exact, asked = [], 0, 0, 0
    for c in grid_configurations(count, seed):
        element = torch.empty((), dtype=c["dtype"]).element_size()
        directions = 2 if c["bidirectional"] else 1
        rule_buffers = cudnn_rnn_buffers(c["mode"], seq_len=c["seq"], batch=c["batch"], hidden=c["hidden"], proj=c["hidden"],
                                         layers=c["layers"], directions=directions, element_size=element, input_size=c["input"])  # fmt: skip
        answer = rnn_temp_sizes(device, c["mode"], input_size=c["input"], hidden=c["hidden"], proj=0, layers=c["layers"],
                                bidirectional=c["bidirectional"], seq_len=c["seq"], batch=c["batch"], dtype=c["dtype"],
                                dropout=c["dropout"])  # fmt: skip
        row = {**c, "dtype": str(c["dtype"]).removeprefix("torch."), "rule_workspace": rule_buffers.workspace,
               "rule_bound": rule_buffers.bound - rule_buffers.reserve_bound, "rule_reserve": rule_buffers.reserve}  # fmt: skip
        if answer is not None:
            asked += 1
            row.update(workspace=answer.forward_workspace, backward_workspace=answer.backward_workspace, reserve=answer.reserve)
            worst = max(abs(answer.forward_workspace - rule_buffers.workspace), abs(answer.backward_workspace - rule_buffers.workspace))
            row["outside_bound"] = worst > row["rule_bound"]
            outside += row["outside_bound"]
            reserve_exact += answer.reserve == rule_buffers.reserve
        rows.append(row)
    return {"configurations": count, "asked": asked, "outside_bound": outside, "reserve_exact": reserve_exact, "rows": rows}


#: The packed grid's axes (``--packed``): a bidirectional or one-way layer over sequences of unequal lengths.
PACKED_AXES = {
    "mode": ["lstm", "gru"], "layers": [1, 2], "hidden": [64, 256, 512, 1024], "input": [64, 256, 512],
    "seq": [16, 64, 200], "batch": [4, 16, 32, 64], "bidirectional": [False, True],
    "dtype": [torch.float32, torch.float32, torch.float16], "dropout": [0.0, 0.1],
}  # fmt: skip


def packed_configurations(count: int, seed: int = 0) -> list[dict[str, Any]]:
    """``count`` configurations drawn from :data:`PACKED_AXES`, each with its sequences' lengths (1
    to ``seq``, the longest ``seq``: a padded batch of ``seq`` steps), the same for the same seed."""
    import random

    draw = random.Random(seed)
    out = []
    for _ in range(count):
        c = {key: draw.choice(values) for key, values in PACKED_AXES.items()}
        c["lengths"] = [c["seq"]] + [draw.randint(1, c["seq"]) for _ in range(c["batch"] - 1)]
        out.append(c)
    return out


def measure_packed(c: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """One forward and backward of the real layer over a packed batch (after a warm-up): the reserve
    it saves (the uint8 tensor), the forward's peak above what it leaves, the backward's above its start."""
    from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence

    kind = nn.LSTM if c["mode"] == "lstm" else nn.GRU
    model = kind(c["input"], c["hidden"], c["layers"], bidirectional=c["bidirectional"], dropout=c["dropout"]).to(device, c["dtype"])
    padded = torch.randn(c["seq"], c["batch"], c["input"], device=device, dtype=c["dtype"])
    packed = pack_padded_sequence(padded, torch.tensor(c["lengths"]), enforce_sorted=False)
    data = packed.data.detach().requires_grad_()
    inp = PackedSequence(data, packed.batch_sizes, packed.sorted_indices, packed.unsorted_indices)
    for _ in range(2):
        model(inp)[0].data.float().sum().backward()
    model.zero_grad(set_to_none=True)
    data.grad = None
    _fresh()
    saved: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.dtype == torch.uint8:
            saved.append(t.untyped_storage().nbytes())
        return t

    before = torch.cuda.memory_allocated()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out, states = model(inp)
    torch.cuda.synchronize()
    after_forward = torch.cuda.memory_allocated()
    forward_peak = torch.cuda.max_memory_allocated()
    loss = out.data.float().sum()
    del states
    torch.cuda.reset_peak_memory_stats()
    at_backward = torch.cuda.memory_allocated()
    loss.backward()
    torch.cuda.synchronize()
    # cuDNN's dropout state (ATen's, kept for the process once a layer trained with dropout) is saved too
    properties = torch.cuda.get_device_properties(device)
    state, _ = dropout_state_bytes((properties.multi_processor_count, properties.max_threads_per_multi_processor))
    dropout_state = state if len(saved) > 1 and state in saved else 0
    result = {
        "batch_sizes": packed.batch_sizes.tolist(),
        "forward_leaves": after_forward - before,
        "forward_workspace": forward_peak - after_forward,
        "backward_above_start": torch.cuda.max_memory_allocated() - at_backward,
        "reserve": sum(saved) - dropout_state,
        "dropout_state": dropout_state,
    }
    del model, padded, packed, data, inp, out, loss
    return result


def packed(device: torch.device, count: int, seed: int = 0) -> dict[str, Any]:
    """Recurrent layers over packed batches (``--packed``): the real layer's reserve and workspace
    (:func:`measure_packed`) beside cuDNN's answer for the packed descriptor ATen makes, its answer
    for the padded batch of the same longest length, and the rule (:func:`cudnn_rnn_buffers`) for
    the padded batch and for the packed rows as one step."""
    from pytorch_mem_profiler.measure.cudnn_sizes import packed_lengths, rnn_temp_sizes

    rows = []
    for c in packed_configurations(count, seed):
        element = torch.empty((), dtype=c["dtype"]).element_size()
        directions = 2 if c["bidirectional"] else 1
        layer = measure_packed(c, device)
        lengths = packed_lengths(layer["batch_sizes"])
        shape = dict(input_size=c["input"], hidden=c["hidden"], proj=0, layers=c["layers"], bidirectional=c["bidirectional"],
                     dtype=c["dtype"], dropout=c["dropout"])  # fmt: skip
        asked = rnn_temp_sizes(device, c["mode"], **shape, seq_len=max(lengths), batch=len(lengths), lengths=lengths)
        padded = rnn_temp_sizes(device, c["mode"], **shape, seq_len=c["seq"], batch=c["batch"])
        rules = {
            key: cudnn_rnn_buffers(c["mode"], seq_len=t, batch=b, hidden=c["hidden"], proj=c["hidden"], layers=c["layers"],
                                   directions=directions, element_size=element, input_size=c["input"])  # fmt: skip
            for key, (t, b) in (("rule_padded", (c["seq"], c["batch"])), ("rule_rows", (1, sum(c["lengths"]))))
        }
        row = {**c, "dtype": str(c["dtype"]).removeprefix("torch."), "tokens": sum(c["lengths"]), **layer}
        for key, answer in (("asked_packed", asked), ("asked_padded", padded)):
            if answer is not None:
                row[key] = {"forward_workspace": answer.forward_workspace, "backward_workspace": answer.backward_workspace,
                            "reserve": answer.reserve}  # fmt: skip
        for key, buffers in rules.items():
            row[key] = {"workspace": buffers.workspace, "reserve": buffers.reserve, "bound": buffers.bound}
        rows.append(row)
    exact = sum(1 for r in rows if r.get("asked_packed", {}).get("reserve") == r["reserve"])
    return {"configurations": count, "reserve_exact_asked_packed": exact, "rows": rows}


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="folder for rnn_rules.json and rnn_rules.md (default: $OUT)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="small sizes, six configurations")
    parser.add_argument("--grid", type=int, metavar="N", help="instead: the rule against cuDNN's own answer on N drawn configurations")
    parser.add_argument("--seed", type=int, default=0, help="the grid's draws (--grid): another seed, other configurations")
    parser.add_argument("--packed", type=int, metavar="N", help="instead: N layers over packed batches, run and asked (GPU)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if args.packed:
        found = packed(device, args.packed, args.seed)
        print(f"{environment_line(device)}: {found['configurations']} packed layers, the reserve as cuDNN answers the "
              f"packed descriptor on {found['reserve_exact_asked_packed']}")  # fmt: skip
        out = output_dir(args.out)
        if out is not None:
            (out / "rnn_rules_packed.json").write_text(json.dumps(found, indent=1))
        return found["rows"]
    if args.grid:
        found = grid(device, args.grid, args.seed)
        line = (f"{environment_line(device)}: {found['configurations']} configurations, cuDNN answered {found['asked']}; "
                f"the workspace outside the rule's bound on {found['outside_bound']}, the reserve rule exact on "
                f"{found['reserve_exact']} (dropout's masks and plain RNNs are not in the rule)")  # fmt: skip
        print(line)
        out = output_dir(args.out)
        if out is not None:
            (out / f"rnn_rules_grid{'' if args.seed == 0 else f'_seed{args.seed}'}.json").write_text(json.dumps(found, indent=1))
        return found["rows"]
    on_gpu = device.type == "cuda"
    started = time.perf_counter()
    rows = []
    for config in configurations(args.quick):
        entry: dict[str, Any] = {"config": config, "rule": rule(config)}
        estimate, bound = estimated(config, device)
        entry["estimate"] = estimate
        entry["error_bound"] = bound
        if on_gpu:
            # cuBLAS's workspaces are made in the warm-up and stay: the step's peak is above them
            entry["layer"] = measure_layer(config, device)
            entry["measured"] = step_peak(config, device)
            entry["difference"] = (estimate - entry["measured"]) / entry["measured"]
        rows.append(entry)
        out = output_dir(args.out)
        if out is not None:  # after each configuration: a run cut short keeps what it measured
            (out / "rnn_rules.json").write_text(json.dumps(rows, indent=1))
    headers = ["config", "reserve measured", "rule", "fwd workspace", "rule", "weight buf", "step measured", "estimated", "diff"]
    table = []
    for e in rows:
        c = e["config"]
        name = f"{c['mode']} L{c['layers']} H{c['hidden']} I{c['input']} T{c['seq']} B{c['batch']}" + (
            " bi" if c["bidirectional"] else ""
        ) + (" bf" if c["batch_first"] else "") + (" bf16" if c["autocast"] else "")
        layer = e.get("layer", {})
        table.append([
            name, layer.get("reserve", "-"), e["rule"]["reserve"], layer.get("forward_workspace", "-"), e["rule"]["workspace"],
            layer.get("weight_buf", "-"), e.get("measured", "-"), e["estimate"],
            f"{100 * e['difference']:+.2f}%" if "difference" in e else "-",
        ])  # fmt: skip
    text = f"{environment_line(device)}; {time.perf_counter() - started:.0f} s\n\n{markdown_table(headers, table)}\n"
    print(text)
    out = output_dir(args.out)
    if out is not None:
        (out / "rnn_rules.json").write_text(json.dumps(rows, indent=1))
        (out / "rnn_rules.md").write_text(text)
    return rows


if __name__ == "__main__":
    main()
