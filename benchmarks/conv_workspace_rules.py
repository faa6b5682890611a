"""cuDNN convolution workspaces and other kernel scratch on a GPU, measured op by op.

    python benchmarks/conv_workspace_rules.py --out results/   # on a GPU: under 90 s on an H100
    python benchmarks/conv_workspace_rules.py --dry-run        # the cases only, no GPU: a smoke test
    python benchmarks/conv_workspace_rules.py --resume old/conv_workspace_rules.json --parts default --out results/
                                                               # what a run cut short left, kept with its rows

A fake-tensor estimate sees what an operator returns, never the workspace a
cuDNN convolution takes from the caching allocator while it runs. For a spread
of convolutions (conv1d, conv2d, conv3d, transposed; N, C_in, C_out including 3
and other non-multiples of 8; kernel 1/3/7, stride 1/2, groups 1, grouped and
depthwise; fp32, bf16, fp16; contiguous, ``channels_last`` and a
non-contiguous channel slice as input) this calls ``aten.convolution`` and
``aten.convolution_backward`` (with the output masks autograd passes: input,
weight and bias gradients; no input gradient for a network's first layer; only
the input gradient for frozen weights) directly on real CUDA tensors and records:

- **first call, clean cache**: after ``empty_cache()``, what the call grew
  ``memory_reserved()`` by and its scratch (the segments a first step's
  workspace leaves reserved; with ``cudnn.benchmark`` the search's workspaces);
- **steady call**: the same call again, ``scratch = peak inside the op -
  max(allocated before, allocated after)``, exactly as ``op_scratch.py`` measures
  it (synchronize, reset the peak, the op, synchronize);
- the bytes of input, weight, output and grad_output (and the input's and
  output's bytes in NHWC with channels padded to a multiple of 8), so that a
  rule can be fitted from the JSON alone.

The default ``torch.backends.cudnn`` flags (``benchmark=False``, ``allow_tf32``
as torch sets it) run in one process, ``cudnn.benchmark=True`` in a second one
(cuDNN plans are cached per shape for the process's life, so one setting must
not see the other's plans). A few fp32 shapes also run with ``allow_tf32=False``.

Besides convolutions, under a per-operator meter (a dispatch mode, as in
``op_scratch.py``): forward and backward of ``upsample_bilinear2d``,
``upsample_nearest2d``, ``max_pool2d``, ``avg_pool2d``, ``adaptive_avg_pool2d``,
``batch_norm`` (``cudnn_batch_norm`` / ``native_batch_norm`` as torch picks) and
``cat``, with the gradient arriving contiguous, ``channels_last`` or as a
non-contiguous slice (a U-Net's concatenation hands its inputs slices of its
gradient): every operator with scratch is recorded with its inputs' strides.

Writes ``conv_workspace_rules.json`` (environment, then one object per
measurement, bytes) and ``conv_workspace_rules.md`` (tables) into ``--out``
(default ``$OUT``), after each part, so a run cut short keeps what it measured.
Where :mod:`pytorch_mem_profiler.estimate.conv_workspace` is importable, each
convolution row also carries the rule's figure and bound.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchutil import markdown_table, output_dir  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# (name, dims, N, C_in, C_out, size, kernel, stride, groups, transposed); padding is kernel // 2
# (0 for a stride-2 2x2 up-convolution). The first rows are shapes measured in real zoo steps.
SHAPES: list[tuple[str, int, int, int, int, int, int, int, int, bool]] = [
    ("unet_dec", 2, 8, 96, 32, 256, 3, 1, 1, False),
    ("unet_c32", 2, 8, 32, 32, 256, 3, 1, 1, False),
    ("resnet_stem", 2, 128, 3, 64, 224, 7, 2, 1, False),
    ("resnet_l1", 2, 128, 64, 64, 56, 3, 1, 1, False),
    ("vgg_big", 2, 64, 64, 64, 224, 3, 1, 1, False),
    ("unet_in3", 2, 8, 3, 32, 256, 3, 1, 1, False),
    ("unet_head", 2, 8, 32, 3, 256, 1, 1, 1, False),
    ("c512_s16", 2, 8, 512, 512, 16, 3, 1, 1, False),
    ("c256_s32", 2, 8, 256, 256, 32, 3, 1, 1, False),
    ("unet_up", 2, 8, 512, 256, 16, 2, 2, 1, True),
    ("down_1x1s2", 2, 128, 64, 128, 56, 1, 2, 1, False),
    ("resnet_l2", 2, 128, 128, 128, 28, 3, 1, 1, False),
    ("resnet_l4", 2, 128, 512, 512, 7, 3, 1, 1, False),
    ("odd_5_17", 2, 32, 5, 17, 64, 3, 1, 1, False),
    ("odd_24_100_s2", 2, 16, 24, 100, 56, 3, 2, 1, False),
    ("odd_33_k7", 2, 4, 33, 33, 128, 7, 1, 1, False),
    ("n1_big", 2, 1, 64, 64, 512, 3, 1, 1, False),
    ("pointwise", 2, 2, 256, 256, 64, 1, 1, 1, False),
    ("dw_3x3", 2, 128, 32, 32, 112, 3, 1, 32, False),
    ("dw_3x3_s2", 2, 64, 144, 144, 56, 3, 2, 144, False),
    ("dw_7x7", 2, 32, 96, 96, 56, 7, 1, 96, False),
    ("grouped_32", 2, 32, 256, 256, 28, 3, 1, 32, False),
    ("cifar_in3", 2, 256, 3, 32, 32, 3, 1, 1, False),
    ("small_k5", 2, 64, 16, 8, 28, 5, 1, 1, False),
    ("dcgan_up", 2, 16, 64, 32, 64, 4, 2, 1, True),
    ("conv1d_audio", 1, 16, 1, 64, 16000, 7, 2, 1, False),
    ("conv1d_seq", 1, 32, 256, 256, 1024, 3, 1, 1, False),
    ("conv1d_dw", 1, 32, 512, 512, 512, 7, 1, 512, False),
    ("conv1d_text_k3", 1, 64, 1024, 1024, 512, 3, 1, 1, False),  # a text CNN over embeddings (held-back normalized_cnn)
    ("conv1d_text_k5", 1, 64, 1024, 1024, 512, 5, 1, 1, False),
    ("conv1d_pos_g16", 1, 8, 768, 768, 199, 128, 1, 16, False),  # Wav2Vec2-base's positional convolution
    ("conv1d_feat_s2", 1, 8, 512, 512, 3199, 3, 2, 1, False),  # Wav2Vec2's feature extractor
    ("conv3d_video", 3, 4, 3, 64, 32, 3, 1, 1, False),
    ("conv3d_mid", 3, 2, 64, 64, 16, 3, 1, 1, False),
    ("conv3d_s2", 3, 2, 32, 64, 32, 3, 2, 1, False),
]
#: 1-D shapes also run over a channels-innermost input (``embed(ids).transpose(1, 2)``: a transposed (N, L, C)
#: tensor), which ATen hands cuDNN channels_last, with the output gradient in the same layout
CHANNELS_INNERMOST_SHAPES = {"conv1d_seq", "conv1d_dw", "conv1d_text_k3", "conv1d_text_k5", "conv1d_pos_g16"}
#: Shapes also run in fp16, with cudnn.benchmark=True, and with allow_tf32=False.
FP16_SHAPES = {"unet_dec", "resnet_stem", "resnet_l1", "c512_s16", "odd_5_17", "dw_3x3", "conv1d_seq", "conv3d_mid"}
BENCHMARK_SHAPES = {"unet_dec", "unet_c32", "resnet_stem", "resnet_l1", "c512_s16", "c256_s32", "unet_up", "odd_5_17",
                    "dw_3x3", "resnet_l4", "conv1d_seq", "conv3d_mid"}
NO_TF32_SHAPES = {"unet_dec", "resnet_l1", "c512_s16", "odd_5_17"}
#: (name, output mask) of the calls measured: a layer's forward, and backward as autograd calls it.
CALLS = [("forward", None), ("backward", (True, True, True)), ("backward", (True, True, False)), ("backward", (False, True, False)),
         ("backward", (False, True, True)), ("backward", (True, False, False)),
         ("backward", (False, False, True))]  # the last: the bias gradient alone (a sum over all but the channels)
QUICK_SHAPES = {"resnet_l1", "odd_5_17", "dw_3x3", "conv1d_seq", "conv3d_mid", "unet_up"}


def environment() -> dict[str, Any]:
    env: dict[str, Any] = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "allow_tf32_default": torch.backends.cudnn.allow_tf32,
        "matmul_allow_tf32_default": torch.backends.cuda.matmul.allow_tf32,
        "benchmark_limit": getattr(torch.backends.cudnn, "benchmark_limit", None),
        "env_vars": {k: v for k, v in os.environ.items() if k.startswith(("TORCH_CUDNN", "CUDNN", "PYTORCH_CUDA_ALLOC"))},
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env.update(gpu=props.name, capability=f"{props.major}.{props.minor}", multiprocessors=props.multi_processor_count,
                   total_memory=props.total_memory)
    return env


def _nbytes(shape: list[int] | tuple[int, ...], element: int) -> int:
    n = element
    for s in shape:
        n *= s
    return n


def _padded_nhwc(shape: list[int], element: int) -> int:
    """Bytes of ``shape`` (N, C, *spatial) in NHWC with C padded to a multiple of 8."""
    return _nbytes([shape[0], -(-shape[1] // 8) * 8, *shape[2:]], element)


def conv_cases(quick: bool, shapes: frozenset[str] | None = None) -> list[dict[str, Any]]:
    """Every (shape, dtype, layout, call) measured under one flag setting, the zoo's shapes first
    (``shapes``: only those named)."""
    cases = []
    for name, dims, n, cin, cout, size, kernel, stride, groups, transposed in SHAPES:
        if quick and name not in QUICK_SHAPES or shapes is not None and name not in shapes:
            continue
        dtypes = ["float32", "bfloat16"] + (["float16"] if name in FP16_SHAPES else [])
        layouts = ["contiguous"] + (["channels_last"] if dims >= 2 else [])
        if name in CHANNELS_INNERMOST_SHAPES:
            layouts.append("channels_innermost")
        if name in ("unet_dec", "resnet_l1", "odd_5_17", "conv1d_seq"):
            layouts.append("noncontig")
        if name in ("resnet_l1", "unet_dec"):
            layouts.append("weight_channels_last")
        for dtype in dtypes:
            for layout in layouts:
                for call, mask in CALLS:
                    if layout in ("noncontig", "weight_channels_last") and mask not in (None, (True, True, False)):
                        continue
                    padding = 0 if transposed and kernel == 2 else (kernel // 2 if not transposed else (kernel - stride) // 2)
                    cases.append({
                        "shape_name": name, "dims": dims, "n": n, "cin": cin, "cout": cout, "size": size if not quick else min(size, 64),
                        "kernel": kernel, "stride": stride, "padding": padding, "groups": groups, "transposed": transposed,
                        "dtype": dtype, "layout": layout, "call": call, "mask": list(mask) if mask else None,
                    })  # fmt: skip
    # every shape's forward and full backward in fp32 and bf16 first; then the other masks; then fp16
    # and the odd layouts: a sweep cut short by its deadline keeps the breadth
    def priority(case: dict[str, Any]) -> int:
        if case["dtype"] == "float16" or case["layout"] in ("noncontig", "weight_channels_last"):
            return 2
        return 0 if case["mask"] in (None, [True, True, True], [True, True, False]) else 1

    return sorted(cases, key=priority)


def _layout(t: torch.Tensor, layout: str) -> torch.Tensor:
    if layout in ("channels_last",) and t.dim() == 4:
        return t.contiguous(memory_format=torch.channels_last)
    if layout in ("channels_last",) and t.dim() == 5:
        return t.contiguous(memory_format=torch.channels_last_3d)
    if layout == "channels_innermost" and t.dim() == 3:  # (N, C, L) as a transposed (N, L, C)
        return t.transpose(1, 2).contiguous().transpose(1, 2)
    return t.contiguous()


def _conv_tensors(case: dict[str, Any], device: torch.device) -> dict[str, Any]:
    dtype = DTYPES[case["dtype"]]
    dims, n, cin, cout, k, s, p, g = (case[x] for x in ("dims", "n", "cin", "cout", "kernel", "stride", "padding", "groups"))
    spatial = [case["size"]] * dims
    if case["transposed"]:
        weight_shape = [cin, cout // g, *([k] * dims)]
        out_spatial = [(x - 1) * s - 2 * p + k for x in spatial]
    else:
        weight_shape = [cout, cin // g, *([k] * dims)]
        out_spatial = [(x + 2 * p - k) // s + 1 for x in spatial]
    layout = case["layout"]
    if layout == "noncontig":  # the first C_in channels of a tensor twice as wide: a concatenation's part
        x = torch.randn([n, 2 * cin, *spatial], device=device, dtype=dtype)[:, :cin]
    else:
        x = _layout(torch.randn([n, cin, *spatial], device=device, dtype=dtype), layout)
    weight_layout = "channels_last" if layout in ("channels_last", "weight_channels_last") else "contiguous"
    w = _layout(torch.randn(weight_shape, device=device, dtype=dtype), weight_layout)
    b = torch.randn(cout, device=device, dtype=dtype)
    out_shape = [n, cout, *out_spatial]
    grad_layout = "channels_last" if layout in ("channels_last", "weight_channels_last") else layout if layout == "channels_innermost" else "contiguous"
    go = _layout(torch.randn(out_shape, device=device, dtype=dtype), grad_layout) if case["call"] == "backward" else None
    return {"x": x, "w": w, "b": b, "go": go, "out_shape": out_shape, "weight_shape": weight_shape}


def _conv_call(case: dict[str, Any], t: dict[str, Any]) -> Callable[[], Any]:
    dims = case["dims"]
    stride, padding, dilation = [case["stride"]] * dims, [case["padding"]] * dims, [1] * dims
    out_pad = [0] * dims
    aten = torch.ops.aten
    if case["call"] == "forward":
        return lambda: aten.convolution.default(t["x"], t["w"], t["b"], stride, padding, dilation, case["transposed"], out_pad, case["groups"])
    mask = case["mask"]
    bias_sizes = [case["cout"]] if mask[2] else None
    return lambda: aten.convolution_backward.default(
        t["go"], t["x"], t["w"], bias_sizes, stride, padding, dilation, case["transposed"], out_pad, case["groups"], mask)


def _sync_and_read() -> tuple[int, int]:
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated(), torch.cuda.memory_reserved()


def _outputs_bytes(out: Any) -> int:
    seen, total = set(), 0
    for t in tree_flatten(out)[0]:
        if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            total += t.untyped_storage().nbytes()
    return total


def measure_call(fn: Callable[[], Any]) -> dict[str, Any]:
    """The first call on a clean cache (reserved growth, scratch), then a steady call's scratch."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before, reserved = _sync_and_read()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    after, reserved_after = _sync_and_read()
    first = {"scratch": torch.cuda.max_memory_allocated() - max(before, after), "reserved_growth": reserved_after - reserved,
             "outputs": _outputs_bytes(out)}
    del out
    runs = []
    for _ in range(2):
        before, _r = _sync_and_read()
        torch.cuda.reset_peak_memory_stats()
        out = fn()
        after, _r = _sync_and_read()
        runs.append(torch.cuda.max_memory_allocated() - max(before, after))
        del out
    return {"first": first, "steady": {"scratch": runs[-1], "scratch_runs": runs}}


