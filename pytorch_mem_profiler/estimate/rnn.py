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

The sizes (:func:`cudnn_rnn_buffers`) follow cuDNN's documented layout, **not yet
measured on a GPU**: a reserve of ``layers * directions * T * B * (gates + 2) * H``
elements (each layer's gate pre-activations, cell state and output per time
step; ``gates`` = 4 for an LSTM, 3 for a GRU, 1 for a plain RNN), a workspace of
one layer's input projections for every time step, ``directions * T * B * gates * H``
elements. ``benchmarks/rnn_rules.py`` measures the real figures on a GPU; until
then each such call carries an error bound (:data:`UNMEASURED_SHARE` of its
reserve and workspace) that the estimate reports beside its peak.

Example::

    >>> buffers = cudnn_rnn_buffers("lstm", seq_len=100, batch=32, hidden=256, proj=256, layers=2, directions=1, element_size=4)
    >>> buffers.reserve == 2 * 100 * 32 * 6 * 256 * 4, buffers.workspace == 100 * 32 * 4 * 256 * 4
    (True, True)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["RNN_GATES", "UNMEASURED_SHARE", "RNNBuffers", "cudnn_rnn_buffers", "CudnnRNNRules"]

#: Gates per cell, by ``torch._VF`` function.
RNN_GATES = {"lstm": 4, "gru": 3, "rnn_tanh": 1, "rnn_relu": 1}
#: The share of a call's reserve and workspace taken as its error bound while the rule is unmeasured.
UNMEASURED_SHARE = 0.5


@dataclass(frozen=True)
class RNNBuffers:
    """Bytes of cuDNN's own buffers for one RNN call."""

    reserve: int
    workspace: int


def cudnn_rnn_buffers(
    mode: str, *, seq_len: int, batch: int, hidden: int, proj: int, layers: int, directions: int, element_size: int
) -> RNNBuffers:
    """cuDNN's reserve space and workspace for one training forward (the unmeasured rule; see the module)."""
    gates = RNN_GATES[mode]
    per_step = gates * hidden + hidden + proj  # gate pre-activations, the cell state, the output
    reserve = layers * directions * seq_len * batch * per_step * element_size
    workspace = directions * seq_len * batch * gates * hidden * element_size
    return RNNBuffers(reserve, workspace)


def _params_per_cell(params: list[torch.Tensor], layers: int, directions: int) -> int:
    return max(1, len(params) // max(1, layers * directions))


class _CudnnRNN(torch.autograd.Function):
    """What ``_cudnn_rnn`` and its backward allocate, with fake tensors (no values computed)."""

    @staticmethod
    def forward(ctx, spec: dict, x: torch.Tensor, *rest: torch.Tensor):  # type: ignore[no-untyped-def, override]
        states = rest[: spec["n_states"]]
        weights = rest[spec["n_states"] :]
        dtype = spec["dtype"]
        steps_batch = tuple(x.shape[:-1])
        out = x.new_empty((*steps_batch, spec["directions"] * spec["proj"]), dtype=dtype)
        finals = [s.new_empty(s.shape, dtype=dtype) for s in states]
        reserve = x.new_empty((spec["reserve"],), dtype=torch.uint8)
        weight_buf = x.new_empty((spec["weight_buf"],), dtype=torch.uint8) if spec["weight_buf"] else None
        workspace = x.new_empty((spec["workspace"],), dtype=torch.uint8)
        del workspace  # taken and given back inside the kernel
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
        workspace = x.new_empty((spec["workspace"],), dtype=torch.uint8)
        grad_x = x.new_empty(x.shape)
        grad_states = [s.new_empty(s.shape) for s in states]
        del workspace
        grad_weights = [w.new_empty(w.shape) for w in weights]
        return (None, grad_x, *grad_states, *grad_weights)


class CudnnRNNRules(TorchFunctionMode):
    """Runs ``nn.LSTM``/``nn.GRU``/``nn.RNN`` as cuDNN would allocate, on fake tensors (see the module).

    Args:
        autocast_device: the device type whose autocast state says whether the
            step runs under autocast (``"cpu"`` where fake CPU tensors stand in for CUDA).
    """

    def __init__(self, autocast_device: str) -> None:
        super().__init__()
        self.autocast_device = autocast_device
        #: the error bound of each operation in the current step: bytes, summed over its calls
        self.bounds: dict[str, int] = {}
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
                element_size=element,
            )  # fmt: skip
            weight_buf = sum(p.numel() for p in params) * element if autocast else 0
            spec = {
                "n_states": len(states),
                "dtype": dtype,
                "directions": directions,
                "proj": proj,
                "reserve": buffers.reserve if train else 0,
                "workspace": buffers.workspace,
                "weight_buf": weight_buf,
            }
            outputs = _CudnnRNN.apply(spec, x, *states, *params)
        operation = f"aten._cudnn_rnn ({mode})"
        self.bounds[operation] = self.bounds.get(operation, 0) + math.ceil(UNMEASURED_SHARE * (spec["reserve"] + spec["workspace"]))
        return tuple(outputs)  # (output, h_n) or, for an LSTM, (output, h_n, c_n), as torch._VF's


def _fake(value: Any) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(value, FakeTensor)
