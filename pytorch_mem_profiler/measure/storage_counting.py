"""Exact live CPU storage bytes: one dispatch mode shared by every CPU counter.

PyTorch keeps no allocation counters for the CPU, so the CPU counter sees every
tensor an operator returns through a ``TorchDispatchMode`` and counts each new
storage by its ``nbytes()`` until a weak reference says it died. This module
holds what all CPU counters share:

- one :class:`StorageRegistry` for the process: each live storage once, the
  counters (:class:`Tally`) that count it, and the bytes each counter gained or
  lost since it last looked;
- one counting mode per thread that runs counters (torch's mode stack is
  per thread), pushed when the thread's first counter starts and popped when
  its last one stops. A ``TorchDispatchMode`` leaves the stack only from the
  top: with a mode per counter, the one closed first could not leave while
  another was above it, and every operation in the process kept paying for it.
  With one mode, counters start and stop in any order. If the user entered a
  mode of their own after ours and it is still active when the last counter
  stops, ours is switched off (an operation then costs one Python call) and
  leaves at the first chance: the next module forward or optimizer step that
  finds it back on top, or the next start or stop of a counter.

An operator that writes a sparse tensor in place (``buf.add_(grad)`` on SGD's momentum over
sparse gradients, a ``_foreach_add_`` over such buffers) gives it new index and value tensors
inside its kernel, which no dispatch mode sees being made, and returns nothing new (or nothing
at all): the old ones die while it runs. So once the counters have seen a sparse tensor, the
arguments an operator writes (``Tensor(a!)`` in its schema) are looked at: the parts of a
non-strided one that were no input's before the call are new storages
(:func:`layout_rewrites`). Until a sparse tensor is seen this costs one attribute look-up.

The per-operator cost is kept small: whether an operator's returns can be new
storages (not views, not in-place results) is decided once per operator, so a
view or an in-place result costs one dictionary look-up; one new result, and a
tuple of new results, are looked at inline, without walking the return in
general; a counted storage's bytes go to its counters as appends to a list
(atomic under the GIL, so no lock on the hot path) that a counter sums up when
it is read. The per-storage log (:attr:`Tally.keyed`) is kept only while the
peak's make-up is watched.

Example::

    >>> import torch
    >>> registry = shared_registry()
    >>> tally = Tally()
    >>> registry.start(tally)
    >>> x = torch.zeros(256)            # 1024 bytes of float32
    >>> allocated, peak = tally.settle()
    >>> allocated >= 1024
    True
    >>> registry.stop(tally)
    >>> registry.installed()
    False
"""

from __future__ import annotations

import itertools
import logging
import threading
import weakref
from typing import Any, Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack

from ..torch_versions import dynamo_frame_hook, never_compiled, set_dynamo_frame_hook
from .accounting import PLAIN_TENSORS, storage_holder, storage_parts
from .engine_sums import ENGINE_SUM, ENGINE_SUM_IN_PLACE, EngineAccumulation

__all__ = [
    "Tally",
    "StorageRegistry",
    "shared_registry",
    "return_kinds",
    "NEW",
    "RESIZED",
    "SKIP",
    "watch_storage_resizes",
    "unwatch_storage_resizes",
    "written_arguments",
    "layout_rewrites",
    "made_inside",
]

_log = logging.getLogger("pytorch_mem_profiler")


# -- storage resizes the dispatcher never sees ------------------------------------------
#: Listeners ``(storage, nbytes_before) -> None`` called after each ``UntypedStorage.resize_``.
_RESIZE_LISTENERS: list[Any] = []
_RESIZE_LOCK = threading.Lock()
_ORIGINAL_RESIZE: Any = None
#: whether ``_ORIGINAL_RESIZE`` was ``UntypedStorage``'s own attribute (someone's wrapper), to put
#: back as it was, or inherited from the C base class (deleting ours shows it again)
_ORIGINAL_IN_CLASS = False


def _resize_and_tell(storage: torch.UntypedStorage, size: int) -> Any:
    before = storage.nbytes()
    out = _ORIGINAL_RESIZE(storage, size)  # the user's resize runs once, outside any try
    for listener in tuple(_RESIZE_LISTENERS):
        try:
            listener(storage, before)
        except Exception as exc:  # noqa: BLE001 - never break the caller's resize
            _log.debug("pytorch_mem_profiler: a storage-resize listener failed: %s", exc)
    return out


