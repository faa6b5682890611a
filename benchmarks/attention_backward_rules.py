"""What the efficient attention kernel's backward asks of the caching allocator, call by call (CUDA).

    PYTHONPATH=. python3 benchmarks/attention_backward_rules.py --out $OUT     # about 20 s on an H200

``aten._scaled_dot_product_efficient_attention_backward`` returns the query's, key's and value's
gradients (and the bias's); a fake step sees those alone. Inside, the kernel may take more: a
contiguous copy of the output's gradient, its ``delta`` (a float per query row), a workspace (the
split-keys accumulator for the query's gradient), and it may lay the three gradients out in one
block where query, key and value are parts of one tensor (a packed projection). This runs the
backward over a sweep of shapes, dtypes, layouts (query, key and value packed in one tensor, or
apart), masks and causality, with the allocator's history recorded around the call alone
(``torch.cuda.memory._record_memory_history``), and writes every block the call asked for, in
order, whether it was given back inside the call, the order of takes and gives, and the returned
gradients' storages' bytes
(also with the output's gradient laid out as ``nn.MultiheadAttention`` hands it back, and with
dropout):
``attention_backward_rules.json`` in ``--out``. ``estimate/scratch.py``'s rule for this operator
rests on it; ``tests/test_estimate_attention_backward.py`` holds the rule to rows of it.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchutil import environment_line, output_dir  # noqa: E402

aten = torch.ops.aten


def _inputs(batch: int, heads: int, length: int, head: int, dtype: torch.dtype, layout: str, device: torch.device):
    """Query, key and value ``(batch, heads, length, head)``: ``packed`` as views of one
    ``(batch, length, 3, heads, head)`` tensor (a packed projection, chunked); ``apart`` three
    ``(batch, length, heads, head)`` tensors transposed (``nn.MultiheadAttention``'s layout after its
    projection); ``contiguous`` three heads-first tensors."""
    if layout == "packed":
        packed = torch.randn(batch, length, 3, heads, head, dtype=dtype, device=device)
        return tuple(packed.select(2, i).transpose(1, 2) for i in range(3))
    if layout == "apart":
        return tuple(torch.randn(batch, length, heads, head, dtype=dtype, device=device).transpose(1, 2) for _ in range(3))
    return tuple(torch.randn(batch, heads, length, head, dtype=dtype, device=device) for _ in range(3))


def one_call(batch: int, heads: int, length: int, head: int, dtype: torch.dtype, layout: str, masked: bool,
             causal: bool, device: torch.device, grad_layout: str = "output", dropout: float = 0.0) -> dict[str, Any]:  # fmt: skip
    """One backward call's blocks: ``asked`` (bytes, in order, and whether given back inside) and the
    returned gradients' storages' bytes. ``grad_layout``: the output's gradient laid out as the
    output (``"output"``), or as ``nn.MultiheadAttention`` hands it back (``"positions_first"``: a
    ``(length, batch, heads, head)`` tensor permuted, from its ``permute(2, 0, 1, 3).contiguous()``);
    ``dropout``: the attention's dropout probability, forward and backward."""
    q, k, v = _inputs(batch, heads, length, head, dtype, layout, device)
    bias = None
    if masked:  # a key padding mask, expanded as nn.MultiheadAttention expands it
        bias = torch.zeros(batch, 1, 1, length, dtype=dtype, device=device).expand(batch, heads, length, length)
    out, lse, seed, offset = aten._scaled_dot_product_efficient_attention(q, k, v, bias, True, dropout, causal)
    if grad_layout == "positions_first":
        grad_out = torch.randn(length, batch, heads, head, dtype=dtype, device=device).permute(1, 2, 0, 3)
    else:
        grad_out = torch.randn_like(out)
    torch.cuda.synchronize(device)
    torch.cuda.memory._record_memory_history(max_entries=100_000)
    try:
        grads = aten._scaled_dot_product_efficient_attention_backward(
            grad_out, q, k, v, bias, out, lse, seed, offset, dropout, [True, True, True, False], causal
        )
        torch.cuda.synchronize(device)
        snapshot = torch.cuda.memory._snapshot(device)
    finally:
        torch.cuda.memory._record_memory_history(None)
    trace = snapshot["device_traces"][device.index or 0]
    asked: list[dict[str, Any]] = []
    order: list[tuple[str, int]] = []  # ("take", block) and ("give", block) as the call made them
    live: dict[int, int] = {}  # address -> the block's number
    for event in trace:
        if event["action"] == "alloc":
            live[event["addr"]] = len(asked)
            order.append(("take", len(asked)))
            asked.append({"bytes": event["size"], "given_back": False})
        elif event["action"] in ("free_requested", "free_completed") and event["addr"] in live:
            number = live.pop(event["addr"])
            asked[number]["given_back"] = True
            order.append(("give", number))
    returned = [grad.untyped_storage().nbytes() for grad in grads[:3]]
    del grads
    return {
        "batch": batch, "heads": heads, "length": length, "head": head, "dtype": str(dtype).removeprefix("torch."),
        "layout": layout, "masked": masked, "causal": causal, "grad_layout": grad_layout, "dropout": dropout,
        "query_contiguous": q.is_contiguous(), "grad_out_contiguous": grad_out.is_contiguous(),
        "asked": asked, "order": order, "returned": returned,
    }  # fmt: skip


