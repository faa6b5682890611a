"""The order CUDA kernels allocate their outputs in, where it is not the order they return them.

A fake kernel makes an operator's outputs in the order it returns them, and the
estimate hands them to the allocator's replay in that order. Where a CUDA kernel
allocates them otherwise, the replay places them otherwise: which free block each
one takes, and so which segments the cache makes and what it reserves. The peak of
allocated bytes does not move (both outputs are made before anything is freed).

- ``native_dropout``: CUDA's fused kernel (``dropout_cuda``) makes the ``bool``
  mask first, then the output; it returns ``(output, mask)``. On an H100 (torch
  2.11) the allocator's history of ``nn.MultiheadAttention`` with dropout shows
  the mask's 67,108,864 bytes requested before the weights' 268,435,456; in the
  order the fake kernel returns them the replay took another block for the output,
  and went on from there with other segments.

Example::

    >>> import torch
    >>> allocation_order(torch.ops.aten.native_dropout.default, 2), allocation_order(torch.ops.aten.mm.default, 1)
    ((1, 0), (0,))
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["CUDA_OUTPUT_ORDER", "allocation_order"]

#: operator -> the indices of its outputs in the order CUDA's kernel allocates them
CUDA_OUTPUT_ORDER: dict[Any, tuple[int, ...]] = {
    torch.ops.aten.native_dropout.default: (1, 0),
}


def allocation_order(func: Any, outputs: int) -> tuple[int, ...]:
    """The indices of ``func``'s ``outputs`` outputs in the order CUDA allocates them."""
    order = CUDA_OUTPUT_ORDER.get(func)
    if order is None or len(order) != outputs:
        return tuple(range(outputs))
    return order