def watch_storage_resizes(listener: Any) -> None:
    """Call ``listener(storage, nbytes_before)`` after every ``torch.UntypedStorage.resize_``.

    ``storage.resize_(n)`` changes a storage's size in C++ without an operator, so no
    dispatch mode sees it. FSDP2 frees its all-gathered parameters that way
    (``resize_(0)`` after forward and backward) and makes them again with
    ``resize_(nbytes)``: a counter that missed it kept every gathered parameter alive.
    The method is wrapped while at least one listener watches and put back after the last
    one leaves (unless someone wrapped it again meanwhile: then the wrapper stays, calling
    no one).

    Example::

        >>> import torch
        >>> seen = []
        >>> listen = lambda storage, before: seen.append((before, storage.nbytes()))
        >>> watch_storage_resizes(listen)
        >>> _ = torch.zeros(4).untyped_storage().resize_(0)
        >>> unwatch_storage_resizes(listen)
        >>> seen, torch.UntypedStorage.resize_ is _ORIGINAL_RESIZE or _ORIGINAL_RESIZE is None
        ([(16, 0)], True)
    """
    global _ORIGINAL_RESIZE, _ORIGINAL_IN_CLASS
    with _RESIZE_LOCK:
        if not _RESIZE_LISTENERS:
            current = torch.UntypedStorage.resize_
            if current is not _resize_and_tell:
                _ORIGINAL_RESIZE = current
                _ORIGINAL_IN_CLASS = "resize_" in torch.UntypedStorage.__dict__
                torch.UntypedStorage.resize_ = _resize_and_tell  # type: ignore[method-assign]
        _RESIZE_LISTENERS.append(listener)


def unwatch_storage_resizes(listener: Any) -> None:
    """Stop calling ``listener``; the last one out puts ``UntypedStorage.resize_`` back."""
    with _RESIZE_LOCK:
        for i, known in enumerate(_RESIZE_LISTENERS):
            if known is listener or known == listener:
                del _RESIZE_LISTENERS[i]
                break
        if not _RESIZE_LISTENERS and torch.UntypedStorage.__dict__.get("resize_") is _resize_and_tell:
            if _ORIGINAL_IN_CLASS:  # a wrapper of someone else's, installed before ours
                torch.UntypedStorage.resize_ = _ORIGINAL_RESIZE  # type: ignore[method-assign]
            else:
                del torch.UntypedStorage.resize_  # the C method of StorageBase shows through again


class Tally:
    """One counter's running figures: live bytes counted and their peak since the last reset.

    The registry appends each change in bytes to :attr:`changes`; :meth:`settle`
    folds them in, in order, so the peak between two reads is exact.
    """

    __slots__ = ("changes", "keyed", "allocated", "peak", "_lock", "__weakref__")

    def __init__(self) -> None:
        self.changes: list[int] = []
        #: while not ``None``, each change is also appended here as ``(storage reference, bytes)``,
        #: in the same order: who is alive at the peak (:mod:`.peak_breakdown`, reported iterations)
        self.keyed: list[tuple[Any, int]] | None = None
        self.allocated = 0
        self.peak = 0
        self._lock = threading.Lock()

    def settle(self, reset: bool = False) -> tuple[int, int]:
        """Fold the changes made since the last call; return ``(allocated, peak)``.

        ``reset``: then start a new peak interval at the current level.
        """
        with self._lock:
            changes = self.changes
            if changes:
                count = len(changes)
                pending = changes[:count]
                del changes[:count]  # appends made meanwhile stay for the next call
                running = list(itertools.accumulate(pending, initial=self.allocated))
                self.allocated = running[-1]
                highest = max(running)
                if highest > self.peak:
                    self.peak = highest
            figures = self.allocated, self.peak
            if reset:
                self.peak = self.allocated
            return figures


class _StorageRef(weakref.ref):
    """A weak reference to a counted storage, with its size and the tallies that count it."""

    __slots__ = ("key", "nbytes", "owners")

    # Compared and hashed by identity: a weak reference's own hash is its referent's and
    # fails once the referent died, and the peak breakdown keys dictionaries on these.
    __hash__ = object.__hash__
    __eq__ = object.__eq__  # type: ignore[assignment]


