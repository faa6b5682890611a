"""Module conversions in the fake step, as they run on real tensors.

``nn.Module._apply`` (``module.to(dtype)``, ``.float()``, ``.half()``) sets a real parameter's
``.data`` to the converted tensor, but swaps a fake one in place with ``torch.utils.swap_tensors``
(``isinstance(param, FakeTensor)``), which refuses a tensor that weak references point to (the
fake mode's memo of the fakes it wraps points to every one; autocast's cast cache to the weights
it cast) and leaves the parameter's gradient accumulator unusable for a backward already recorded.
So a model whose forward converts one of its own layers (Switch Transformers' router:
``self.classifier = self.classifier.to(self.dtype)``) raised ``_apply(): Couldn't swap
Linear.weight`` out of the estimate (torch 2.13 and 2.14; plain torch does the same:
``nn.Linear(4, 4).to(torch.float32)`` inside a ``FakeTensorMode``). :func:`swappable_fakes` makes
the fake step's conversions take the real tensors' path: a swap ``Module._apply`` asks for where
a real tensor would have its ``.data`` set sets ``.data``; where the real one would be swapped too
(``torch.__future__.set_swap_module_params_on_conversion(True)``), the memo's entries for the two
tensors are dropped first (stale by then: each is keyed by a temporary meta tensor's id).

Example::

    >>> import torch
    >>> from torch import nn
    >>> from torch._subclasses.fake_tensor import FakeTensorMode
    >>> mode = FakeTensorMode()
    >>> with mode, swappable_fakes(mode):
    ...     layer = nn.Linear(4, 4)
    ...     _ = layer.to(torch.bfloat16)
    >>> layer.weight.dtype
    torch.bfloat16
"""

from __future__ import annotations

import contextlib
import sys
import weakref
from typing import Any, Iterator

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

__all__ = ["swappable_fakes"]


@contextlib.contextmanager
def swappable_fakes(mode: Any) -> Iterator[None]:
    """For the block, a swap ``Module._apply`` asks for sets ``.data`` where it would for a real
    tensor; any other swap first drops ``mode``'s memo entries for the two tensors."""
    converter = getattr(mode, "fake_tensor_converter", None)
    memo = getattr(getattr(converter, "meta_converter", None), "tensor_memo", None)
    real = torch.utils.swap_tensors
    apply_code = nn.Module._apply.__code__

    def swap_tensors(t1: torch.Tensor, t2: torch.Tensor) -> None:
        if sys._getframe(1).f_code is apply_code and _set_data_for_real(t1, t2):
            t1.data = t2  # what Module._apply does to a real parameter or gradient
            return None
        if isinstance(memo, weakref.WeakValueDictionary):
            _forget(memo, t1, t2)
        return real(t1, t2)

    torch.utils.swap_tensors = swap_tensors  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.utils.swap_tensors = real  # type: ignore[assignment]


def _set_data_for_real(t1: torch.Tensor, t2: torch.Tensor) -> bool:
    """Whether ``Module._apply`` would set ``t1.data`` where ``t1`` a real tensor (it swaps only
    under ``set_swap_module_params_on_conversion(True)`` or for a wrapper subclass)."""
    return (
        isinstance(t1, FakeTensor)
        and not torch.__future__.get_swap_module_params_on_conversion()
        and not is_traceable_wrapper_subclass(t2)
    )


def _forget(memo: weakref.WeakValueDictionary, *tensors: torch.Tensor) -> None:
    # each tensor's own weak references name their keys (a WeakValueDictionary's are KeyedRefs):
    # no walk over the memo, which holds every fake tensor alive
    for t in tensors:
        for ref in weakref.getweakrefs(t):
            if isinstance(ref, weakref.KeyedRef) and memo.data.get(ref.key) is ref:
                del memo.data[ref.key]
