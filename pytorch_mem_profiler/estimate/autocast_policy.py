"""CUDA autocast's dtype policy, every operator of it, for fake CPU tensors standing in for CUDA ones.

Under ``torch.autocast`` each operator autocast lists has a kernel at the device's
autocast dispatch key (``AutocastCUDA``, ``AutocastCPU``) that casts the
floating-point arguments by a policy, then runs the operator with autocast off for
what it calls; an operator it does not list falls through, runs in its arguments'
dtypes, and a composite one's inner operators meet the policy one by one. The
policies (``aten/src/ATen/autocast_mode.h`` and ``autocast_mode.cpp``):

- ``lower_precision_fp``: every float argument to the autocast dtype; a float32
  leaf that requires grad (a weight) is cast once per autocast region and the copy
  kept until the outermost region exits (autocast's cast cache);
- ``fp32``: every low-precision float argument to float32;
- ``fp32_set_opt_dtype``: where the first argument is a float tensor and no
  ``dtype=`` is given, ``dtype=float32``: a bf16 ``sum``, ``softmax``, ``cumsum``
  gives a float32 result;
- ``fp32_append_dtype``: the overload that takes a ``dtype``, with float32 (``norm``);
- ``promote``: every float argument to the widest float dtype among them;
- ``banned``: an error (``binary_cross_entropy`` on CUDA).

The CPU's lists differ from CUDA's: CUDA runs ``pow``, ``exp``, ``log``,
``layer_norm``, the upsamplings in float32, gives ``sum``/``softmax``/``cumsum``
a float32 result, casts ``addmv``/``einsum``/the RNN cells to half precision and
promotes ``addcmul``, ``index_put``, ``scatter_add``; the CPU lists none of these,
and lists in float32 what CUDA leaves alone (``cross_entropy_loss`` as one operator,
3-d pooling, padding, FFTs, linear-algebra decompositions) and promotes ``cat`` and
``stack``. On fake CPU tensors under CPU autocast, :func:`cuda_autocast` gives every
operator CUDA's policy: it registers a Python kernel at ``AutocastCPU`` for each
operator whose two policies differ (no other: the C++ kernels keep the rest, and
their cast cache), for the length of the block. Each kernel acts as CUDA's C++
kernel does for fake tensors, and as the CPU's for real ones; an operator CUDA does
not list is redispatched below autocast with autocast still on, so a composite's
inner operators meet the policy as on CUDA (``cross_entropy_loss``: a
``log_softmax`` in the input's dtype, then a float32 ``nll_loss``). Autocast's own
state decides as ever: a nested ``torch.autocast(..., enabled=False)`` region
reaches none of these kernels. Leaving the block removes them and torch's kernels
are back.

The tables are by operator name; which operators the running torch lists at each
key is asked of its dispatcher (:func:`listed`), so operators added or removed
between versions (``rms_norm``, the named-tensor overloads, ``linalg_matrix_sqrth``)
need no version test, and ``tests/test_estimate_emulation_autocast.py`` fails where
the running torch lists an operator the tables do not know.

Example::

    >>> from torch._subclasses import FakeTensorMode
    >>> with FakeTensorMode(), cuda_autocast(), torch.autocast("cpu", dtype=torch.bfloat16):
    ...     x = torch.empty(8, 8, dtype=torch.bfloat16)
    ...     torch.pow(x, 3.0).dtype, x.sum().dtype, torch.cat([x, x.float()]).dtype
    (torch.float32, torch.float32, torch.float32)
    >>> policy("pow.Tensor_Scalar", "cuda"), policy("pow.Tensor_Scalar", "cpu")
    ('fp32', 'fallthrough')
"""

from __future__ import annotations

import contextlib
import re
import threading
import warnings
import weakref
from typing import Any, Callable, Iterator

import torch
from torch._subclasses.fake_tensor import is_fake

__all__ = [
    "LOWER_PRECISION_FP",
    "FP32",
    "FP32_SET_OPT_DTYPE",
    "FP32_APPEND_DTYPE",
    "PROMOTE",
    "BANNED",
    "FALLTHROUGH",
    "CUDA_POLICY",
    "CPU_POLICY",
    "APPEND_DTYPE_OVERLOAD",
    "HANDLED_ELSEWHERE",
    "listed",
    "policy",
    "differing_policies",
    "cuda_autocast",
]

