"""The estimate's two CUDA paths op by op: fake CUDA tensors (on a GPU machine) against fake CPU tensors standing in for CUDA.

    python benchmarks/estimate_paths.py --out results/paths/   # on a GPU: stops starting configurations after --budget (85 s)
    python benchmarks/estimate_paths.py --quick --out /tmp/p   # without a GPU: the emulated path alone, small sizes
    python benchmarks/estimate_paths.py --zoo gpt2 --against gpt2-bf16.json --out /tmp/p   # without a GPU: the emulated
                                                               # path against the fake CUDA path a GPU run wrote

For each model (a BERT-style encoder and a T5 encoder-decoder with its loss from
``transformers`` configs, a Llama with grouped-query attention, GPT-2), in fp32 and
under bf16 autocast, the same ``estimate_memory`` step runs through both paths. For
each path it records every aten operator the step ran (name, phase, output dtypes,
shapes and bytes) and every tensor autograd saved for backward (the node that made
it, dtype, shape, bytes), then writes per configuration:

- ``<model>-<precision>.json``: both paths' operator and saved-tensor lists, the
  peaks, and the diff: operators by name with count and bytes in each path, saved
  bytes by (node, dtype) in each path, and the first places where the operator
  sequences diverge;
- ``summary.md``: one line per configuration (the two peaks and their difference)
  and the largest differences by operator and by saved node.

Send the folder back: the diff shows which of CUDA's choices (autocast's dtypes,
the attention kernel and what it saves, masks, cross-attention) the emulation misses.
"""

from __future__ import annotations

import argparse
import difflib
import json
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchutil import environment_line, output_dir  # noqa: E402

from pytorch_mem_profiler import estimate_memory  # noqa: E402
from pytorch_mem_profiler.estimate import counter as counter_module  # noqa: E402
from pytorch_mem_profiler.estimate import step as step_module  # noqa: E402


