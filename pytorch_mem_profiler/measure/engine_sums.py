"""Gradients summed by autograd's engine: in place where no mode is watching, as the run would.

Where a tensor feeds several operators (a skip connection, an inception block's
branches, a weight shared by two layers' inputs), backward hands its gradient in
pieces, and the engine sums them as they come (``InputBuffer::accumulate``). It adds
the new piece into the one it holds, in place, where it holds the last reference to
it and its storage (``can_accumulate_inplace``: a plain dense tensor, not a view
shared with another), and makes ``old + new`` otherwise. A tensor is *subclass-like*
to that test where it has the Python key (a fake tensor) **or where any dispatch mode
is on**. So a mode that only watches changes the step's memory: every sum becomes a
new tensor, one gradient piece's bytes more at each sum and other free blocks for the
allocator (ELECTRA's backward made 36 more allocations, 2.26 GB more bytes, in the fake
step than the real one on an H100).

:class:`EngineAccumulation`, asked by a mode about each ``aten.add.Tensor``
(:meth:`~EngineAccumulation.in_place`), answers whether the engine would add it in place
with no mode on: inside a backward pass (``_current_graph_task_id``), without grad mode,
of two strided tensors of one shape, dtype and device, the first non-overlapping and
dense and held by nothing but the engine. "Nothing but the engine" is its reference
counts (tensor and storage) equal to those of a sum the engine makes of a gradient it
alone holds: :meth:`~EngineAccumulation.calibrate` runs such a sum under the same modes
and notes them, so the counts the dispatch machinery adds (which differ between torch
versions) are the same in both. A gradient handed to two places (``AddBackward``'s, a
residual's: one tensor to both branches), an expanded or shared view, or one a hook or a
saved tensor also holds, has more, and stays a new tensor, as it does without a mode.

Two modes ask it:

- the CPU counter's (:mod:`.storage_counting`), on the real step, with ``plain=True``:
  both pieces plain ``torch.Tensor`` objects and no other mode on the stack below it
  (a user's own mode already makes the unwatched step sum out of place). The profiled
  step then holds what the same step holds without the profiler;
- the estimate's counter, on the fake step (whose tensors are subclasses, under the fake
  mode): the sums the target makes where nothing watches it.

Example::

    >>> import torch
    >>> from torch.utils._python_dispatch import TorchDispatchMode
    >>> seen = []
    >>> class Watch(TorchDispatchMode):
    ...     def __torch_dispatch__(self, func, types, args=(), kwargs=None):
    ...         if func is ENGINE_SUM and torch._C._current_graph_task_id() != -1:
    ...             seen.append(sums.in_place(args, kwargs or {}))  # the sums backward makes
    ...         return func(*args, **(kwargs or {}))
    >>> sums = EngineAccumulation(plain=True)
    >>> with Watch():
    ...     sums.calibrate()
    ...     seen.clear()
    ...     x = torch.ones(8, 4, requires_grad=True)
    ...     h = x * 1.0
    ...     ((h * 2.0).sum() + (h * 3.0).sum()).backward()  # h's two pieces: summed in place
    ...     y = x * 1.0
    ...     (y + y * 2.0).sum().backward()  # the residual's piece is also the other branch's: a new tensor
    >>> sums.signature is not None, seen
    (True, [True, False])
"""

from __future__ import annotations

from typing import Any

import torch

from .accounting import non_overlapping_and_dense

__all__ = ["ENGINE_SUM", "ENGINE_SUM_IN_PLACE", "EngineAccumulation"]

#: The operator the engine sums gradient pieces with when it cannot add in place.
ENGINE_SUM = torch.ops.aten.add.Tensor
#: The one it sums them with in place: what a mode runs for a sum :meth:`EngineAccumulation.in_place` answers.
ENGINE_SUM_IN_PLACE = torch.ops.aten.add_.Tensor


def _storage_uses(tensor: torch.Tensor) -> int:
    return torch._C._storage_Use_Count(tensor.untyped_storage()._cdata)


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1 and not torch.is_grad_enabled()


class EngineAccumulation:
    """Which ``aten.add.Tensor`` calls are the engine's sums of gradient pieces that it adds in
    place where no mode watches (see the module). ``signature``: the reference counts of a
    gradient only the engine holds, as the dispatch modes see them (``None`` until
    :meth:`calibrate`). ``plain``: asked from a mode over the real step (see the module)."""

    def __init__(self, *, plain: bool = False) -> None:
        self.signature: tuple[int, int] | None = None
        #: only plain tensors, with no other mode on the stack (the real step; see the module)
        self.plain = plain
        self._calibrating = False

    def calibrate(self) -> None:
        """Run one sum of two gradient pieces the engine alone holds, under the modes on now
        (the counter's among them: it asks :meth:`in_place`), and note their counts. Where that
        fails, no signature is noted and every sum stays a new tensor (the estimate as before)."""
        self._calibrating = True
        try:
            with torch.inference_mode(False), torch.enable_grad():
                x = torch.zeros(4, 4, requires_grad=True)
                h = x * 1.0
                ((h * 2.0).sum() + (h * 3.0).sum()).backward()
        except Exception:  # noqa: BLE001 - the sums' rule off, never the estimate
            self.signature = None
        finally:
            self._calibrating = False

    def in_place(self, args: tuple, kwargs: dict) -> bool:
        """Whether this ``aten.add.Tensor(*args, **kwargs)`` is a sum the engine makes in place
        where no mode watches (while calibrating: note its counts, and answer no)."""
        if len(args) != 2 or kwargs or not _in_backward():
            return False
        old, new = args
        if self.plain:
            # A subclass, or a user's mode below the asking one (popped while it runs), is
            # subclass-like to the engine without the profiler too: it sums out of place.
            if type(old) is not torch.Tensor or type(new) is not torch.Tensor:
                return False
            if torch._C._len_torch_dispatch_stack() != 0:
                return False
        elif not (isinstance(old, torch.Tensor) and isinstance(new, torch.Tensor)):
            return False
        if old.layout is not torch.strided or new.layout is not torch.strided:
            return False
        if old.shape != new.shape or old.dtype != new.dtype or old.device != new.device or old.requires_grad:
            return False
        if old.is_nested or old._is_zerotensor() or new._is_zerotensor():
            return False
        if not non_overlapping_and_dense(old):
            return False
        counts = (old._use_count(), _storage_uses(old))
        if self._calibrating:
            self.signature = counts
            return False
        return counts == self.signature
