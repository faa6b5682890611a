"""cuDNN's own sizes for a recurrent layer's buffers, asked as ATen asks them: exact where a GPU is here.

cuDNN chooses a recurrent layer's workspace by heuristics of its own, which its
documentation calls not monotonic in the sizes; no rule of the sizes holds it (on an
H200, one in three of 458 layer configurations measured fell outside
:func:`pytorch_mem_profiler.estimate.rnn.workspace_bound`, up to 3.1 GB over). But cuDNN answers the question for
any configuration without running it: ``cudnnGetRNNTempSpaceSizes`` returns the
workspace and reserve space that ``cudnnRNNForward`` and the backward calls will
take. ATen asks it before each call and allocates exactly that
(``aten/src/ATen/native/cudnn/RNN.cpp``: ``_cudnn_rnn`` for the forward, the same
question with the backward's algorithm for ``_cudnn_rnn_backward_input`` and
``_cudnn_rnn_backward_weight``).

:func:`rnn_temp_sizes` asks it the same way, through ``ctypes`` on the cuDNN library
torch has loaded: ATen's algorithm choice (``get_algo``: the persistent kernel for
small hidden sizes, the persistent static one for some half-precision layers on some
cards), its descriptor (double bias, linear input, the compute type promoted to float
for half precision, tensor-op math for half precision, FMA math for float without
TF32, padded unpacked sequence-major input). The answer was the device's allocation
on 458 configurations measured on an H200 (torch 2.11, cuDNN 9): the reserve to the
byte on all 458, the forward's workspace within the allocator's rounding on the 447
whose measured peak holds nothing else (the other 11 run under autocast, whose cast
weights sit beside it) (each layer run once, its forward's peak above what it leaves,
the uint8 tensor it saves;
``tests/test_rnn_cudnn_sizes_cuda.py`` checks eight more, with dropout, double precision,
projections and ``batch_first``). Asking takes no device memory from torch's
allocator: cuDNN's handle is made once per process (cuDNN keeps a little of its own
device memory for it, outside the caching allocator).

A packed batch (``pack_padded_sequence``) is asked with ATen's descriptor for one: the
standard algorithm, padded input and output off, each sequence's length (``lengths=``, from
``batch_sizes`` by :func:`packed_lengths`). On an H200 the answer was the layer's reserve to the
byte and its forward workspace within the allocator's rounding on 60 drawn layers
(``benchmarks/rnn_rules.py --packed 60``); asked with padded input and output on, as for an
unpacked batch, the workspace came out up to 2.4x the real one.

Where it cannot be asked (no GPU here, a dtype cuDNN's RNN does not take, a cuDNN
the call fails on), :func:`rnn_temp_sizes` returns ``None``.
``benchmarks/rnn_rules.py --grid N`` checks the estimate's rule
(:mod:`pytorch_mem_profiler.estimate.rnn`) against it; an estimate on fake CUDA tensors
takes its answer for every training call outside autocast (docs/estimate.md, "Recurrent
layers").

Example::

    >>> import torch
    >>> sizes = rnn_temp_sizes(torch.device("cpu"), "lstm", input_size=256, hidden=512, proj=0, layers=2,
    ...                        bidirectional=False, seq_len=128, batch=32, dtype=torch.float32, dropout=0.0)
    >>> sizes is None  # only a CUDA device is asked
    True
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
from typing import NamedTuple

import torch

__all__ = ["RNNTempSizes", "packed_lengths", "rnn_algorithm", "rnn_temp_sizes"]

# cudnn_adv.h / cudnn_graph.h (cuDNN 8.x and 9.x)
_ALGO_STANDARD, _ALGO_PERSIST_STATIC, _ALGO_PERSIST_STATIC_SMALL_H = 0, 1, 3
_MODES = {"rnn_relu": 0, "rnn_tanh": 1, "lstm": 2, "gru": 3}
_DOUBLE_BIAS = 2
_UNIDIRECTIONAL, _BIDIRECTIONAL = 0, 1
_LINEAR_INPUT = 0
_DATA_TYPES = {torch.float32: 0, torch.float64: 1, torch.float16: 2}
_DEFAULT_MATH, _TENSOR_OP_MATH, _FMA_MATH = 0, 1, 3
_PADDED_IO_DISABLED, _PADDED_IO_ENABLED = 0, 1
_SEQ_MAJOR_UNPACKED, _SEQ_MAJOR_PACKED = 0, 1
_FWD_MODE_TRAINING = 1


class RNNTempSizes(NamedTuple):
    """Bytes cuDNN takes for one training call of a recurrent layer."""

    forward_workspace: int
    backward_workspace: int
    reserve: int


def rnn_algorithm(
    mode: str, *, hidden: int, proj: int, layers: int, bidirectional: bool, seq_len: int, batch: int, input_size: int,
    half: bool, double: bool, forward: bool, device_properties: tuple[int, int, int],
) -> int:  # fmt: skip
    """ATen's ``get_algo`` for an unpacked input: cuDNN's RNN algorithm enum value.

    ``device_properties``: (major, minor, multiprocessors) of the card.

    Example::

        >>> H100 = (9, 0, 132)
        >>> kw = dict(proj=0, layers=2, bidirectional=False, seq_len=128, batch=32, input_size=256, half=False, double=False)
        >>> rnn_algorithm("lstm", hidden=128, forward=True, device_properties=H100, **kw)  # persistent, small hidden size
        3
        >>> rnn_algorithm("lstm", hidden=160, forward=False, device_properties=H100, **kw)  # its backward: standard
        0
    """
    major, minor, multiprocessors = device_properties
    if proj:
        return _ALGO_STANDARD  # LSTM projections run the standard algorithm only
    if not double and major >= 6:
        recurrent = mode in ("rnn_tanh", "rnn_relu")
        small = (hidden <= 384 if recurrent else hidden <= 192) if forward else (hidden <= 256 if recurrent else hidden <= 128)
        if small:
            return _ALGO_PERSIST_STATIC_SMALL_H
    if half:
        common = layers == 1 and hidden <= 1024 and not bidirectional and hidden % 128 == 0 and input_size % 128 == 0
        on_device = False
        if major == 7:
            on_device = minor != 5 and (
                ((batch % 16 == 0 and batch not in (80, 112)) or batch == 8)
                and ((seq_len >= 40 and batch <= 128) or (seq_len >= 20 and batch <= 96) or (seq_len >= 10 and batch <= 32))
            )
        elif major >= 8 and multiprocessors >= 98 and minor != 6:
            if mode == "lstm":
                on_device = batch % 8 == 0 and batch <= 128
            elif mode != "gru":
                on_device = batch % 8 == 0 and batch <= 128 and (batch < 96 or hidden < 896)
        if common and on_device:
            return _ALGO_PERSIST_STATIC
    return _ALGO_STANDARD


@functools.lru_cache(maxsize=None)
def _library() -> ctypes.CDLL | None:
    """The cuDNN library torch loaded (its main one, which exports the whole API), or ``None``."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        if not torch.backends.cudnn.is_available() or torch.backends.cudnn.version() is None:
            return None
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libcudnn.so" in line}
        names = sorted(p for p in paths if os.path.basename(p).startswith("libcudnn.so"))
        return ctypes.CDLL(names[0]) if names else None
    except Exception:  # noqa: BLE001 - no library to ask: the rule stands
        return None


