"""What is alive at an iteration's peak, by category: the measure side of ``peak_breakdown``.

An observer (:mod:`.observers`) of watched iterations only (the iteration's plan
puts it on then, and nothing of it runs on the others): each storage alive at the iteration's peak is put in one category
of :data:`~pytorch_mem_profiler.stats.PEAK_CATEGORIES`, by identity, in this
order: ``weights`` (parameters and buffers), ``gradients`` (a parameter's
``.grad``), ``optimizer_state``, ``inputs`` (the tensors the model was entered
with), ``activations`` (the feature maps: saved for backward during the model's forward, seen
by a ``saved_tensors_hooks`` pack hook chained to the user's), then
``activation_gradients`` (the intermediate gradients: made during backward) and ``other``
(the keys are the CSV's: see :mod:`pytorch_mem_profiler.stats`). The values sum
to the iteration's peak exactly.

Two ways, by what the device lets one see:

- :class:`CpuPeakBreakdown`: the CPU counter sees every storage made and
  freed. While the iteration runs, its changes are also appended keyed by
  storage; at each boundary (phase, module) they are folded in order, and when
  a new peak is set the set of live storages is copied (a dictionary copy).
  Exact to the byte.
- :class:`BoundaryPeakBreakdown` (CUDA and other devices with a peak counter):
  the allocator gives no per-allocation view, so the categories are tracked by
  identity (weak references to the storages) and read at each boundary the
  phase machine reads (phases; modules in per-layer mode) together with the allocator.
  The weight gradients backward made are looked for at each of its boundaries
  (a parameter whose ``.grad`` appeared since), in C-level passes over the
  parameters still without one: no hook is put on the user's parameters, and
  a boundary reads the gradients a hook per gradient would have seen by then.
  The iteration's peak lies in one interval between two boundaries: what was
  alive at the interval's start is put in its categories, and the rest (peak
  minus allocated at that start) is a *transient* of the module the interval
  ran in: ``activation_gradients`` in backward, ``other`` elsewhere, with its
  module and bytes reported apart.
  In backward, the allocated bytes no category claims beyond what was
  unclaimed when backward began count as ``activation_gradients``.
  From one reported iteration to the next it keeps what has not changed:
  the weights' and optimizer state's tracked storages (walked again, and
  dropped, when one of them is replaced, resized or dies). It installs no hook
  that outlives a forward.

Example::

    >>> import torch
    >>> from pytorch_mem_profiler.measure.devices import CpuCounter
    >>> counter = CpuCounter(); counter.start()
    >>> model = torch.nn.Linear(4, 4)
    >>> counter.adopt(model.parameters())
    >>> tracker = CpuPeakBreakdown(counter)
    >>> tracker.start(list(model.parameters()), [], [])
    >>> _ = counter.mark(); tracker.boundary(counter.read(), "other", "forward", None)
    >>> x = torch.randn(2, 4)
    >>> result = tracker.result(counter.mark().peak_allocated, list(model.parameters()), [])
    >>> result.breakdown["weights"], result.breakdown["other"]
    (80, 32)
    >>> counter.stop()
"""

from __future__ import annotations

import functools
import itertools
import operator
import weakref
from typing import Any, Callable, Iterable, NamedTuple, Sequence

import torch

from ..faults import FaultGuard
from ..stats import PEAK_CATEGORIES
from .accounting import PLAIN_TENSORS, DeviceMatch, allocation_bytes, optimizer_state_tensors, parts_on, same_device
from .devices import CpuCounter, MemoryCounter, Reading
from .observers import Observer
from .saved_tensors import ChainedSavedTensorsHooks, can_chain
from .trees import tensors_in

__all__ = [
    "PeakResult",
    "PeakBreakdown",
    "CpuPeakBreakdown",
    "BoundaryPeakBreakdown",
    "make_peak_breakdown",
    "BREAKDOWN_PART",
]

#: The part of the profiler a fault in the breakdown switches off (the fault guard's name for it).
BREAKDOWN_PART = "peak breakdown"


