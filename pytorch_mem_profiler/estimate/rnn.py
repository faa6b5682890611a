"""cuDNN's recurrent layers on CUDA, for fake tensors: what ``nn.LSTM``, ``nn.GRU`` and ``nn.RNN`` hold.

On CUDA, ``nn.LSTM``/``nn.GRU``/``nn.RNN`` run cuDNN's RNN kernels (``aten._cudnn_rnn``),
which keep buffers a CPU kernel does not: a **reserve space** (the gates and
states of every layer and time step, written by the forward and read by the
backward: saved for backward), a **workspace** (taken and given back inside the
forward, and again inside the backward), and under autocast a **weight buffer**
(every weight cast to half precision into one flat buffer, also saved). Under the
fake mode ``_cudnn_rnn``'s backward wants a weight buffer that a fake forward does
not make, and fails inside torch; on fake CPU tensors standing in for CUDA the CPU's
kernels keep other tensors than cuDNN's.

:class:`CudnnRNNRules` (a ``TorchFunctionMode`` for the length of a CUDA estimate's
step) runs these layers' calls (``torch._VF.lstm``, ``gru``, ``rnn_tanh``,
``rnn_relu``) as an autograd function that makes what cuDNN makes, with fake
tensors: the output and final states in the compute dtype, the reserve space and
the weight buffer saved for backward, the workspace alive inside the operator;
in backward the input's, states' and weights' gradients and the workspace again.

The sizes (:func:`cudnn_rnn_buffers`) are fitted to cuDNN's buffers measured on an
H100 (``benchmarks/rnn_rules.py``; ``docs/estimate.md`` has the table):

- the **reserve** is every layer's and direction's per-step values, less the last
  layer's output (which is the output tensor itself), plus 256 bytes:
  ``directions * (layers * per_layer - proj) * T * B * element + 256`` where
  ``per_layer`` is ``4H + H + proj`` for an LSTM (gate pre-activations, cell, output)
  and ``3H + 3H + H`` for a GRU (its input and recurrent gate halves apart, as
  ``r * (W_hn h + b_hn)`` needs, and the output). Exact to the byte on all 22
  measured configurations; a plain RNN's (``H + H``) and an LSTM with
  ``proj_size`` are not measured and carry half their reserve as an error bound;
- the **weight buffer** under autocast is every weight in half precision, exact;
- the **workspace** is what cuDNN's heuristics ask for
  (``cudnnGetRNNTempSpaceSizes``), which cuDNN documents as not monotonic in the
  sizes: taken here as one layer's input projections for every step
  (``directions * T * B * gates * H * element``) plus :data:`WORKSPACE_FLOOR`, the
  size measured where the projections are small; the spread measured around that
  (from 13.5 MiB under to 92 MiB over), or far from the sizes it was fitted to an
  envelope that held on 4,500 layers drawn at random (:data:`WORKSPACE_ENVELOPE`),
  whichever is larger, is each call's error bound (:func:`workspace_bound`). It is
  taken in forward and again, twice in a row, in backward (backward data, then
  backward weights).

On fake CUDA tensors with a GPU here, cuDNN itself is asked, as ATen asks it before each
call (:func:`~pytorch_mem_profiler.measure.cudnn_sizes.rnn_temp_sizes`): the workspaces of the
forward and the backward and the reserve (with dropout a little larger than the rule's) are then
exact, and no bound is left for them. Without a GPU (emulated), and under autocast, the rule and
its bound stand.

In ATen's order, which decides where the caching allocator puts each block: the forward
copies a ``batch_first`` input to time-major (``input.contiguous()``), then makes the output
(time-major; a ``batch_first`` layer returns its transposed view, which a linear head after it
copies), the final states, the workspace and the reserve, and frees the workspace and the copy. In
backward (``_cudnn_rnn_backward``): zeros for final states without a gradient; the data pass
copies the input again and the output's gradient where it is not contiguous time-major (for
``batch_first`` always), makes the input's and states' gradients and its workspace, and frees
the workspace and the copies; the weights' pass copies the input again, makes the weights'
gradient as one flat buffer (in the compute dtype; under autocast cast to each float32 weight
after) and its workspace, and frees the workspace and the copy.

Two buffers outside the calls:

- the **flat weight buffer**: ``model.to("cuda")`` (``nn.RNNBase._apply``) copies each
  weight on its own, then ``flatten_parameters`` makes one buffer of them all
  (``_cudnn_rnn_flatten_weight``: cuDNN's weight space, which is their sum: 50,380,800
  bytes, exact, for a 2-layer 1024-wide GRU on an H200), points the weights into it and
  the copies are freed. It happens where cuDNN is on and every weight is a CUDA tensor
  of one dtype cuDNN takes (half, float, double: not bfloat16), none sharing memory.
  :func:`flatten_weights` makes the fake weights views of one fake buffer so;
- the **dropout state**: a layer with ``dropout > 0`` in training takes, in its first
  forward, a seed (a CUDA ``int64`` scalar, freed at once) and cuDNN's dropout state
  (``cudnnDropoutGetStatesSize``, kept by ATen for the process, one per device; made
  again after ``torch.manual_seed``). Its size depends on the device alone: 6,488,064
  bytes on an H200, 49,152 per multiprocessor (:func:`dropout_state_bytes`), measured
  on that one card; elsewhere it carries its own size as its error bound.

Example::

    >>> buffers = cudnn_rnn_buffers("lstm", seq_len=100, batch=32, hidden=256, proj=256, layers=2, directions=1, element_size=4)
    >>> buffers.reserve == (2 * 6 - 1) * 100 * 32 * 256 * 4 + 256, buffers.workspace == 100 * 32 * 4 * 256 * 4 + WORKSPACE_FLOOR
    (True, True)
    >>> sizes = dict(seq_len=100, batch=32, hidden=256, input_size=256, layers=2, directions=1, element_size=4)
    >>> buffers.bound == workspace_bound("lstm", **sizes)  # the reserve is measured: only the workspace's spread
    True
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from .allocator import block_size
from .kernel_probe import measured_or_pending, recurrent_key
from .lengths import known_values

__all__ = [
    "DROPOUT_STATE_PER_MULTIPROCESSOR",
    "dropout_state_bytes",
    "cudnn_flattens",
    "flatten_weights",
    "RNN_GATES",
    "UNMEASURED_SHARE",
    "WORKSPACE_ENVELOPE",
    "WORKSPACE_ENVELOPE_FLOOR",
    "WORKSPACE_FLOOR",
    "RNNBuffers",
    "cudnn_rnn_buffers",
    "workspace_bound",
    "CudnnRNNRules",
]

#: Gates per cell, by ``torch._VF`` function.
RNN_GATES = {"lstm": 4, "gru": 3, "rnn_tanh": 1, "rnn_relu": 1}
#: The share of a reserve taken as its error bound where its layout is not measured (plain RNNs, LSTM projections).
UNMEASURED_SHARE = 0.5
#: cuDNN's workspace above one layer's input projections: measured 32-32.75 MiB on an H100 where the
#: projections are 4 MiB (128 steps x 4, or 16 steps x 32, of a 512-wide LSTM), the smallest measured.
WORKSPACE_FLOOR = 32 * 2**20
#: The largest distance measured between cuDNN's workspace and the rule, above the projections' own size
#: (92 MiB over for a bidirectional 2-layer LSTM whose projections are 64 MiB; 50 MiB over for a 1-layer
#: one under autocast whose projections are 16 MiB), on the 22 layers the rule was fitted to.
WORKSPACE_SPREAD = 48 * 2**20
#: Far from those 22, cuDNN's workspace follows no one size (its algorithm changes with the sizes):
#: ``benchmarks/rnn_rules.py --grid`` found it outside the spread above on 1,822 of 4,500 drawn layers
#: on an H200 (LSTM, GRU, plain RNN; 1-4 layers, hidden 64-2,048, input 32-1,024, 8-512 steps, batch
#: 1-256, bidirectional, fp32 and fp16, dropout; seeds 0 and 1), up to 11.1 GB over. On those and on
#: 9,000 more on an H100 (seeds 0-2; torch 2.11, cuDNN 9.19 on both) it stayed under this many times
#: (the input projections + the input once per direction + every layer's output + half the weights),
#: plus :data:`WORKSPACE_ENVELOPE_FLOOR`: the largest ratio measured was 5.26 (a 1-layer plain RNN on
#: the H100), and the smallest layers took up to 48.6 MiB.
WORKSPACE_ENVELOPE = 5.75
#: See :data:`WORKSPACE_ENVELOPE`.
WORKSPACE_ENVELOPE_FLOOR = 64 * 2**20
#: cuDNN's reserve space carries this many bytes past the per-step values (all 22 measured configurations).
RESERVE_PAD = 256


#: cuDNN's dropout state per streaming multiprocessor: 6,488,064 bytes on an H200's 132 (torch 2.11).
DROPOUT_STATE_PER_MULTIPROCESSOR = 49_152
#: The card the dropout state was measured on: multiprocessors, resident threads per multiprocessor.
DROPOUT_STATE_MEASURED_ON = (132, 2048)
#: The error bound's name for the dropout state's size where the card is not the one measured.
DROPOUT_STATE_BOUND = "cuDNN dropout state"
#: The dtypes cuDNN runs recurrent layers in (``torch.backends.cudnn.CUDNN_TENSOR_DTYPES``).
_CUDNN_DTYPES = frozenset({torch.float16, torch.float32, torch.float64})


def dropout_state_bytes(multiprocessors: tuple[int, int] | None) -> tuple[int, int]:
    """cuDNN's dropout state on a card of ``(multiprocessors, threads per multiprocessor)``
    (``None``: unknown, an H100's or H200's 132 assumed), and how far it may be off: nothing on
    the card measured, its own size elsewhere (the size per multiprocessor is measured on one card).

    Example::

        >>> dropout_state_bytes((132, 2048))
        (6488064, 0)
        >>> dropout_state_bytes(None) == (6488064, 6488064)
        True
    """
    sms = multiprocessors[0] if multiprocessors is not None else DROPOUT_STATE_MEASURED_ON[0]
    size = sms * DROPOUT_STATE_PER_MULTIPROCESSOR
    return size, 0 if multiprocessors is not None and tuple(multiprocessors) == DROPOUT_STATE_MEASURED_ON else size


def cudnn_flattens(module: nn.Module) -> bool:
    """Whether ``module.to("cuda")`` leaves ``module``'s weights in one flat buffer of cuDNN's: an
    ``nn.RNNBase`` whose weights are all tensors of one dtype cuDNN takes, none sharing memory, with
    cuDNN on (what ``nn.RNNBase.flatten_parameters`` checks; the module's tensors may be fake CPU ones
    standing in for CUDA).

    Example::

        >>> cudnn_flattens(nn.GRU(4, 4)), cudnn_flattens(nn.GRU(4, 4).bfloat16()), cudnn_flattens(nn.Linear(4, 4))
        (True, False, False)
    """
    if not isinstance(module, nn.RNNBase) or not torch.backends.cudnn.enabled:
        return False
    weights = getattr(module, "_flat_weights", None)
    names = getattr(module, "_flat_weights_names", None)
    if not weights or names is None or len(weights) != len(names):
        return False
    if not all(isinstance(w, torch.Tensor) for w in weights):
        return False
    dtype = weights[0].dtype
    if dtype not in _CUDNN_DTYPES or any(w.dtype != dtype for w in weights):
        return False
    try:
        starts = {(id(w.untyped_storage()), w.storage_offset()) for w in weights}
    except (RuntimeError, NotImplementedError, TypeError):
        return False
    return len(starts) == len(weights)  # aliased weights take PyTorch's copying path


def flatten_weights(model: nn.Module) -> dict[int, tuple[int, ...]]:
    """Makes each recurrent layer's weights views of one flat buffer, as ``flatten_parameters``
    leaves them on CUDA (see :func:`cudnn_flattens`); by ``id`` of each layer flattened, the bytes of
    the separate copies the buffer replaced, in the order they were made. Call on the step's own
    (fake) model, before counting.

    Example::

        >>> gru = nn.GRU(4, 8)
        >>> replaced = flatten_weights(gru)[id(gru)]
        >>> len({p.untyped_storage().data_ptr() for p in gru.parameters()}), sum(replaced) == gru.weight_ih_l0.untyped_storage().nbytes()
        (1, True)
    """
    flattened: dict[int, tuple[int, ...]] = {}
    for module in model.modules():
        if id(module) in flattened or not cudnn_flattens(module):
            continue
        weights = list(module._flat_weights)
        replaced = tuple(w.untyped_storage().nbytes() for w in weights)
        flat = weights[0].new_empty((sum(w.numel() for w in weights),))
        offset = 0
        with torch.no_grad():
            for w in weights:
                w.set_(flat.untyped_storage(), offset, w.shape)  # contiguous, as cuDNN's copy lays them
                offset += w.numel()
        flattened[id(module)] = replaced
    return flattened


@dataclass(frozen=True)
class RNNBuffers:
    """Bytes of cuDNN's own buffers for one RNN call, and how far the estimate of them may be off."""

    reserve: int
    workspace: int
    bound: int = 0
    #: of ``bound``, what the reserve may be off by where its layout is not measured (kept for
    #: backward, so the calls' add up; the rest is the workspace's, inside the operator)
    reserve_bound: int = 0


