"""Indexing by a 0-d integer tensor whose value the fake step does not have: index 0, noted.

``x[:, i]`` with ``i`` a 0-d integer tensor (a delay ``topk`` picked, an ``argmax``) is a ``select``
in ATen whatever the device (``TensorIndexing.h``: the index is read with ``item()`` and the
dimension selected), a view of ``x`` whose shape and memory do not depend on which position is
picked. A fake tensor computed from the data has no value to read, and the estimate was refused at
that line (Autoformer's time-delay aggregation, ``x[:, top_k_delays_index[i]]``). For the length of
the fake step, :func:`scalar_indices_taken_as_zero` indexes with 0 where such an index has no value
and notes the line; an index with a value (a real tensor, or a fake one the step knows), a slice's
bounds (which decide the shape) and every other index are left to torch.

Example::

    >>> import torch
    >>> from pytorch_mem_profiler.estimate.fake import fake_mode
    >>> with fake_mode(), scalar_indices_taken_as_zero() as taken:
    ...     scores = torch.empty(4, 10)
    ...     picked = scores.mean(0).argmax()                  # no value in the fake step
    ...     column = scores[:, picked]                        # a view, whichever column
    >>> tuple(column.shape), sum(taken.values())
    ((4,), 1)
"""

from __future__ import annotations

import contextlib
import traceback
from typing import Any, Iterator

import torch
from torch._subclasses.fake_tensor import FakeTensor

from .draws import user_line

__all__ = ["scalar_indices_taken_as_zero"]


def _unknown_scalar(index: Any) -> bool:
    """A 0-d integer fake tensor without a value (bool and uint8 ones are masks, not positions)."""
    return (
        isinstance(index, FakeTensor)
        and index.dim() == 0
        and not index.is_floating_point()
        and not index.is_complex()
        and index.dtype not in (torch.bool, torch.uint8)
        and getattr(index, "constant", None) is None
    )


def _replaced(index: Any) -> tuple[Any, int]:
    """``index`` with each unknown 0-d integer position at its top level taken as 0, and how many."""
    if _unknown_scalar(index):
        return 0, 1
    if type(index) is tuple:
        unknown = [_unknown_scalar(part) for part in index]
        if any(unknown):
            return tuple(0 if taken else part for part, taken in zip(index, unknown)), sum(unknown)
    return index, 0


@contextlib.contextmanager
def scalar_indices_taken_as_zero() -> Iterator[dict[str, int]]:
    """Patch ``torch.Tensor.__getitem__`` and ``__setitem__`` for the fake step; yields the lines that
    indexed by a position without a value, with how many such positions each read."""
    taken: dict[str, int] = {}
    getitem, setitem = torch.Tensor.__getitem__, torch.Tensor.__setitem__

    def note(count: int) -> None:
        line = user_line(traceback.extract_stack()) or "Tensor.__getitem__"
        taken[line] = taken.get(line, 0) + count

    def get(self: torch.Tensor, index: Any) -> Any:
        index, count = _replaced(index)
        if count:
            note(count)
        return getitem(self, index)

    def put(self: torch.Tensor, index: Any, value: Any) -> None:
        index, count = _replaced(index)
        if count:
            note(count)
        setitem(self, index, value)

    torch.Tensor.__getitem__, torch.Tensor.__setitem__ = get, put  # type: ignore[method-assign]
    try:
        yield taken
    finally:
        torch.Tensor.__getitem__, torch.Tensor.__setitem__ = getitem, setitem  # type: ignore[method-assign]
