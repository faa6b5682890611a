"""References to tensors that leave a fake parameter free to be swapped.

``nn.Module._apply`` (``module.to(dtype)``, ``.float()``, ``.half()``) swaps a fake parameter's
contents in place with ``torch.utils.swap_tensors`` (always for a fake tensor, and wherever
``torch.__future__.set_swap_module_params_on_conversion(True)`` is set), and ``swap_tensors``
refuses a tensor any weak reference points to. Two kinds pointed to every parameter of the fake
step, so a model whose forward converts one of its own layers (Switch Transformers' router:
``self.classifier = self.classifier.to(self.dtype)``) raised ``_apply(): Couldn't swap
Linear.weight`` out of the estimate (torch 2.13 and 2.14; plain torch does the same:
``nn.Linear(4, 4).to(torch.float32)`` inside a ``FakeTensorMode``):

- the fake mode's own memo of the fake tensors it wrapped (``MetaConverter.tensor_memo``, a
  ``WeakValueDictionary`` keyed by the meta tensor's id): :func:`swappable_fakes` drops a
  tensor's entries just before it is swapped, for the length of the fake step;
- the estimate's own records by identity (values drawn at random for small tensors, autocast's
  cast copies): :func:`identity_ref` holds a parameter strongly (its module keeps it alive as
  long; only a parameter the model drops during the step outlives it, by the estimate's end).

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
    >>> plain = torch.zeros(1)
    >>> identity_ref(plain)() is plain, identity_ref(layer.weight)() is layer.weight
    (True, True)
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Callable, Iterator

import torch
from torch import nn

__all__ = ["identity_ref", "swappable_fakes"]


class _Held:
    """A strong reference called like a weak one."""

    __slots__ = ("_tensor",)

    def __init__(self, tensor: torch.Tensor) -> None:
        self._tensor = tensor

    def __call__(self) -> torch.Tensor:
        return self._tensor


def identity_ref(tensor: torch.Tensor) -> Callable[[], torch.Tensor | None]:
    """A reference to ``tensor`` to tell a reused ``id`` apart: weak, but strong for a parameter
    (a fake one counts: ``nn.Parameter`` of a fake tensor is the fake tensor marked ``_is_param``)."""
    if isinstance(tensor, nn.Parameter):
        return _Held(tensor)
    return weakref.ref(tensor)


@contextlib.contextmanager
def swappable_fakes(mode: Any) -> Iterator[None]:
    """For the block, ``torch.utils.swap_tensors`` first drops the entries of ``mode``'s memo of
    wrapped fake tensors that point to the two tensors (stale by then: each is keyed by a
    temporary meta tensor's id), then swaps. Nothing changes where this torch keeps no such memo."""
    converter = getattr(mode, "fake_tensor_converter", None)
    memo = getattr(getattr(converter, "meta_converter", None), "tensor_memo", None)
    if not isinstance(memo, weakref.WeakValueDictionary):
        yield
        return
    real = torch.utils.swap_tensors

    def swap_tensors(t1: torch.Tensor, t2: torch.Tensor) -> None:
        _forget(memo, t1, t2)
        return real(t1, t2)

    torch.utils.swap_tensors = swap_tensors  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.utils.swap_tensors = real  # type: ignore[assignment]


def _forget(memo: weakref.WeakValueDictionary, *tensors: torch.Tensor) -> None:
    # each tensor's own weak references name their keys (a WeakValueDictionary's are KeyedRefs):
    # no walk over the memo, which holds every fake tensor alive
    for t in tensors:
        for ref in weakref.getweakrefs(t):
            if isinstance(ref, weakref.KeyedRef) and memo.data.get(ref.key) is ref:
                del memo.data[ref.key]