def workspace_bound(
    mode: str, *, seq_len: int, batch: int, hidden: int, input_size: int, layers: int, directions: int, element_size: int
) -> int:
    """How far cuDNN's workspace may be from the rule (:data:`WORKSPACE_SPREAD` near the layers the
    rule was fitted to, :data:`WORKSPACE_ENVELOPE` anywhere measured: the larger of the two).

    Example::

        >>> sizes = dict(seq_len=128, batch=32, hidden=512, input_size=512, layers=2, directions=1, element_size=4)
        >>> workspace_bound("lstm", **sizes) > 4 * 128 * 32 * 512 * 4 + WORKSPACE_SPREAD
        True
    """
    gates = RNN_GATES[mode]
    tokens = seq_len * batch
    projections = _input_projections(gates, tokens, hidden, directions, element_size)
    inputs = directions * tokens * input_size * element_size
    outputs = directions * tokens * hidden * element_size * layers
    weights = directions * gates * hidden * (input_size + hidden + (layers - 1) * (directions + 1) * hidden) * element_size
    envelope = math.ceil(WORKSPACE_ENVELOPE * (projections + inputs + outputs + weights / 2)) + WORKSPACE_ENVELOPE_FLOOR
    return max(projections + WORKSPACE_SPREAD, envelope - _rule_workspace(projections))


