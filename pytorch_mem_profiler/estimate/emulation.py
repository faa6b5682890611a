"""CUDA's choices, made for fake CPU tensors that stand in for CUDA ones on a machine without a GPU.

Autograd cannot run on fake CUDA tensors where CUDA's runtime is missing, so an
estimate for CUDA runs on fake CPU tensors there. Sizes are the same; what
differs is where an operator picks its algorithm or its precision by device,
and two such places hold most of a transformer's memory:

- attention: ``scaled_dot_product_attention`` on the CPU falls back to the math
  path (which keeps the whole attention matrix for backward) where CUDA runs
  flash attention (half precision, no mask) or memory-efficient attention
  (otherwise); here it runs CUDA's choice, as the composite CUDA code calls it;
- dropout: CUDA runs one fused kernel (``native_dropout``) that saves a ``bool``
  mask, where the CPU draws a mask in the input's dtype (``bernoulli_``, ``div_``,
  ``mul``) and saves it: four times the bytes in float32 (the GPU diff of
  ``benchmarks/estimate_paths.py`` showed it in every transformer measured);
- host scalars: an optimizer's per-parameter counts (Adam's and AdamW's ``step``, NAdam's
  ``mu_product``, Adagrad's ``step``: ``torch.tensor(0.0)``, no device, unless ``capturable``
  or ``fused``) stay in host memory beside CUDA parameters, but are made beside the stand-ins
  here: :class:`HostScalars` makes such a tensor uncounted (512 bytes a parameter in the
  device's figures otherwise: +2.7% on a 2 MB MobileBERT step with AdamW);
- capturable optimizers: ``Adam(..., capturable=True)`` (and AdamW, NAdam, RAdam, Adamax, ASGD,
  Adadelta, RMSprop, Rprop) assert that their parameters are on a device that can capture, which
  the CPU stand-ins are not: :func:`capturable_on_stand_ins` lets the CPU pass that check while an
  emulated optimizer is built and steps, so it takes CUDA's capturable path (its counts on the
  device, counted);
- autocast: CUDA's autocast lists other operators, with other policies, than the
  CPU's (``pow``, ``exp``, ``layer_norm`` in float32, a float32 ``sum`` and
  ``softmax``, no ``cross_entropy_loss`` as one operator, ...): every operator takes
  CUDA's policy (:mod:`.autocast_policy`), so that a GELU written with ``pow``
  runs in float32 and saves float32 tensors, as on CUDA.

:func:`cuda_rules` puts these in place for the length of a step (module
attributes of ``torch.nn.functional`` for the kernels, autocast kernels at
``AutocastCPU`` for the policy; fake tensors only: real tensors take torch's own
path), and takes them away after.

Example::

    >>> import torch
    >>> from torch._subclasses import FakeTensorMode
    >>> with FakeTensorMode(), cuda_rules():
    ...     q = torch.empty(2, 4, 256, 64, requires_grad=True)
    ...     out = torch.nn.functional.scaled_dot_product_attention(q, q, q, dropout_p=0.1)
    >>> type(out.grad_fn).__name__
    'ScaledDotProductEfficientAttentionBackward0'
"""

from __future__ import annotations

import contextlib
import functools
import math
import weakref
from typing import Any, Callable, ContextManager, Iterator

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor
from torch.overrides import TorchFunctionMode

from ..torch_versions import CUDNN_ATTENTION_TAKES_MASK, SDPA_ENABLE_GQA, attention_softmax, math_attention_upcasts
from .autocast_policy import cuda_autocast

__all__ = ["HostScalars", "capturable_on_stand_ins", "cuda_backend", "cuda_boolean_mask", "cuda_rules", "math_attention"]

#: Head sizes cuDNN's attention takes on Hopper with a mask (torch 2.11, cuDNN 9).
CUDNN_MAX_HEAD_DIM = 128

#: Head sizes flash attention takes on CUDA (sm80 and newer).
FLASH_MAX_HEAD_DIM = 256

_HALF = (torch.float16, torch.bfloat16)


def _fake(*values: Any) -> bool:
    return any(_is_fake(v) for v in values)


def _is_fake(value: Any) -> bool:
    """A fake tensor, or one functionalized over a fake tensor (a compiled module's graph being traced)."""
    if isinstance(value, FakeTensor):
        return True
    if type(value).__name__ != "FunctionalTensor":
        return False
    try:
        return isinstance(torch._from_functional_tensor(value.elem), FakeTensor)
    except (AttributeError, RuntimeError, TypeError):
        return False


def _autocast_dtype() -> torch.dtype | None:
    if torch.is_autocast_enabled("cpu"):
        return torch.get_autocast_dtype("cpu")
    return None


