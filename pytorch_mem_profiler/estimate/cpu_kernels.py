"""The CPU's kernels, for fake tensors: an operator's outputs as the CPU makes them, where torch's fake kernels differ.

An estimate on the CPU counts what the CPU counter would count: the storages the
operators return (a kernel's buffers freed before it returns are seen by
neither). The fake mode's kernels (meta kernels and decompositions) give almost
every operator the CPU's shapes, dtypes and strides; where one does not, the
estimate counts other bytes, and the operators after it see other dtypes and
strides. Found by running each operator of real CPU training steps again on fake
copies of its inputs and comparing what comes back (the zoo's models and small
models of each family: normalization layers, convolutions of every kind, pooling,
upsampling, attention, recurrent layers, losses, embeddings; float32 and bf16/fp16
autocast; torch 2.13 and 2.14; ``tests/test_estimate_cpu_kernels.py`` does it):

- **normalization statistics under mixed precision**: ``native_batch_norm`` (and
  its ``_native_batch_norm_legit*`` and ``_batch_norm_with(out)_update`` forms),
  ``native_layer_norm`` and ``native_group_norm`` given a bf16 or fp16 input and
  float32 parameters (autocast's usual case: the input was cast, the weights were
  not) keep their saved mean and inverse standard deviation in float32; the fake
  kernels give them the input's dtype, half the bytes.
- **memory formats of batch and group norm**: the CPU's batch norm and
  ``native_group_norm`` outputs and ``native_batch_norm_backward``'s and
  ``native_group_norm_backward``'s input gradient are in the input's suggested
  memory format (channels-last stays channels-last; anything else is
  contiguous), where the fake kernels make the gradients contiguous and the
  batch norm's output in the input's own strides: ``BatchNorm1d`` over a
  sequence transposed to channels first (PatchTST's ``PatchTSTBatchNorm``:
  ``bn(x.transpose(1, 2)).transpose(1, 2)``) gave a contiguous result where the
  CPU's is not, and the linear layers after it did not copy their input as they
  do for real (24,576 B under the CPU's peak on a small PatchTST); the fake
  ``native_group_norm_backward`` also makes its gradient float32 where the CPU
  keeps the input's dtype (twice the bytes under autocast).
- **layer norm's input gradient is contiguous**: ``native_layer_norm_backward``
  (CPU and CUDA alike: both take ``input.expect_contiguous()`` and make the
  gradient ``empty_like`` it, contiguous) where the fake kernel gives it the
  input's strides. A layer norm over a permuted tensor (PVT's and Swin's patch
  merging, ``LayerNorm2d`` as a permute around ``F.layer_norm``) then hands the
  backward a non-contiguous gradient that a later ``view`` cannot take: the
  estimate copied it (``reshape``: ``clone``), 32,768 B over on timm's PVT-v2-b0,
  and autograd's in-place accumulation of it took other paths. On CUDA this rule
  is applied too (:class:`CpuKernels` with ``device_type="cuda"``), with one of
  CUDA's own: ``native_batch_norm_backward`` in training gives the input's gradient
  the input's suggested memory format (a bfloat16 ``BatchNorm2d`` over
  channels-last input, which takes it rather than cuDNN's), in evaluation a
  contiguous one, where the fake kernel makes it contiguous in both.
- **losses reduced in place**: ``mse_loss``, ``smooth_l1_loss``,
  ``binary_cross_entropy`` and ``soft_margin_loss`` with ``reduction="mean"`` or
  ``"sum"`` reduce into their elementwise buffer and shrink it: the 0-d loss
  keeps a storage of the whole elementwise size until it dies.
- **embedding bags**: ``_embedding_bag`` allocates each index's bag one element
  longer than it keeps (and each bag's size too, with ``include_last_offset``).
- **oneDNN's LSTM** (``nn.LSTM`` on the CPU, without ``proj_size``, takes
  ``aten.mkldnn_rnn_layer``, one call per layer and direction): while gradients
  are on, each call returns oneDNN's **workspace**, saved for backward, which the
  fake kernel leaves empty. Its bytes are oneDNN's own layout
  (:func:`onednn_lstm_workspace`, from ``rnn_utils``' ``set_workspace_sizes`` and
  ``set_offsets``): the gates, the hidden states, the layer's and the cell's
  states and the three gradient states of every step, each region page-aligned.
  In backward (``mkldnn_rnn_layer_backward``) every gradient is float32, the two
  bias gradients two storages (the fake kernel may return one twice).

:class:`CpuKernels` is called after each operator of a CPU estimate (by the
counter's dispatch mode, above the fake mode) and gives back the outputs, the
differing ones replaced by fake tensors as the CPU makes them: autograd saves
those, and later operators see them. Other operators pass through untouched.

Example::

    >>> import torch
    >>> from torch._subclasses import FakeTensorMode
    >>> aten = torch.ops.aten
    >>> with FakeTensorMode():
    ...     x = torch.empty(2, 8, 4, 4, dtype=torch.bfloat16)
    ...     weight, bias = torch.empty(8), torch.empty(8)
    ...     out = aten.native_layer_norm(x, [4], None, None, 1e-5)    # bf16 in, no parameters: as the CPU
    ...     plain = CpuKernels()(aten.native_layer_norm.default, (x, [4], None, None, 1e-5), {}, out)
    ...     args = (x, weight, bias, None, None, True, 0.1, 1e-5)
    ...     out = CpuKernels()(aten.native_batch_norm.default, args, {}, aten.native_batch_norm(*args))
    >>> plain[1].dtype, out[1].dtype, out[1].untyped_storage().nbytes()
    (torch.bfloat16, torch.float32, 32)
    >>> sizes = dict(seq_len=8, batch=2, input_size=32, hidden=32, element_size=4, cell_element_size=4)
    >>> onednn_lstm_workspace(**sizes, version=(3, 9)), onednn_lstm_workspace(**sizes, version=(3, 8))  # oneDNN 3.9+, older
    (53248, 69632)
"""