def _input_projections(gates: int, tokens: int, hidden: int, directions: int, element_size: int) -> int:
    """One layer's input projections for every step, in bytes: what the workspace rule is built on."""
    return directions * tokens * gates * hidden * element_size


def _rule_workspace(projections: int) -> int:
    """The rule's workspace for input projections of ``projections`` bytes (see the module)."""
    return projections + WORKSPACE_FLOOR


def cudnn_rnn_buffers(
    mode: str, *, seq_len: int, batch: int, hidden: int, proj: int, layers: int, directions: int, element_size: int,
    input_size: int | None = None,
) -> RNNBuffers:  # fmt: skip
    """cuDNN's reserve space and workspace for one training forward, with the rule's error bound (see
    the module); ``input_size`` (default ``hidden``) the layer's input features."""
    gates = RNN_GATES[mode]
    if mode == "lstm":
        per_layer = gates * hidden + hidden + proj  # gate pre-activations, the cell state, the output
    elif mode == "gru":
        per_layer = 2 * gates * hidden + hidden  # the input's and the state's gate halves apart, the output
    else:
        per_layer = gates * hidden + hidden  # not measured: the pre-activation and the output
    tokens = seq_len * batch
    reserve = directions * (layers * per_layer - proj) * tokens * element_size + RESERVE_PAD
    measured = mode == "gru" or (mode == "lstm" and proj == hidden)
    reserve_bound = 0 if measured else math.ceil(UNMEASURED_SHARE * reserve)
    bound = workspace_bound(mode, seq_len=seq_len, batch=batch, hidden=hidden, input_size=hidden if input_size is None else input_size,
                            layers=layers, directions=directions, element_size=element_size)  # fmt: skip
    workspace = _rule_workspace(_input_projections(gates, tokens, hidden, directions, element_size))
    return RNNBuffers(reserve, workspace, bound + reserve_bound, reserve_bound)