def sweep() -> list[tuple]:
    rows: list[tuple] = []
    for dtype, layout in itertools.product((torch.float32, torch.bfloat16), ("packed", "apart")):
        # the output's gradient as nn.MultiheadAttention hands it back
        rows += [(b, 12, 512, 64, dtype, layout, m, False, "positions_first", 0.0) for b in (8, 112) for m in (False, True)]
        # with dropout (nn.MultiheadAttention's in training), as it hands the gradient back
        rows += [(b, 12, 512, 64, dtype, layout, m, False, "positions_first", 0.1) for b in (8, 112) for m in (False, True)]
    for batch, heads, length, head in ((8, 12, 512, 64), (32, 12, 512, 64), (112, 12, 512, 64), (16, 4, 128, 64),
                                       (8, 8, 1024, 64), (8, 12, 512, 128), (8, 12, 500, 80), (64, 16, 256, 32)):  # fmt: skip
        for dtype, layout, masked, causal in itertools.product(
            (torch.float32, torch.bfloat16), ("packed", "apart", "contiguous"), (False, True), (False, True)
        ):
            if masked and causal:
                continue
            rows.append((batch, heads, length, head, dtype, layout, masked, causal, "output", 0.0))
    # head dims above 128 (Gemma's global layers of 256 and 512): the kernel built for any head dim
    for batch, heads, length, head in itertools.product((8,), (4, 8), (128, 512), (160, 192, 256, 512)):
        for dtype, masked, causal in itertools.product((torch.float32, torch.bfloat16), (False, True), (False, True)):
            if masked and causal:
                continue
            rows.append((batch, heads, length, head, dtype, "contiguous", masked, causal, "output", 0.0))
    return rows


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="folder for attention_backward_rules.json (default: $OUT)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("the efficient attention kernel runs on CUDA")
    device = torch.device("cuda", torch.cuda.current_device())
    out = output_dir(args.out) or Path(".")
    started = time.perf_counter()
    rows = []
    for config in sweep():
        try:
            *shape, grad_layout, dropout = config
            rows.append(one_call(*shape, device=device, grad_layout=grad_layout, dropout=dropout))
        except Exception as exc:  # noqa: BLE001 - a shape the kernel refuses is a row too
            rows.append({"config": [str(c) for c in config], "error": f"{type(exc).__name__}: {exc}"[:300]})
        torch.cuda.empty_cache()
    payload = {"environment": environment_line(device), "torch": torch.__version__, "seconds": time.perf_counter() - started, "rows": rows}
    (out / "attention_backward_rules.json").write_text(json.dumps(payload, indent=1))
    print(f"{len(rows)} calls in {payload['seconds']:.0f} s; wrote {out / 'attention_backward_rules.json'}")
    return rows


if __name__ == "__main__":
    main()