@functools.lru_cache(maxsize=None)
def _handle(index: int) -> tuple[ctypes.CDLL, ctypes.c_void_p] | None:
    """A cuDNN handle on CUDA device ``index``, made once."""
    lib = _library()
    if lib is None:
        return None
    try:
        handle = ctypes.c_void_p()
        with torch.cuda.device(index):
            if lib.cudnnCreate(ctypes.byref(handle)) != 0:
                return None
        return lib, handle
    except Exception:  # noqa: BLE001
        return None


#: host memory standing in for cuDNN's dropout states, never read (see :func:`_dropout`)
_STATES_STAND_IN: list[ctypes.Array] = []


@functools.lru_cache(maxsize=None)
def _dropout(index: int, probability: float) -> ctypes.c_void_p | None:
    """A dropout descriptor of ``probability``, made once. Between layers in training, dropout
    changes the sizes (its masks), so the descriptor says it; its random states are never read by
    the size queries, and ``cudnnRestoreDropoutDescriptor`` sets a descriptor without initialising
    them (no kernel runs), so host memory of their size stands in: no device memory is taken."""
    made = _handle(index)
    if made is None:
        return None
    lib, handle = made
    descriptor = ctypes.c_void_p()
    if lib.cudnnCreateDropoutDescriptor(ctypes.byref(descriptor)) != 0:
        return None
    p = ctypes.c_float(probability)
    if probability == 0.0:
        status = lib.cudnnSetDropoutDescriptor(descriptor, handle, p, None, ctypes.c_size_t(0), ctypes.c_ulonglong(0))
        return descriptor if status == 0 else None
    size = ctypes.c_size_t()
    if lib.cudnnDropoutGetStatesSize(handle, ctypes.byref(size)) != 0:
        return None
    states = (ctypes.c_uint8 * max(1, size.value))()
    _STATES_STAND_IN.append(states)  # kept as long as the descriptor
    status = lib.cudnnRestoreDropoutDescriptor(descriptor, handle, p, ctypes.cast(states, ctypes.c_void_p), size, ctypes.c_ulonglong(0))
    return descriptor if status == 0 else None


