"""Process-wide caches the fake step fills: emptied of its fake tensors when the step ends.

Libraries memoize tensors made from sizes in ``functools.lru_cache`` functions shared by every
instance of a class (transformers' BEiT and Data2Vec make their relative position index through
``compile_compatible_method_lru_cache``, keyed by the window size). The fake step calls them as the
real one would, and the cache keeps what they returned: a fake tensor. Left there, the user's own
model, built and trained for real after the estimate in the same process, would be handed that fake
tensor and compute on it. So each fake step notes every cache's misses before it runs, and after
it empties those that missed meanwhile and now hold a fake tensor (only those: a cache that
memoizes a singleton keeps it). Before it runs, it empties those that hold a tensor (one an earlier
real run made): the step is estimated as a fresh process's first step, which makes what it caches,
counted where that step counts it; the user's real model makes it again, once. The caches are found
among every object of the process before each step (tens of milliseconds), and again after it
where a module was imported meanwhile (a library makes its caches when it is imported).

Example::

    >>> import functools, torch
    >>> from pytorch_mem_profiler.estimate.fake import fake_mode
    >>> @functools.lru_cache(maxsize=4)
    ... def index(n: int) -> torch.Tensor:
    ...     return torch.arange(n * n).view(n, n)
    >>> with fake_values_left_out_of_caches():
    ...     with fake_mode():
    ...         _ = index(17)
    >>> index.cache_info().currsize, type(index(17)) is torch.Tensor
    (0, True)
"""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import sys
import types
from typing import Any, Iterator

import torch
from torch._subclasses.fake_tensor import is_fake

__all__ = ["fake_values_left_out_of_caches"]

_log = logging.getLogger("pytorch_mem_profiler")
_CACHE = functools._lru_cache_wrapper
#: how deep a cached value is looked into (a tuple of tensors, a dict of them, an object's fields)
_DEPTH = 3


def _all_caches() -> list[Any]:
    """Every ``functools`` cache of the process, found among all its objects (tens of ms)."""
    return [obj for obj in gc.get_objects() if type(obj) is _CACHE]


def _holds_fake(value: Any, depth: int = _DEPTH) -> bool:
    kind = type(value)  # (not isinstance: a deprecated object's __class__ may warn)
    if issubclass(kind, torch.Tensor):
        try:
            return bool(is_fake(value))
        except Exception:  # noqa: BLE001 - a tensor torch cannot look at is no fake one
            return False
    if depth == 0:
        return False
    if issubclass(kind, (tuple, list, set, frozenset)):
        items: Any = value
    elif issubclass(kind, dict):
        items = value.values()
    elif not issubclass(kind, (type, types.ModuleType)) and isinstance(getattr(value, "__dict__", None), dict):
        items = vars(value).values()
    else:
        return False
    return any(_holds_fake(item, depth - 1) for item in items)


def _cached_values(cache: Any) -> Iterator[Any]:
    """What ``cache`` holds: its results (a bounded cache's, as the garbage collector sees them;
    an unbounded one's, its dict's values), and its keys."""
    for held in gc.get_referents(cache):
        if isinstance(held, dict):
            yield from held.values()
        elif type(held).__name__ == "_lru_list_elem":
            yield from gc.get_referents(held)
        else:
            yield held


def _holds_tensor(value: Any, depth: int = 2) -> bool:
    """Whether ``value`` is a tensor, or a tuple, list or dict holding one (``depth`` levels down)."""
    kind = type(value)
    if issubclass(kind, torch.Tensor):
        return True
    if depth == 0:
        return False
    if issubclass(kind, (tuple, list)):
        return any(_holds_tensor(item, depth - 1) for item in value)
    if issubclass(kind, dict):
        return any(_holds_tensor(item, depth - 1) for item in value.values())
    return False


def _emptied_of_tensors(caches: list[Any]) -> None:
    """Empty those of ``caches`` that hold a tensor (see the module: the step as a fresh process's first)."""
    for cache in caches:
        if cache.cache_info().currsize and any(_holds_tensor(value) for value in _cached_values(cache)):
            cache.cache_clear()


@contextlib.contextmanager
def fake_values_left_out_of_caches() -> Iterator[None]:
    """Empty the ``functools`` caches that hold a tensor before the block, and those it filled with
    fake tensors after it (see the module)."""
    caches = _all_caches()
    try:
        _emptied_of_tensors(caches)
    except Exception as exc:  # noqa: BLE001 - never fail an estimate for this
        _log.warning("could not look into the process's caches before the estimate: %r", exc)
    misses = {id(cache): cache.cache_info().misses for cache in caches}
    modules = len(sys.modules)
    try:
        yield
    finally:
        try:
            if len(sys.modules) != modules:  # a library imported meanwhile made caches of its own
                caches = _all_caches()
            for cache in caches:
                if misses.get(id(cache)) == cache.cache_info().misses:
                    continue  # nothing new in it
                if any(_holds_fake(value) for value in _cached_values(cache)):
                    cache.cache_clear()
        except Exception as exc:  # noqa: BLE001 - never fail an estimate that was made
            _log.warning("could not look into the caches the estimate filled: %r", exc)