from __future__ import annotations

import functools
import math
import re
from typing import Any, Callable, Sequence

import torch
from torch._prims_common import suggest_memory_format  # the C++ Tensor method, which Python lacks
from torch._subclasses.fake_tensor import FakeTensor

__all__ = ["CpuKernels", "onednn_lstm_workspace", "lstm_workspace_bound", "onednn_version", "ONEDNN_PAGE"]

#: oneDNN aligns each region of an RNN's workspace to this many bytes (``set_offsets``' page size).
ONEDNN_PAGE = 4096
#: oneDNN versions before this one keep two more copies of the layer's states in the workspace
#: (``set_offsets`` registered ``ws_states_iter`` twice; removed in 3.9, "remove unnecessary
#: memory allocations").
_ONEDNN_WITHOUT_STATES_ITER = (3, 9)
_HALF = (torch.bfloat16, torch.float16)


@functools.lru_cache(maxsize=1)
def onednn_version() -> tuple[int, int] | None:
    """The oneDNN (MKL-DNN) version this torch was built with, ``(major, minor)``; ``None`` if none.

    The one place the estimate asks which oneDNN it runs on: torch names it only in its
    build configuration (``torch.__config__.show()``: ``Intel(R) MKL-DNN v3.12.0 ...``).
    """
    try:
        found = re.search(r"MKL-DNN v(\d+)\.(\d+)", torch.__config__.show())
    except Exception:  # noqa: BLE001 - a build without the text: unknown
        return None
    return (int(found.group(1)), int(found.group(2))) if found else None


def _good_ld(dim: int, element_size: int) -> int:
    """oneDNN's leading dimension for a matrix row of ``dim`` elements (``rnn_utils::get_good_ld``):
    64-byte aligned, and not a multiple of 256 elements (4K aliasing)."""
    step = 64 // element_size
    ld = math.ceil(dim / step) * step
    return ld + step if ld % 256 == 0 else ld


def _pages(nbytes: int) -> int:
    return math.ceil(nbytes / ONEDNN_PAGE) * ONEDNN_PAGE


