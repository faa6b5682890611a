"""The memory data-parallel wrappers add: DDP's gradient buckets, FSDP2's gathered parameters.

- DDP (``DistributedDataParallel``) reduces gradients in flat buckets it
  allocates once: one more gradient-sized block per rank, unless
  ``gradient_as_bucket_view=True`` makes the gradients views into the buckets.
  :func:`ddp_gradient_bucket_bytes` counts the bucket bytes held apart from the
  gradients, from the parameters DDP reduces (as its reducer lays them out).
- FSDP2 (``fully_shard``) keeps each parameter as a DTensor shard (the weights
  a rank holds) and all-gathers each unit's full parameters for its forward
  and backward. :class:`FsdpGatherTracker` measures those gathered copies.

Example::

    >>> import torch
    >>> ddp_gradient_bucket_bytes(torch.nn.Linear(4, 4)) is None   # no DDP inside
    True
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

import torch

from .accounting import same_device
from .observers import Observer

__all__ = ["ddp_gradient_bucket_bytes", "ddp_bucket_bytes", "fsdp_units", "FsdpGatherTracker"]


def _ddp_class() -> type | None:
    try:
        from torch.nn.parallel import DistributedDataParallel
    except ImportError:  # a torch build without distributed support
        return None
    return DistributedDataParallel


def ddp_bucket_bytes(ddp: torch.nn.Module, device: torch.device | None = None) -> int:
    """Bytes of the flat gradient buckets a ``DistributedDataParallel`` module allocates.

    The reducer puts every parameter that requires a gradient, is not ignored
    and has a dense gradient, once, into a bucket of its dtype (DDP's
    ``mixed_precision.param_dtype`` when set); a bucket is a flat tensor of
    exactly its parameters' elements. Parameters of sparse ``Embedding`` /
    ``EmbeddingBag`` modules get no flat bucket.
    """
    ignored = getattr(ddp, "parameters_to_ignore", None) or set()
    mixed = getattr(ddp, "mixed_precision", None)
    bucket_dtype = getattr(mixed, "param_dtype", None) if mixed is not None else None
    seen: set[int] = set()
    total = 0
    inner = getattr(ddp, "module", ddp)
    for module_name, module in inner.named_modules():
        sparse = isinstance(module, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and bool(
            getattr(module, "sparse", False)
        )
        for param_name, param in module.named_parameters(recurse=False):
            # The reducer's own test, names included (a root parameter is ".name").
            if not param.requires_grad or f"{module_name}.{param_name}" in ignored:
                continue
            if id(param) in seen:
                continue
            seen.add(id(param))
            if sparse or (device is not None and not same_device(param, device)):
                continue
            itemsize = (
                torch.empty((), dtype=bucket_dtype).element_size()
                if bucket_dtype is not None
                else param.element_size()
            )
            total += param.numel() * itemsize
    return total


def ddp_gradient_bucket_bytes(
    model: torch.nn.Module, device: torch.device | None = None
) -> int | None:
    """Bytes of DDP's gradient buckets in ``model`` held apart from the gradients.

    The sum over the ``DistributedDataParallel`` modules in ``model`` (pass the
    DDP-wrapped model to the profiler): the bucket bytes with
    ``gradient_as_bucket_view=False`` (DDP's default), 0 with ``True``, where
    the gradients are views into the buckets and counted as gradients.
    ``None`` when ``model`` holds no DDP module.

    Example::

        >>> ddp_gradient_bucket_bytes(torch.nn.Linear(3, 2)) is None
        True
    """
    ddp_class = _ddp_class()
    if ddp_class is None:
        return None
    total = None
    for module in model.modules():
        if isinstance(module, ddp_class):
            held = 0 if getattr(module, "gradient_as_bucket_view", False) else ddp_bucket_bytes(module, device)
            total = (total or 0) + held
    return total


def _is_fsdp_unit(module: torch.nn.Module) -> bool:
    # fully_shard swaps the module's class for one deriving from FSDPModule,
    # which lives in torch.distributed.fsdp (torch >= 2.6) or
    # torch.distributed._composable.fsdp (2.4, 2.5): match it by name.
    return any(cls.__name__ == "FSDPModule" for cls in type(module).__mro__)


def fsdp_units(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules of ``model`` that ``fully_shard`` was applied to, in module order."""
    return [m for m in model.modules() if _is_fsdp_unit(m)]


class _Unit:
    """One FSDP unit's parameters: where each is registered, and its sharded object."""

    __slots__ = ("entries",)

    def __init__(self) -> None:
        #: (owner module, attribute name, the sharded parameter registered there)
        self.entries: list[tuple[torch.nn.Module, str, torch.Tensor]] = []

    def gathered(self) -> bool:
        owner, name, sharded = self.entries[0]
        return owner._parameters.get(name) is not sharded

    def gathered_bytes(self, seen: set[int]) -> int:
        total = 0
        for owner, name, sharded in self.entries:
            param = owner._parameters.get(name)
            if param is None or param is sharded:
                continue
            local = getattr(param, "_local_tensor", param)
            try:
                storage = local.untyped_storage()
            except (RuntimeError, NotImplementedError, TypeError):
                continue
            key = storage.data_ptr()
            if key in seen:
                continue
            seen.add(key)
            total += storage.nbytes()
        return total


#: the part a fault in the gathered-parameter sampling switches off (``FaultGuard``)
FSDP_PART = "fsdp tracking"


class FsdpGatherTracker(Observer):
    """Measures FSDP2's gathered (unsharded) parameters: the largest amount alive at once.

    FSDP2 swaps the sharded parameter registered on a module for the gathered
    one while the unit computes, and back when it reshards. As each unit's
    forward begins (after FSDP has gathered its parameters), the tracker sums
    the storage bytes of every unit's parameters that are gathered at that
    moment (the root's stay gathered through the forward); the iteration's
    figure is the largest such sum. A unit prefetched but not yet swapped in
    is not counted. An observer (:mod:`.observers`) with hooks of its own: it
    samples on watched iterations only (each sample looks at every unit, at every
    unit's forward), as the plan it is given says.

    Args:
        model: the root module, with ``fully_shard`` applied to it or its submodules.
        wrap: makes the hook fault-safe (the profiler's ``FaultGuard.wrap``).

    Example::

        >>> FsdpGatherTracker.attach(torch.nn.Linear(2, 2)) is None   # no FSDP unit
        True
    """

    part = FSDP_PART

    def __init__(self, model: torch.nn.Module, units: list[torch.nn.Module], wrap: Any = None) -> None:
        self.model = model
        wrap = wrap or (lambda name, fn: fn)
        self._guarded_sample: Callable[[], None] = wrap(FSDP_PART, self._sample)
        self._handles: list = []
        self._units: list[_Unit] = []
        self.iteration_max: int | None = None
        #: whether the units' forwards are sampled (set by the plan: :meth:`begin`)
        self.active = True
        self.refresh(units)

    def begin(self, plan: Any) -> None:
        """Sample the units' forwards on a watched iteration only."""
        self.active = plan.watched

    @classmethod
    def attach(cls, model: torch.nn.Module, wrap: Any = None) -> FsdpGatherTracker | None:
        """A tracker with its hooks installed, or ``None`` when ``model`` has no FSDP unit."""
        units = fsdp_units(model)
        if not units:
            return None
        return cls(model, units, wrap)

    def refresh(self, units: list[torch.nn.Module] | None = None) -> None:
        """Find the units and their sharded parameters again (at construction and each epoch end)."""
        self.remove()
        units = fsdp_units(self.model) if units is None else units
        unit_ids = {id(u) for u in units}
        by_unit: dict[int, _Unit] = {}
        seen: set[int] = set()

        def walk(module: torch.nn.Module, owner: int | None) -> None:
            if id(module) in unit_ids:
                owner = id(module)
            if owner is not None:
                for name, param in module._parameters.items():
                    if param is None or id(param) in seen:
                        continue
                    seen.add(id(param))
                    by_unit.setdefault(owner, _Unit()).entries.append((module, name, param))
            for child in module.children():
                walk(child, owner)

        walk(self.model, None)
        self._units = [u for u in by_unit.values() if u.entries]
        for unit in units:
            # Registered after fully_shard's own pre-hook, so it runs once the
            # unit's parameters are gathered.
            self._handles.append(unit.register_forward_pre_hook(_SampleHook(self)))

    def _sample(self) -> None:
        seen: set[int] = set()
        total = 0
        for unit in self._units:
            if unit.gathered():
                total += unit.gathered_bytes(seen)
        if self.iteration_max is None or total > self.iteration_max:
            self.iteration_max = total

    def finish_iteration(self) -> int | None:
        """The iteration's largest gathered bytes (``None``: no FSDP forward ran); starts anew."""
        value, self.iteration_max = self.iteration_max, None
        return value

    def remove(self) -> None:
        """Take the sampling hooks off the units (:meth:`refresh` puts them back)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def close(self) -> None:
        self.remove()


class _SampleHook:
    """A forward pre-hook that holds its tracker weakly, so the model does not keep it alive."""

    __slots__ = ("tracker",)

    def __deepcopy__(self, memo: dict) -> _SampleHook:
        return self  # a copied model shares the hook (see ``EntryWatch.__deepcopy__``)

    def __init__(self, tracker: FsdpGatherTracker) -> None:
        self.tracker = weakref.ref(tracker)

    def __call__(self, module: torch.nn.Module, args: Any) -> None:
        tracker = self.tracker()
        if tracker is not None and tracker.active and torch.is_grad_enabled():
            tracker._guarded_sample()
        return None