class PeakResult(NamedTuple):
    """One iteration's peak, explained (bytes)."""

    #: bytes alive at the peak by category; the values sum to the peak
    breakdown: dict[str, int]
    #: the ``activation_gradients`` part at backward's own peak: the intermediate gradients
    #: (``None``: no backward seen)
    backward_intermediate_gradients: int | None
    #: bytes of each module's feature maps alive at the peak (per-layer mode), largest first
    peak_layers: dict[str, int] | None
    #: bytes of the peak made and freed between two boundaries (not seen by identity; 0 on the CPU)
    transient: int
    #: the module (``""``: the model's own code) or phase the transient ran in
    transient_in: str | None
    #: the part of ``other`` that was alive before the iteration began (not this model's
    #: weights, gradients or optimizer state: another model, a cache, tensors kept from before)
    other_before: int = 0
    #: the part of ``other`` the optimizer step allocated and still held at the peak (its
    #: temporaries: what it allocated above what was allocated at its start, less new state)
    step_temporaries: int = 0


def _empty() -> dict[str, int]:
    return dict.fromkeys(PEAK_CATEGORIES, 0)


class PeakBreakdown(Observer):
    """What both ways share: watching saved tensors and the model's inputs during forward, and the
    iteration's events, as an observer (:mod:`.observers`).

    Args:
        device: the profiled device.
        guard: contains its faults, those of its saved-tensor hook included (part
            :data:`BREAKDOWN_PART`).
    """

    part = BREAKDOWN_PART

    def __init__(self, device: torch.device, guard: FaultGuard | None = None) -> None:
        self.device = device
        # Whether a tensor's device is this one, by device object, without a helper call per tensor
        # (see ``accounting.DeviceMatch``).
        self._on_device = DeviceMatch(device)
        self._guard = guard or FaultGuard()
        #: the module running now (per-layer mode, given at :meth:`start`), for ``peak_layers``
        self.module_name: Callable[[], str] | None = None
        self._saved_hooks = ChainedSavedTensorsHooks(self._observe_saved, self._saved_hook_failed)
        # the parameters of the running iteration (given at :meth:`start`)
        self._params: Sequence[torch.Tensor] = ()

    def _saved_hook_failed(self, exc: BaseException) -> None:
        self._guard.fault(BREAKDOWN_PART, exc)

    # -- the observer's events: forward -----------------------------------------------
    def inputs_seen(self, args: Any) -> None:
        """The model was entered with ``args``: their storages are the ``inputs``."""
        for part in parts_on(tensors_in(args), self.device):
            self._input(part)

    def forward_began(self, args: Any, entry: Any = None) -> None:
        """The model was entered with ``args``: count them, and watch what autograd saves
        (called before the per-layer attribution pushes its own hooks: they pop in reverse)."""
        self.inputs_seen(args)
        if can_chain():
            self._saved_hooks.push()

    #: entered again within the same pass: the same as a pass beginning
    forward_resumed = forward_began

    def forward_left(self) -> None:
        """The model was left: stop watching saved tensors."""
        self._saved_hooks.pop()

    def backward_finished(self) -> None:
        self.gradients_ready(self._params)

    def on_fault(self) -> None:
        self.close()

    def _observe_saved(self, kept: Any) -> None:
        module = self.module_name() if self.module_name is not None else None
        if type(kept) in PLAIN_TENSORS and kept.layout is torch.strided:
            # The common case (no user's hook): the tensor is its one piece of memory; on the
            # device (``accounting.same_device``, inline: this runs for every saved tensor)?
            if self._on_device[kept.device]:
                self._saved(kept, module)
            return
        for part in parts_on(tensors_in(kept), self.device):
            self._saved(part, module)

    def close(self) -> None:
        """Drop everything held (the hooks are removed, the storages forgotten)."""
        self._saved_hooks.pop()
        self.module_name = None  # refers back to the per-layer attribution
        self._params = ()

    # -- for the two ways -------------------------------------------------------
    def _input(self, tensor: torch.Tensor) -> None:
        raise NotImplementedError

    def _saved(self, tensor: torch.Tensor, module: str | None) -> None:
        raise NotImplementedError

    def start(
        self,
        params: Sequence[torch.Tensor],
        buffers: Iterable[torch.Tensor],
        optimizers: Iterable[Any],
        allocated: int | None = None,
        module_name: Callable[[], str] | None = None,
    ) -> None:
        """A watched iteration starts: the model's ``params``, ``buffers`` and ``optimizers`` now,
        ``allocated`` at its start (``None``: read it), and ``module_name`` the module running now
        (per-layer mode; ``None``: no ``peak_layers``)."""
        raise NotImplementedError

    def boundary(self, reading: Reading, ended: str, following: str, where: str | None) -> None:
        """The counters were read at a boundary: ``reading`` closed an interval of phase ``ended`` run
        in ``where`` (a module name, or ``None``) and opened one of phase ``following``."""
        raise NotImplementedError


    def gradients_ready(self, params: Sequence[torch.Tensor]) -> None:
        """A backward ended: the parameters' ``.grad`` are the weight gradients."""

    def result(self, peak: int | None, params: Sequence[torch.Tensor], optimizers: Iterable[Any]) -> PeakResult | None:
        """The iteration (whose peak the hooks measured as ``peak``) ends: what its peak held."""
        raise NotImplementedError