def _ask(
    lib: ctypes.CDLL, handle: ctypes.c_void_p, dropout: ctypes.c_void_p, mode: str, *, algorithm: int, data_type: int,
    math_type: int, input_size: int, hidden: int, proj: int, layers: int, bidirectional: bool, seq_len: int, batch: int,
    lengths: tuple[int, ...] | None = None,
) -> tuple[int, int] | None:  # fmt: skip
    rnn, data = ctypes.c_void_p(), ctypes.c_void_p()
    if lib.cudnnCreateRNNDescriptor(ctypes.byref(rnn)) != 0:
        return None
    try:
        if lib.cudnnCreateRNNDataDescriptor(ctypes.byref(data)) != 0:
            return None
        compute = 0 if data_type == _DATA_TYPES[torch.float16] else data_type  # ATen's promote_rnn_math_type
        status = lib.cudnnSetRNNDescriptor_v8(
            rnn, algorithm, _MODES[mode], _DOUBLE_BIAS, _BIDIRECTIONAL if bidirectional else _UNIDIRECTIONAL, _LINEAR_INPUT,
            # ATen's RNN descriptor: padded input and output for an unpacked batch only
            data_type, compute, math_type, input_size, hidden, proj or hidden, layers, dropout,
            _PADDED_IO_ENABLED if lengths is None else _PADDED_IO_DISABLED,
        )  # fmt: skip
        if status != 0:
            return None
        # a packed batch (ATen's descriptor for one): each sequence's length, longest first
        layout = _SEQ_MAJOR_UNPACKED if lengths is None else _SEQ_MAJOR_PACKED
        each = (ctypes.c_int * batch)(*([seq_len] * batch if lengths is None else lengths))
        fill = ctypes.c_double(0.0) if data_type == _DATA_TYPES[torch.float64] else ctypes.c_float(0.0)
        if lib.cudnnSetRNNDataDescriptor(data, data_type, layout, seq_len, batch, input_size, each, ctypes.byref(fill)) != 0:
            return None
        workspace, reserve = ctypes.c_size_t(), ctypes.c_size_t()
        if lib.cudnnGetRNNTempSpaceSizes(handle, rnn, _FWD_MODE_TRAINING, data, ctypes.byref(workspace), ctypes.byref(reserve)) != 0:
            return None
        return int(workspace.value), int(reserve.value)
    finally:
        if data.value:
            lib.cudnnDestroyRNNDataDescriptor(data)
        lib.cudnnDestroyRNNDescriptor(rnn)