LOWER_PRECISION_FP = "lower_precision_fp"
FP32 = "fp32"
FP32_SET_OPT_DTYPE = "fp32_set_opt_dtype"
FP32_APPEND_DTYPE = "fp32_append_dtype"
PROMOTE = "promote"
BANNED = "banned"
#: Not listed: the operator runs in its arguments' dtypes, a composite's inner operators meet the policy.
FALLTHROUGH = "fallthrough"


def _by_policy(**groups: tuple[str, ...]) -> dict[str, str]:
    return {name: kind for kind, names in groups.items() for name in names}


#: CUDA autocast's policy by operator (``name`` or ``name.overload``), from ATen's
#: ``AT_FORALL_*`` lists and ``autocast_mode.cpp`` of torch 2.4 to 2.14. Named-tensor
#: overloads (``Dimname``) are listed up to the versions that still have them.
CUDA_POLICY: dict[str, str] = _by_policy(
    lower_precision_fp=(
        "_convolution.deprecated", "_convolution", "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d",
        "conv_transpose2d.input", "conv_transpose3d.input", "convolution", "cudnn_convolution",
        "cudnn_convolution_transpose", "prelu", "addmm", "addmv", "addr", "matmul", "einsum", "mm", "mv",
        "linalg_vecdot", "linear", "addbmm", "baddbmm", "bmm", "chain_matmul", "linalg_multi_dot",
        "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell", "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell",
        "_scaled_dot_product_flash_attention", "scaled_dot_product_attention",
    ),
    fp32=(
        "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt",
        "sinh", "tan", "pow.Tensor_Scalar", "pow.Tensor_Tensor", "pow.Scalar", "softplus", "layer_norm",
        "native_layer_norm", "rms_norm", "group_norm", "frobenius_norm.dim", "nuclear_norm", "nuclear_norm.dim",
        "cosine_similarity", "poisson_nll_loss", "cosine_embedding_loss", "nll_loss", "nll_loss2d",
        "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss",
        "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss",
        "multi_margin_loss", "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm", "logsumexp",
        "upsample_nearest1d", "_upsample_nearest_exact1d", "upsample_nearest2d", "_upsample_nearest_exact2d",
        "upsample_nearest3d", "_upsample_nearest_exact3d", "upsample_linear1d", "upsample_bilinear2d",
        "_upsample_bilinear2d_aa", "upsample_trilinear3d", "upsample_bicubic2d", "_upsample_bicubic2d_aa",
        "linalg_matrix_sqrth",
    ),
    fp32_set_opt_dtype=(
        "prod", "prod.dim_int", "prod.dim_Dimname", "softmax.int", "softmax.Dimname", "log_softmax.int",
        "log_softmax.Dimname", "cumprod", "cumprod.dimname", "cumsum", "cumsum.dimname", "linalg_vector_norm",
        "linalg_matrix_norm", "linalg_matrix_norm.str_ord", "sum", "sum.dim_IntList", "sum.dim_DimnameList",
    ),
    fp32_append_dtype=("norm.Scalar", "norm.ScalarOpt_dim", "norm.names_ScalarOpt_dim"),
    promote=(
        "addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sampler", "index_put",
        "tensordot", "scatter_add",
    ),
    banned=("binary_cross_entropy",),
)  # fmt: skip