# What an operator's return can be, decided once per operator from its schema.
_SKIP = 0  # a view or an in-place result: shares an input's storage and cannot change its size
_NEW = 1  # may be a new storage
_RESIZED = 2  # shares an input's storage, whose size the operator may change (out=, resize_)

#: Operators that change the size of the storage they return (beside every ``out=`` variant).
_RESIZING = frozenset(
    {
        "aten::resize_",
        "aten::resize_as_",
        "aten::_resize_output_",
        "aten::set_",
        "aten::resize_as_sparse_",
        "aten::sparse_resize_",
        "aten::sparse_resize_and_clear_",
    }
)

#: Per operator, by ``id``: ``None`` when no return needs looking at, else one kind per
#: return (a list return's one kind describes all its items). Keyed by ``id`` because
#: ``OpOverload.__hash__`` is a Python function; the operators themselves are kept in
#: ``_PLANNED`` so that their ids stay theirs.
_PLANS: dict[int, tuple[int, ...] | None] = {}
_PLANNED: list[Any] = []
_UNPLANNED = object()
_ONE_NEW = (_NEW,)
#: Plans of several returns, each :data:`_NEW` (a tuple return of as many items).
_ALL_NEW: set[tuple[int, ...]] = set()
_Tensor = torch.Tensor
_STRIDED = torch.strided


def _plan(func: Any) -> tuple[int, ...] | None:
    schema = getattr(func, "_schema", None)
    returns = getattr(schema, "returns", ())
    name = getattr(schema, "name", "")
    resizing = name in _RESIZING or any(
        arg.kwarg_only and arg.alias_info is not None and arg.alias_info.is_write
        for arg in getattr(schema, "arguments", ())
    )
    kinds = []
    for ret in returns:
        alias = ret.alias_info
        if "Tensor" not in str(ret.type):
            kinds.append(_SKIP)  # a Python number (item()), a bool, a shape: no storage
        elif alias is None:
            kinds.append(_NEW)
        elif alias.is_write and resizing:
            kinds.append(_RESIZED)
        else:
            kinds.append(_SKIP)
    if name == "aten::lift_fresh":
        # It aliases the brand-new tensor torch.tensor() made outside the mode.
        kinds = [_NEW] * len(kinds)
    if schema is None:
        kinds = [_NEW, _NEW]  # unknown: look at every returned tensor
    plan = tuple(kinds) if any(kinds) else None
    if plan == _ONE_NEW:
        plan = _ONE_NEW  # one object, so that the handler's fast path is an identity test
    elif plan is not None and all(kind == _NEW for kind in plan):
        _ALL_NEW.add(plan)  # several returns, each may be new: the handler's tuple fast path
    _PLANNED.append(func)
    _PLANS[id(func)] = plan
    return plan


#: Public names of the kinds of return, for other counters that follow the same rules.
SKIP, NEW, RESIZED = _SKIP, _NEW, _RESIZED


def return_kinds(func: Any) -> tuple[int, ...] | None:
    """Per return of the operator ``func``: :data:`NEW` (may be a new storage), :data:`RESIZED`
    (an input's storage whose size it may change) or :data:`SKIP` (a view, an in-place result, a
    number); ``None`` when no return needs looking at. Decided once per operator.

    Example::

        >>> import torch
        >>> return_kinds(torch.ops.aten.add.Tensor) == (NEW,), return_kinds(torch.ops.aten.view.default)
        (True, None)
    """
    plan = _PLANS.get(id(func), _UNPLANNED)
    return _plan(func) if plan is _UNPLANNED else plan



#: Per operator, by ``id``: the arguments it writes in place, as ``(position, name)`` pairs.
_WRITES: dict[int, tuple[tuple[int, str], ...]] = {}
_WRITERS: list[Any] = []  # keeps the operators whose ids key _WRITES


def written_arguments(func: Any) -> tuple[tuple[int, str], ...]:
    """The arguments the operator ``func`` writes in place (``Tensor(a!)``, ``Tensor(a!)[]``),
    as ``(position, name)`` pairs; ``()`` for none. Decided once per operator.

    Example::

        >>> import torch
        >>> written_arguments(torch.ops.aten.add_.Tensor), written_arguments(torch.ops.aten.add.Tensor)
        (((0, 'self'),), ())
        >>> written_arguments(torch.ops.aten._foreach_mul_.Scalar)
        ((0, 'self'),)
    """
    found = _WRITES.get(id(func))
    if found is None:
        schema = getattr(func, "_schema", None)
        found = tuple(
            (i, arg.name)
            for i, arg in enumerate(getattr(schema, "arguments", ()))
            if arg.alias_info is not None and arg.alias_info.is_write
        )
        _WRITERS.append(func)
        _WRITES[id(func)] = found
    return found