# -- the CPU: exact ---------------------------------------------------------------------------------
class CpuPeakBreakdown(PeakBreakdown):
    """Exact breakdown from the CPU counter's storage changes (see the module's text)."""

    def __init__(self, counter: CpuCounter, guard: FaultGuard | None = None) -> None:
        super().__init__(counter.device, guard)
        self.counter = counter
        self._reset()

    def _reset(self) -> None:
        self._live: dict[Any, int] = {}
        self._events: list[tuple[Any, int]] | None = None
        self._total = 0
        self._best: tuple[int, dict[Any, int]] | None = None
        self._backward_best: tuple[int, dict[Any, int]] | None = None
        self._born_in_backward: set[Any] = set()
        self._born_in_step: set[Any] = set()
        self._before: set[Any] = set()
        self._saved_by: dict[Any, str | None] = {}
        self._inputs: set[Any] = set()
        self._gradients: set[Any] = set()
        self._state: set[Any] = set()

    def start(
        self,
        params: Sequence[torch.Tensor],
        buffers: Iterable[torch.Tensor],
        optimizers: Iterable[Any],
        allocated: int | None = None,
        module_name: Callable[[], str] | None = None,
    ) -> None:
        self._params, self.module_name = params, module_name
        self.counter.unwatch_storages()
        self._reset()
        # the buffers' counted storages, not the buffers: a forward that replaces a buffer
        # (``self.pe = self.pe.to(x.dtype)``) frees the old one, with the profiler as without it
        self._buffer_refs: set[Any] = set()
        self._add_refs(self._buffer_refs, buffers)
        self._live, self._events = self.counter.watch_storages()
        self._total = sum(self._live.values())
        # what was alive when the iteration began: ``other`` there is not the iteration's
        self._before = set(self._live)
        self.gradients_ready(params)
        self._add_refs(self._state, optimizer_state_tensors(optimizers))

    def _add_refs(self, into: set[Any], tensors: Iterable[Any]) -> None:
        ref_of = self.counter.storage_ref
        for part in parts_on((t for t in tensors if isinstance(t, torch.Tensor)), self.device):
            ref = ref_of(part)
            if ref is not None:
                into.add(ref)

    def _input(self, tensor: torch.Tensor) -> None:
        ref = self.counter.storage_ref(tensor)
        if ref is not None:
            self._inputs.add(ref)

    def _saved(self, tensor: torch.Tensor, module: str | None) -> None:
        ref = self.counter.storage_ref(tensor)
        if ref is not None and ref not in self._saved_by:
            self._saved_by[ref] = module

    def gradients_ready(self, params: Sequence[torch.Tensor]) -> None:
        self._add_refs(self._gradients, (p.grad for p in params if p.grad is not None))

    def boundary(self, reading: Reading, ended: str, following: str, where: str | None) -> None:
        events = self._events
        if events is None:
            return
        count = len(events)
        batch = events[:count]
        del events[:count]  # changes appended meanwhile stay for the next boundary
        running = list(itertools.accumulate((delta for _, delta in batch), initial=self._total))
        top = max(running)
        best, backward_best = self._best, self._backward_best
        new_peak = best is None or top > best[0]
        new_backward_peak = ended == "backward" and (backward_best is None or top > backward_best[0])
        if new_peak or new_backward_peak:
            at = running.index(top)  # the first time the top was reached: changes before it
            self._fold(batch[:at], ended)
            alive = self._live.copy()
            if new_peak:
                self._best = (top, alive)
            if new_backward_peak:
                self._backward_best = (top, alive)
            self._fold(batch[at:], ended)
        else:
            self._fold(batch, ended)
        self._total = running[-1]

    def _fold(self, batch: list[tuple[Any, int]], phase: str) -> None:
        live = self._live
        in_backward = phase == "backward"
        born = self._born_in_backward if in_backward else self._born_in_step if phase == "optimizer" else None
        for ref, delta in batch:
            n = live.get(ref)
            if n is None:
                live[ref] = delta
                if born is not None:
                    born.add(ref)
            else:
                n += delta
                if n > 0:
                    live[ref] = n
                else:
                    del live[ref]

    def _categorize(
        self, alive: dict[Any, int], weights: set[Any]
    ) -> tuple[dict[str, int], dict[str, int], int, int]:
        """(bytes by category, feature maps by module, ``other`` alive before the
        iteration, ``other`` the optimizer step made)."""
        out = _empty()
        layers: dict[str, int] = {}
        saved_by = self._saved_by
        before = step = 0
        for ref, n in alive.items():
            if ref in weights:
                category = "weights"
            elif ref in self._gradients:
                category = "gradients"
            elif ref in self._state:
                category = "optimizer_state"
            elif ref in self._inputs:
                category = "inputs"
            elif ref in saved_by:
                category = "activations"
                module = saved_by[ref]
                if module is not None:
                    layers[module] = layers.get(module, 0) + n
            elif ref in self._born_in_backward:
                category = "activation_gradients"
            else:
                category = "other"
                if ref in self._before:
                    before += n
                elif ref in self._born_in_step:
                    step += n
            out[category] += n
        return out, layers, before, step

    def result(self, peak: int | None, params: Sequence[torch.Tensor], optimizers: Iterable[Any]) -> PeakResult | None:
        try:
            if self._events is None or self._best is None or peak is None:
                return None
            self.gradients_ready(params)
            self._add_refs(self._state, optimizer_state_tensors(optimizers))
            weights: set[Any] = set()
            self._add_refs(weights, params)
            weights |= self._buffer_refs
            top, alive = self._best
            breakdown, layers, before, step = self._categorize(alive, weights)
            # The hooks' peak is read from the same changes: equal unless another thread counted
            # into this counter between the two reads; what differs is not known by identity.
            breakdown["other"] += peak - top
            backward = None
            if self._backward_best is not None:
                backward = self._categorize(self._backward_best[1], weights)[0]["activation_gradients"]
            has_layers = self.module_name is not None
            return PeakResult(
                breakdown,
                backward,
                dict(sorted(layers.items(), key=lambda kv: -kv[1])) if has_layers else None,
                0,
                None,
                before,
                step,
            )
        finally:
            self.counter.unwatch_storages()
            self._reset()

    _buffer_refs: set[Any] = frozenset()  # type: ignore[assignment]

    def close(self) -> None:
        super().close()
        self.counter.unwatch_storages()
        self._reset()


