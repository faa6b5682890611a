"""Run convolutions and cuDNN recurrent layers on this machine's GPU and measure the scratch each
takes: the estimate's probe.

Run as ``python -m pytorch_mem_profiler.measure.kernel_scratch`` by
:mod:`pytorch_mem_profiler.estimate.kernel_probe`, in a process of its own so that
the caller's allocator, cache and peak statistics are left as they were: reads
``{"device": index, "calls": [key, ...]}`` (JSON, keys as
:func:`~pytorch_mem_profiler.estimate.kernel_probe.convolution_key` makes them) on
stdin, runs each call on real tensors of the same shapes, strides and storage
offsets (a first call chooses and caches cuDNN's plan), and prints the list of
scratch figures, ``peak inside the operator - max(allocated before, allocated
after)`` in bytes, ``null`` for a call not run (too large for an eighth of the free
memory, or failing). A recurrent layer's key
(:func:`~pytorch_mem_profiler.estimate.kernel_probe.recurrent_key`) is run as a layer of
that configuration trains (:func:`run_recurrent`).

Example::

    >>> storage_bytes([[2, 3], [3, 1], 0], 4)
    24
"""

from __future__ import annotations

import json
import sys
from typing import Any

import torch

__all__ = ["run_convolution", "run_recurrent", "storage_bytes"]


def storage_bytes(spec: list | None, element: int) -> int:
    """Bytes of the storage a ``[shape, strides, offset]`` view needs."""
    if spec is None:
        return 0
    shape, stride, offset = spec
    return (1 + offset + sum((s - 1) * st for s, st in zip(shape, stride) if s > 0)) * element


def _make(spec: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    shape, stride, offset = spec
    base = torch.randn(max(storage_bytes(spec, 1), 1), dtype=dtype, device=device)
    return base.as_strided(shape, stride, offset)


def run_convolution(key: list, device: torch.device) -> int | None:
    """The scratch of one convolution call (a key as JSON gives it back), or ``None`` if not run."""
    kind, tensors, dtype_name, geometry, mask, flags = key
    dtype = getattr(torch, dtype_name)
    element = torch.empty((), dtype=dtype).element_size()
    stride, padding, dilation, transposed, output_padding, groups = geometry
    torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic, torch.backends.cudnn.allow_tf32 = flags
    views = [t for t in tensors[:3] if isinstance(t, list) and t and isinstance(t[0], list)]
    # the tensors, their gradients or outputs, and a workspace of transforms: a few times them
    if 8 * sum(storage_bytes(t, element) for t in views) > torch.cuda.mem_get_info(device)[0]:
        return None
    aten = torch.ops.aten
    if kind == "forward":
        x, w = _make(tensors[0], dtype, device), _make(tensors[1], dtype, device)
        b = _make(tensors[2], dtype, device) if tensors[2] is not None else None

        def call() -> Any:
            return aten.convolution.default(x, w, b, stride, padding, dilation, transposed, output_padding, groups)
    else:
        go, x, w = (_make(t, dtype, device) for t in tensors[:3])
        bias_sizes = list(tensors[3]) or None

        def call() -> Any:
            return aten.convolution_backward.default(go, x, w, bias_sizes, stride, padding, dilation, transposed,
                                                     output_padding, groups, list(mask))  # fmt: skip

    call()  # the plan is chosen (and cached) on the first call
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    out = call()
    torch.cuda.synchronize(device)
    after = torch.cuda.memory_allocated(device)
    del out
    return max(0, torch.cuda.max_memory_allocated(device) - max(before, after))


def run_recurrent(key: list, device: torch.device) -> int | None:
    """cuDNN's workspace for one recurrent layer call (a key as JSON gives it back): the training
    forward's peak above what it leaves allocated (output, final states, reserve space), after a
    first forward and backward (cuDNN's plan, the dropout state); ``None`` if not run."""
    _, mode, (seq_len, batch, input_size), (hidden, proj, layers, directions), layout, dtype_name, flags = key
    bias, batch_first, dropout, train = layout
    dtype = getattr(torch, dtype_name)
    torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic, torch.backends.cudnn.allow_tf32 = flags
    kinds = {"lstm": torch.nn.LSTM, "gru": torch.nn.GRU, "rnn_tanh": torch.nn.RNN, "rnn_relu": torch.nn.RNN}
    kwargs: dict[str, Any] = {"num_layers": layers, "bias": bias, "batch_first": batch_first,
                              "bidirectional": directions == 2, "dropout": 0.5 if dropout and layers > 1 else 0.0}  # fmt: skip
    if mode.startswith("rnn_"):
        kwargs["nonlinearity"] = mode.removeprefix("rnn_")
    if mode == "lstm" and proj != hidden:
        kwargs["proj_size"] = proj
    element = torch.empty((), dtype=dtype).element_size()
    tokens = seq_len * batch
    # the input, output and reserve (every layer's gates per step): a few times them must fit
    rough = element * tokens * (input_size + 8 * layers * directions * hidden)
    if 4 * rough > torch.cuda.mem_get_info(device)[0]:
        return None
    layer = kinds[mode](input_size, hidden, **kwargs).to(device=device, dtype=dtype).train(train)
    shape = (batch, seq_len, input_size) if batch_first else (seq_len, batch, input_size)
    x = torch.randn(shape, device=device, dtype=dtype)
    layer(x)[0].sum().backward()  # cuDNN's plan, the dropout state: made once, as in a run
    layer.zero_grad(set_to_none=True)
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    with torch.set_grad_enabled(train):
        out = layer(x)
    torch.cuda.synchronize(device)
    after = torch.cuda.memory_allocated(device)
    peak = torch.cuda.max_memory_allocated(device)
    del out
    return max(0, peak - max(before, after))


def _main() -> None:
    request = json.loads(sys.stdin.read())
    device = torch.device("cuda", request["device"])
    torch.cuda.set_device(device)
    answers: list[int | None] = []
    for key in request["calls"]:
        try:
            run = run_recurrent if key and key[0] == "recurrent" else run_convolution
            answers.append(run(key, device))
        except Exception:  # noqa: BLE001 - one call that cannot run leaves its rule in place
            answers.append(None)
        torch.cuda.empty_cache()
    print(json.dumps(answers))


if __name__ == "__main__":
    _main()