def cuda_boolean_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bool mask as CUDA's attention converts it: one ``where`` into an additive mask (0 kept, -inf out)."""
    return torch.where(mask, torch.scalar_tensor(0.0, dtype=dtype), torch.scalar_tensor(float("-inf"), dtype=dtype))


def cuda_backend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    enable_gqa: bool = False,
) -> str:
    """The kernel CUDA's ``scaled_dot_product_attention`` picks on a Hopper GPU (H100), by its rules.

    Follows ATen's ``select_sdp_backend`` (``sdp_utils.cpp``) for dense inputs
    as torch 2.11 ships it: ``"cudnn"`` (half precision with a mask that needs
    no gradient, equal head sizes, a multiple of 8 up to 128: cuDNN's attention
    is first in the order on Hopper), ``"flash"`` (half precision, no mask, equal head sizes up to
    256), ``"efficient"`` (float32 or half precision, head sizes aligned, the
    same number of heads in query, key and value), else ``"math"``. Every fused
    kernel wants 4-d inputs whose last dimension is contiguous, and a mask whose
    last dimension is too. Without a mask cuDNN's attention allocates and saves
    what flash attention does (the H100 diff of ``benchmarks/estimate_paths.py``),
    so ``"flash"`` stands in for it. With one it differs from the efficient
    kernel in its output's layout: cuDNN's follows the query's, so that
    ``nn.MultiheadAttention``'s ``permute(...).contiguous()`` afterwards copies
    nothing (an ``nn.TransformerEncoder`` in bf16 on the H100: 2.1 GB of copies
    the efficient kernel's layout would make). Torch 2.4's cuDNN attention takes
    no mask (:data:`~pytorch_mem_profiler.torch_versions.CUDNN_ATTENTION_TAKES_MASK`):
    there a masked one is ``"efficient"``.

    Example::

        >>> q = torch.empty(1, 8, 16, 64)
        >>> cuda_backend(q, q, q), cuda_backend(q.half(), q.half(), q.half())
        ('efficient', 'flash')
        >>> cuda_backend(q, q[:, :2], q[:, :2], enable_gqa=True)  # grouped-query attention in float32
        'math'
    """
    tensors = (query, key, value)
    if any(t.dim() != 4 for t in tensors) or any(t.stride(-1) != 1 and t.size(-1) != 1 for t in tensors):
        return "math"
    if attn_mask is not None and attn_mask.dim() > 0 and attn_mask.stride(-1) != 1:
        return "math"  # a mask whose last dimension is strided (T5's permuted position bias)
    dtype = query.dtype
    if any(t.dtype != dtype for t in tensors) or any(t.size(-2) == 0 for t in tensors):
        return "math"
    heads_equal = query.size(1) == key.size(1) == value.size(1)
    head_dim, value_dim = query.size(-1), value.size(-1)
    if (
        dtype in _HALF
        and attn_mask is None
        and head_dim == key.size(-1) == value_dim
        and head_dim <= FLASH_MAX_HEAD_DIM
        and (heads_equal or (enable_gqa and query.size(1) % key.size(1) == 0 and query.size(1) % value.size(1) == 0))
    ):
        return "flash"
    if (
        CUDNN_ATTENTION_TAKES_MASK
        and dtype in _HALF
        and attn_mask is not None
        and not attn_mask.requires_grad  # cuDNN gives no gradient for the mask (T5's learned position bias)
        and heads_equal
        and head_dim == key.size(-1) == value_dim
        and head_dim % 8 == 0
        and head_dim <= CUDNN_MAX_HEAD_DIM
    ):
        return "cudnn"
    alignment = 8 if dtype in _HALF else 4  # minimum_gemm_alignment on sm80+: 128 bits, at least 4
    if (
        dtype in (torch.float32, *_HALF)
        and heads_equal  # torch 2.11's efficient kernel takes no grouped-query attention
        and head_dim == key.size(-1)
        and head_dim % alignment == 0
        and value_dim % alignment == 0
    ):
        return "efficient"
    return "math"