def _rule_for(case: dict[str, Any], flags: dict[str, Any]) -> dict[str, Any] | None:
    try:
        from pytorch_mem_profiler.estimate import conv_workspace
    except ImportError:
        return None
    try:
        return conv_workspace.rule_for_sweep_case(case, flags)
    except Exception as err:  # noqa: BLE001 - a rule's fault marks the row, it does not end the sweep
        return {"error": repr(err)}


def case_key(case: dict[str, Any], flags_name: str) -> str:
    """What tells a measured case apart, for ``--resume``."""
    fields = ("shape_name", "dims", "n", "cin", "cout", "size", "kernel", "stride", "groups", "transposed", "dtype", "layout",
              "call", "mask", "op", "c")  # fmt: skip
    return json.dumps([flags_name, *(case.get(f) for f in fields)])


def run_convolutions(flags: dict[str, Any], quick: bool, deadline: float, rows: list[dict[str, Any]], save: Callable[[], None],
                     done: frozenset[str] = frozenset(), shapes: frozenset[str] | None = None) -> None:  # fmt: skip
    device = torch.device("cuda")
    torch.backends.cudnn.benchmark = flags["benchmark"]
    torch.backends.cudnn.allow_tf32 = flags["allow_tf32"]
    cases = conv_cases(quick, shapes)
    if flags["benchmark"]:
        cases = [c for c in cases if c["shape_name"] in BENCHMARK_SHAPES and c["dtype"] != "float16" and c["layout"] in ("contiguous", "channels_last")
                 and c["mask"] in (None, [True, True, True])]
    elif not flags["allow_tf32"]:
        cases = [c for c in cases if c["shape_name"] in NO_TF32_SHAPES and c["dtype"] == "float32" and c["layout"] in ("contiguous", "channels_last")]
    cases = [c for c in cases if case_key(c, flags["name"]) not in done]
    free = torch.cuda.mem_get_info()[0]
    for i, case in enumerate(cases):
        if time.perf_counter() > deadline:
            rows.append({"part": "conv", "flags": flags, "stopped": f"deadline, {len(cases) - i} cases left"})
            break
        row: dict[str, Any] = {"part": "conv", "flags": flags, **case}
        try:
            t = _conv_tensors(case, device)
            element = t["x"].element_size()
            row.update(
                input_shape=list(t["x"].shape), weight_shape=t["weight_shape"], output_shape=t["out_shape"],
                input_bytes=_nbytes(t["x"].shape, element), weight_bytes=_nbytes(t["weight_shape"], element),
                output_bytes=_nbytes(t["out_shape"], element), input_nhwc8_bytes=_padded_nhwc(list(t["x"].shape), element),
                output_nhwc8_bytes=_padded_nhwc(t["out_shape"], element), element_size=element,
                input_strides=list(t["x"].stride()), weight_strides=list(t["w"].stride()),
            )  # fmt: skip
            if row["input_bytes"] * 8 > free:
                row["skipped"] = "too large for free memory"
            else:
                row.update(measure_call(_conv_call(case, t)))
            del t
        except Exception as err:  # noqa: BLE001 - an unsupported combination is a row, not the end of the sweep
            row["error"] = f"{type(err).__name__}: {str(err)[:300]}"
        rule = _rule_for(case, flags)
        if rule is not None:
            row["rule"] = rule
        rows.append(row)
        if i % 25 == 0:
            save()


