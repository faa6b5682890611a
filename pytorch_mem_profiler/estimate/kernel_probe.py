"""Convolutions and cuDNN's recurrent layers run once for real on this machine's GPU, for their
scratch: what the rules can only bound.

Which plan cuDNN's heuristics pick, and its workspace, is cuDNN's own choice (see
:mod:`.conv_workspace`): the rule states a bound around it. Where the estimate
runs on fake CUDA tensors with the GPU at hand, ``estimate_memory(...,
measure_kernels=True)`` measures instead: each distinct convolution call of the
step (shapes, strides, dtype, geometry, output mask, cuDNN flags) runs once on the
GPU, in a separate process (:mod:`pytorch_mem_profiler.measure.kernel_scratch`,
so that this process's allocator, its cache and its peak statistics are left as
they were), as ``benchmarks/op_scratch.py`` measures:
a first call, then ``scratch = peak inside the operator - max(allocated before,
allocated after)``. A call whose tensors would take more than an eighth of the GPU's
free memory is not run (the rule and its bound stand). Results are kept for the
process's life, by call.

cuDNN's recurrent layers (``nn.LSTM``, ``nn.GRU``, ``nn.RNN``) likewise: their
workspace is what cuDNN's heuristics ask for (:mod:`.rnn` bounds it). With
``measure_kernels=True`` each distinct layer call (:func:`recurrent_key`: kind,
sizes, layers, directions, compute dtype, layout) runs in the same child, as a
layer of that configuration does in training, and its workspace is the forward's
peak above what the forward leaves (its output, final states, reserve space):
the size each of its three cuDNN calls takes (forward, backward data, backward
weights), as the rule has it.

Example::

    >>> import torch
    >>> with torch.device("meta"):
    ...     x, w = torch.empty(2, 8, 16, 16), torch.empty(4, 8, 3, 3)
    >>> key = convolution_key(torch.ops.aten.convolution.default, (x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1), {})
    >>> key[0], key[1][0]
    ('forward', ((2, 8, 16, 16), (2048, 256, 16, 1), 0))
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any, Iterable

import torch

__all__ = ["MEASURED", "convolution_key", "measure_convolutions", "measured_or_pending", "recurrent_key"]

#: Scratch measured by call key (bytes; ``None``: not measured, too large for the free memory).
MEASURED: dict[tuple, int | None] = {}
#: Seconds a probe process may take before the rules stand in for what it did not measure.
PROBE_TIMEOUT = 300


def _spec(t: Any) -> tuple | None:
    if not isinstance(t, torch.Tensor):
        return None
    return (tuple(t.shape), tuple(t.stride()), int(t.storage_offset()))


def _ints(values: Any) -> tuple[int, ...]:
    return tuple(int(v) for v in values) if values is not None else ()


def convolution_key(func: Any, args: tuple, kwargs: dict) -> tuple:
    """A hashable, JSON-able description of one convolution call: what the probe runs."""
    aten = torch.ops.aten
    flags = (bool(torch.backends.cudnn.benchmark), bool(torch.backends.cudnn.deterministic), bool(torch.backends.cudnn.allow_tf32))
    if func is aten.convolution.default:
        names = ("input", "weight", "bias", "stride", "padding", "dilation", "transposed", "output_padding", "groups")
        a = {**dict(zip(names, args)), **kwargs}
        return ("forward", (_spec(a["input"]), _spec(a["weight"]), _spec(a["bias"])), str(a["input"].dtype).removeprefix("torch."),
                (_ints(a["stride"]), _ints(a["padding"]), _ints(a["dilation"]), bool(a["transposed"]), _ints(a["output_padding"]),
                 int(a["groups"])), (), flags)  # fmt: skip
    names = ("grad_output", "input", "weight", "bias_sizes", "stride", "padding", "dilation", "transposed", "output_padding",
             "groups", "output_mask")  # fmt: skip
    a = {**dict(zip(names, args)), **kwargs}
    return ("backward", (_spec(a["grad_output"]), _spec(a["input"]), _spec(a["weight"]), _ints(a["bias_sizes"])),
            str(a["input"].dtype).removeprefix("torch."),
            (_ints(a["stride"]), _ints(a["padding"]), _ints(a["dilation"]), bool(a["transposed"]), _ints(a["output_padding"]),
             int(a["groups"])), tuple(bool(m) for m in a["output_mask"]), flags)  # fmt: skip


def measured_or_pending(key: tuple, pending: set[tuple]) -> int | None:
    """The scratch measured for ``key`` (bytes); ``None`` where there is none, and ``key`` added
    to ``pending`` where it was not measured yet (not where it was tried and could not run).

    Example::

        >>> pending = set()
        >>> measured_or_pending(("example",), pending), pending
        (None, {('example',)})
    """
    value = MEASURED.get(key)
    if value is None and key not in MEASURED:
        pending.add(key)
    return value


def recurrent_key(
    mode: str, *, seq_len: int, batch: int, input_size: int, hidden: int, proj: int, layers: int, directions: int,
    bias: bool, batch_first: bool, dtype: torch.dtype, dropout: float, train: bool,
) -> tuple:
    """A hashable, JSON-able description of one cuDNN recurrent layer call (``mode``: ``"lstm"``,
    ``"gru"``, ``"rnn_tanh"`` or ``"rnn_relu"``; ``dtype``: the dtype cuDNN computes in): what the
    probe runs.

    Example::

        >>> recurrent_key("gru", seq_len=128, batch=97, input_size=512, hidden=512, proj=512, layers=2,
        ...               directions=1, bias=True, batch_first=True, dtype=torch.float32, dropout=0.0, train=True)[:4]
        ('recurrent', 'gru', (128, 97, 512), (512, 512, 2, 1))
    """
    flags = (bool(torch.backends.cudnn.benchmark), bool(torch.backends.cudnn.deterministic), bool(torch.backends.cudnn.allow_tf32))
    return ("recurrent", mode, (int(seq_len), int(batch), int(input_size)), (int(hidden), int(proj), int(layers), int(directions)),
            (bool(bias), bool(batch_first), bool(dropout > 0), bool(train)), str(dtype).removeprefix("torch."), flags)  # fmt: skip


def measure_convolutions(keys: Iterable[tuple], device: torch.device) -> dict[tuple, int | None]:
    """Measure each key's scratch on ``device`` in a child process; records them in :data:`MEASURED` and returns them.

    The keys are :func:`convolution_key`'s and :func:`recurrent_key`'s, in any mix.

    A child that fails or runs past :data:`PROBE_TIMEOUT` measures nothing (the rules stand).
    """
    wanted = [k for k in dict.fromkeys(keys) if k not in MEASURED]
    if not wanted:
        return {}
    request = json.dumps({"device": device.index or 0, "calls": wanted})
    env = dict(os.environ)
    # the child imports this package from where this process did
    package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    try:
        done = subprocess.run([sys.executable, "-m", "pytorch_mem_profiler.measure.kernel_scratch"], input=request,
                              capture_output=True, text=True, timeout=PROBE_TIMEOUT, env=env, check=False)  # fmt: skip
        answers = json.loads(done.stdout.strip().splitlines()[-1]) if done.returncode == 0 and done.stdout.strip() else None
    except (subprocess.TimeoutExpired, OSError, ValueError, IndexError):
        answers = None
    if not isinstance(answers, list) or len(answers) != len(wanted):
        return {}
    found = {}
    for key, value in zip(wanted, answers):
        found[key] = MEASURED[key] = value if isinstance(value, int) else None
    return found
