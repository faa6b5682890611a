"""Fake CPU tensors standing in for CUDA take CUDA autocast's policy, operator by operator.

Two kinds of evidence, neither taken from the code under test:

- torch's own CUDA autocast kernels: fake CUDA tensors run them on this machine
  without a GPU (``AutocastCUDA`` switched on directly, outside ``torch.autocast``,
  which refuses CUDA without a device; no tensor requires grad: a CPU build of
  torch cannot make autograd metadata for a CUDA tensor). Each case runs there and
  emulated, and the results' dtypes and every cast (``_to_copy``: from, to, shape)
  must be the same;
- the policy classes written out: what CUDA's autocast saves for backward in a
  small model of each class (a GELU written with ``pow``, a ``sum``, ``exp``/``log``,
  ``layer_norm``, an upsampling, a ``cat`` of mixed dtypes, an ``einsum`` with a
  weight), in bytes computed from the shapes, against what a ``saved_tensors_hooks``
  pack hook saw in the emulated step.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from pytorch_mem_profiler.estimate.autocast_policy import (
    CPU_POLICY,
    CUDA_POLICY,
    FALLTHROUGH,
    HANDLED_ELSEWHERE,
    cuda_autocast,
    differing_policies,
    listed,
)
from pytorch_mem_profiler.estimate.emulation import cuda_rules

from .helpers import transformers_or_skip

BF16 = torch.bfloat16


def _leaves(value: Any) -> list[Any]:
    if isinstance(value, (list, tuple)):
        return [leaf for v in value for leaf in _leaves(v)]
    return [value]


class _Casts(TorchDispatchMode):
    """Every cast made (``_to_copy``: from dtype, to dtype, shape) and every operator with its results' dtypes, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.casts: list[tuple[str, str, tuple[int, ...]]] = []
        self.ops: list[tuple[str, tuple[str, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        if func.namespace != "prim":  # device queries: CUDA's make more of them
            self.ops.append((str(func.overloadpacket), tuple(_dtypes(out))))
        if func is torch.ops.aten._to_copy.default and out.dtype != args[0].dtype:
            self.casts.append((str(args[0].dtype), str(out.dtype), tuple(out.shape)))
        return out


def _dtypes(out: Any) -> list[str]:
    return [str(t.dtype) if isinstance(t, torch.Tensor) else repr(t) for t in _leaves(out)]


@contextlib.contextmanager
def _cuda_autocast_on(dtype: torch.dtype):
    """``AutocastCUDA`` on, as ``torch.autocast("cuda")`` sets it where a GPU is."""
    before = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
    torch.set_autocast_enabled("cuda", True)
    torch.set_autocast_dtype("cuda", dtype)
    try:
        yield
    finally:
        torch.set_autocast_enabled("cuda", before[0])
        torch.set_autocast_dtype("cuda", before[1])


def on_cuda(run: Callable[[str], Any], dtype: torch.dtype = BF16, mode: FakeTensorMode | None = None) -> tuple[list[str], _Casts]:
    """``run``'s result dtypes and what it ran under torch's CUDA autocast kernels, on fake CUDA tensors."""
    with mode or FakeTensorMode(), torch.no_grad(), _Casts() as seen, _cuda_autocast_on(dtype):
        out = run("cuda")
    return _dtypes(out), seen


def emulated(run: Callable[[str], Any], dtype: torch.dtype = BF16, mode: FakeTensorMode | None = None) -> tuple[list[str], _Casts]:
    """The same on fake CPU tensors standing in for CUDA, under CPU autocast."""
    with mode or FakeTensorMode(), cuda_rules(), torch.no_grad(), _Casts() as seen, torch.autocast("cpu", dtype=dtype):
        out = run("cpu")
    return _dtypes(out), seen


def _t(*shape: int, dtype: torch.dtype = BF16, device: str = "cpu") -> torch.Tensor:
    return torch.empty(*shape, dtype=dtype, device=device)


# One call per operator whose CUDA and CPU policies differ (and a few alike), each on tensors made on ``d``.
CASES: dict[str, Callable[[str], Any]] = {
    # fp32 on CUDA, not listed on the CPU
    **{
        name: (lambda fn: lambda d: fn(_t(4, 8, device=d)))(getattr(torch, name))
        for name in ("acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt", "sinh", "tan")
    },
    "pow.Tensor_Scalar": lambda d: torch.pow(_t(4, 8, device=d), 3.0),
    "pow.Tensor_Tensor": lambda d: torch.pow(_t(4, 8, device=d), _t(4, 8, device=d)),
    "pow.Scalar": lambda d: torch.pow(2.0, _t(4, 8, device=d)),
    "softplus": lambda d: F.softplus(_t(4, 8, device=d)),
    "layer_norm": lambda d: F.layer_norm(_t(4, 8, device=d), (8,), _t(8, dtype=torch.float32, device=d), _t(8, device=d)),
    "group_norm": lambda d: F.group_norm(_t(2, 4, 8, device=d), 2, _t(4, dtype=torch.float32, device=d)),
    "rms_norm": lambda d: F.rms_norm(_t(4, 8, device=d), (8,)) if hasattr(F, "rms_norm") else _t(1, device=d),
    "cosine_similarity": lambda d: F.cosine_similarity(_t(4, 8, device=d), _t(4, 8, device=d)),
    "dist": lambda d: torch.dist(_t(4, 8, device=d), _t(4, 8, device=d)),
    "pdist": lambda d: F.pdist(_t(4, 8, device=d)),
    "renorm": lambda d: torch.renorm(_t(4, 8, device=d), 2, 0, 1.0),
    "logsumexp": lambda d: torch.logsumexp(_t(4, 8, device=d), 1),
    "frobenius_norm.dim": lambda d: torch.ops.aten.frobenius_norm.dim(_t(4, 8, device=d), [1]),
    "nuclear_norm": lambda d: torch.ops.aten.nuclear_norm(_t(4, 8, device=d)),
    "upsample_nearest2d": lambda d: F.interpolate(_t(1, 2, 4, 4, device=d), scale_factor=2),
    "_upsample_nearest_exact1d": lambda d: F.interpolate(_t(1, 2, 4, device=d), scale_factor=2, mode="nearest-exact"),
    "upsample_linear1d": lambda d: F.interpolate(_t(1, 2, 4, device=d), scale_factor=2, mode="linear"),
    "upsample_bilinear2d": lambda d: F.interpolate(_t(1, 2, 4, 4, device=d), size=(7, 7), mode="bilinear"),
    "_upsample_bilinear2d_aa": lambda d: F.interpolate(_t(1, 2, 8, 8, device=d), size=(3, 3), mode="bilinear", antialias=True),
    "upsample_bicubic2d": lambda d: F.interpolate(_t(1, 2, 4, 4, device=d), scale_factor=2, mode="bicubic"),
    "upsample_trilinear3d": lambda d: F.interpolate(_t(1, 2, 4, 4, 4, device=d), scale_factor=2, mode="trilinear"),
    "upsample_nearest3d": lambda d: F.interpolate(_t(1, 2, 4, 4, 4, device=d), scale_factor=2),
    # fp32 on both
    "mse_loss": lambda d: F.mse_loss(_t(4, 8, device=d), _t(4, 8, device=d)),
    # fp32_set_opt_dtype on CUDA
    "sum": lambda d: _t(4, 8, device=d).sum(),
    "sum.dim_IntList": lambda d: _t(4, 8, device=d).sum(1),
    "sum with dtype": lambda d: _t(4, 8, device=d).sum(1, dtype=BF16),
    "prod": lambda d: _t(4, 8, device=d).prod(),  # the CPU: fp32 (a float32 copy first)
    "prod.dim_int": lambda d: _t(4, 8, device=d).prod(1),
    "cumsum": lambda d: _t(4, 8, device=d).cumsum(1),
    "cumprod": lambda d: _t(4, 8, device=d).cumprod(1),
    "softmax.int": lambda d: torch.softmax(_t(4, 8, device=d), -1),
    "log_softmax.int": lambda d: F.log_softmax(_t(4, 8, device=d), -1),
    "linalg_vector_norm": lambda d: torch.linalg.vector_norm(_t(4, 8, device=d)),
    "linalg_matrix_norm": lambda d: torch.linalg.matrix_norm(_t(4, 8, device=d)),
    "float32 sum": lambda d: _t(4, 8, dtype=torch.float32, device=d).sum(),
    # fp32_append_dtype on CUDA
    "norm.Scalar": lambda d: torch.ops.aten.norm.Scalar(_t(4, 8, device=d)),
    "norm.ScalarOpt_dim": lambda d: _t(4, 8, device=d).norm(2, 1),
    # promote on CUDA
    "addcmul": lambda d: torch.addcmul(_t(4, 8, dtype=torch.float32, device=d), _t(4, 8, device=d), _t(4, 8, device=d)),
    "addcdiv": lambda d: torch.addcdiv(_t(4, 8, device=d), _t(4, 8, device=d), _t(4, 8, dtype=torch.float32, device=d)),
    "atan2": lambda d: torch.atan2(_t(4, 8, device=d), _t(4, 8, dtype=torch.float32, device=d)),
    "cross": lambda d: torch.linalg.cross(_t(4, 3, device=d), _t(4, 3, dtype=torch.float32, device=d)),
    "dot": lambda d: torch.dot(_t(8, device=d), _t(8, dtype=torch.float32, device=d)),
    "vdot": lambda d: torch.vdot(_t(8, device=d), _t(8, device=d)),
    "index_put": lambda d: torch.ops.aten.index_put(_t(8, 4, dtype=torch.float32, device=d), [torch.zeros(2, dtype=torch.long, device=d)], _t(2, 4, device=d)),
    "scatter_add": lambda d: torch.scatter_add(_t(4, 8, device=d), 1, torch.zeros(4, 8, dtype=torch.long, device=d), _t(4, 8, dtype=torch.float32, device=d)),
    "tensordot": lambda d: torch.tensordot(_t(4, 8, device=d), _t(8, 2, dtype=torch.float32, device=d), dims=1),
    "bilinear": lambda d: F.bilinear(_t(4, 3, device=d), _t(4, 5, device=d), _t(2, 3, 5, dtype=torch.float32, device=d)),
    "grid_sampler": lambda d: F.grid_sample(_t(1, 2, 4, 4, device=d), _t(1, 3, 3, 2, dtype=torch.float32, device=d), align_corners=False),
    # lower precision on CUDA only
    "addmv": lambda d: torch.addmv(_t(4, dtype=torch.float32, device=d), _t(4, 8, dtype=torch.float32, device=d), _t(8, device=d)),
    "addr": lambda d: torch.addr(_t(4, 8, dtype=torch.float32, device=d), _t(4, dtype=torch.float32, device=d), _t(8, dtype=torch.float32, device=d)),
    "mv": lambda d: torch.mv(_t(4, 8, dtype=torch.float32, device=d), _t(8, dtype=torch.float32, device=d)),
    "einsum": lambda d: torch.einsum("ij,jk->ik", _t(4, 8, dtype=torch.float32, device=d), _t(8, 2, dtype=torch.float32, device=d)),
    "chain_matmul": lambda d: torch.linalg.multi_dot([_t(4, 8, dtype=torch.float32, device=d), _t(8, 2, dtype=torch.float32, device=d), _t(2, 3, dtype=torch.float32, device=d)]),
    "lstm_cell": lambda d: torch.lstm_cell(
        _t(2, 4, dtype=torch.float32, device=d), [_t(2, 3, dtype=torch.float32, device=d)] * 2, _t(12, 4, dtype=torch.float32, device=d),
        _t(12, 3, dtype=torch.float32, device=d), _t(12, dtype=torch.float32, device=d), _t(12, dtype=torch.float32, device=d),
    ),
    "gru_cell": lambda d: torch.gru_cell(_t(2, 4, dtype=torch.float32, device=d), _t(2, 3, dtype=torch.float32, device=d), _t(9, 4, dtype=torch.float32, device=d), _t(9, 3, dtype=torch.float32, device=d)),
    "rnn_tanh_cell": lambda d: torch.rnn_tanh_cell(_t(2, 4, dtype=torch.float32, device=d), _t(2, 3, dtype=torch.float32, device=d), _t(3, 4, dtype=torch.float32, device=d), _t(3, 3, dtype=torch.float32, device=d)),
    # lower precision on both
    "linear": lambda d: F.linear(_t(4, 8, dtype=torch.float32, device=d), _t(2, 8, dtype=torch.float32, device=d)),
    # listed on the CPU only: falls through on CUDA
    "cat": lambda d: torch.cat([_t(4, 8, device=d), _t(4, 8, dtype=torch.float32, device=d)]),
    "stack": lambda d: torch.stack([_t(4, 8, device=d), _t(4, 8, dtype=torch.float32, device=d)]),
    "cross_entropy_loss": lambda d: F.cross_entropy(_t(4, 8, device=d), torch.zeros(4, dtype=torch.long, device=d)),
    "cross_entropy_loss smoothed": lambda d: F.cross_entropy(_t(4, 8, device=d), torch.zeros(4, dtype=torch.long, device=d), label_smoothing=0.1),
    "cross_entropy_loss probabilities": lambda d: F.cross_entropy(_t(4, 8, device=d), _t(4, 8, device=d)),
    "max_pool3d": lambda d: F.max_pool3d(_t(1, 2, 4, 4, 4, device=d), 2),
    "avg_pool3d": lambda d: F.avg_pool3d(_t(1, 2, 4, 4, 4, device=d), 2),
    "adaptive_avg_pool3d": lambda d: F.adaptive_avg_pool3d(_t(1, 2, 4, 4, 4, device=d), 2),
    "reflection_pad2d": lambda d: F.pad(_t(1, 2, 4, 4, device=d), (1, 1, 1, 1), mode="reflect"),
    "replication_pad2d": lambda d: F.pad(_t(1, 2, 4, 4, device=d), (1, 1, 1, 1), mode="replicate"),
    "trace": lambda d: torch.trace(_t(4, 4, device=d)),
    "polar": lambda d: torch.polar(_t(4, device=d), _t(4, device=d)),
    "binary_cross_entropy_with_logits": lambda d: F.binary_cross_entropy_with_logits(_t(4, device=d), _t(4, device=d)),
}


#: Cases where CUDA runs another kernel than the CPU (not autocast's doing): casts and results compared, not every operator.
KERNEL_CHOICES = {
    "rms_norm": "CUDA's fused kernel (_fused_rms_norm) where the CPU runs the composite",
    "lstm_cell": "CUDA's fused cell (_thnn_fused_lstm_cell) where the CPU runs the composite",
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_operator_casts_as_torchs_cuda_autocast_kernel_does(case):
    run = CASES[case]
    try:
        dtypes, cuda = on_cuda(run)
    except Exception as err:  # noqa: BLE001 - an operator fake CUDA tensors cannot run here (no GPU)
        pytest.skip(f"fake CUDA tensors cannot run {case} here: {type(err).__name__}: {err}")
    got, emulation = emulated(run)
    assert (got, emulation.casts) == (dtypes, cuda.casts)
    if case not in KERNEL_CHOICES:
        assert emulation.ops == cuda.ops


def _aten_ops_with_kernel(key: str) -> set[str]:
    names = torch._C._dispatch_get_all_op_names()
    return {n[len("aten::") :] for n in names if n.startswith("aten::") and torch._C._dispatch_has_kernel_for_dispatch_key(n, key)}


def test_every_operator_torch_gives_an_autocast_kernel_has_a_policy_in_the_tables():
    # A torch that adds an operator to CUDA's (or the CPU's) autocast lists fails here until the tables
    # say what its policy is; until then the emulation leaves that operator to the CPU's autocast.
    cuda, cpu = _aten_ops_with_kernel("AutocastCUDA"), _aten_ops_with_kernel("AutocastCPU")
    assert {"pow.Tensor_Scalar", "layer_norm", "sum", "addmv"} <= cuda and {"cat", "cross_entropy_loss", "linear"} <= cpu
    assert sorted(cuda - set(CUDA_POLICY) - HANDLED_ELSEWHERE) == []
    assert sorted(cpu - set(CPU_POLICY)) == []
    # and each kernel the emulation registers is for an operator this torch has, whose two policies differ
    differing = differing_policies()
    assert {"pow.Tensor_Scalar", "sum", "layer_norm", "cat", "cross_entropy_loss", "prod"} <= set(differing)
    assert not {"linear", "mm", "nll_loss", "mse_loss"} & set(differing)  # alike on both: torch's C++ kernels stay
    for name, (on_cuda_, on_cpu) in differing.items():
        assert on_cuda_ == (CUDA_POLICY[name] if listed(name, "cuda") else FALLTHROUGH)
        assert on_cpu == (CPU_POLICY[name] if listed(name, "cpu") else FALLTHROUGH)


def _real_cpu_autocast() -> tuple[list[str], list]:
    x = torch.ones(4, 8).bfloat16()
    with _Casts() as seen, torch.autocast("cpu", dtype=BF16):
        out = (torch.pow(x, 3.0), x.sum(), torch.cat([x, x.float()]), F.cross_entropy(x, torch.zeros(4, dtype=torch.long)))
    return _dtypes(out), seen.ops


def test_real_tensors_keep_cpu_autocast_and_leaving_puts_torchs_kernels_back():
    clear, dumps = torch.clear_autocast_cache, {n: torch._C._dispatch_dump(f"aten::{n}") for n in ("cat", "pow.Tensor_Scalar", "sum")}
    before = _real_cpu_autocast()
    # the CPU's policy: pow and sum in bfloat16, cat promoted to float32 by a cast, cross_entropy_loss in float32
    assert before[0] == ["torch.bfloat16", "torch.bfloat16", "torch.float32", "torch.float32"]
    assert before[1][:3] == [("aten.pow", ("torch.bfloat16",)), ("aten.sum", ("torch.bfloat16",)), ("aten._to_copy", ("torch.float32",))]
    with cuda_autocast():
        assert torch._C._dispatch_dump("aten::cat") != dumps["cat"]  # a kernel of ours is in place
        assert _real_cpu_autocast() == before
        with FakeTensorMode(), torch.autocast("cpu", dtype=BF16):
            assert torch.pow(_t(4, 8), 3.0).dtype == torch.float32
    assert _real_cpu_autocast() == before
    assert {n: torch._C._dispatch_dump(f"aten::{n}") for n in dumps} == dumps
    assert torch.clear_autocast_cache is clear
    with FakeTensorMode(), torch.autocast("cpu", dtype=BF16):
        assert torch.pow(_t(4, 8), 3.0).dtype == BF16  # the CPU's policy again


def test_blocks_nest_and_the_kernels_stay_until_the_last_exits():
    def pow_dtype() -> torch.dtype:
        with FakeTensorMode(), torch.autocast("cpu", dtype=BF16):
            return torch.pow(_t(4, 8), 3.0).dtype

    with cuda_autocast():
        with cuda_rules():
            assert pow_dtype() == torch.float32
        assert pow_dtype() == torch.float32
    assert pow_dtype() == BF16


def test_a_region_with_autocast_off_inside_takes_no_policy():
    # transformers' Llama computes RoPE under torch.autocast(device_type, enabled=False): as on CUDA, no
    # operator there is cast; around it the policy holds
    with FakeTensorMode(), cuda_rules(), _Casts() as seen, torch.autocast("cpu", dtype=BF16):
        x = _t(4, 8)
        with torch.autocast("cpu", enabled=False):
            inside = (torch.pow(x, 2.0), x.sum(), torch.exp(x))
        outside = torch.pow(x, 2.0)
    assert _dtypes(inside) == ["torch.bfloat16"] * 3
    assert outside.dtype == torch.float32
    assert seen.casts == [("torch.bfloat16", "torch.float32", (4, 8))]  # outside only


def _saved(run: Callable[[], torch.Tensor]) -> tuple[dict[tuple[str, str], int], _Casts]:
    """(node that made it, dtype) -> storage bytes of what autograd saved (0-d leaves, wrapped scalars, left out)."""
    seen: Counter[tuple[str, str]] = Counter()

    def pack(t: torch.Tensor) -> torch.Tensor:
        base = t._base if t._is_view() and t._base is not None else t
        node = type(base.grad_fn).__name__ if base.grad_fn is not None else "leaf"
        if t.dim() > 0:
            seen[(node, str(t.dtype).replace("torch.", ""))] += t.untyped_storage().nbytes()
        return t

    with FakeTensorMode(), cuda_rules(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), _Casts() as ops:
        with torch.autocast("cpu", dtype=BF16):
            out = run()
        out.float().sum().backward()
    return dict(seen), ops


N, D = 16, 32


def _leaf(*shape: int, dtype: torch.dtype = BF16) -> torch.Tensor:
    return torch.empty(*shape, dtype=dtype, requires_grad=True)


def test_a_gelu_written_with_pow_runs_in_float32_and_saves_float32():
    # GPT-2's NewGELUActivation: 0.5 * x * (1 + tanh(c * (x + 0.044715 * x**3))). pow is on CUDA's float32
    # list: x is copied to float32 (pow saves the copy), and type promotion carries float32 through
    # every operator after; the one half-precision tensor saved is 0.5 * x, which the last mul saves.
    x = None

    def run():  # type: ignore[no-untyped-def]
        nonlocal x
        x = _leaf(N, D)
        return 0.5 * x * (1.0 + torch.tanh(0.7978845608 * (x + 0.044715 * torch.pow(x, 3.0))))

    saved, _ = _saved(run)
    f32, bf16 = N * D * 4, N * D * 2
    assert saved == {
        ("ToCopyBackward0", "float32"): f32,  # pow's input
        ("TanhBackward0", "float32"): f32,  # tanh's result
        ("AddBackward0", "float32"): f32,  # 1 + tanh, for the last mul
        ("MulBackward0", "bfloat16"): bf16,  # 0.5 * x, for the last mul
    }, saved


def test_a_sum_of_a_half_precision_tensor_gives_float32():
    # sum is fp32_set_opt_dtype on CUDA: dtype=float32 where none is given
    saved, _ = _saved(lambda: (lambda y: y * y)(_leaf(N, D).sum(-1)))
    assert saved == {("SumBackward1", "float32"): 2 * N * 4}, saved


def test_exp_and_log_run_on_float32_copies():
    # both on CUDA's float32 list: exp saves its float32 result, log its float32 input (the copy)
    saved, ops = _saved(lambda: (lambda x: torch.exp(x).sum() + torch.log(x).sum())(_leaf(N, D)))
    assert saved == {("ExpBackward0", "float32"): N * D * 4, ("ToCopyBackward0", "float32"): N * D * 4}, saved
    assert ops.casts[:2] == [("torch.bfloat16", "torch.float32", (N, D))] * 2  # one copy per operator


def test_layer_norm_runs_in_float32_and_saves_its_float32_input_and_statistics():
    def run():  # type: ignore[no-untyped-def]
        return F.layer_norm(_leaf(N, D), (D,), _leaf(D, dtype=torch.float32), _leaf(D, dtype=torch.float32))

    saved, _ = _saved(run)
    assert saved == {
        ("ToCopyBackward0", "float32"): N * D * 4,  # the input, copied to float32
        # weight and bias as they are, and the mean and 1/std of each row (outputs without a gradient)
        ("leaf", "float32"): 2 * D * 4 + 2 * N * 4,
    }, saved


def test_an_upsampling_gives_float32():
    # upsample_bilinear2d is on CUDA's float32 list: a float32 result, which the mul after saves twice
    saved, _ = _saved(lambda: (lambda y: y * y)(F.interpolate(_leaf(2, 3, 8, 8), scale_factor=2, mode="bilinear")))
    assert saved == {("UpsampleBilinear2DBackward0", "float32"): 2 * 2 * 3 * 16 * 16 * 4}, saved


def test_a_cat_of_mixed_dtypes_promotes_without_a_copy():
    # cat is not on CUDA's lists: ATen's own type promotion gives float32 without casting the bfloat16
    # input first (the CPU's autocast promotes it by a float32 copy)
    saved, ops = _saved(lambda: (lambda c: c * c)(torch.cat([_leaf(N, D), _leaf(N, D, dtype=torch.float32)])))
    assert saved == {("CatBackward0", "float32"): 2 * 2 * N * D * 4}, saved
    assert ops.casts[0] != ("torch.bfloat16", "torch.float32", (N, D))  # the first cast is backward's, not cat's
    assert ("aten.cat", ("torch.float32",)) in ops.ops and ops.ops.index(("aten.cat", ("torch.float32",))) < ops.ops.index(
        next(o for o in ops.ops if o[0] == "aten._to_copy")
    )


def test_einsum_with_a_weight_casts_it_once_per_autocast_region_and_keeps_the_copy_until_it_exits():
    # einsum is on CUDA's half-precision list only: a float32 weight is cast by autocast's cache, once
    # per region, and the copy lives until the region exits even where nothing saves it
    import weakref

    copies: list[weakref.ref] = []

    class Keep(_Casts):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            out = super().__torch_dispatch__(func, types, args, kwargs)
            if func is torch.ops.aten._to_copy.default and tuple(out.shape) == (D, 4):
                copies.append(weakref.ref(out))
            return out

    with FakeTensorMode(), cuda_rules(), Keep() as seen:
        weight = _leaf(D, 4, dtype=torch.float32)
        x = torch.empty(N, D)  # no gradient: nothing saves the weight's copy
        for _ in range(2):
            with torch.autocast("cpu", dtype=BF16):
                y = torch.einsum("nd,dk->nk", x, weight) + torch.einsum("nd,dk->nk", x, weight)
                assert y.dtype == BF16 and copies[-1]() is not None
            assert copies[-1]() is None  # gone when the region exits
    assert seen.casts.count(("torch.float32", "torch.bfloat16", (D, 4))) == 2  # once in each region


def _transformers():  # type: ignore[no-untyped-def]
    return transformers_or_skip()


def test_gpt2_forward_runs_every_operator_in_the_dtypes_cuda_autocast_gives():
    # A small GPT-2 (transformers; eager attention: the attention kernel is not the point here) under bf16
    # autocast, operator by operator against torch's CUDA autocast kernels on fake CUDA tensors. On the
    # H100 the emulation had run its NewGELU in bfloat16 where CUDA's pow is float32 (-11% at GPT-2 small).
    from pytorch_mem_profiler.estimate.fake import fake_model

    T = _transformers()
    config = T.GPT2Config(vocab_size=512, n_embd=64, n_layer=2, n_head=4, n_positions=64, bos_token_id=0, eos_token_id=0)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = T.GPT2LMHeadModel(config).train().requires_grad_(False)

    def run(device: str) -> dict[str, Any]:  # type: ignore[no-untyped-def]
        mode = FakeTensorMode()
        with mode:
            fake = fake_model(model, torch.device(device), mode)
        return {"run": lambda d: fake(torch.zeros(2, 32, dtype=torch.long, device=d), use_cache=False).logits, "mode": mode}

    try:
        dtypes, cuda = on_cuda(**run("cuda"))
    except Exception as err:  # noqa: BLE001
        pytest.skip(f"fake CUDA tensors cannot run GPT-2 here: {type(err).__name__}: {err}")
    got, emulation = emulated(**run("cpu"))
    assert got == dtypes == ["torch.bfloat16"]
    assert emulation.ops == cuda.ops
    # the GELU: pow, tanh and what follows in float32, as on CUDA
    assert ("aten.pow", ("torch.float32",)) in cuda.ops and ("aten.tanh", ("torch.float32",)) in cuda.ops


def test_gpt2_step_saves_its_gelu_in_float32():
    # The same GPT-2 (sdpa attention, as transformers picks it), forward and backward on fake CPU tensors: the
    # only tanh is NewGELU's, whose input is float32 once pow has run in float32 (CUDA's float32 list), so each
    # layer saves a float32 tanh of batch x sequence x 4 x width (CUDA's path saved 1,207,959,552 B of them at
    # GPT-2 small, batch 8, on the H100: 12 layers x 8 x 512 x 3072 x 4 B x 2 steps; the emulation had saved none)
    T = _transformers()
    config = T.GPT2Config(vocab_size=512, n_embd=64, n_layer=2, n_head=4, n_positions=64, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = T.GPT2LMHeadModel(config).train()
    batch, seq = 2, 32
    from pytorch_mem_profiler.estimate.fake import fake_model

    def run():  # type: ignore[no-untyped-def]
        mode = torch._guards.detect_fake_mode()
        fake = fake_model(model, torch.device("cpu"), mode)
        return fake(torch.zeros(batch, seq, dtype=torch.long), use_cache=False).logits

    saved, _ = _saved(run)
    assert saved[("TanhBackward0", "float32")] == config.n_layer * batch * seq * 4 * config.n_embd * 4, saved
    assert ("TanhBackward0", "bfloat16") not in saved