def packed_lengths(batch_sizes: list[int]) -> tuple[int, ...]:
    """A packed batch's sequence lengths, longest first, from its ``batch_sizes`` (how many
    sequences still run at each step): what ATen hands cuDNN's packed data descriptor.

    Example::

        >>> packed_lengths([3, 2, 2, 1])  # ABCD, EFG, HI
        (4, 3, 1)
    """
    return tuple(sum(1 for n in batch_sizes if n > i) for i in range(batch_sizes[0] if batch_sizes else 0))


@functools.lru_cache(maxsize=4096)
def _temp_sizes(
    index: int, mode: str, input_size: int, hidden: int, proj: int, layers: int, bidirectional: bool, seq_len: int,
    batch: int, dtype: torch.dtype, tf32: bool, probability: float, lengths: tuple[int, ...] | None = None,
) -> RNNTempSizes | None:  # fmt: skip
    made, dropout = _handle(index), _dropout(index, probability)
    if made is None or dropout is None:
        return None
    lib, handle = made
    properties = torch.cuda.get_device_properties(index)
    card = (properties.major, properties.minor, properties.multi_processor_count)
    data_type = _DATA_TYPES[dtype]
    half, double = dtype == torch.float16, dtype == torch.float64
    math_type = _TENSOR_OP_MATH if half else (_FMA_MATH if dtype == torch.float32 and not tf32 else _DEFAULT_MATH)
    shape = dict(input_size=input_size, hidden=hidden, proj=proj, layers=layers, bidirectional=bidirectional, seq_len=seq_len, batch=batch)
    answers = []
    for forward in (True, False):
        # ATen's get_algo: a packed input runs the standard algorithm (the persistent ones refuse
        # lengths that vary across the batch)
        algorithm = _ALGO_STANDARD if lengths is not None else rnn_algorithm(
            mode, **shape, half=half, double=double, forward=forward, device_properties=card
        )  # fmt: skip
        answer = _ask(lib, handle, dropout, mode, algorithm=algorithm, data_type=data_type, math_type=math_type, **shape,
                      lengths=lengths)  # fmt: skip
        if answer is None:
            return None
        answers.append(answer)
    (forward_workspace, reserve), (backward_workspace, _) = answers
    return RNNTempSizes(forward_workspace, backward_workspace, reserve)


def rnn_temp_sizes(
    device: torch.device, mode: str, *, input_size: int, hidden: int, proj: int, layers: int, bidirectional: bool,
    seq_len: int, batch: int, dtype: torch.dtype, dropout: float, lengths: tuple[int, ...] | None = None,
) -> RNNTempSizes | None:  # fmt: skip
    """What cuDNN takes for one training call of this layer on ``device`` (see the module), or
    ``None`` where it cannot be asked: not a CUDA device here, a dtype cuDNN's RNN does not take, a
    failing call. ``proj``: LSTM's ``proj_size`` (0: none); ``dropout``: between layers, in training;
    ``lengths``: a packed batch's sequence lengths, longest first (``batch`` of them, the longest
    ``seq_len``), as :func:`packed_lengths` reads them from ``batch_sizes``; ``None``: unpacked."""
    if device.type != "cuda" or dtype not in _DATA_TYPES or mode not in _MODES or batch < 1 or seq_len < 1:
        return None
    if lengths is not None and (len(lengths) != batch or max(lengths) != seq_len):
        return None
    try:
        if not torch.cuda.is_available():
            return None
        index = device.index if device.index is not None else torch.cuda.current_device()
        return _temp_sizes(index, mode, int(input_size), int(hidden), int(proj), int(layers), bool(bidirectional), int(seq_len),
                           int(batch), dtype, bool(torch.backends.cudnn.allow_tf32), float(dropout),
                           None if lengths is None else tuple(int(n) for n in lengths))  # fmt: skip
    except Exception:  # noqa: BLE001 - cuDNN could not be asked: the rule stands
        return None