# -- CUDA and other devices: boundaries -------------------------------------------------------------
class _StorageLife(weakref.ref):
    """A weak reference to a tracked storage, with its key, size, category and module."""

    __slots__ = ("key", "nbytes", "category", "module")


#: the categories whose lives :class:`_StaticStorages` keeps from one reported iteration to the next
_REMEMBERED = frozenset(("weights", "optimizer_state"))

_storage_of = torch.Tensor.untyped_storage
_nbytes_of = torch.UntypedStorage.nbytes
_layout_of = operator.attrgetter("layout")
_device_of = operator.attrgetter("device")
_grad_of = operator.attrgetter("grad")
_is_none = functools.partial(operator.is_, None)
_STRIDED_ONLY = frozenset((torch.strided,))
_PLAIN_SET = frozenset(PLAIN_TENSORS)


def _all_plain_strided(tensors: list[Any]) -> bool:
    """Whether every one of ``tensors`` is a plain strided tensor (its one piece of memory): the
    loops run in C (``map``), as these lists hold every weight and state tensor of the model."""
    return set(map(type, tensors)) <= _PLAIN_SET and set(map(_layout_of, tensors)) <= _STRIDED_ONLY


class _Alive:
    """Storages tracked by identity while they live, with running totals per category and module."""

    def __init__(self) -> None:
        self.items: dict[int, _StorageLife] = {}
        self.totals = _empty()
        #: the sum of ``totals`` (kept, so that each boundary need not add them up)
        self.tracked = 0
        self.by_module: dict[str, int] = {}
        #: the weights' and optimizer state's lives, kept from one reported iteration to the next
        #: (:class:`_StaticStorages`); one of them dying makes them stale
        self.static: dict[int, _StorageLife] = {}
        self.static_valid = False
        self._died = self._on_death
        self._died_unremembered = self._on_death_unremembered

    def add(self, tensor: torch.Tensor, category: str, module: str | None = None) -> bool:
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError, TypeError):
            return False
        return self.add_storage(storage, category, module)

    def add_storage(self, storage: Any, category: str, module: str | None = None) -> bool:
        """Track ``storage`` (an ``UntypedStorage``) in ``category``; False when it is tracked already."""
        key = id(storage)
        items = self.items
        if key in items:
            return False  # the first category given wins
        # Only the weights' and the state's lives can be remembered (``static``): the others'
        # deaths need not look there (most deaths are feature maps', during backward).
        life = _StorageLife(storage, self._died if category in _REMEMBERED else self._died_unremembered)
        nbytes = storage.nbytes()
        life.key, life.nbytes, life.category, life.module = key, nbytes, category, module
        items[key] = life
        self.totals[category] += nbytes
        self.tracked += nbytes
        if module is not None:
            by_module = self.by_module
            by_module[module] = by_module.get(module, 0) + nbytes
        return True

    def _on_death(self, life: _StorageLife) -> None:
        if self.static.get(life.key) is life:
            self.static_valid = False
        self._on_death_unremembered(life)

    def _on_death_unremembered(self, life: _StorageLife) -> None:
        if self.items.get(life.key) is life:
            del self.items[life.key]
            self.totals[life.category] -= life.nbytes
            self.tracked -= life.nbytes
            if life.module is not None:
                self.by_module[life.module] -= life.nbytes

    def clear(self) -> None:
        self.items.clear()  # the weak references go with them: no callback runs
        self.totals = _empty()
        self.tracked = 0
        self.by_module = {}


