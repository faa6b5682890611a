"""What libraries decide from tensor values, decided for fake tensors as the real step decides.

A library may look at a tensor's values to skip work, and treat a fake tensor, which has none,
as the case where it cannot skip. Where what the real step finds is known without the values,
the estimate answers for it, for the length of its step:

- **transformers, packed sequences** (``masking_utils.find_packed_sequence_indices``): a decoder
  trained without a cache (``use_cache=False``, which gradient checkpointing sets) and without an
  attention mask looks for several sequences packed in one row, where the position ids restart.
  Its ``is_tracing()`` counts a fake tensor as tracing, so the fake step takes the positions as
  packed and builds a causal mask (and, on CUDA, attention with a mask) that the real step skips
  (scaled dot-product attention's ``is_causal``). Position ids the model made itself (from its
  cache positions: a range in every row) are one sequence per row: not packed. Position ids the
  step's inputs hold, whose values the estimate does not keep, are left to transformers (a mask
  built: what packed inputs need).

Example::

    >>> import torch
    >>> with library_rules([torch.zeros(2, 8)]):
    ...     pass
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Iterable, Iterator

import torch

__all__ = ["library_rules"]


def _storage_key(t: torch.Tensor) -> int | None:
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError, AttributeError):
        return None


def _fake_without_values(t: Any) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor) and getattr(t, "constant", None) is None


@contextlib.contextmanager
def library_rules(inputs: Iterable[torch.Tensor]) -> Iterator[None]:
    """For the ``with`` block: the libraries' value-dependent choices as the real step makes them
    (see the module); ``inputs``: the step's input tensors (their values are the user's)."""
    masking = sys.modules.get("transformers.masking_utils")
    find = getattr(masking, "find_packed_sequence_indices", None)
    if find is None:
        yield
        return
    given = {key for key in map(_storage_key, inputs) if key is not None}

    def find_packed_sequence_indices(position_ids: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if _fake_without_values(position_ids) and _storage_key(position_ids) not in given:
            return None  # the model's own positions: a range in every row, one sequence each
        return find(position_ids, *args, **kwargs)

    masking.find_packed_sequence_indices = find_packed_sequence_indices
    try:
        yield
    finally:
        masking.find_packed_sequence_indices = find