def _written_non_strided(func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for position, name in written_arguments(func):
        value = args[position] if position < len(args) else kwargs.get(name)
        for t in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(t, torch.Tensor) and t.layout is not _STRIDED:
                out.append(t)
    return out


def layout_rewrites(
    func: Any, args: tuple, kwargs: dict
) -> tuple[list[torch.Tensor], dict[int, weakref.ref], list[list[torch.Tensor]]] | None:
    """Before ``func(*args, **kwargs)`` runs: the non-strided tensors it writes in place, every
    input's storages now, as weak references by ``id``, and the written tensors' parts now
    (``None`` when it writes none).

    After the call, a part (:func:`~.accounting.storage_parts`) of a written tensor whose
    storage is not one of those (:func:`made_inside`) was made inside the kernel: a sparse
    ``add_`` on the CPU merges into new index and value tensors, on CUDA it concatenates them
    (CUDA's ``mul_`` copies them). The kernel makes a tensor's new parts before it drops its old
    ones, so both are held at once: the caller keeps each written tensor's old parts (the third
    item, one list per written tensor) until it has counted that tensor's new ones, then drops
    them; a ``_foreach_`` operator's loop so holds one tensor's old and new parts at a time.

    Example::

        >>> import torch
        >>> buf = torch.eye(3).to_sparse()
        >>> args = (buf, torch.eye(3).to_sparse())
        >>> written, before, held = layout_rewrites(torch.ops.aten.add_.Tensor, args, {})
        >>> _ = buf.add_(args[1])
        >>> [made_inside(p, before) for p in storage_parts(buf)], [len(parts) for parts in held]
        ([True, True], [2])
    """
    written = _written_non_strided(func, args, kwargs)
    if not written:
        return None
    before: dict[int, weakref.ref] = {}
    for value in (*args, *kwargs.values()):
        for t in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(t, torch.Tensor):
                for part in storage_parts(t):
                    try:
                        storage = part.untyped_storage()
                    except (RuntimeError, NotImplementedError, TypeError):
                        continue
                    before[id(storage)] = weakref.ref(storage)
    held = [[part for part in storage_parts(tensor) if part is not tensor] for tensor in written]
    return written, before, held


def made_inside(part: torch.Tensor, before: dict[int, weakref.ref]) -> bool:
    """Whether ``part``'s storage is none of ``before``'s (see :func:`layout_rewrites`)."""
    storage = part.untyped_storage()
    ref = before.get(id(storage))
    return ref is None or ref() is not storage


class _CountingMode(TorchDispatchMode):
    """Hands every tensor an operator returns on its thread to the registry, for its thread's tallies."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch wraps a mode's __torch_dispatch__ in a Dynamo-disabling wrapper that costs about
        # 2 us per operator, at every operator. The mode is off the stack while its handler runs,
        # so inside a compiled region Dynamo would compile the handler's own frames (and keep the
        # tensors their cached frames hold): __torch_dispatch__ turns Dynamo's frame hook off
        # itself, only where one is set (one C call of about 25 ns elsewhere).
        return False

    def __init__(self, registry: StorageRegistry) -> None:
        super().__init__()
        self.registry = registry
        self.live = registry.live
        #: the running counters started on this mode's thread; empty: switched off
        self.tallies: tuple[Tally, ...] = ()
        #: a non-strided tensor was counted: operators writing one in place are looked at
        self.sparse = registry.sparse
        #: autograd's engine sums gradient pieces in place where no mode is on, and out of
        #: place under any mode: this one's sums are put back in place (:meth:`calibrate`)
        self.sums = EngineAccumulation(plain=True)

    def calibrate(self) -> None:
        """Note how a gradient only the engine holds looks from here (this mode on top, counting
        nothing yet), so that the step's sums are made in place as without the mode. A fault here
        leaves every sum out of place (as under any mode), and the counting on."""
        try:
            self.sums.calibrate()
        except Exception as exc:  # noqa: BLE001 - the sums' rule off, never the counter
            self.sums = EngineAccumulation(plain=True)  # not calibrated: no sum in place
            _log.debug("gradient sums left out of place: %r", exc)

    def _without_dynamo(self, func, types, args, kwargs):  # type: ignore[no-untyped-def]
        # in a compiled region (a frame torch.compile runs eagerly under this mode): this handler's
        # frames run with Dynamo's frame hook off, as torch.compiler.disable(recursive=True) runs them
        try:
            prior = set_dynamo_frame_hook(None)
        except Exception as exc:  # noqa: BLE001 - the counting off, never the user's operator
            self.registry.fail(exc)
            return func._op(*args, **kwargs) if kwargs else func._op(*args)
        try:
            return self.__torch_dispatch__(func, types, args, kwargs)
        finally:
            try:
                set_dynamo_frame_hook(prior)
            except Exception as exc:  # noqa: BLE001 - as above
                self.registry.fail(exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        # The operator runs exactly once, outside any try (its errors are the user's);
        # every line of bookkeeping is inside one, so a fault there never stops it.
        # This runs for every operator of the step: each line is measured against
        # a mode that only calls the operator (benchmarks/cpu_overhead.py).
        try:
            # in a compiled region nothing more runs here before Dynamo's frame hook is off
            compiling = dynamo_frame_hook() is not None
            tallies, rewrites = (), None
            if not compiling:
                tallies = self.tallies
                rewrites = layout_rewrites(func, args, kwargs or {}) if self.sparse and tallies else None
                if func is ENGINE_SUM and not kwargs and self.sums.in_place(args, {}):
                    # the engine's sum of gradient pieces, into the first: as the step makes it unwatched
                    func = ENGINE_SUM_IN_PLACE
        except Exception as exc:  # noqa: BLE001 - never break the user's operator
            compiling, tallies, rewrites = False, (), None
            self.registry.fail(exc)
        if compiling:
            return self._without_dynamo(func, types, args, kwargs)
        out = func._op(*args, **kwargs) if kwargs else func._op(*args)
        if not tallies:
            return out
        try:
            if rewrites is not None:
                self.registry.rewritten(*rewrites, tallies)
            plan = _PLANS.get(id(func), _UNPLANNED)
            if plan is None:
                # Views, in-place results, numbers: most operators of an optimizer step.
                return out
            if plan is _ONE_NEW:
                # One result that may own a new storage (mm, relu, div, ...), inlined.
                if type(out) is _Tensor and out.layout is _STRIDED:
                    if out.is_cpu:
                        storage = out.untyped_storage()
                        key = id(storage)
                        if key not in self.live:
                            self.registry.add(storage, key, tallies)
                    return out
            elif plan is _UNPLANNED:
                plan = _plan(func)
                if plan is None:
                    return out
            elif type(out) is tuple and plan in _ALL_NEW:
                # Several new results (max.dim, convolution_backward, max_pool2d_with_indices):
                # each plain CPU tensor among them is looked at, without the general walk.
                live, registry = self.live, self.registry
                for item in out:
                    if type(item) is _Tensor and item.layout is _STRIDED:
                        if item.is_cpu:
                            storage = item.untyped_storage()
                            key = id(storage)
                            if key not in live:
                                registry.add(storage, key, tallies)
                    elif item is not None:
                        registry.see(item, _ONE_NEW, tallies, args)
                return out
            self.registry.see(out, plan, tallies, args)
        except Exception as exc:  # noqa: BLE001 - never break the user's operator
            self.registry.fail(exc)
        return out


# Dynamo runs the handler's own frames as they are (their callees run with its hook off, above)
never_compiled(_CountingMode.__torch_dispatch__.__code__)
never_compiled(_CountingMode._without_dynamo.__code__)


class StorageRegistry:
    """Every counted CPU storage of the process, once, with the tallies that count it.

    Use :func:`shared_registry`: one registry for the process is what lets
    counters start and stop in any order. A counter counts the storages made on
    the thread it started on (and in the autograd work that thread runs), as a
    dispatch mode does; all counters of a thread share that thread's one mode.
    """

    def __init__(self) -> None:
        #: live storages by ``id(storage)``; a storage's id cannot be reused before its
        #: weak-reference callback has removed it
        self.live: dict[int, _StorageRef] = {}
        self._lock = threading.RLock()
        self._modes: dict[int, _CountingMode] = {}  # by thread ident: counting there now
        self._waiting: dict[int, _CountingMode] = {}  # switched off, not yet off their stack
        self._mode_of: dict[Tally, _CountingMode] = {}
        self._hooks: list[Any] = []
        self._died = self._storage_died  # one bound method for every weak reference
        self._failed = False
        #: a non-strided tensor (sparse) was counted since the first counter started
        self.sparse = False

    # -- lifecycle ----------------------------------------------------------
    def start(self, tally: Tally) -> None:
        """Count storages made on this thread from now on into ``tally``; push the mode if needed."""
        with self._lock:
            if self._failed or tally in self._mode_of:
                return
            ident = threading.get_ident()
            mode = self._modes.get(ident) or self._waiting.pop(ident, None)
            if mode is None or not _on_stack(mode):
                mode = _CountingMode(self)
                mode.__enter__()
                mode.calibrate()
            mode.sparse = self.sparse
            # A mode still on the stack, switched off, is switched on again: nothing is pushed.
            self._modes[ident] = mode
            mode.tallies = (*mode.tallies, tally)
            if not self._mode_of:
                watch_storage_resizes(self._storage_resized)
            self._mode_of[tally] = mode
            self._leave_where_possible()  # forget the modes of threads that ended
            if not self._waiting:
                self._remove_hooks()

    def stop(self, tally: Tally) -> None:
        """Stop counting into ``tally``; the last counter of a thread takes its mode away.

        Safe to call again after it raised: each step is done again or found done.
        """
        with self._lock:
            mode = self._mode_of.get(tally)
            if mode is not None:
                mode.tallies = tuple(t for t in mode.tallies if t is not tally)
                if not mode.tallies:
                    for ident, running in list(self._modes.items()):
                        if running is mode:
                            del self._modes[ident]
                            self._waiting[ident] = mode
                del self._mode_of[tally]
            self._forget(tally)
            if not self._mode_of:
                unwatch_storage_resizes(self._storage_resized)
                self.live.clear()  # drops the weak references: no callback will run
                self._failed = False
                self.sparse = False
            self._leave_where_possible()
            if self._waiting and not self._hooks:
                self._wait_for_a_chance()

    @property
    def failed(self) -> bool:
        """Whether a fault stopped the counting (:meth:`fail`) since the first counter started."""
        return self._failed

    def installed(self) -> bool:
        """Whether a counting mode of this registry is on the current thread's mode stack."""
        ident = threading.get_ident()
        return any(
            mode is not None and _on_stack(mode)
            for mode in (self._modes.get(ident), self._waiting.get(ident))
        )

    # -- counting -------------------------------------------------------------
    def see(self, out: Any, plan: tuple[int, ...], tallies: tuple[Tally, ...], inputs: Any = ()) -> None:
        """Count the new storages among an operator's returns ``out`` into ``tallies``.

        ``inputs``: the operator's arguments, which a sparse result may wrap.
        """
        if isinstance(out, torch.Tensor):
            kind = plan[0]
            if kind == _NEW:
                if out.layout is not _STRIDED:
                    self._new_sparse(out, tallies, inputs)
                else:
                    self._new(out, tallies)
            elif kind == _RESIZED:
                self._resized(out)
        elif isinstance(out, (tuple, list)):
            last = plan[-1]
            for i, item in enumerate(out):
                if isinstance(item, torch.Tensor):
                    kind = plan[i] if i < len(plan) else last
                    if kind == _NEW:
                        if item.layout is not _STRIDED:
                            self._new_sparse(item, tallies, inputs)
                        else:
                            self._new(item, tallies)
                    elif kind == _RESIZED:
                        self._resized(item)

    def _new(self, tensor: torch.Tensor, tallies: tuple[Tally, ...]) -> None:
        if not tensor.is_cpu:
            return
        if type(tensor) not in PLAIN_TENSORS:
            parts = storage_parts(tensor)  # a DTensor's memory is its local shard, not its global shape
            if len(parts) != 1 or parts[0] is not tensor:
                for part in parts:
                    self._new(part, tallies)
                return
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError, TypeError):
            return  # sparse, nested or wrapper tensors without one plain storage
        key = id(storage)
        if key not in self.live:
            self.add(storage, key, tallies)

    def _new_sparse(self, tensor: torch.Tensor, tallies: tuple[Tally, ...], inputs: Any) -> None:
        """A sparse tensor's memory is its index and value tensors; those that are an input
        of the operator (embedding backward wraps its input as the indices) are no new memory."""
        if not tensor.is_cpu:
            return
        self._saw_sparse()
        given = {
            id(part.untyped_storage())
            for t in inputs
            if isinstance(t, torch.Tensor) and t.is_cpu
            for part in storage_parts(t)
        }
        for part in storage_parts(tensor):
            if part is tensor:
                continue
            storage = part.untyped_storage()
            key = id(storage)
            if key not in given and key not in self.live:
                self.add(storage, key, tallies)

    def _saw_sparse(self) -> None:
        if not self.sparse:
            self.sparse = True
            for mode in (*self._modes.values(), *self._waiting.values()):
                mode.sparse = True

    def rewritten(
        self, written: list[torch.Tensor], before: dict[int, weakref.ref], held: list[list[torch.Tensor]], tallies: tuple[Tally, ...]
    ) -> None:
        """Count the parts of ``written`` (non-strided tensors an operator wrote in place) that
        are new: no input's storage before the call (:func:`layout_rewrites`), not counted yet;
        each tensor's old parts (``held``) are let go after its new ones are counted."""
        for tensor, old in zip(written, held):
            if tensor.is_cpu:
                for part in storage_parts(tensor):
                    if part is tensor:
                        continue
                    storage = part.untyped_storage()
                    key = id(storage)
                    if key not in self.live and made_inside(part, before):
                        self.add(storage, key, tallies)
            old.clear()  # its old parts die now, after its new ones are born

    def add(self, storage: torch.UntypedStorage, key: int, tallies: tuple[Tally, ...]) -> None:
        """Count a storage not counted yet into ``tallies``."""
        nbytes = storage.nbytes()
        ref = _StorageRef(storage, self._died)
        ref.key = key
        ref.nbytes = nbytes
        ref.owners = tallies
        self.live[key] = ref
        for tally in tallies:
            tally.changes.append(nbytes)
            keyed = tally.keyed  # kept only while the peak's make-up is wanted
            if keyed is not None:
                keyed.append((ref, nbytes))

    def adopt(self, tensors: Iterable[Any], tally: Tally) -> None:
        """Count storages made before ``tally`` started (a model's weights) into it, each once."""
        for whole in tensors:
            if not isinstance(whole, torch.Tensor) or not whole.is_cpu:
                continue
            if whole.layout is not _STRIDED:
                self._saw_sparse()
            for tensor in storage_parts(whole):  # a sparse tensor: its indices and values
                self._adopt_one(tensor, tally)

    def _adopt_one(self, tensor: torch.Tensor, tally: Tally) -> None:
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError, TypeError):
            return
        key = id(storage)
        ref = self.live.get(key)
        if ref is None:
            self.add(storage, key, (tally,))
        elif tally not in ref.owners:
            ref.owners = (*ref.owners, tally)
            tally.changes.append(ref.nbytes)
            if tally.keyed is not None:
                tally.keyed.append((ref, ref.nbytes))

    def _resized(self, tensor: torch.Tensor) -> None:
        if not tensor.is_cpu:
            return
        for part in storage_parts(tensor):
            try:
                storage = part.untyped_storage()
            except (RuntimeError, NotImplementedError, TypeError):
                continue
            self._storage_resized(storage)

    def _storage_resized(self, storage: torch.UntypedStorage, _before: int | None = None) -> None:
        """A counted storage may have a new size: ``out=`` kernels, ``storage.resize_``."""
        ref = self.live.get(id(storage))
        if ref is None:
            return  # a storage made before counting began
        nbytes = storage.nbytes()
        if nbytes != ref.nbytes:
            change, ref.nbytes = nbytes - ref.nbytes, nbytes
            for tally in ref.owners:
                tally.changes.append(change)
                if tally.keyed is not None:
                    tally.keyed.append((ref, change))

    def _storage_died(self, ref: _StorageRef) -> None:
        try:  # a weak-reference callback: a fault would only be printed, and the figures wrong
            live, key = self.live, ref.key
            if live.get(key) is ref:
                del live[key]
            change = -ref.nbytes
            for tally in ref.owners:
                tally.changes.append(change)
                keyed = tally.keyed
                if keyed is not None:
                    keyed.append((ref, change))
        except Exception as exc:  # noqa: BLE001 - counting stops, training goes on
            self.fail(exc)

    def _forget(self, tally: Tally) -> None:
        """Take a stopped tally off every storage, so that nothing keeps it alive."""
        for key, ref in list(self.live.items()):
            if tally in ref.owners:
                ref.owners = tuple(t for t in ref.owners if t is not tally)
                if not ref.owners:
                    self.live.pop(key, None)

    def ref_of(self, tensor: torch.Tensor) -> _StorageRef | None:
        """The live counted storage of a strided CPU tensor (``None``: not counted)."""
        tensor = storage_holder(tensor)  # a DTensor: its local shard
        try:
            return self.live.get(id(tensor.untyped_storage()))
        except (RuntimeError, NotImplementedError, TypeError):
            return None

    def watch(self, tally: Tally) -> tuple[dict[Any, int], list[tuple[Any, int]]]:
        """Start keying ``tally``'s changes by storage: the storages it counts now with their
        bytes, and the list each later change is appended to as ``(storage reference, bytes)``."""
        with self._lock:
            alive = {ref: ref.nbytes for ref in list(self.live.values()) if tally in ref.owners}
            keyed: list[tuple[Any, int]] = []
            tally.keyed = keyed
            return alive, keyed

    def unwatch(self, tally: Tally) -> None:
        """Stop keying ``tally``'s changes."""
        tally.keyed = None

    def fail(self, exc: BaseException) -> None:
        """A fault while counting: stop counting (figures would be wrong), log it once."""
        with self._lock:
            if self._failed:
                return
            self._failed = True
            for mode in self._modes.values():
                mode.tallies = ()
        try:  # called from the dispatch mode and weak-reference callbacks: a failed log line stays here
            _log.warning(
                "pytorch_mem_profiler: the CPU storage counter failed and is switched off; "
                "training continues (%s: %s)",
                type(exc).__name__,
                exc,
                exc_info=exc,
            )
        except Exception:  # noqa: BLE001 - a log line is not worth the training run
            pass

    # -- leaving torch's mode stack ------------------------------------------------
    def _leave_where_possible(self) -> None:
        """Pop this thread's switched-off mode if it is on top again; forget ones no longer on a stack."""
        # Threads that ended took their stacks with them.
        alive = {t.ident for t in threading.enumerate()}
        for gone in [i for i in self._waiting if i not in alive]:
            del self._waiting[gone]
        ident = threading.get_ident()
        mode = self._waiting.get(ident)
        if mode is None:
            return
        stack = _get_current_dispatch_mode_stack()
        if stack and stack[-1] is mode:
            mode.__exit__(None, None, None)
            del self._waiting[ident]
        elif not any(m is mode for m in stack):
            del self._waiting[ident]  # taken off by someone else

    def _a_chance(self, *args: Any, **kwargs: Any) -> None:
        """Run at each module forward or optimizer step while a switched-off mode waits."""
        try:
            with self._lock:
                self._leave_where_possible()
                if not self._waiting:
                    self._remove_hooks()
        except Exception as exc:  # noqa: BLE001 - never break the user's forward
            _log.debug("pytorch_mem_profiler: leaving the mode stack failed: %s", exc)
        return None

    def _wait_for_a_chance(self) -> None:
        from torch.nn.modules.module import register_module_forward_pre_hook
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        _log.warning(
            "pytorch_mem_profiler: the CPU counter's dispatch mode cannot leave torch's mode "
            "stack now (another TorchDispatchMode is active above it, or it was closed from "
            "another thread); it is switched off and leaves at the first forward or optimizer "
            "step that finds it on top"
        )
        self._hooks = [
            register_module_forward_pre_hook(self._a_chance),
            register_optimizer_step_pre_hook(self._a_chance),
        ]

    def _remove_hooks(self) -> None:
        hooks, self._hooks = self._hooks, []
        for handle in hooks:
            handle.remove()


def _on_stack(mode: TorchDispatchMode) -> bool:
    return any(m is mode for m in _get_current_dispatch_mode_stack())


_REGISTRY = StorageRegistry()


def shared_registry() -> StorageRegistry:
    """The process's one :class:`StorageRegistry`."""
    return _REGISTRY