def onednn_lstm_workspace(
    *,
    seq_len: int,
    batch: int,
    input_size: int,
    hidden: int,
    element_size: int,
    cell_element_size: int,
    version: tuple[int, int] | None = None,
) -> int:
    """Bytes of the workspace oneDNN's LSTM training forward returns for one layer and direction.

    ``element_size``: the input's (4 for float32, 2 for bf16: the gates and states are
    kept in it); ``cell_element_size``: the cell state's. Gradient states are float32.
    Regions, each starting on a 4096-byte page: the gates (``T x B x ld(4H)``), the hidden
    states (``T x B x ld(H)``), the layer's states (``2 x (T+1) x B x ld(max(I, H))``; before
    oneDNN 3.9 twice more), the cell states (``2 x (T+1) x B x H``), and the layer's, the
    iteration's and the cell's gradient states in float32. ``version``: oneDNN's, default
    this torch's (:func:`onednn_version`).
    """
    version = version if version is not None else onednn_version()
    steps, states = seq_len * batch, 2 * (seq_len + 1) * batch
    widest = max(input_size, hidden)
    regions = [
        steps * _good_ld(4 * hidden, element_size) * element_size,  # gates
        steps * _good_ld(hidden, element_size) * element_size,  # hidden states (ws_ht)
        states * _good_ld(widest, element_size) * element_size,  # layer states
    ]
    if version is not None and version < _ONEDNN_WITHOUT_STATES_ITER:
        regions += regions[-1:] * 2
    regions += [
        states * hidden * cell_element_size,  # cell states
        states * _good_ld(widest, 4) * 4,  # gradient of the layer's states
        states * _good_ld(widest, 4) * 4,  # gradient of the iteration's states
        states * hidden * 4,  # gradient of the cell states
    ]
    return sum(_pages(n) for n in regions)


# -- replacing outputs ------------------------------------------------------------------
def _like(t: torch.Tensor, *, dtype: torch.dtype | None = None, memory_format: torch.memory_format | None = None) -> torch.Tensor:
    """A new fake tensor of ``t``'s shape: ``dtype`` (default ``t``'s), strides of ``memory_format``
    (default ``t``'s own). Made by a factory under the fake mode (below the caller's mode)."""
    dtype = dtype or t.dtype
    if memory_format is None:
        return torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=dtype, device=t.device)
    return torch.empty(tuple(t.shape), dtype=dtype, device=t.device, memory_format=memory_format)


def _replaced(out: Any, changes: dict[int, torch.Tensor]) -> Any:
    if not changes:
        return out
    items = list(out)
    for i, t in changes.items():
        items[i] = t
    return tuple(items)


def _mixed(x: Any, params: Sequence[Any]) -> bool:
    """The CPU's ``is_mixed_type``: a half-precision input with float32 parameters."""
    return (
        isinstance(x, torch.Tensor)
        and x.dtype in _HALF
        and any(isinstance(p, torch.Tensor) and p.dtype == torch.float32 for p in params)
    )


Rule = Callable[[Any, tuple, dict, Any], Any]


def _argument(func: Any, args: tuple, kwargs: dict, name: str) -> Any:
    """The operator's argument ``name`` as called, or its schema's default (the dispatcher leaves
    trailing defaults out of ``args``)."""
    for i, spec in enumerate(func._schema.arguments):
        if spec.name == name:
            if i < len(args) and not spec.kwarg_only:
                return args[i]
            return kwargs.get(name, spec.default_value)
    raise KeyError(name)


def _kept(t: torch.Tensor, numel: int) -> torch.Tensor:
    """A fake tensor of ``t``'s shape and dtype on a storage of ``numel`` elements: what a kernel
    leaves after shrinking its buffer with ``resize_`` (a smaller shape keeps the storage)."""
    return torch.empty(numel, dtype=t.dtype, device=t.device).resize_(tuple(t.shape))


def _float32_statistics(params: slice, statistics: tuple[int, ...]) -> Rule:
    """The saved statistics (outputs ``statistics``) in float32 when the input and the
    parameters (arguments ``params``) are of mixed precision, as the CPU keeps them."""

    def rule(func: Any, args: tuple, kwargs: dict, out: Any) -> Any:
        if not isinstance(out, (tuple, list)) or not _mixed(args[0], args[params]):
            return out
        return _replaced(
            out,
            {
                i: _like(out[i], dtype=torch.float32)
                for i in statistics
                if isinstance(out[i], torch.Tensor) and out[i].dtype != torch.float32
            },
        )

    return rule


def _layer_norm_statistics(func: Any, args: tuple, kwargs: dict, out: Any) -> Any:
    """Layer norm's saved mean and inverse standard deviation (outputs 1, 2) as the CPU keeps them:
    float32 where the input and the parameters (arguments 2, 3) are of mixed precision, else in
    the input's dtype (torch 2.4's fake kernel makes them float32 for any half-precision input)."""
    if not isinstance(out, (tuple, list)) or not isinstance(args[0], torch.Tensor):
        return out
    dtype = torch.float32 if _mixed(args[0], args[2:4]) else args[0].dtype
    return _replaced(out, {i: _like(out[i], dtype=dtype) for i in (1, 2) if isinstance(out[i], torch.Tensor) and out[i].dtype != dtype})