def _params_per_cell(params: list[torch.Tensor], layers: int, directions: int) -> int:
    return max(1, len(params) // max(1, layers * directions))


class _CudnnRNN(torch.autograd.Function):
    """What ``_cudnn_rnn`` and its backward allocate, with fake tensors (no values computed), in
    ATen's order (``aten/src/ATen/native/cudnn/RNN.cpp``), which decides how the caching allocator
    places the blocks: where the input is not contiguous in the kernel's time-major layout
    (``batch_first``) each call copies it first (``input.contiguous()``) and frees the copy last."""

    @staticmethod
    def forward(ctx, spec: dict, x: torch.Tensor, *rest: torch.Tensor):  # type: ignore[no-untyped-def, override]
        states = rest[: spec["n_states"]]
        weights = rest[spec["n_states"] :]
        dtype = spec["dtype"]
        weight_buf = x.new_empty((spec["weight_buf"],), dtype=torch.uint8) if spec["weight_buf"] else None
        copy = _time_major_copy(x, spec)
        width = spec["directions"] * spec["proj"]
        if spec["batch_first"]:
            # the kernel writes its output time-major and ATen hands back the transposed view: a
            # consumer that needs it contiguous (a linear head) copies it
            out = x.new_empty((x.shape[1], x.shape[0], width), dtype=dtype).transpose(0, 1)
        else:
            out = x.new_empty((*x.shape[:-1], width), dtype=dtype)
        finals = [s.new_empty(s.shape, dtype=dtype) for s in states]
        workspace = x.new_empty((spec["workspace"],), dtype=torch.uint8)
        reserve = x.new_empty((spec["reserve"],), dtype=torch.uint8)
        del workspace, copy
        saved = [x, *states, out, reserve, *weights]
        if weight_buf is not None:
            saved.append(weight_buf)
        ctx.save_for_backward(*saved)
        ctx.spec = spec
        ctx.n_weights = len(weights)
        return (out, *finals)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):  # type: ignore[no-untyped-def, override]
        spec = ctx.spec
        saved = ctx.saved_tensors
        x = saved[0]
        states = saved[1 : 1 + spec["n_states"]]
        weights = saved[3 + spec["n_states"] : 3 + spec["n_states"] + ctx.n_weights]
        dtype = spec["dtype"]
        # backward data: the input and the output's gradient made contiguous in the kernel's
        # time-major layout (for batch_first ATen transposes both first: copies), the input's and
        # states' gradients, the workspace
        copy = _time_major_copy(x, spec)
        grad_out = grads[0].transpose(0, 1).contiguous() if spec["batch_first"] else grads[0].contiguous()
        grad_x = x.new_empty(x.shape)
        grad_states = [s.new_empty(s.shape) for s in states]
        workspace = x.new_empty((spec["backward_workspace"],), dtype=torch.uint8)
        del workspace, grad_out, copy
        # backward weights: the input's copy again, one flat buffer in the compute dtype, the workspace
        copy = _time_major_copy(x, spec)
        flat = x.new_empty((sum(w.numel() for w in weights),), dtype=dtype)
        workspace = x.new_empty((spec["backward_workspace"],), dtype=torch.uint8)
        del workspace, copy
        grad_weights = []
        offset = 0
        for w in weights:
            view = flat.narrow(0, offset, w.numel()).view(w.shape)
            # under autocast the flat half-precision gradient is cast to each float32 weight
            grad_weights.append(view if w.dtype == dtype else view.to(w.dtype))
            offset += w.numel()
        del flat
        return (None, grad_x, *grad_states, *grad_weights)