class OpMeter(TorchDispatchMode):
    """Per operator: its scratch (peak inside above both ends) and the segments it reserved."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[dict[str, Any]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        before, reserved = _sync_and_read()
        torch.cuda.reset_peak_memory_stats()
        out = func(*args, **kwargs)
        after, reserved_after = _sync_and_read()
        scratch = torch.cuda.max_memory_allocated() - max(before, after)
        tensors = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        self.rows.append({
            "op": str(func), "scratch": scratch, "reserved_growth": reserved_after - reserved,
            "inputs": [{"shape": list(a.shape), "dtype": str(a.dtype).removeprefix("torch."), "strides": list(a.stride()),
                        "contiguous": a.is_contiguous(), "channels_last": a.dim() == 4 and a.is_contiguous(memory_format=torch.channels_last),
                        "bytes": a.numel() * a.element_size()} for a in tensors],
            "outputs": _outputs_bytes(out),
        })  # fmt: skip
        return out


def _other_op_cases(quick: bool) -> list[dict[str, Any]]:
    n, c, s = (2, 16, 16) if quick else (8, 64, 128)
    cases = []
    for op in ("upsample_bilinear2d", "upsample_nearest2d", "max_pool2d", "avg_pool2d", "adaptive_avg_pool2d", "batch_norm", "cat"):
        for dtype in ("float32", "bfloat16"):
            for layout in ("contiguous", "channels_last", "noncontig"):
                cases.append({"op": op, "dtype": dtype, "layout": layout, "n": n, "c": c, "size": s})
    if not quick:  # a second size: does the scratch scale with the tensor?
        cases += [{"op": op, "dtype": "float32", "layout": "noncontig", "n": 16, "c": 32, "size": 64}
                  for op in ("upsample_bilinear2d", "max_pool2d", "batch_norm")]
        cases += [{"op": "batch_norm", "dtype": "bfloat16", "layout": layout, "n": 64, "c": 128, "size": 56}
                  for layout in ("contiguous", "channels_last")]
    return cases


def _other_forward(case: dict[str, Any], x: torch.Tensor) -> torch.Tensor:
    op = case["op"]
    if op == "upsample_bilinear2d":
        return F.interpolate(x, scale_factor=2, mode="bilinear", align_corners=False)
    if op == "upsample_nearest2d":
        return F.interpolate(x, scale_factor=2, mode="nearest")
    if op == "max_pool2d":
        return F.max_pool2d(x, 2)
    if op == "avg_pool2d":
        return F.avg_pool2d(x, 2)
    if op == "adaptive_avg_pool2d":
        return F.adaptive_avg_pool2d(x, 7)
    if op == "batch_norm":
        c = x.shape[1]
        weight = torch.ones(c, device=x.device, requires_grad=True)
        bias = torch.zeros(c, device=x.device, requires_grad=True)
        return F.batch_norm(x, torch.zeros(c, device=x.device), torch.ones(c, device=x.device), weight, bias, training=True)
    if op == "cat":
        return torch.cat([x, x * 1], dim=1)
    raise ValueError(op)


def run_other_ops(quick: bool, deadline: float, rows: list[dict[str, Any]], done: frozenset[str] = frozenset()) -> None:
    """Forward and backward of each op under the meter, the gradient in the case's layout; twice on
    a clean cache, the second run's operators recorded (and the first run's reserved growth)."""
    device = torch.device("cuda")
    for case in _other_op_cases(quick):
        if case_key(case, "ops") in done:
            continue
        if time.perf_counter() > deadline:
            rows.append({"part": "ops", "stopped": "deadline"})
            break
        row: dict[str, Any] = {"part": "ops", **case}
        try:
            dtype = DTYPES[case["dtype"]]
            base = torch.randn(case["n"], case["c"], case["size"], case["size"], device=device, dtype=dtype)
            x = _layout(base, "channels_last" if case["layout"] == "channels_last" else "contiguous").requires_grad_()
            del base
            for attempt in ("first", "steady"):
                gc.collect()
                if attempt == "first":
                    torch.cuda.empty_cache()
                out = _other_forward(case, x)
                if case["layout"] == "noncontig":  # the gradient as a slice of a wider one: a concatenation's backward
                    wide = torch.randn(out.shape[0], 2 * out.shape[1], *out.shape[2:], device=device, dtype=out.dtype)
                    grad = wide[:, out.shape[1]:]
                else:
                    grad = _layout(torch.randn(out.shape, device=device, dtype=out.dtype),
                                   "channels_last" if case["layout"] == "channels_last" else "contiguous")
                meter = OpMeter()
                with meter:
                    out.backward(grad)
                x.grad = None
                del out, grad
                row[attempt] = [r for r in meter.rows if r["scratch"] > 0 or r["reserved_growth"] > 0 or attempt == "steady"]
            # the forward too, once, under the meter
            meter = OpMeter()
            with meter:
                out = _other_forward(case, x)
            row["forward"] = [r for r in meter.rows if r["scratch"] > 0]
            del out, x
        except Exception as err:  # noqa: BLE001
            row["error"] = f"{type(err).__name__}: {str(err)[:300]}"
        rows.append(row)


def _short(row: dict[str, Any]) -> str:
    dims = row["dims"]
    name = f"{row['shape_name']} {row['n']}x{row['cin']}x{row['size']}^{dims}->{row['cout']} k{row['kernel']}s{row['stride']}"
    if row["groups"] > 1:
        name += f" g{row['groups']}"
    if row["transposed"]:
        name += " T"
    return name


def markdown(env: dict[str, Any], rows: list[dict[str, Any]], seconds: float) -> str:
    lines = [f"GPU {env.get('gpu')} (sm {env.get('capability')}), torch {env['torch']}, CUDA {env['cuda']}, cuDNN {env['cudnn']}; "
             f"allow_tf32 default {env['allow_tf32_default']}; {seconds:.0f} s", ""]
    headers = ["conv", "dtype", "layout", "call", "in MB", "out MB", "first scratch", "first reserved+", "steady scratch",
               "steady/(in+out)", "rule", "bound"]
    for flags_name in ("default", "benchmark", "no_tf32"):
        table = []
        for r in rows:
            if r.get("part") != "conv" or "shape_name" not in r or r["flags"]["name"] != flags_name:
                continue
            call = r["call"] if r["mask"] is None else "bwd " + "".join("1" if m else "0" for m in r["mask"])
            if "steady" not in r:
                table.append([_short(r), r["dtype"], r["layout"], call, "-", "-", r.get("error", r.get("skipped", "-"))[:60], "", "", "", "", ""])
                continue
            steady = r["steady"]["scratch"]
            rule = r.get("rule") or {}
            table.append([
                _short(r), r["dtype"], r["layout"], call, f"{r['input_bytes'] / 1e6:.2f}", f"{r['output_bytes'] / 1e6:.2f}",
                f"{r['first']['scratch']:,}", f"{r['first']['reserved_growth']:,}", f"{steady:,}",
                f"{steady / (r['input_bytes'] + r['output_bytes']):.3f}", f"{rule['scratch']:,}" if "scratch" in rule else "-",
                f"{rule['bound']:,}" if "bound" in rule else "-",
            ])  # fmt: skip
        if table:
            lines += [f"## convolutions, cudnn flags: {flags_name}", "", markdown_table(headers, table), ""]
    other = []
    for r in rows:
        if r.get("part") != "ops" or "op" not in r:
            continue
        if "error" in r:
            other.append([r["op"], r["dtype"], r["layout"], f"{r['n']}x{r['c']}x{r['size']}", r["error"][:60], "", ""])
            continue
        for item in r.get("steady", []) + r.get("forward", []):
            if item["scratch"] > 0:
                ins = " ".join(f"{tuple(i['shape'])}{'' if i['contiguous'] else ' cl' if i['channels_last'] else ' nc'}" for i in item["inputs"])
                other.append([r["op"], r["dtype"], r["layout"], f"{r['n']}x{r['c']}x{r['size']}", item["op"], f"{item['scratch']:,}", ins])
    if other:
        lines += ["## other operators: every operator with scratch (steady backward, forward)", "",
                  markdown_table(["case", "dtype", "layout", "size", "operator", "scratch", "inputs (cl: channels_last, nc: non-contiguous)"], other), ""]
    return "\n".join(lines)


FLAG_SETS = {
    "default": {"name": "default", "benchmark": False, "allow_tf32": None},
    "benchmark": {"name": "benchmark", "benchmark": True, "allow_tf32": None},
    "no_tf32": {"name": "no_tf32", "benchmark": False, "allow_tf32": False},
}


def run_part(part: str, quick: bool, seconds: float, json_path: Path, done: frozenset[str] = frozenset(),
             shapes: frozenset[str] | None = None) -> None:  # fmt: skip
    """One process's share: a flag setting's convolutions (and, for the default without ``shapes``, the other ops)."""
    deadline = time.perf_counter() + seconds
    rows: list[dict[str, Any]] = []
    flags = dict(FLAG_SETS[part])
    if flags["allow_tf32"] is None:
        flags["allow_tf32"] = torch.backends.cudnn.allow_tf32

    def save() -> None:
        json_path.write_text(json.dumps(rows))

    torch.zeros(1, device="cuda")
    other_ops = part == "default" and shapes is None
    ops_left = sum(case_key(c, "ops") not in done for c in _other_op_cases(quick)) if other_ops else 0
    run_convolutions(flags, quick, deadline - min(12, ops_left), rows, save, done, shapes)
    save()
    if other_ops:
        run_other_ops(quick, deadline, rows, done)
    save()


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="folder for conv_workspace_rules.json and .md (default: $OUT)")
    parser.add_argument("--quick", action="store_true", help="a few small shapes: seconds")
    parser.add_argument("--dry-run", action="store_true", help="list the cases (and the rule's figures where it exists); no GPU")
    parser.add_argument("--budget", type=float, default=80.0, help="seconds for the whole sweep (default 80)")
    parser.add_argument("--parts", default="default,benchmark,no_tf32",
                        help="flag settings to run, in order (default: default,benchmark,no_tf32)")
    parser.add_argument("--resume", default=None, help="a previous conv_workspace_rules.json: its rows are kept, its cases not run again")
    parser.add_argument("--shapes", default=None, help=f"comma-separated convolution shapes to run, and no other operator "
                        f"(default: every one: {','.join(name for name, *_ in SHAPES)})")
    parser.add_argument("--part", choices=sorted(FLAG_SETS), help=argparse.SUPPRESS)
    parser.add_argument("--part-json", help=argparse.SUPPRESS)
    parser.add_argument("--part-seconds", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--done-json", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    shapes = frozenset(n for n in args.shapes.split(",") if n) if args.shapes else None
    unknown_shapes = (shapes or frozenset()) - {name for name, *_ in SHAPES}
    if unknown_shapes:
        parser.error(f"--shapes: unknown {sorted(unknown_shapes)}; choose from {[name for name, *_ in SHAPES]}")
    if args.part:
        done = frozenset(json.loads(Path(args.done_json).read_text())) if args.done_json else frozenset()
        run_part(args.part, args.quick, args.part_seconds, Path(args.part_json), done, shapes)
        return []
    parts = [p for p in args.parts.split(",") if p]
    unknown = set(parts) - set(FLAG_SETS)
    if unknown:
        parser.error(f"--parts: unknown {sorted(unknown)}; choose from {sorted(FLAG_SETS)}")
    started = time.perf_counter()
    env = environment()
    if args.dry_run or not torch.cuda.is_available():
        cases = conv_cases(args.quick, shapes)
        rows = [{"part": "conv", "flags": FLAG_SETS["default"], **c, "rule": _rule_for(c, FLAG_SETS["default"])} for c in cases]
        print(f"{len(cases)} convolution cases under the default flags; {len(_other_op_cases(args.quick))} other-operator cases"
              + ("" if torch.cuda.is_available() else " (no GPU: nothing measured)"))
        return rows
    out = output_dir(args.out) or Path(".")
    rows: list[dict[str, Any]] = []
    if args.resume:  # what a run cut short by its deadline measured: kept, and not measured again
        previous = json.loads(Path(args.resume).read_text())["rows"]
        rows = [r for r in previous if "steady" in r or r.get("part") == "ops" and "op" in r]
        for row in rows:  # the rule as it is now, under the row's flags
            if row.get("part") == "conv":
                tf32, torch.backends.cudnn.allow_tf32 = torch.backends.cudnn.allow_tf32, row["flags"]["allow_tf32"]
                rule = _rule_for(row, row["flags"])
                torch.backends.cudnn.allow_tf32 = tf32
                if rule is not None:
                    row["rule"] = rule
    done = sorted(case_key(r, r["flags"]["name"] if r.get("part") == "conv" else "ops") for r in rows)
    done_json = out / "conv_workspace_rules.done.json"
    done_json.write_text(json.dumps(done))
    # shares of the budget: the default flags (with the other ops), then cudnn.benchmark, then no TF32;
    # each process spends some seconds importing torch and starting CUDA
    shares = {"default": 0.5, "benchmark": 0.7, "no_tf32": 1.0}
    for i, part in enumerate(parts):
        remaining = args.budget - (time.perf_counter() - started)
        share = 1.0 if i == len(parts) - 1 else shares[part]
        seconds = max(8.0, share * remaining)
        part_json = out / f"conv_workspace_rules.{part}.json"
        command = [sys.executable, __file__, "--part", part, "--part-json", str(part_json), "--part-seconds", str(seconds - 7),
                   "--done-json", str(done_json)]  # fmt: skip
        if args.quick:
            command.append("--quick")
        if args.shapes:
            command += ["--shapes", args.shapes]
        finished = subprocess.run(command, check=False, timeout=seconds + 60)
        part_rows = json.loads(part_json.read_text()) if part_json.exists() else []
        if finished.returncode != 0:
            part_rows.append({"part": part, "process_exit": finished.returncode})
        rows += part_rows
        part_json.unlink(missing_ok=True)
        seconds_so_far = time.perf_counter() - started
        (out / "conv_workspace_rules.json").write_text(json.dumps({"environment": env, "seconds": seconds_so_far, "rows": rows}, indent=0))
        (out / "conv_workspace_rules.md").write_text(markdown(env, rows, seconds_so_far))
    done_json.unlink(missing_ok=True)
    print(markdown(env, rows, time.perf_counter() - started))
    return rows


if __name__ == "__main__":
    main()