def math_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    dropout_p: float,
    is_causal: bool,
    scale: float | None,
    enable_gqa: bool,
) -> torch.Tensor:
    """ATen's math attention as it runs on CUDA: the whole matrix (in float32), the mask added in place,
    ``_safe_softmax``, fused dropout.

    The composite ``_scaled_dot_product_attention_math`` would draw its dropout
    mask by the CPU's route (in the matrix's dtype); on CUDA ``at::dropout``
    takes the fused kernel and saves a bool mask, so the steps are spelled out
    here, in the order ATen runs them, with ``native_dropout``. Torch 2.4's
    composite computes half precision in its own dtype and runs ``softmax``
    (:mod:`~pytorch_mem_profiler.torch_versions` tells which).
    """
    origin = query.dtype
    if math_attention_upcasts():  # half precision is computed in float32 for accuracy
        query, key, value = (t.float() if t.dtype in _HALF else t for t in (query, key, value))
    root = math.sqrt(scale if scale is not None else 1.0 / math.sqrt(query.size(-1)))
    query = torch.ops.aten.mul.Scalar(query, root)  # ATen scales by a scalar (a Python float would wrap a tensor)
    if is_causal:
        causal = torch.ones(query.size(-2), key.size(-2), dtype=torch.bool, device=query.device).tril()
        attn_mask = cuda_boolean_mask(causal, query.dtype)
    if enable_gqa and not query.size(-3) == key.size(-3) == value.size(-3):
        key = key.repeat_interleave(query.size(-3) // key.size(-3), -3)
        value = value.repeat_interleave(query.size(-3) // value.size(-3), -3)
    attn = torch.matmul(query, torch.ops.aten.mul.Scalar(key.transpose(-2, -1), root))
    if attn_mask is not None:
        # in place, as ATen adds it on the device; fake tensors would take its out-of-place branch
        # (tensor subclasses: areAnyTensorSubclassLike), a matrix more that moves the blocks around
        attn.add_(attn_mask)
    attn = attention_softmax(attn)
    if dropout_p > 0.0:
        attn = torch.ops.aten.native_dropout(attn, dropout_p, True)[0]
    return torch.matmul(attn, value).to(origin)


def _attention(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    @functools.wraps(original)
    def attention(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> torch.Tensor:
        # enable_gqa is passed on only when set: torch 2.4's attention has no such argument
        gqa = {"enable_gqa": True} if enable_gqa else {}
        if enable_gqa and not SDPA_ENABLE_GQA:
            raise TypeError(
                f"scaled_dot_product_attention(enable_gqa=True) needs torch 2.5 or later (this is torch "
                f"{torch.__version__}): repeat key and value to every query head instead"
            )
        if not _fake(query, key, value) or query.is_nested:
            return original(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, **gqa)
        dtype = _autocast_dtype()
        with torch.autocast("cpu", enabled=False):
            if dtype is not None:  # attention is on autocast's half-precision list on CUDA: every float argument
                query, key, value, attn_mask = (
                    t.to(dtype) if t is not None and t.is_floating_point() else t for t in (query, key, value, attn_mask)
                )
            backend = cuda_backend(query, key, value, attn_mask, enable_gqa)
            if backend == "flash" and not query.size(1) == key.size(1) == value.size(1):
                # grouped-query attention in half precision: the CPU's flash kernel takes it and saves
                # what CUDA's does (llama-gqa-bf16 on the H100: 16 KB apart in 2.5 GB)
                return original(query, key, value, None, dropout_p, is_causal, scale=scale, **gqa)
            if backend == "flash":
                return torch.ops.aten._scaled_dot_product_flash_attention(
                    query, key, value, dropout_p, is_causal, False, scale=scale
                )[0]
            if attn_mask is not None and attn_mask.dtype == torch.bool:
                attn_mask = cuda_boolean_mask(attn_mask, query.dtype)
            if backend == "math":
                return math_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
            bias = attn_mask.to(query.dtype) if attn_mask is not None else None
            grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
            if backend == "cudnn":  # its meta kernel lays the output out as CUDA's does
                return torch.ops.aten._scaled_dot_product_cudnn_attention(
                    query, key, value, bias, grad, dropout_p, is_causal, False, scale=scale
                )[0]
            return torch.ops.aten._scaled_dot_product_efficient_attention(
                query, key, value, bias, grad, dropout_p, is_causal, scale=scale
            )[0]

    return attention


def _fused_dropout(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``dropout``: CUDA's fused kernel (a bool mask saved), as ATen picks it for a CUDA input."""

    @functools.wraps(original)
    def dropout(input: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False) -> torch.Tensor:
        # ATen's dropout takes the fused kernel for a CUDA input with 0 < p < 1 that is not in place
        if not _is_fake(input) or inplace or not training or not 0 < p < 1 or input.numel() == 0:
            return original(input, p, training, inplace)
        return torch.ops.aten.native_dropout(input, p, True)[0]

    return dropout


@contextlib.contextmanager
def cuda_rules() -> Iterator[None]:
    """CUDA's attention and dropout kernels and CUDA autocast's policy for fake CPU tensors, for the block."""
    patches = {"scaled_dot_product_attention": _attention, "dropout": _fused_dropout}
    originals = {name: getattr(F, name) for name in patches}
    with cuda_autocast():
        try:
            for name, wrap in patches.items():
                setattr(F, name, wrap(originals[name]))
            yield
        finally:
            for name, original in originals.items():
                setattr(F, name, original)


@functools.lru_cache(maxsize=None)
def _capturable_checking_modules() -> tuple[Any, ...]:
    """``torch.optim``'s modules that imported ``_get_capturable_supported_devices`` by name, found once
    (an emulated estimate enters :func:`capturable_on_stand_ins` at each optimizer step)."""
    import importlib
    import pkgutil

    import torch.optim

    found = []
    for info in pkgutil.iter_modules(torch.optim.__path__):
        try:
            module = importlib.import_module(f"torch.optim.{info.name}")
        except Exception:  # noqa: BLE001 - a module that does not import has no optimizer to patch
            continue
        if callable(getattr(module, "_get_capturable_supported_devices", None)):
            found.append(module)
    return tuple(found)


@contextlib.contextmanager
def capturable_on_stand_ins() -> Iterator[None]:
    """While on: torch's optimizers take the CPU (the stand-ins' device) for a device that can run
    ``capturable=True``, as CUDA can; real CPU tensors never reach them in an emulated step.

    Each of ``torch.optim``'s modules imported ``_get_capturable_supported_devices`` by name, so
    each module's own reference is replaced, and put back after.

    Example::

        >>> import torch
        >>> weight = torch.nn.Parameter(torch.ones(3))
        >>> optimizer = torch.optim.Adam([weight], capturable=True)
        >>> weight.grad = torch.ones(3)
        >>> with capturable_on_stand_ins():
        ...     optimizer.step()
        >>> bool(weight.detach().lt(1).all())
        True
    """

    def with_cpu(original: Callable[..., list[str]]) -> Callable[..., list[str]]:
        @functools.wraps(original)
        def supported(*args: Any, **kwargs: Any) -> list[str]:
            devices = list(original(*args, **kwargs))
            return devices if "cpu" in devices else [*devices, "cpu"]

        return supported

    replaced = [(module, module._get_capturable_supported_devices) for module in _capturable_checking_modules()]
    try:
        for module, original in replaced:
            module._get_capturable_supported_devices = with_cpu(original)
        yield
    finally:
        for module, original in replaced:
            module._get_capturable_supported_devices = original


#: Factories that make a tensor on the default device (host memory in a CUDA run) where given no
#: ``device``.
_HOST_FACTORIES = (torch.tensor, torch.as_tensor, torch.scalar_tensor, torch.zeros, torch.ones, torch.full, torch.empty)


def _host(device: Any) -> bool:
    """Whether a factory given ``device`` makes its tensor in host memory in a CUDA run: given none
    (the default device, the CPU's), or the CPU by name (Adam's and AdamW's counts in torch 2.11
    and later: ``device="cpu"``). A device read off a tensor (``p.device``) is a ``torch.device``:
    here the stand-ins', the CPU, but CUDA in the run, so the device's."""
    if device is None:
        return torch.get_default_device().type == "cpu"
    return isinstance(device, str) and device == "cpu"


class HostScalars(TorchFunctionMode):
    """While on (an optimizer's construction and step, on fake CPU tensors standing in for CUDA
    ones): a tensor made by a factory given no ``device``, or ``"cpu"`` by name, stays in host
    memory in a CUDA run, so it is made with the count paused (``paused()``, the counter's) and
    remembered (:meth:`holds`) for what adopts the optimizer's state. A factory given a device
    read off a tensor (the parameters', the CPU here) makes a tensor on the device, counted.

    Example::

        >>> import contextlib
        >>> made = []
        >>> weight = torch.zeros(3)
        >>> with HostScalars(lambda: contextlib.nullcontext(made.append("paused"))) as host:
        ...     step, one = torch.tensor(0.0), torch.tensor(1.0, device="cpu")
        ...     moment = torch.zeros(3, device=weight.device)
        >>> made, host.holds(step), host.holds(one), host.holds(moment)
        (['paused', 'paused'], True, True, False)
    """

    def __init__(self, paused: Callable[[], ContextManager[Any]]) -> None:
        super().__init__()
        self._paused = paused
        # by id, each a weak reference: a set of tensors would compare them with ``==``
        self._made: dict[int, weakref.ref[torch.Tensor]] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func in _HOST_FACTORIES and _host(kwargs.get("device")):
            with self._paused():
                made = func(*args, **kwargs)
            if isinstance(made, torch.Tensor):
                self._made[id(made)] = weakref.ref(made)
            return made
        return func(*args, **kwargs)

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` was made here in host memory."""
        ref = self._made.get(id(tensor))
        return ref is not None and ref() is tensor