#: CPU autocast's policy by operator, from ``autocast_mode.cpp`` of torch 2.4 to 2.14.
CPU_POLICY: dict[str, str] = _by_policy(
    lower_precision_fp=(
        "conv1d", "conv1d.padding", "conv2d", "conv2d.padding", "conv3d", "conv3d.padding", "bmm", "mm",
        "linalg_vecdot", "baddbmm", "addmm", "_addmm_activation", "addbmm", "linear", "_convolution.deprecated",
        "matmul", "conv_tbc", "mkldnn_rnn_layer", "conv_transpose1d", "conv_transpose2d.input",
        "conv_transpose3d.input", "prelu", "scaled_dot_product_attention", "_native_multi_head_attention",
    ),
    fp32=(
        "avg_pool3d", "binary_cross_entropy", "grid_sampler", "polar", "prod", "prod.dim_int", "prod.dim_Dimname",
        "quantile", "quantile.scalar", "nanquantile", "nanquantile.scalar", "stft", "stft.center", "cdist",
        "grid_sampler_2d", "_grid_sampler_2d_cpu_fallback", "grid_sampler_3d", "trace", "view_as_complex",
        "cholesky", "cholesky_inverse", "cholesky_solve", "inverse", "lu_solve", "orgqr", "ormqr", "pinverse",
        "max_pool3d", "max_unpool2d", "max_unpool3d", "adaptive_avg_pool3d", "reflection_pad1d",
        "reflection_pad2d", "replication_pad1d", "replication_pad2d", "replication_pad3d", "mse_loss",
        "cosine_embedding_loss", "nll_loss", "nll_loss2d", "hinge_embedding_loss", "poisson_nll_loss",
        "smooth_l1_loss", "cross_entropy_loss", "l1_loss", "huber_loss", "margin_ranking_loss", "soft_margin_loss",
        "triplet_margin_loss", "multi_margin_loss", "ctc_loss.IntList", "ctc_loss.Tensor", "kl_div",
        "multilabel_margin_loss", "binary_cross_entropy_with_logits", "fft_fft", "fft_ifft", "fft_fft2",
        "fft_ifft2", "fft_fftn", "fft_ifftn", "fft_rfft", "fft_irfft", "fft_rfft2", "fft_irfft2", "fft_rfftn",
        "fft_irfftn", "fft_hfft", "fft_ihfft", "linalg_cond", "linalg_cond.p_str", "linalg_matrix_rank",
        "linalg_matrix_rank.tol_tensor", "linalg_matrix_rank.atol_rtol_tensor", "linalg_matrix_rank.atol_rtol_float",
        "linalg_solve", "linalg_cholesky", "linalg_svdvals", "linalg_eigvals", "linalg_eigvalsh", "linalg_inv",
        "linalg_householder_product", "linalg_tensorinv", "linalg_tensorsolve", "fake_quantize_per_tensor_affine",
        "geqrf", "_lu_with_info", "qr", "svd", "triangular_solve", "fractional_max_pool2d", "fractional_max_pool3d",
        "adaptive_max_pool3d", "multilabel_margin_loss_forward", "linalg_qr", "linalg_cholesky_ex", "linalg_svd",
        "linalg_eig", "linalg_eigh", "linalg_lstsq", "linalg_inv_ex", "linalg_matrix_sqrth",
    ),
    promote=("stack", "cat", "index_copy", "index_copy.dimname"),
)  # fmt: skip

#: ``fp32_append_dtype``: the overload each one runs instead, with ``dtype=float32``.
APPEND_DTYPE_OVERLOAD = {
    "norm.Scalar": "norm.ScalarOpt_dtype",
    "norm.ScalarOpt_dim": "norm.ScalarOpt_dim_dtype",
    "norm.names_ScalarOpt_dim": "norm.names_ScalarOpt_dim_dtype",
}

#: Operators with a CUDA autocast kernel outside ``autocast_mode.cpp`` that the emulation runs its own way:
#: cuDNN's RNN (its weight buffer; :mod:`.rnn`).
HANDLED_ELSEWHERE = frozenset({"_cudnn_rnn"})

_KEYS = {"cuda": "AutocastCUDA", "cpu": "AutocastCPU"}
_TABLES = {"cuda": CUDA_POLICY, "cpu": CPU_POLICY}
_AUTOCAST_CPU = torch._C.DispatchKey.AutocastCPU


def listed(name: str, device: str) -> bool:
    """Whether the running torch has an autocast kernel for operator ``name`` on ``device`` (``"cuda"``/``"cpu"``).

    Example::

        >>> listed("pow.Tensor_Scalar", "cuda"), listed("pow.Tensor_Scalar", "cpu"), listed("no_such_op", "cuda")
        (True, False, False)
    """
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{name}", _KEYS[device])
    except RuntimeError:  # no such operator in this torch
        return False


def policy(name: str, device: str) -> str | None:
    """Autocast's policy for operator ``name`` on ``device`` in the running torch.

    :data:`FALLTHROUGH` where it has no autocast kernel there, ``None`` where it has
    one that the tables do not know (a torch newer than the tables).
    """
    if not listed(name, device):
        return FALLTHROUGH
    return _TABLES[device].get(name)


def _overload(name: str) -> torch._ops.OpOverload | None:
    packet, _, overload = name.partition(".")
    try:
        return getattr(getattr(torch.ops.aten, packet), overload or "default")
    except (AttributeError, RuntimeError):
        return None