def _time_major_copy(x: torch.Tensor, spec: dict) -> torch.Tensor | None:
    """``input.contiguous()`` of a ``batch_first`` input, transposed to time-major: a copy."""
    return x.new_empty(x.shape) if spec["batch_first"] else None


class CudnnRNNRules(TorchFunctionMode):
    """Runs ``nn.LSTM``/``nn.GRU``/``nn.RNN`` as cuDNN would allocate, on fake tensors (see the module).

    Args:
        autocast_device: the device type whose autocast state says whether the
            step runs under autocast (``"cpu"`` where fake CPU tensors stand in for CUDA).
        multiprocessors: the card's streaming multiprocessors and resident threads per
            multiprocessor (``None``: no device here), which size cuDNN's dropout state.
        pending: where the GPU is at hand and ``measure_kernels=True``, the set the calls
            not measured yet go to (:func:`~.kernel_probe.recurrent_key`); ``None``: the rule.
    """

    def __init__(
        self, autocast_device: str, *, multiprocessors: tuple[int, int] | None = None, pending: set[tuple] | None = None,
        exact: bool = False,
    ) -> None:
        super().__init__()
        self.autocast_device = autocast_device
        #: ask cuDNN its sizes for each call (a fake CUDA step on a machine with a GPU)
        self.exact = exact
        self.multiprocessors = multiprocessors
        #: with ``measure_kernels=True``: the calls whose workspace is not measured yet are added
        #: here (their rule stands) for the caller to measure; measured ones take their measurement
        self.pending = pending
        #: cuDNN's dropout state once a layer trained with dropout: ATen keeps it for the process
        self.dropout_state: torch.Tensor | None = None
        #: the dropout state's error bound (kept from the step that made it on)
        self.dropout_bound = 0
        #: the error bound of each operation's workspace in the current step: the largest call's
        #: (the workspaces of calls in a row are never alive together)
        self.bounds: dict[str, int] = {}
        #: the error bound of each operation's reserves where their layout is not measured: summed
        #: over the calls (each call's reserve is kept for backward)
        self.reserve_bounds: dict[str, int] = {}
        self.funcs = {getattr(torch._VF, name): name for name in RNN_GATES}

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = self.funcs.get(func)
        if name is None or kwargs or not args or not _fake(args[0]):
            return func(*args, **(kwargs or {}))
        return self._run(name, args)

    def _run(self, mode: str, args: tuple) -> Any:
        x = args[0]
        packed = isinstance(args[1], torch.Tensor) and args[1].dim() == 1 and args[1].dtype == torch.int64 and x.dim() == 2
        if packed:  # (data, batch_sizes, hx, params, has_biases, layers, dropout, train, bidirectional)
            hx, params, _bias, layers, _drop, train, bidirectional = args[2:9]
            batch_first = False
        else:  # (input, hx, params, has_biases, layers, dropout, train, bidirectional, batch_first)
            hx, params, _bias, layers, _drop, train, bidirectional, batch_first = args[1:9]
        if train and _drop > 0 and self.dropout_state is None:
            self._make_dropout_state(x)
        states = list(hx) if isinstance(hx, (tuple, list)) else [hx]
        params = list(params)
        directions = 2 if bidirectional else 1
        hidden = params[0].shape[0] // RNN_GATES[mode]
        proj = states[0].shape[-1]
        autocast = torch.is_autocast_enabled(self.autocast_device)
        # cuDNN's autocast wrapper casts the input, the states and a flat copy of the weights to half
        dtype = torch.float16 if autocast and x.is_floating_point() else x.dtype
        with torch.autocast(self.autocast_device, enabled=False):
            if dtype != x.dtype:
                x = x.to(dtype)
                states = [s.to(dtype) for s in states]
            if packed:
                seq_len, batch = 1, x.shape[0]
            else:
                seq_len, batch = (x.shape[1], x.shape[0]) if batch_first else (x.shape[0], x.shape[1])
                if x.dim() == 2:
                    seq_len, batch = x.shape[0], 1
            element = torch.empty((), dtype=dtype).element_size()
            buffers = cudnn_rnn_buffers(
                mode, seq_len=seq_len, batch=batch, hidden=hidden, proj=proj, layers=layers, directions=directions,
                element_size=element, input_size=x.shape[-1],
            )  # fmt: skip
            weight_buf = sum(p.numel() for p in params) * element if autocast else 0
            transposed = bool(batch_first) and not packed and x.dim() == 3
            workspace, bound = buffers.workspace, buffers.bound - buffers.reserve_bound
            reserve, reserve_bound = buffers.reserve, buffers.reserve_bound
            # under autocast the rule stands: with cuDNN's answer the step came out 3.4% above the real
            # one on an H100 (2-layer LSTM, GRU and RNN language models under bf16), which asks
            # something the rule's bound covered and this does not tell apart
            asked = None if autocast else self._asked(
                mode, x, hidden=hidden, proj=proj, layers=layers, bidirectional=bool(bidirectional), seq_len=seq_len,
                batch=batch, dtype=dtype, dropout=float(_drop), train=bool(train), batch_sizes=args[1] if packed else None,
            )  # fmt: skip
            if asked is not None:
                # cuDNN's own answer, as ATen asks it before each call: exact, no bound left
                workspace, reserve = asked.forward_workspace, asked.reserve
                bound = reserve_bound = 0
            elif self.pending is not None and not packed:
                key = recurrent_key(mode, seq_len=seq_len, batch=batch, input_size=x.shape[-1], hidden=hidden, proj=proj,
                                    layers=layers, directions=directions, bias=_bias, batch_first=transposed, dtype=dtype,
                                    dropout=_drop, train=train)  # fmt: skip
                measured = measured_or_pending(key, self.pending)
                if measured is not None:
                    # the probe's peak holds the input's transposed copy beside the workspace
                    workspace, bound = max(0, measured - (block_size(x.numel() * element) if transposed else 0)), 0
            spec = {
                "n_states": len(states),
                "dtype": dtype,
                "directions": directions,
                "proj": proj,
                "reserve": reserve if train else 0,
                "workspace": workspace,
                "backward_workspace": workspace if asked is None else asked.backward_workspace,
                "weight_buf": weight_buf,
                "batch_first": transposed,
            }
            outputs = _CudnnRNN.apply(spec, x, *states, *params)
        operation = f"aten._cudnn_rnn ({mode})"
        # the workspaces of calls in a row are never alive together: the largest call's bound stands for all
        if bound:
            self.bounds[operation] = max(self.bounds.get(operation, 0), bound)
        if reserve_bound and train:
            name = f"{operation} reserve"
            self.reserve_bounds[name] = self.reserve_bounds.get(name, 0) + reserve_bound
        return tuple(outputs)

    def _asked(self, mode: str, x: torch.Tensor, *, hidden: int, proj: int, layers: int, bidirectional: bool, seq_len: int,
               batch: int, dtype: torch.dtype, dropout: float, train: bool, batch_sizes: Any) -> Any:  # fmt: skip
        """cuDNN's own sizes for this training call (:func:`~..measure.cudnn_sizes.rnn_temp_sizes`), where
        the estimate's device is a GPU here and ``exact`` is on; ``None``: the rule stands. ``batch_sizes``:
        a packed batch's (a host tensor with values, see :mod:`.lengths`), asked with ATen's packed
        descriptor from the sequences' lengths it gives; ``None``: unpacked."""
        if not self.exact or not train or x.device.type != "cuda":
            return None
        from ..measure.cudnn_sizes import packed_lengths, rnn_temp_sizes

        lengths = None
        if batch_sizes is not None:
            sizes = known_values(batch_sizes)
            if sizes is None:
                return None
            lengths = packed_lengths(sizes)
            seq_len, batch = max(lengths, default=0), len(lengths)
        return rnn_temp_sizes(x.device, mode, input_size=x.shape[-1], hidden=hidden, proj=0 if proj == hidden else proj,
                              layers=layers, bidirectional=bidirectional, seq_len=seq_len, batch=batch, dtype=dtype,
                              dropout=dropout, lengths=lengths)  # fmt: skip

    def _make_dropout_state(self, x: torch.Tensor) -> None:
        """ATen's ``get_dropout_state``: a seed drawn into a scalar on the device and read back
        (freed at once), then the state, kept (before the call's own buffers)."""
        seed = x.new_empty((), dtype=torch.int64)
        del seed
        size, self.dropout_bound = dropout_state_bytes(self.multiprocessors)
        self.dropout_state = x.new_empty((size,), dtype=torch.uint8)

    def transient_bounds(self) -> dict[str, int]:
        """The workspaces' bounds, by operation: inside one operator, never alive with another's."""
        return dict(self.bounds)

    def kept_bounds(self) -> dict[str, int]:
        """The unmeasured reserves' bounds, by operation: kept for backward, summed over the calls."""
        kept = dict(self.reserve_bounds)
        if self.dropout_state is not None and self.dropout_bound:
            kept[DROPOUT_STATE_BOUND] = self.dropout_bound
        return kept


def _fake(value: Any) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(value, FakeTensor)
