"""The order CUDA kernels allocate their outputs in, where it is not the order they return them, and
the outputs they make in host memory.

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
- ``_scaled_dot_product_efficient_attention`` (and ``_efficient_attention_forward``,
  which it calls): CUDA's kernel allocates the output and the log-sum-exp on the
  device; its dropout seed and offset are host scalars (``at::scalar_tensor`` or
  ``at::empty({})`` without a device, outside a CUDA graph's capture), which the
  fake kernel puts on the device. They are not in the order, so the counter does
  not count them: on an H200 (torch 2.11) the frozen encoder's allocator history
  had none of the two 512-byte blocks per call the estimate had asked for, two of
  them kept for backward per trained layer.

Example::

    >>> import torch
    >>> allocation_order(torch.ops.aten.native_dropout.default, 2), allocation_order(torch.ops.aten.mm.default, 1)
    ((1, 0), (0,))
    >>> allocation_order(torch.ops.aten._scaled_dot_product_efficient_attention.default, 4)   # seed, offset: host
    (0, 1)
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["CUDA_OUTPUT_ORDER", "allocation_order"]

#: operator -> the indices of the outputs CUDA's kernel allocates on the device, in the order it
#: allocates them (an output not listed is made in host memory)
CUDA_OUTPUT_ORDER: dict[Any, tuple[int, ...]] = {
    torch.ops.aten.native_dropout.default: (1, 0),
    torch.ops.aten._scaled_dot_product_efficient_attention.default: (0, 1),
}
_efficient_forward = getattr(torch.ops.aten, "_efficient_attention_forward", None)
if _efficient_forward is not None:
    CUDA_OUTPUT_ORDER[_efficient_forward.default] = (0, 1)


def allocation_order(func: Any, outputs: int) -> tuple[int, ...]:
    """The indices of ``func``'s outputs (of ``outputs`` returned) that CUDA allocates on the device,
    in the order it allocates them: all of them in the order returned where no rule says otherwise."""
    order = CUDA_OUTPUT_ORDER.get(func)
    if order is None or max(order) >= outputs:
        return tuple(range(outputs))
    return order
