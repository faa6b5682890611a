"""What the installed torch offers where the supported releases differ (torch 2.4 to the newest).

The package supports torch 2.4 and newer. Where an operator, an argument or a
behaviour came in a later release, the code that depends on it asks here, and
so do the tests that expect one side or the other; ``tests/test_torch_versions.py``
holds each answer against what torch itself does. Features are detected where
torch can be asked (an operator's schema, a function's presence); a release
number is compared only where nothing can be asked.

Older places that tell releases apart each for their own feature:
:func:`~pytorch_mem_profiler.measure.saved_tensors.can_chain` (torch 2.8),
``CudaHistory`` in :mod:`~pytorch_mem_profiler.measure.allocator`,
``fully_shard_function`` in :mod:`~pytorch_mem_profiler.estimate.parallel` and
``timeline_exporter_state`` in :mod:`~pytorch_mem_profiler.tools.timeline`.

Example::

    >>> TORCH_VERSION >= (2, 4)
    True
    >>> release("2.4.1+cu121"), release("2.6.0a0+git1234abc"), release("2.10.0.dev20250101")
    ((2, 4), (2, 6), (2, 10))
    >>> SDPA_ENABLE_GQA == (TORCH_VERSION >= (2, 5))
    True
"""

from __future__ import annotations

import functools
import re
from typing import Any, Callable

import torch
import torch.utils._python_dispatch

__all__ = [
    "COMPILE_YIELDS_TO_DISPATCH_MODES",
    "CUDNN_ATTENTION_TAKES_MASK",
    "FSDP2_ON_CPU",
    "INDUCTOR_PLAN_MODELLED",
    "SDPA_ENABLE_GQA",
    "TORCH_VERSION",
    "attention_softmax",
    "dynamo_frame_hook",
    "fake_tolist_reads_values",
    "math_attention_upcasts",
    "never_compiled",
    "release",
    "set_dynamo_frame_hook",
]


def release(version: str) -> tuple[int, int]:
    """``(major, minor)`` of a torch version string (local builds and pre-releases included)."""
    found = re.match(r"(\d+)\.(\d+)", version)
    if found is None:
        raise ValueError(f"not a torch version: {version!r}")
    return int(found.group(1)), int(found.group(2))


#: The installed torch's ``(major, minor)``.
TORCH_VERSION = release(torch.__version__)

#: ``scaled_dot_product_attention(..., enable_gqa=True)``: grouped-query attention, torch 2.5 and later.
SDPA_ENABLE_GQA = any(
    argument.name == "enable_gqa" for argument in torch.ops.aten.scaled_dot_product_attention.default._schema.arguments
)

#: cuDNN's attention takes an additive mask (``attn_bias``): torch 2.5 and later. Where it does, torch
#: 2.11 on Hopper runs masked half-precision attention through it; torch 2.4's takes none.
CUDNN_ATTENTION_TAKES_MASK = any(
    argument.name == "attn_bias"
    for argument in torch.ops.aten._scaled_dot_product_cudnn_attention.default._schema.arguments
)

#: FSDP2 (``fully_shard``) on CPU tensors: torch 2.6 and later. Torch 2.4 and 2.5 make CUDA
#: streams for it whatever the device, which fails where CUDA's driver is missing.
FSDP2_ON_CPU = TORCH_VERSION >= (2, 6)

#: The estimate's model of Inductor (its partition, fusion and memory planning) follows torch 2.11 to
#: 2.14, where it was measured; on torch 2.4 Inductor plans otherwise (the zoo's test models measured
#: -6% to +3.6% from that model), so a compiled module is estimated uncompiled there, with its bound.
#: Releases 2.5 to 2.10 are not measured.
INDUCTOR_PLAN_MODELLED = TORCH_VERSION >= (2, 5)

#: ``torch.compile`` runs a frame eagerly while a ``TorchDispatchMode`` is active (2.13 does), so
#: a mode that counts tensors (the CPU counter) sees every operator of a compiled model. Torch 2.4
#: runs the compiled code there, whose tensors no mode sees (inductor allocates its buffers past
#: the dispatcher).
COMPILE_YIELDS_TO_DISPATCH_MODES = hasattr(
    torch.utils._python_dispatch, "is_in_any_mode_without_ignore_compile_internals"
)