def differing_policies() -> dict[str, tuple[str, str]]:
    """``{operator: (CUDA's policy, CPU's policy)}`` where the running torch's two differ and both are known.

    Example::

        >>> differing_policies()["layer_norm"], "linear" in differing_policies()
        (('fp32', 'fallthrough'), False)
    """
    out = {}
    for name in sorted(set(CUDA_POLICY) | set(CPU_POLICY)):
        cuda, cpu = policy(name, "cuda"), policy(name, "cpu")
        if cuda is not None and cpu is not None and cuda != cpu and _overload(name) is not None:
            out[name] = (cuda, cpu)
    return out


class _CastCache:
    """Autocast's cast cache for the casts these kernels make (the C++ kernels keep their own).

    As ATen's: a float32 leaf that requires grad, cast to the autocast dtype, is cast
    once and the copy kept until ``torch.clear_autocast_cache()`` (which
    ``torch.autocast`` calls when its outermost region exits). Keyed by the tensor's
    identity, with a weak reference to tell a reused id apart.
    """

    def __init__(self) -> None:
        self._casts: dict[tuple[int, torch.dtype], tuple[weakref.ref, torch.Tensor]] = {}
        self._lock = threading.Lock()

    def cast(self, tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        key = (id(tensor), dtype)
        with self._lock:
            hit = self._casts.get(key)
            if hit is not None and hit[0]() is tensor:
                return hit[1]
        copy = tensor.to(dtype)
        with self._lock:
            self._casts[key] = (weakref.ref(tensor), copy)
        return copy

    def clear(self) -> None:
        with self._lock:
            self._casts.clear()


def _eligible(value: Any) -> bool:
    """A float tensor autocast may cast (on the CPU, where these kernels run; float64 never)."""
    return isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != torch.float64 and value.device.type == "cpu"


def _tensors(values: Any) -> Iterator[torch.Tensor]:
    for value in values:
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            yield from (v for v in value if isinstance(v, torch.Tensor))


def _map(values: tuple, kwargs: dict, fn: Callable[[torch.Tensor], torch.Tensor]) -> tuple[tuple, dict]:
    """``fn`` on every tensor argument (tensor lists too), the rest as they are."""

    def one(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return fn(value)
        if isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value):
            return type(value)(fn(v) if isinstance(v, torch.Tensor) else v for v in value)
        return value

    # last argument first, as ATen's kernels cast them (a C++ parameter pack, evaluated right to left by GCC)
    new_kwargs = {k: one(kwargs[k]) for k in reversed(kwargs)}
    new_values = [one(v) for v in reversed(values)][::-1]
    return tuple(new_values), {k: new_kwargs[k] for k in kwargs}


class _Kernel:
    """One operator's autocast kernel at ``AutocastCPU``: CUDA's policy for fake tensors, the CPU's for real ones."""

    def __init__(self, name: str, cuda: str, cpu: str, cache: _CastCache) -> None:
        self.name, self.cuda, self.cpu, self.cache = name, cuda, cpu, cache
        self.op = _overload(name)
        assert self.op is not None
        self.target = _overload(APPEND_DTYPE_OVERLOAD[name]) if name in APPEND_DTYPE_OVERLOAD else None
        # ``ScalarType?`` arguments (``dtype=``) that fp32_set_opt_dtype fills: (position, name, keyword-only)
        # (the schema's Python types show a ScalarType as an int: its text tells them apart)
        optional_dtypes = set(re.findall(r"ScalarType\? (\w+)", str(self.op._schema)))
        self.dtype_args = [(i, a.name, a.kwarg_only) for i, a in enumerate(self.op._schema.arguments) if a.name in optional_dtypes]

    def __call__(self, keyset: Any, *args: Any, **kwargs: Any) -> Any:
        stands_for_cuda = any(is_fake(t) for t in _tensors((*args, *kwargs.values())))
        kind = self.cuda if stands_for_cuda else self.cpu
        if kind == FALLTHROUGH:
            # as an unlisted operator on CUDA: below autocast, autocast still on for what it calls
            return self.op.redispatch(keyset & torch._C._dispatch_keyset_full_after(_AUTOCAST_CPU), *args, **kwargs)
        if kind == BANNED:
            raise RuntimeError(
                f"torch.autocast on CUDA refuses {self.name} (torch.nn.functional.binary_cross_entropy, nn.BCELoss): "
                "a sigmoid then binary cross entropy is unsafe in half precision; use "
                "torch.nn.functional.binary_cross_entropy_with_logits or nn.BCEWithLogitsLoss, which autocast runs in float32"
            )
        with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(_AUTOCAST_CPU)):
            return self._cast_and_run(kind, args, kwargs)

    def _cast_and_run(self, kind: str, args: tuple, kwargs: dict) -> Any:
        low = torch.get_autocast_dtype("cpu")
        first_eligible = bool(args) and _eligible(args[0])
        if kind == LOWER_PRECISION_FP:
            args, kwargs = _map(args, kwargs, lambda t: self._cast(t, low, cache=True))
        elif kind == FP32:
            args, kwargs = _map(args, kwargs, lambda t: self._cast(t, torch.float32))
        elif kind == PROMOTE:
            to = _promoted(low, _tensors((*args, *kwargs.values())))
            args, kwargs = _map(args, kwargs, lambda t: self._cast(t, to))
        elif kind == FP32_SET_OPT_DTYPE and first_eligible:
            args, kwargs = list(args), dict(kwargs)
            for position, name, kwarg_only in self.dtype_args:
                if not kwarg_only and position < len(args):
                    args[position] = torch.float32 if args[position] is None else args[position]
                elif kwargs.get(name) is None:
                    kwargs[name] = torch.float32
            args = tuple(args)
        elif kind == FP32_APPEND_DTYPE:
            assert self.target is not None
            dtype = torch.float32 if first_eligible else args[0].dtype
            return self.target(*self._with_defaults(args, kwargs), dtype=dtype)
        return self.op(*args, **kwargs)

    def _cast(self, tensor: torch.Tensor, dtype: torch.dtype, cache: bool = False) -> torch.Tensor:
        if not _eligible(tensor) or tensor.dtype == dtype:
            return tensor
        if cache and tensor.dtype == torch.float32 and tensor.requires_grad and tensor.is_leaf and not tensor._is_view():
            if torch.is_autocast_cache_enabled():
                return self.cache.cast(tensor, dtype)
        return tensor.to(dtype)

    def _with_defaults(self, args: tuple, kwargs: dict) -> list:
        """The positional arguments in full, defaults filled in (the ``dtype`` overload has none)."""
        full = list(args)
        for a in self.op._schema.arguments[len(args) :]:
            full.append(kwargs[a.name] if a.name in kwargs else a.default_value)
        return full