class _StaticStorages:
    """The storages of the weights and the optimizer state, found by walking them once and
    remembered while they stay the same: a reported iteration then puts their tracked lives back
    instead of making them again (this is most of :meth:`BoundaryPeakBreakdown.start`).

    They stay the same while the walk (parameters, buffers, then each optimizer state tensor)
    meets the same storages, of the same sizes, in the same order, and none of them died: a
    parameter replaced or moved (``model.to()``), optimizer state made at the first step or
    replaced, a storage resized in place, each changes the walk. Identities compare safely: a
    storage remembered is alive (its death marks the cache stale), so its ``id`` is not reused.
    Only plain strided tensors are remembered (anything else is walked every time).
    """

    __slots__ = ("ids", "sizes", "weights", "state", "state_keys")

    def __init__(self) -> None:
        self.ids: list[int] | None = None
        self.sizes: list[int] = []
        self.weights = 0
        self.state = 0
        self.state_keys: set[int] = set()

    @staticmethod
    def walk(tensors: list[Any]) -> tuple[list[int], list[int]] | None:
        """(storage ids, storage sizes) of ``tensors``; ``None`` where one is not a plain strided tensor."""
        if not _all_plain_strided(tensors):
            return None
        try:
            storages = list(map(_storage_of, tensors))
            return list(map(id, storages)), list(map(_nbytes_of, storages))
        except (RuntimeError, NotImplementedError, TypeError):
            return None


class _Boundary(NamedTuple):
    """What was alive when an interval opened."""

    allocated: int
    parts: dict[str, int]
    layers: dict[str, int] | None
    #: the least ``other`` at any boundary since the iteration began: what was alive before
    #: it and is still alive now is at most this
    floor: int


#: ``_Boundary(*fields)`` made in C, without the Python ``__new__`` a NamedTuple has (once per boundary)
_new_boundary = functools.partial(tuple.__new__, _Boundary)