def _output_like_input(func: Any, args: tuple, kwargs: dict, out: Any) -> Any:
    """The output (0) in the input's (argument 0) memory format, as the CPU's group norm makes it."""
    y, x = out[0], args[0]
    fmt = suggest_memory_format(x)
    if not isinstance(y, torch.Tensor) or y.is_contiguous(memory_format=fmt):
        return out
    return _replaced(out, {0: _like(y, memory_format=fmt)})


def _input_gradient_like_input(func: Any, args: tuple, kwargs: dict, out: Any) -> Any:
    """The input's gradient (output 0) in the input's (argument 1) dtype and memory format."""
    grad, x = out[0], args[1]
    if not isinstance(grad, torch.Tensor) or not isinstance(x, torch.Tensor):
        return out
    fmt = suggest_memory_format(x)
    if grad.dtype == x.dtype and grad.is_contiguous(memory_format=fmt):
        return out
    return _replaced(out, {0: _like(grad, dtype=x.dtype, memory_format=fmt)})


def _contiguous_input_gradient(func: Any, args: tuple, kwargs: dict, out: Any) -> Any:
    """The input's gradient (output 0) contiguous, as layer norm's CPU and CUDA kernels make it;
    the weight's and the bias's gradients (outputs 1, 2) in the weight's and the bias's dtype
    (arguments 5, 6), as the kernels make them (torch 2.4's fake kernel gives them the input's:
    half the bytes under autocast, where the weights stay float32)."""
    changes = {}
    grad = out[0]
    if isinstance(grad, torch.Tensor) and not grad.is_contiguous():
        changes[0] = _like(grad, memory_format=torch.contiguous_format)
    for i, param in ((1, args[5] if len(args) > 5 else None), (2, args[6] if len(args) > 6 else None)):
        made = out[i]
        if isinstance(made, torch.Tensor) and isinstance(param, torch.Tensor) and made.dtype != param.dtype:
            changes[i] = _like(made, dtype=param.dtype)
    return _replaced(out, changes) if changes else out


def _training_input_gradient_like_input(func: Any, args: tuple, kwargs: dict, out: Any) -> Any:
    """CUDA's ``native_batch_norm_backward``: in training the input's gradient is in the input's
    suggested memory format (channels-last stays channels-last: measured on an H200 for a
    bfloat16 ``BatchNorm2d`` over channels-last input, where the fake kernel makes it contiguous);
    in evaluation it is contiguous, as torch 2.11's fake kernel makes it in both."""
    if _argument(func, args, kwargs, "train"):
        return _input_gradient_like_input(func, args, kwargs, out)
    grad = out[0]
    if not isinstance(grad, torch.Tensor) or grad.is_contiguous():
        return out
    return _replaced(out, {0: _like(grad, memory_format=torch.contiguous_format)})


def _reduced_in_place(func: Any, args: tuple, kwargs: dict, out: Any) -> Any:
    """A loss reduced (mean or sum) into its own elementwise buffer: the 0-d result keeps the
    storage of the input and target broadcast together."""
    if _argument(func, args, kwargs, "reduction") == 0 or not isinstance(out, torch.Tensor):
        return out  # reduction="none": the elementwise loss itself
    x, target = args[0], args[1]
    numel = math.prod(torch.broadcast_shapes(tuple(x.shape), tuple(target.shape)))
    if out.untyped_storage().nbytes() >= numel * out.element_size():
        return out
    return _kept(out, numel)


def _bag_buffers(func: Any, args: tuple, kwargs: dict, out: Any) -> Any:
    """``_embedding_bag``: the bag of each index (output 1) is allocated one longer than it is
    kept; so is each bag's size (output 2) with ``include_last_offset``."""
    changes = {}
    offset2bag, bag_size = out[1], out[2]
    if isinstance(offset2bag, torch.Tensor) and offset2bag.numel() > 0:
        changes[1] = _kept(offset2bag, offset2bag.numel() + 1)
    if _argument(func, args, kwargs, "include_last_offset") and isinstance(bag_size, torch.Tensor) and bag_size.numel() > 0:
        changes[2] = _kept(bag_size, bag_size.numel() + 1)
    return _replaced(out, changes)


def _lstm_sizes(args: tuple) -> dict[str, int]:
    """``mkldnn_rnn_layer``'s sizes for :func:`onednn_lstm_workspace`: its input is ``(T, B, I)``
    (made sequence-first before the call), argument 10 the hidden size, 6 the cell state."""
    x, cx = args[0], args[6]
    return dict(
        seq_len=int(x.shape[0]),
        batch=int(x.shape[1]),
        input_size=int(x.shape[2]),
        hidden=int(args[10]),
        element_size=x.element_size(),
        cell_element_size=cx.element_size() if isinstance(cx, torch.Tensor) else x.element_size(),
    )