_EVAL_FRAME = getattr(getattr(torch._C, "_dynamo", None), "eval_frame", None)
#: Dynamo's frame hook (``torch._C._dynamo.eval_frame.set_eval_frame``): set to ``None`` it compiles
#: no frame; it returns the hook it replaced. ``None`` where this torch has no Dynamo.
set_dynamo_frame_hook = getattr(_EVAL_FRAME, "set_eval_frame", None)


def _read_by_setting() -> Any:
    prior = set_dynamo_frame_hook(None)  # type: ignore[misc]
    set_dynamo_frame_hook(prior)  # type: ignore[misc]
    return prior


def never_compiled(code: Any) -> None:
    """Mark a code object for Dynamo to run as it is, never to compile (the frames it calls are
    Dynamo's to decide): ``skip_code``, a C call on every torch, no ``torch._dynamo`` import."""
    try:
        if hasattr(_EVAL_FRAME, "set_code_exec_strategy") and hasattr(_EVAL_FRAME, "_FrameExecStrategy"):
            action = _EVAL_FRAME._FrameAction
            _EVAL_FRAME.set_code_exec_strategy(code, _EVAL_FRAME._FrameExecStrategy(action.SKIP, action.DEFAULT))
        elif hasattr(_EVAL_FRAME, "skip_code"):  # torch before the frame execution strategies
            _EVAL_FRAME.skip_code(code)
    except Exception:  # noqa: BLE001 - called at import: a torch that answers otherwise compiles the frame, as before
        pass


#: Dynamo's frame hook now (``None``: no frame would be compiled). Read directly where torch offers
#: ``get_eval_frame_callback``, else by setting it and putting it back.
dynamo_frame_hook: Callable[[], Any] = (
    getattr(_EVAL_FRAME, "get_eval_frame_callback", None)
    or (_read_by_setting if set_dynamo_frame_hook is not None else (lambda: None))
)


# ATen's math attention normalises with ``_safe_softmax`` from torch 2.5 on (a row masked
# out entirely gives zeros, not NaN); torch 2.4 runs ``softmax``.
_SAFE_SOFTMAX = getattr(torch.ops.aten, "_safe_softmax", None)


def attention_softmax(scores: torch.Tensor) -> torch.Tensor:
    """The softmax over the last dimension that ATen's math attention (``_scaled_dot_product_attention_math``)
    runs on this torch: ``_safe_softmax`` (2.5 and later) or ``softmax`` (2.4). Both save their result.

    Example::

        >>> attention_softmax(torch.zeros(2, 4)).sum(-1).tolist()
        [1.0, 1.0]
    """
    if _SAFE_SOFTMAX is not None:
        return _SAFE_SOFTMAX(scores, -1)
    return torch.softmax(scores, -1)


def math_attention_upcasts() -> bool:
    """Whether ATen's math attention computes half-precision inputs in float32, now.

    Torch 2.5 and later do, unless ``torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(True)``
    was called (a global switch, read each time); torch 2.4 computes in the inputs' dtype.

    Example::

        >>> math_attention_upcasts() == (TORCH_VERSION >= (2, 5))   # with torch's default
        True
    """
    allowed = getattr(torch.backends.cuda, "fp16_bf16_reduction_math_sdp_allowed", None)
    return allowed is not None and not allowed()


@functools.lru_cache(maxsize=None)
def fake_tolist_reads_values() -> bool:
    """Whether a fake tensor's ``tolist()`` reads each element as ``item()`` does (a value it holds
    is read; torch 2.5 and later), rather than making a new unbacked symbol per element, which
    needs a shape environment and ignores the value (torch 2.4). Asked of torch once.

    Example::

        >>> fake_tolist_reads_values() == (TORCH_VERSION >= (2, 5))
        True
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():  # no shape environment: 2.4's symbols cannot be made, 2.5's reads are refused
        try:
            torch.empty(3).tolist()
        except AttributeError:  # "'NoneType' object has no attribute 'create_unbacked_symint'"
            return False
        except RuntimeError:  # the data-dependent read of item()
            return True
    return True