class BoundaryPeakBreakdown(PeakBreakdown):
    """Breakdown from the allocator read at the phase machine's boundaries (see the module's text).

    Args:
        counter: the device counter (read at :meth:`start`; the machine reads it at boundaries).
        guard: contains its faults.
    """

    def __init__(self, counter: MemoryCounter, guard: FaultGuard | None = None) -> None:
        super().__init__(counter.device, guard)
        self.counter = counter
        self._alive = _Alive()
        self._static = _StaticStorages()
        self._reset()

    def _reset(self) -> None:
        self._alive.clear()
        self._open: _Boundary | None = None
        # (peak, the interval's opening, its phase, where it ran, weight gradients at its end)
        self._best: tuple[int, _Boundary, str, str | None, int] | None = None
        self._backward_best: tuple[int, _Boundary, str, str | None, int] | None = None
        self._unclaimed_before_backward = 0
        self._floor: int | None = None
        self._started = False
        # the parameters that may get a gradient and had none yet: looked at in backward
        self._awaiting: list[torch.Tensor] = []

    def start(
        self,
        params: Sequence[torch.Tensor],
        buffers: Iterable[torch.Tensor],
        optimizers: Iterable[Any],
        allocated: int | None = None,
        module_name: Callable[[], str] | None = None,
    ) -> None:
        self._params, self.module_name = params, module_name
        self._reset()
        buffers = list(buffers)
        optimizers = list(optimizers)
        if not self._static_again(params, buffers, optimizers):
            self._track(params, "weights")
            self._track(buffers, "weights")
            self.gradients_ready(params)
            self._add_state(optimizers)
        # Those with a gradient already (kept from before, accumulated in place) are tracked.
        self._awaiting = [p for p in params if p.requires_grad and p.grad is None]
        # ``allocated``: what the iteration before read last (the same moment): no second read.
        if allocated is None:
            allocated = self.counter.read().allocated
        self._open = self._boundary(allocated, in_backward=False)
        self._started = True

    def _track(self, tensors: Iterable[torch.Tensor], category: str) -> None:
        """``alive.add(part, category)`` for each piece of ``tensors`` on the device, in order
        (:func:`~.accounting.parts_on`): a plain strided tensor, the common case, without a helper
        call (this runs for every weight, state tensor and gradient of a reported iteration)."""
        alive = self._alive
        add_storage = alive.add_storage
        on_device = self._on_device
        strided = torch.strided
        for t in tensors:
            if type(t) in PLAIN_TENSORS and t.layout is strided:
                if not on_device[t.device]:
                    continue
                try:
                    storage = t.untyped_storage()
                except (RuntimeError, NotImplementedError, TypeError):
                    continue
                add_storage(storage, category)
            else:
                for part in parts_on((t,), self.device):
                    alive.add(part, category)

    def _static_again(self, params: Sequence[torch.Tensor], buffers: list[torch.Tensor], optimizers: list[Any]) -> bool:
        """Track the weights, the gradients there are and the optimizer state, in that order (the
        first category met wins), from :class:`_StaticStorages` where they did not change, else
        walking them and remembering them; False (nothing tracked) where they cannot be remembered."""
        alive, static = self._alive, self._static
        walked = static.walk([*params, *buffers, *optimizer_state_tensors(optimizers)])
        if walked is None:
            static.ids = None
            return False
        grads = [grad for p in params if (grad := p.grad) is not None]
        if (
            alive.static_valid
            and walked[0] == static.ids
            and walked[1] == static.sizes
            # a gradient over optimizer state would be a gradient (met before the state): walk again
            and not (grads and static.state_keys and not static.state_keys.isdisjoint(self._storage_ids(grads)))
        ):
            alive.items.update(alive.static)
            totals = alive.totals
            totals["weights"] += static.weights
            totals["optimizer_state"] += static.state
            alive.tracked += static.weights + static.state
            self._track_new(grads, "gradients")
            return True
        # Walk as always, then remember what the weights and the state were.
        self._track(params, "weights")
        self._track(buffers, "weights")
        self._track(grads, "gradients")
        self._add_state(optimizers)
        kept = {key: life for key, life in alive.items.items() if life.category in ("weights", "optimizer_state")}
        alive.static, alive.static_valid = kept, True
        static.ids, static.sizes = walked
        static.weights = alive.totals["weights"]
        static.state = alive.totals["optimizer_state"]
        static.state_keys = {key for key, life in kept.items() if life.category == "optimizer_state"}
        return True

    def _storage_ids(self, tensors: Iterable[torch.Tensor]) -> set[int]:
        """The keys (``id`` of the storage) :meth:`_track` would give the pieces of ``tensors``."""
        ids = set()
        for part in parts_on(tensors, self.device):
            try:
                ids.add(id(part.untyped_storage()))
            except (RuntimeError, NotImplementedError, TypeError):
                pass
        return ids

    def _add_state(self, optimizers: Iterable[Any]) -> None:
        self._track(optimizer_state_tensors(optimizers), "optimizer_state")

    def _gradients_made(self) -> None:
        """Track the gradients backward made since the last boundary: those of the parameters
        still awaiting one (each looked at once it has one; the loops run in C)."""
        awaiting = self._awaiting
        grads = list(map(_grad_of, awaiting))
        if all(map(_is_none, grads)):  # most boundaries: none new (no list made for them)
            return
        missing = list(map(_is_none, grads))
        self._awaiting = list(itertools.compress(awaiting, missing))
        # Gradients that appeared since the last boundary are new to the tracker as a rule:
        # ``_track`` without ``_track_new``'s look-up first (``_track`` leaves a storage tracked
        # already in its first category all the same).
        self._track(list(itertools.compress(grads, map(operator.not_, missing))), "gradients")

    def gradients_ready(self, params: Sequence[torch.Tensor]) -> None:
        self._track_new([grad for p in params if (grad := p.grad) is not None], "gradients")

    def _track_new(self, tensors: list[Any], category: str) -> None:
        """:meth:`_track`, where most of ``tensors`` are tracked already (the gradients found at
        earlier boundaries): their storages are looked up in C (``map``), and only the others are
        tracked."""
        if not tensors:
            return
        if _all_plain_strided(tensors):
            items = self._alive.items
            try:
                storages = list(map(_storage_of, tensors))
            except (RuntimeError, NotImplementedError, TypeError):
                pass  # one that has none: ``_track`` leaves it out
            else:
                # A tracked storage is alive, so its ``id`` names no other: those are left as they are.
                tensors = [t for t, tracked in zip(tensors, map(items.__contains__, map(id, storages))) if not tracked]
        self._track(tensors, category)

    def _input(self, tensor: torch.Tensor) -> None:
        self._alive.add(tensor, "inputs")

    def _saved(self, tensor: torch.Tensor, module: str | None) -> None:
        self._alive.add(tensor, "activations", module)

    def _observe_saved(self, kept: Any) -> None:
        # What the shared one does, inline for a plain tensor (this runs for every saved tensor),
        # and a storage tracked already (a view saved again, a weight) asks for no module name.
        if type(kept) in PLAIN_TENSORS and kept.layout is torch.strided:
            if not self._on_device[kept.device]:
                return
            try:
                storage = kept.untyped_storage()
            except (RuntimeError, NotImplementedError, TypeError):
                return
            alive = self._alive
            if id(storage) in alive.items:
                return  # the first category given wins
            alive.add_storage(storage, "activations", self.module_name() if self.module_name is not None else None)
            return
        super()._observe_saved(kept)

    def _boundary(self, allocated: int, in_backward: bool) -> _Boundary:
        alive = self._alive
        parts = dict(alive.totals)
        unclaimed = allocated - alive.tracked
        if in_backward:
            grads = max(0, unclaimed - self._unclaimed_before_backward)
            parts["activation_gradients"] += grads
            unclaimed -= grads
        parts["other"] += unclaimed
        layers = dict(alive.by_module) if self.module_name is not None else None
        floor = self._floor
        floor = self._floor = max(0, parts["other"] if floor is None else min(floor, parts["other"]))
        return _new_boundary((allocated, parts, layers, floor))

    def boundary(self, reading: Reading, ended: str, following: str, where: str | None) -> None:
        if not self._started:
            return
        if ended == "backward" and self._awaiting:
            self._gradients_made()  # before the interval's end and the next one's start are read
        opened, peak = self._open, reading.peak_allocated
        if opened is not None and peak is not None:
            best, backward_best = self._best, self._backward_best
            new_best = best is None or peak > best[0]
            new_backward_best = ended == "backward" and (backward_best is None or peak > backward_best[0])
            if new_best or new_backward_best:  # most boundaries set neither: no tuple made for them
                ran_in = where if where is not None else ended
                interval = (peak, opened, ended, ran_in, self._alive.totals["gradients"])
                if new_best:
                    self._best = interval
                if new_backward_best:
                    self._backward_best = interval
        if following == "backward" and ended != "backward":
            # Backward begins: what no category claims now is not backward's.
            self._unclaimed_before_backward = reading.allocated - self._alive.tracked
        self._open = self._boundary(reading.allocated, following == "backward" and ended == "backward")

    def backward_started(self, grad_outputs: Any) -> None:
        # The gradients of the outputs are already allocated when the gradient reaches the model:
        # they belong to backward. (On the CPU every storage is seen: nothing to move.)
        output_gradients = 0
        device = self.device
        for g in grad_outputs:
            if isinstance(g, torch.Tensor) and same_device(g, device):
                output_gradients += allocation_bytes(g)
        opened = self._open
        if opened is None or output_gradients <= 0:
            return
        moved = min(output_gradients, opened.parts["other"])
        self._unclaimed_before_backward -= moved
        parts = dict(opened.parts)
        parts["other"] -= moved
        parts["activation_gradients"] += moved
        self._open = opened._replace(parts=parts)

    def _explain(
        self, best: tuple[int, _Boundary, str, str | None, int], optimizers: list[Any]
    ) -> tuple[dict[str, int], int, int, int]:
        """(bytes by category, the transient, ``other`` alive before the iteration, ``other``
        the optimizer step made) at ``best``'s peak."""
        peak, opened, phase, _, gradients_at_end = best
        step = 0
        parts = dict(opened.parts)
        transient = peak - opened.allocated
        if transient < 0:  # cannot happen with a sound counter: keep the sum exact all the same
            parts["other"] += transient
            transient = 0
        if phase == "backward":
            # Weight gradients made in the interval and alive at its end were likely alive at
            # its peak too; the rest of what it made and freed is backward's.
            made = min(transient, max(0, gradients_at_end - opened.parts["gradients"]))
            parts["gradients"] += made
            parts["activation_gradients"] += transient - made
        elif phase == "optimizer":
            state_now = self._state_bytes(optimizers)
            made = min(transient, max(0, state_now - opened.parts["optimizer_state"]))
            parts["optimizer_state"] += made
            parts["other"] += transient - made
            # the step's intervals open at its start (it has no module boundaries): what it
            # allocated above that, less its new state, is its temporaries
            step = transient - made
        else:
            parts["other"] += transient
        if parts["other"] < 0:  # tracked storages outside the allocator: take it off the largest
            largest = max(parts, key=lambda k: parts[k])
            parts[largest] += parts["other"]
            parts["other"] = 0
        # What existed before the iteration and is still alive was in ``other`` at every boundary
        # since: at most the least of those (exact while such memory stays, as a model does).
        before = min(opened.floor, parts["other"])
        return parts, transient, before, min(step, parts["other"] - before)

    def _state_bytes(self, optimizers: list[Any]) -> int:
        """The bytes of the optimizer state's pieces on the device now, a piece counted each time
        a tensor names it; for plain strided tensors (the common case) the loops run in C."""
        tensors = list(optimizer_state_tensors(optimizers))
        if not _all_plain_strided(tensors):
            return sum(part.untyped_storage().nbytes() for part in parts_on(tensors, self.device))
        devices = list(map(_device_of, tensors))
        on = self._on_device
        if not all(map(on.__getitem__, set(devices))):  # some elsewhere (Adam's CPU step counters beside CUDA moments)
            tensors = list(itertools.compress(tensors, map(on.__getitem__, devices)))
        return sum(map(_nbytes_of, map(_storage_of, tensors)))

    def result(self, peak: int | None, params: Sequence[torch.Tensor], optimizers: Iterable[Any]) -> PeakResult | None:
        try:
            best = self._best
            if not self._started or best is None or peak is None:
                return None
            optimizers = list(optimizers)
            if best[0] != peak:
                return None  # an interval this tracker did not see (it started late)
            parts, transient, before, step = self._explain(best, optimizers)
            backward = None
            if self._backward_best is not None:
                backward = self._explain(self._backward_best, optimizers)[0]["activation_gradients"]
            layers = best[1].layers
            return PeakResult(
                parts,
                backward,
                dict(sorted(((k, v) for k, v in layers.items() if v > 0), key=lambda kv: -kv[1]))
                if layers is not None
                else None,
                transient,
                best[3],
                before,
                step,
            )
        finally:
            self._reset()

    def close(self) -> None:
        super().close()
        self._reset()
        self._alive.static, self._alive.static_valid = {}, False


def make_peak_breakdown(counter: MemoryCounter, guard: FaultGuard | None = None) -> PeakBreakdown | None:
    """The tracker for ``counter``'s device; ``None`` where the device keeps no peak (MPS)."""
    if isinstance(counter, CpuCounter):
        return CpuPeakBreakdown(counter, guard)
    if counter.has_peak:
        return BoundaryPeakBreakdown(counter, guard)
    return None
