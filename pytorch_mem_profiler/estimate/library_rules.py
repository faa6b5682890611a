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
  step's inputs hold are left to transformers, which reads their values where the estimate kept
  them (see :meth:`.Draws.inputs`) and builds the mask packed rows need where it did not.
- **transformers, tensors with values** (``is_tracing``): transformers takes any fake tensor for
  one being traced, whose values it may not read, and then never skips work by them (a mask of
  ones: scaled dot-product attention's ``is_causal`` instead of a mask built). A fake tensor that
  has its values (the inputs' attention mask of ones, see :meth:`.Draws.inputs`) is not traced:
  transformers reads it as the real step does.

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


def _fake(t: Any, *, with_values: bool) -> bool:
    """Whether ``t`` is a fake tensor with (``with_values``) or without its values."""
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor) and (getattr(t, "constant", None) is not None) is with_values


@contextlib.contextmanager
def _replaced(modules: Iterable[Any], name: str, original: Any, replacement: Any) -> Iterator[None]:
    """``name`` set to ``replacement`` in each of ``modules`` that holds ``original`` under it."""
    holders = [m for m in modules if getattr(m, "__dict__", {}).get(name) is original]
    for module in holders:
        setattr(module, name, replacement)
    try:
        yield
    finally:
        for module in holders:
            setattr(module, name, original)


def _transformers_modules() -> list[Any]:
    # read from each module's __dict__, never getattr: transformers' lazy modules import on getattr
    return [m for key, m in list(sys.modules.items()) if key.split(".")[0] == "transformers" and m is not None]


@contextlib.contextmanager
def library_rules(inputs: Iterable[torch.Tensor]) -> Iterator[None]:
    """For the ``with`` block: the libraries' value-dependent choices as the real step makes them
    (see the module); ``inputs``: the step's input tensors (their values are the user's)."""
    with contextlib.ExitStack() as rules:
        if "transformers" in sys.modules:
            modules = _transformers_modules()
            masking = sys.modules.get("transformers.masking_utils")
            find = getattr(masking, "__dict__", {}).get("find_packed_sequence_indices")
            if find is not None:
                given = {key for key in map(_storage_key, inputs) if key is not None}

                def find_packed_sequence_indices(position_ids: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
                    if _fake(position_ids, with_values=False) and _storage_key(position_ids) not in given:
                        return None  # the model's own positions: a range in every row, one sequence each
                    return find(position_ids, *args, **kwargs)

                rules.enter_context(_replaced([masking], "find_packed_sequence_indices", find, find_packed_sequence_indices))
            utils = sys.modules.get("transformers.utils.import_utils")
            traced = getattr(utils, "__dict__", {}).get("is_tracing")
            if traced is not None:

                def is_tracing(tensor: Any = None) -> bool:
                    # a fake tensor with values is read as the real one is; tracing itself still counts
                    return bool(traced(None if _fake(tensor, with_values=True) else tensor))

                rules.enter_context(_replaced(modules, "is_tracing", traced, is_tracing))
        yield