def _promoted(low: torch.dtype, tensors: Iterator[torch.Tensor]) -> torch.dtype:
    """The widest float dtype among the eligible tensors, from the autocast dtype (float64 ignored), as ATen's."""
    to = low
    for t in tensors:
        if not _eligible(t) or t.dtype == to:
            continue
        if to == torch.float32 or t.dtype == torch.float32:
            to = torch.float32
        else:
            raise RuntimeError(f"autocast cannot promote {to} with {t.dtype} (two half-precision dtypes)")
    return to


_active = 0
_active_lock = threading.Lock()
_library: Any = None
_cache = _CastCache()
_original_clear: Callable[[], None] | None = None


def _clear_autocast_cache() -> None:
    """``torch.clear_autocast_cache`` while the kernels are in place: torch's cache and theirs."""
    assert _original_clear is not None
    _original_clear()
    _cache.clear()


def _install() -> None:
    global _library, _original_clear
    library = torch.library.Library("aten", "IMPL")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "Overriding a previously registered kernel": the point here
            for name, (cuda, cpu) in differing_policies().items():
                library.impl(name, _Kernel(name, cuda, cpu, _cache), "AutocastCPU", with_keyset=True)
    except BaseException:
        library._destroy()
        raise
    _library, _original_clear = library, torch.clear_autocast_cache
    torch.clear_autocast_cache = _clear_autocast_cache


def _uninstall() -> None:
    global _library, _original_clear
    if torch.clear_autocast_cache is _clear_autocast_cache and _original_clear is not None:
        torch.clear_autocast_cache = _original_clear
    _original_clear = None
    if _library is not None:
        _library._destroy()  # torch's kernels at AutocastCPU are back
    _library = None
    _cache.clear()


@contextlib.contextmanager
def cuda_autocast() -> Iterator[None]:
    """CUDA autocast's policy for fake CPU tensors under CPU autocast, for the block.

    Blocks may nest and run in several threads at once: the kernels are in place
    from the first entry to the last exit.
    """
    global _active
    with _active_lock:
        if _active == 0:
            _install()
        _active += 1
    try:
        yield
    finally:
        with _active_lock:
            _active -= 1
            if _active == 0:
                _uninstall()