def models(quick: bool) -> dict[str, dict[str, Any]]:
    """``estimate_memory`` arguments by model name (transformers configs, random weights)."""
    import transformers as T

    width, layers, heads, seq, batch, vocab = (64, 2, 4, 32, 2, 512) if quick else (768, 4, 12, 512, 8, 32_000)
    ids = lambda b: torch.zeros(b, seq, dtype=torch.long)  # noqa: E731
    logits_loss = lambda out: out.logits.float().sum()  # noqa: E731
    bert = T.BertConfig(vocab_size=vocab, hidden_size=width, num_hidden_layers=layers, num_attention_heads=heads, intermediate_size=4 * width)
    t5 = T.T5Config(
        vocab_size=vocab, d_model=width, d_kv=width // heads, d_ff=4 * width, num_layers=layers, num_decoder_layers=layers,
        num_heads=heads, decoder_start_token_id=0, pad_token_id=0,
    )  # fmt: skip
    llama = T.LlamaConfig(
        vocab_size=vocab, hidden_size=width, intermediate_size=int(2.75 * width), num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=max(1, heads // 4),
    )  # fmt: skip
    gpt2 = T.GPT2Config(vocab_size=vocab, n_embd=width, n_layer=layers, n_head=heads, n_positions=max(seq, 64))
    return {
        "bert": {"model": lambda: T.BertForMaskedLM(bert), "example_inputs": lambda b: {"input_ids": ids(b), "attention_mask": torch.ones(b, seq, dtype=torch.long)}, "loss_fn": logits_loss},
        "t5": {"model": lambda: T.T5ForConditionalGeneration(t5), "example_inputs": lambda b: {"input_ids": ids(b), "labels": ids(b)}, "loss_fn": lambda out: out.loss},
        "llama-gqa": {"model": lambda: T.LlamaForCausalLM(llama), "example_inputs": ids, "loss_fn": logits_loss},
        "gpt2": {"model": lambda: T.GPT2LMHeadModel(gpt2), "example_inputs": ids, "loss_fn": logits_loss},
    }, batch


def model_configurations(names: str | None, quick: bool) -> list[tuple[str, str, Any, dict[str, Any], int]]:
    """(name, precision, autocast, estimate arguments, batch) for the transformers models, fp32 and bf16 each."""
    zoo, batch = models(quick)
    chosen = names.split(",") if names else list(zoo)
    return [(name, precision, autocast, zoo[name], batch) for name in chosen for precision, autocast in (("fp32", None), ("bf16", torch.bfloat16))]


def zoo_configurations(names: list[str], size: str) -> list[tuple[str, str, Any, dict[str, Any], int]]:
    """The same for zoo models (``benchmarks/zoo``: the zoo, the held-back sets and the sweep), each in
    its own precision and at its batch for ``size``."""
    from zoo import registries

    registry: dict[str, Any] = {}
    for models in registries().values():  # a name in two registries: the first one's (the zoo's first)
        for name, entry in models.items():
            registry.setdefault(name, entry)
    configurations = []
    for name in names:
        if name not in registry:
            raise SystemExit(f"--zoo: {name!r} is in none of the zoo's registries (zoo, held-back text and vision, sweep)")
        entry = registry[name]
        kwargs = entry.estimate_kwargs(size)
        autocast = kwargs.pop("autocast")
        configurations.append((name, "bf16" if autocast is torch.bfloat16 else "fp32", autocast, kwargs, entry.batch[size]))
    return configurations


class Recording:
    """Patches the estimate's counter and saved-tensor hook, for one step, to record what they see."""

    def __init__(self) -> None:
        self.ops: list[dict[str, Any]] = []
        self.saved: list[dict[str, Any]] = []

    def __enter__(self) -> Recording:
        mode = counter_module._LifeMode
        saver = step_module._SavedByModule
        self._originals = (mode.__torch_dispatch__, saver._pack)
        original_dispatch, original_pack = self._originals
        ops, saved = self.ops, self.saved

        def dispatch(mode_self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            out = original_dispatch(mode_self, func, types, args, kwargs)
            items = [out] if isinstance(out, torch.Tensor) else list(out) if isinstance(out, (tuple, list)) else []
            tensors = [t for t in items if isinstance(t, torch.Tensor)]
            ops.append({
                "op": str(func), "phase": mode_self.counter.phase,
                "dtypes": [str(t.dtype).replace("torch.", "") for t in tensors],
                "shapes": [list(t.shape) for t in tensors],
                "bytes": sum(t.numel() * t.element_size() for t in tensors),
            })  # fmt: skip
            return out

        def pack(saver_self, t):  # type: ignore[no-untyped-def]
            base = t._base if t._is_view() and t._base is not None else t
            saved.append({
                "node": type(base.grad_fn).__name__ if base.grad_fn is not None else "leaf",
                "dtype": str(t.dtype).replace("torch.", ""), "shape": list(t.shape),
                "bytes": t.untyped_storage().nbytes(), "module": saver_self.stack[-1],
            })  # fmt: skip
            return original_pack(saver_self, t)

        mode.__torch_dispatch__ = dispatch
        saver._pack = pack
        return self

    def __exit__(self, *exc: object) -> None:
        counter_module._LifeMode.__torch_dispatch__, step_module._SavedByModule._pack = self._originals


def run_path(kwargs: dict[str, Any], batch: int, autocast: Any, emulate: bool) -> dict[str, Any]:
    with Recording() as rec:
        est = estimate_memory(**kwargs, batch_size=batch, autocast=autocast, device="cuda", emulate=emulate, fit=False, workspace=0)
    half = len(rec.ops) // 2  # the step runs twice; the second one is the steady state
    return {"peak": est.peak, "peak_phase": est.peak_phase, "phases": dict(est.phases), "ops": rec.ops, "saved": rec.saved, "second_step_from": half}


def _by(items: list[dict[str, Any]], key) -> dict[str, list[int]]:  # type: ignore[no-untyped-def]
    out: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for item in items:
        k = key(item)
        out[k][0] += 1
        out[k][1] += item["bytes"]
    return dict(out)


def diff(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Where path ``a`` (fake CUDA) and path ``b`` (emulated) differ."""
    ops_a = _by(a["ops"], lambda o: f"{o['op']} {'/'.join(o['dtypes'])}")
    ops_b = _by(b["ops"], lambda o: f"{o['op']} {'/'.join(o['dtypes'])}")
    saved_a = _by(a["saved"], lambda s: f"{s['node']} {s['dtype']}")
    saved_b = _by(b["saved"], lambda s: f"{s['node']} {s['dtype']}")

    def table(x: dict[str, list[int]], y: dict[str, list[int]]) -> list[dict[str, Any]]:
        rows = []
        for k in sorted(set(x) | set(y)):
            cx, bx = x.get(k, [0, 0])
            cy, by = y.get(k, [0, 0])
            if (cx, bx) != (cy, by):
                rows.append({"key": k, "cuda_count": cx, "cuda_bytes": bx, "emulated_count": cy, "emulated_bytes": by, "bytes_diff": by - bx})
        return sorted(rows, key=lambda r: -abs(r["bytes_diff"]))

    # prim.device calls allocate nothing and are most of the sequence: the matcher (quadratic) skips them
    kept_a = [o for o in a["ops"] if o["op"] != "prim.device.default"]
    kept_b = [o for o in b["ops"] if o["op"] != "prim.device.default"]
    sig = lambda ops: [f"{o['op']} {o['dtypes']} {o['shapes']}" for o in ops]  # noqa: E731
    sa, sb = sig(kept_a), sig(kept_b)
    matcher = difflib.SequenceMatcher(a=sa, b=sb, autojunk=True)
    divergences = []
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag != "equal" and len(divergences) < 40:
            divergences.append({"tag": tag, "cuda": sa[i1 : min(i2, i1 + 6)], "emulated": sb[j1 : min(j2, j1 + 6)], "at": [i1, j1], "phase": kept_a[min(i1, len(sa) - 1)]["phase"] if sa else None})
    return {"ops": table(ops_a, ops_b), "saved": table(saved_a, saved_b), "divergences": divergences, "similarity": matcher.ratio()}


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="folder for the JSON files and summary.md (default: $OUT)")
    parser.add_argument("--quick", action="store_true", help="small sizes")
    parser.add_argument("--models", default=None, help="comma-separated subset of bert,t5,llama-gqa,gpt2")
    parser.add_argument("--budget", type=float, default=85.0, help="seconds: no configuration starts after this (default 85)")
    parser.add_argument("--skip-done", action="store_true", help="skip configurations whose JSON is already in --out")
    parser.add_argument("--against", action="append", default=[], help="a JSON this script wrote on a GPU: without a GPU, its fake CUDA path stands in for the one not run here (repeatable)")
    parser.add_argument("--zoo", default=None, help="comma-separated zoo models (benchmarks/zoo: the zoo, held-back and sweep registries) at their real size, in their own precision, instead of --models")
    args = parser.parse_args(argv)
    out = output_dir(args.out)
    started = time.perf_counter()
    on_gpu = torch.cuda.is_available()
    # fake CUDA paths recorded on a GPU, by (model, precision), for a machine without one
    recorded = {(r["model"], r["precision"]): r["cuda"] for r in (json.loads(Path(f).read_text()) for f in args.against) if "cuda" in r}
    configurations = zoo_configurations(args.zoo.split(","), "small" if args.quick else "real") if args.zoo else model_configurations(args.models, args.quick)
    lines = [f"{environment_line(torch.device('cuda' if on_gpu else 'cpu'))}", ""]
    lines.append("| model | precision | fake CUDA peak | emulated peak | emulated vs CUDA | ops similarity |")
    lines.append("| --- | --- | --- | --- | --- | --- |")
    details = []
    for name, precision, autocast, kwargs, batch in configurations:
        if out is not None and args.skip_done and (out / f"{name}-{precision}.json").exists():
            continue
        if time.perf_counter() - started > args.budget:
            lines.append(f"| {name} | {precision} | (not run: past --budget; rerun with --skip-done) | | | |")
            continue
        emulated = run_path(kwargs, batch, autocast, emulate=True)
        result: dict[str, Any] = {"model": name, "precision": precision, "emulated": emulated}
        if on_gpu or (name, precision) in recorded:
            cuda = run_path(kwargs, batch, autocast, emulate=False) if on_gpu else recorded[(name, precision)]
            result["cuda"] = cuda
            result["diff"] = d = diff(cuda, emulated)
            change = 100 * (emulated["peak"] - cuda["peak"]) / cuda["peak"]
            lines.append(f"| {name} | {precision} | {cuda['peak']:,} | {emulated['peak']:,} | {change:+.2f}% | {d['similarity']:.3f} |")
            top = [f"  - op {r['key']}: CUDA {r['cuda_count']}x {r['cuda_bytes']:,} B, emulated {r['emulated_count']}x {r['emulated_bytes']:,} B" for r in d["ops"][:5]]
            top += [f"  - saved {r['key']}: CUDA {r['cuda_bytes']:,} B, emulated {r['emulated_bytes']:,} B" for r in d["saved"][:5]]
            details.append(f"- {name} {precision}:\n" + "\n".join(top))
        else:
            lines.append(f"| {name} | {precision} | (no GPU) | {emulated['peak']:,} | - | - |")
        if out is not None:
            (out / f"{name}-{precision}.json").write_text(json.dumps(result))
            (out / "summary.md").write_text("\n".join(lines) + "\n")  # after each configuration
    lines += ["", f"{time.perf_counter() - started:.0f} s", "", "Largest differences (bytes over the two steps):", *details]
    text = "\n".join(lines) + "\n"
    print(text)
    if out is not None:
        (out / "summary.md").write_text(text)
    return text


if __name__ == "__main__":
    main()