def lstm_workspace_bound(**sizes: int) -> int:
    """Bytes the workspace may be off by where oneDNN's version is unknown: the layer's states that
    versions before 3.9 keep twice more (:func:`onednn_lstm_workspace`'s two layouts apart)."""
    old = onednn_lstm_workspace(**sizes, version=(3, 8))
    new = onednn_lstm_workspace(**sizes, version=_ONEDNN_WITHOUT_STATES_ITER)
    return old - new


def _lstm_gradients(func: Any, args: tuple, kwargs: dict, out: Any) -> Any:
    """``mkldnn_rnn_layer_backward``: every gradient a float32 storage of its own (the second
    bias gradient is a copy of the first); the bias gradients (outputs 3, 4) one value per gate
    row, ``(4 * hidden,)``, also for a layer without biases (torch 2.4's fake kernel shapes them
    as the weights)."""
    gate_rows = out[1].shape[0] if isinstance(out[1], torch.Tensor) else None

    def made(i: int, t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        shape = (gate_rows,) if i in (3, 4) and gate_rows is not None else tuple(t.shape)
        return torch.empty(shape, dtype=torch.float32, device=t.device)

    return tuple(made(i, t) for i, t in enumerate(out))


def _both(first: Rule, second: Rule) -> Rule:
    return lambda func, args, kwargs, out: second(func, args, kwargs, first(func, args, kwargs, out))


#: The rules CUDA's kernels share with the CPU's (the same ATen code makes the outputs).
_ON_CUDA_TOO = frozenset({"native_layer_norm_backward.default"})


def _takes_cudnn(func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether CUDA's batch norm takes cuDNN's kernel for these arguments (ATen's
    ``_batch_norm_impl_index``): no bfloat16, half only with float32 weights, weights and biases
    given, three dimensions or more, and a batch cuDNN takes (the forms here that run without
    running statistics are training ones, which cuDNN takes too)."""
    x, weight, bias = args[0], args[1], args[2]
    if not all(isinstance(t, torch.Tensor) for t in (x, weight, bias)) or x.dim() < 3:
        return False
    if torch.bfloat16 in (x.dtype, weight.dtype) or (x.dtype == torch.float16 and weight.dtype != torch.float32):
        return False
    names = {a.name for a in func._schema.arguments}
    if "training" in names:
        training = bool(_argument(func, args, kwargs, "training"))
    else:  # _batch_norm_with_update trains; _batch_norm_no_update and _legit_no_training do not
        training = func._schema.name.endswith("_with_update")
    return x.shape[0] <= (880801 if training else 65535) and x.numel() < 2**31 - 1


def _cudnn_output_like_input(func: Any, args: tuple, kwargs: dict, out: Any) -> Any:
    """Batch norm on fake CPU tensors standing in for CUDA ones: where CUDA takes cuDNN's kernel its
    output is in the input's suggested memory format (a sequence transposed to channels first
    comes out contiguous: measured on an H200), where it takes ATen's own the input's strides, as
    the fake kernel makes it."""
    return _output_like_input(func, args, kwargs, out) if _takes_cudnn(func, args, kwargs) else out


#: CUDA's own rules, where its kernel makes an output otherwise than the CPU's and the fake one.
_CUDA_OWN: dict[str, Rule] = {
    "native_batch_norm_backward.default": _training_input_gradient_like_input,
    # the emulation's forms (fake CPU tensors): on fake CUDA tensors cuDNN's kernel is its own operator
    "native_batch_norm.default": _cudnn_output_like_input,
    "_native_batch_norm_legit.default": _cudnn_output_like_input,
    "_batch_norm_with_update.default": _cudnn_output_like_input,
    "_native_batch_norm_legit_no_training.default": _cudnn_output_like_input,
    "_batch_norm_no_update.default": _cudnn_output_like_input,
}


def _rules(device_type: str = "cpu") -> dict[Any, Rule]:
    aten = torch.ops.aten
    by_name: dict[str, Rule] = {
        # (input, weight, bias, running_mean, running_var, ...) -> (output, save_mean, save_invstd, ...)
        "native_batch_norm.default": _both(_float32_statistics(slice(1, 5), (1, 2)), _output_like_input),
        "_native_batch_norm_legit.default": _both(_float32_statistics(slice(1, 5), (1, 2)), _output_like_input),
        "_native_batch_norm_legit.no_stats": _both(_float32_statistics(slice(1, 3), (1, 2)), _output_like_input),
        "_native_batch_norm_legit_no_training.default": _both(_float32_statistics(slice(1, 5), (1, 2)), _output_like_input),
        "_batch_norm_with_update.default": _both(_float32_statistics(slice(1, 5), (1, 2)), _output_like_input),
        "_batch_norm_no_update.default": _both(_float32_statistics(slice(1, 5), (1, 2)), _output_like_input),
        # (input, normalized_shape, weight, bias, eps) -> (output, mean, rstd)
        "native_layer_norm.default": _layer_norm_statistics,
        # (input, weight, bias, N, C, HxW, group, eps) -> (output, mean, rstd)
        "native_group_norm.default": _both(_float32_statistics(slice(1, 3), (1, 2)), _output_like_input),
        # (grad_out, input, ...) -> (grad_input, grad_weight, grad_bias)
        "native_batch_norm_backward.default": _input_gradient_like_input,
        "batch_norm_backward.default": _input_gradient_like_input,
        "native_group_norm_backward.default": _input_gradient_like_input,
        # (grad_out, input, normalized_shape, mean, rstd, weight, bias, mask) -> (grad_input, ...)
        "native_layer_norm_backward.default": _contiguous_input_gradient,
        "mse_loss.default": _reduced_in_place,
        "smooth_l1_loss.default": _reduced_in_place,
        "binary_cross_entropy.default": _reduced_in_place,
        "soft_margin_loss.default": _reduced_in_place,
        "_embedding_bag.default": _bag_buffers,
        "_embedding_bag_forward_only.default": _bag_buffers,
        "mkldnn_rnn_layer_backward.default": _lstm_gradients,
    }
    if device_type != "cpu":  # CUDA's kernels: the rules they share with the CPU's, and their own
        by_name = {name: rule for name, rule in by_name.items() if name in _ON_CUDA_TOO}
        by_name.update(_CUDA_OWN)
    rules = {}
    for name, rule in by_name.items():
        packet, overload = name.split(".")
        op = getattr(getattr(aten, packet, None), overload, None)  # an operator this torch lacks: no rule
        if op is not None:
            rules[op] = rule
    return rules


class CpuKernels:
    """``kernels(func, args, kwargs, out)``: ``out``, with the outputs the CPU makes otherwise
    than the fake kernel replaced (see the module's list); anything else unchanged.

    Args:
        device_type: the estimate's target; on ``"cuda"`` only the rules CUDA's kernels share
            with the CPU's (layer norm's input gradient).

    Attributes:
        bounds: bytes the outputs made may be off by, per operation (``estimate.error_bounds``):
            only oneDNN's LSTM workspaces where this torch does not name its oneDNN version,
            summed over the calls (each layer's workspace is kept for backward); cleared by the
            caller at each step.
    """

    def __init__(self, *, device_type: str = "cpu") -> None:
        self._rules = _rules(device_type)
        lstm = getattr(torch.ops.aten, "mkldnn_rnn_layer", None)
        if lstm is not None and device_type == "cpu":
            self._rules[lstm.default] = self._lstm_workspace
        self.bounds: dict[str, int] = {}

    def __call__(self, func: Any, args: tuple, kwargs: dict, out: Any) -> Any:
        rule = self._rules.get(func)
        if rule is None:
            return out
        made = [t for t in (out if isinstance(out, (tuple, list)) else [out]) if isinstance(t, torch.Tensor)]
        if any(type(t) is not FakeTensor for t in made):
            return out  # a wrapper's (a DTensor's) outputs: its own dispatch makes them
        return rule(func, args, kwargs, out)

    def _lstm_workspace(self, func: Any, args: tuple, kwargs: dict, out: Any) -> Any:
        """``mkldnn_rnn_layer``: oneDNN's workspace, taken (and returned) while gradients are on."""
        if not torch.is_grad_enabled():
            return out  # inference: no workspace, as the fake kernel says
        sizes = _lstm_sizes(args)
        workspace = torch.empty(onednn_lstm_workspace(**sizes), dtype=torch.uint8, device=out[3].device)
        if onednn_version() is None:
            operation = "aten.mkldnn_rnn_layer (oneDNN's workspace; its version unknown)"
            self.bounds[operation] = self.bounds.get(operation, 0) + lstm_workspace_bound(**sizes)
        return _replaced(out, {3: workspace})
