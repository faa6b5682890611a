"""Feature maps by layer: which module's forward saved the tensors autograd keeps for backward.

During a reported iteration's forward (only then: the cost is divided by
``print_period``) a ``saved_tensors_hooks`` pack hook sees every tensor autograd
really keeps for backward, and global module hooks keep a stack of the modules
running, so each saved storage is put down to the innermost module whose
forward saved it (its fully qualified name, e.g. ``encoder.layers.3.self_attn``;
``net.0`` when a framework enters the model through its child ``net``).

The pack hook is chained to the saved-tensor hooks that were active
(:mod:`.saved_tensors`): the user's ``save_on_cpu()`` or hand-written pair runs
exactly as without the profiler, and what is counted is what the user's hook
left on the profiled device (nothing for tensors moved to the CPU, the
float16 copy for a hook that casts). Torch older than 2.8 cannot tell which
hooks are active, so there nothing is pushed and no tensor is attributed
(:attr:`LayerAttribution.watching_saved_tensors` is False); the peak locations
below still work.

- each storage counts once (views of it, the same tensor saved twice);
- parameters and buffers are left out (they are weights and buffers already);
- the model's inputs count apart, as ``(input)``;
- copies of weights that autocast made (bf16/fp16) are their own category,
  ``weight copies``, under the module that saved them;
- a module called several times in one forward is summed, with a call count;
- checkpointed blocks (``torch.utils.checkpoint``) save nothing through these
  hooks: what they keep (their inputs) shows in what no module saved;
- a pair of saved-tensor hooks the model pushes inside its forward (a block that
  runs its layers under ``save_on_cpu()``) is watched over from the next module
  whose forward begins under it (:func:`.saved_tensors.watch_over_inner_hooks`):
  its layers' tensors count as that pair keeps them. What a module saves in its
  own forward under a pair pushed there (no module call between) is not seen.

The same module hooks tell the phase machine (``on_exit``, ``on_backward_enter``)
where a few modules (those at the depth where there are at most
``MAX_LOCATIONS`` of them) end their forward, and where backward reaches their
outputs, so the profiler can tell in which module an iteration's peak was
reached: a forward interval ending with a module's forward is put down to that
module.

:class:`LayerAttribution` is an observer (:mod:`.observers`) of the iterations
whose plan is at the ``"full"`` level: it attributes each forward pass from its
start (:meth:`LayerAttribution.forward_began`) to its exits from the model, and
gives the record the breakdown of the pass that kept the most
(:meth:`LayerAttribution.finish`).

Example::

    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU())
    >>> attribution = LayerAttribution(model, torch.device("cpu"))
    >>> x = torch.randn(4, 8)
    >>> attribution.start((x,))
    >>> y = model(x)
    >>> breakdown = attribution.stop()
    >>> breakdown.by_module.get(("1", "activations")) == 4 * 16 * 4 or not can_chain()  # ReLU keeps its output
    True
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass, field
from threading import get_ident
from typing import Any, Callable

import torch
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

from types import MappingProxyType

from ..faults import FaultGuard
from ..stats import ACTIVATIONS, INPUT, WEIGHT_COPIES, LayerFeatureMaps
from .accounting import PLAIN_TENSORS, DeviceMatch, storage_parts
from .observers import Observer
from .saved_tensors import ChainedSavedTensorsHooks, InnerWatch, can_chain, watch_over_inner_hooks
from .trees import is_compiled, output_grad_nodes, tensors_in

__all__ = [
    "LayerAttribution",
    "LayerBreakdown",
    "INPUT",
    "ACTIVATIONS",
    "WEIGHT_COPIES",
    "MAX_LOCATIONS",
    "ATTRIBUTION_PART",
    "is_compiled",
]

_log = logging.getLogger("pytorch_mem_profiler")

#: The part of the profiler a fault in these hooks switches off (the fault guard's name for it).
ATTRIBUTION_PART = "per-layer attribution"

#: At most this many modules mark peak locations (the deepest level that fits):
#: each mark is one read of the allocator's counters.
MAX_LOCATIONS = 16


@dataclass
class LayerBreakdown:
    """The storages one forward saved for backward, by module, in bytes."""

    #: bytes by (module name, category)
    by_module: dict[tuple[str, str], int] = field(default_factory=dict)
    #: forward calls per module name
    calls: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        """Bytes saved by modules (the inputs not included)."""
        return sum(n for (module, _), n in self.by_module.items() if module != INPUT)

    @property
    def inputs(self) -> int:
        return sum(n for (module, _), n in self.by_module.items() if module == INPUT)


def _tracked_modules(model: torch.nn.Module, limit: int) -> dict[int, str]:
    """Modules whose boundaries mark peak locations: every module down to the deepest
    level that keeps them at most ``limit`` (the root excluded)."""
    by_depth: dict[int, list[tuple[str, torch.nn.Module]]] = {}
    for name, module in model.named_modules():
        if name:
            by_depth.setdefault(name.count(".") + 1, []).append((name, module))
    chosen: dict[int, str] = {}
    for depth in sorted(by_depth):
        candidate = dict(chosen)
        candidate.update({id(m): n for n, m in by_depth[depth]})
        if len(candidate) > limit:
            break
        chosen = candidate
    return chosen


class ModelMap:
    """What the attribution knows of the model: its modules' names, the modules that mark peak
    locations, its parameters' names and the storages of its parameters and buffers.

    Learnt at construction and again at :meth:`LayerAttribution.refresh` (after the model changed);
    :meth:`for_entry` names an ``nn.DataParallel`` replica's modules after the model's.

    Example::

        >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
        >>> known = ModelMap(model, max_locations=16)
        >>> sorted(known.tracked.values()), known.param_names[id(model[0].weight)]
        (['0', '1'], '0.weight')
        >>> known.for_entry(None) == (known.names, known.root, known.tracked)
        True
    """

    __slots__ = ("max_locations", "names", "root", "tracked", "param_names", "state_ptrs")

    def __init__(self, model: torch.nn.Module, max_locations: int) -> None:
        self.max_locations = max_locations
        self.names = {id(m): name for name, m in model.named_modules()}
        self.root = id(model)
        self.tracked = _tracked_modules(model, max_locations)
        self.state_ptrs: set[tuple[int, int]] = set()
        self.param_names: dict[int, str] = {}
        for name, p in model.named_parameters():
            self.param_names[id(p)] = name
            self.state_ptrs.update(_storage_key(part) for part in storage_parts(p))
        for b in model.buffers():
            if b is not None:
                self.state_ptrs.update(_storage_key(part) for part in storage_parts(b))

    def for_entry(self, entry: torch.nn.Module | None) -> tuple[dict[int, str], int, dict[int, str]]:
        """``(names, root, tracked)`` of the forward that enters through ``entry``: the model's, or
        where it is an ``nn.DataParallel`` replica (copied from the model at each call, modules and
        all), the replica's, under the names of the modules they copy."""
        if entry is None or not getattr(entry, "_is_replica", False):
            return self.names, self.root, self.tracked
        names = {id(m): name for name, m in entry.named_modules()}
        tracked = set(self.tracked.values())
        return names, id(entry), {key: name for key, name in names.items() if name in tracked}


class _Installed:
    """The hooks one attributed forward installs: the global module hooks' handles and the pair of
    saved-tensor hooks pushed on the thread's stack, removed together."""

    __slots__ = ("handles", "saved")

    def __init__(self, handles: list, saved: ChainedSavedTensorsHooks) -> None:
        self.handles, self.saved = handles, saved


class LayerAttribution(Observer):
    """Attributes saved tensors to modules during one forward at a time.

    Args:
        model: the root module.
        device: only storages on this device are counted.
        on_exit: called with two module names when a tracked module's forward
            ends: the one that ended and the one the running code is back in.
        on_backward_enter: called with a module name when backward reaches the
            outputs of a tracked module.
    """

    part = ATTRIBUTION_PART

    def __init__(
        self,
        model: torch.nn.Module,
        device: torch.device,
        on_exit: Callable[[str, str], None] | None = None,
        on_backward_enter: Callable[[str], None] | None = None,
        max_locations: int = MAX_LOCATIONS,
        guard: FaultGuard | None = None,
    ) -> None:
        self.model = model
        #: contains the faults of the hooks it installs (part :data:`ATTRIBUTION_PART`)
        self.guard = guard or FaultGuard()
        # whether a saved tensor's device is this one, by device object (the pack hook asks for each)
        self._on_device = DeviceMatch(device)
        self.on_exit = on_exit
        self.on_backward_enter = on_backward_enter
        self._learn(ModelMap(model, max_locations))
        # the module hooks and the saved-tensor pair of the forward attributed now (None: none)
        self._installed: _Installed | None = None
        # the modules running: (id, name), and where one began under the model's own saved-tensor
        # hooks, the pair pushed over them (id, name, InnerWatch), taken off where it ends
        self._stack: list[tuple[Any, ...]] = []
        # the forward's thread: the module hooks are global, and another thread's modules (a
        # DataParallel replica on another GPU) run meanwhile
        self._thread: int | None = None
        # the storages this forward saw, by key; a counted one with a weak reference to it, where its
        # bytes went and how many (a storage saved in a branch the forward drops dies before its end)
        self._seen: dict[tuple[int, int], tuple[weakref.ref, tuple[str, str], int] | None] = {}
        self._inputs: set[tuple[int, int]] = set()
        self._current = LayerBreakdown()
        self.begin(None)

    def refresh(self) -> None:
        """Learn the model's module names, parameters and buffers again (after it changed)."""
        self._learn(ModelMap(self.model, self._map.max_locations))

    def _learn(self, known: ModelMap) -> None:
        self._map = known
        # read on every module call and saved tensor: the map's, bound here
        self._names, self._root, self._tracked = known.for_entry(None)
        self._state_ptrs = known.state_ptrs

    # -- one forward -------------------------------------------------------
    def start(self, inputs: Any, entry: torch.nn.Module | None = None) -> None:
        """Begin attributing a forward pass: call where it begins.

        ``inputs`` are the arguments the model was entered with (their storages
        count as ``(input)``); ``entry`` the module it was entered through, when
        that is not the root (``net`` under a wrapper whose method calls ``self.net``).
        """
        self._current = LayerBreakdown()
        self._seen = {}
        self._inputs = set()
        self.resume(inputs, entry)

    def resume(self, inputs: Any, entry: torch.nn.Module | None = None) -> None:
        """Attribute again within the same forward pass (a second module entered from outside,
        e.g. ``self.decoder`` after ``self.encoder``): the figures add up."""
        self.close()
        self._names, self._root, self._tracked = self._map.for_entry(entry)
        self.add_inputs(inputs)
        self._stack = [(self._root, "")]
        self._thread = get_ident()
        if entry is not None and id(entry) != self._root:
            name = self._names.get(id(entry))
            if name is not None:
                # Entered from its own pre-hook, before the module hooks below exist.
                self._stack.append((id(entry), name))
                self._current.calls[name] = self._current.calls.get(name, 0) + 1
        # Dropped at close(): they refer back to this object. Each holds its fault guard's
        # ``try`` itself (no wrapper frame: they run twice per module call).
        # Each hook is put down where close() finds it before the next is installed: a fault
        # between two leaves nothing behind.
        saved = ChainedSavedTensorsHooks(self._observe_saved, lambda exc: self.guard.fault(ATTRIBUTION_PART, exc))
        installed = self._installed = _Installed([], saved)
        installed.handles.append(register_module_forward_pre_hook(self._module_pre))
        installed.handles.append(register_module_forward_hook(self._module_post, always_call=True))
        saved.push()

    def add_inputs(self, inputs: Any) -> None:
        """Count the storages of ``inputs`` as the model's input."""
        for t in tensors_in(inputs):
            for part in storage_parts(t):
                self._inputs.add(_storage_key(part))

    def stop(self) -> LayerBreakdown:
        """End attributing (at the end of the forward) and hand back what was saved."""
        self.close()
        self._drop_dead()
        return self._current

    def _drop_dead(self) -> None:
        """Take out what storages that died before the forward ended had counted: saved in a branch
        whose graph the forward dropped (scores computed only for ``topk`` or ``argmax`` indices),
        they are not kept for backward."""
        for key in list(self._seen):
            self._still_held(key)

    @property
    def breakdown(self) -> LayerBreakdown:
        """What the running (or last) forward pass saved so far."""
        return self._current

    def current_module(self) -> str:
        """The name of the innermost module running now (``""``: the model's own code)."""
        return self._stack[-1][1] if self._stack else ""

    @property
    def watching_saved_tensors(self) -> bool:
        """Whether saved tensors can be watched here (torch 2.8 or later: see :mod:`.saved_tensors`)."""
        return can_chain()

    def close(self) -> None:
        """Remove the hooks, if installed; safe to call at any time (and again after it raised)."""
        for entry in reversed(self._stack):
            if len(entry) == 3:
                entry[2].pop()
        self._stack = [entry[:2] for entry in self._stack]
        installed = self._installed
        if installed is None:
            return
        installed.saved.pop()
        self._installed = None  # only once popped, so that a second call pops what a failed one left
        for handle in installed.handles:
            handle.remove()

    # -- the observer's events (iterations at the "full" level) --------------------------
    def begin(self, plan: Any) -> None:
        # the tracked modules whose outputs tell when backward reaches them (None: every one; the
        # plan reads backward at a few: no gradient hook on the others' outputs)
        marks = plan.backward_marks if plan is not None else None
        self._reach: frozenset[str] | None = None if marks is None else frozenset(marks)
        # whether the running pass is attributed; the breakdown of the pass that kept the most
        # (and what it kept), and the most any pass kept
        self._attributed = False
        self._largest: tuple[LayerBreakdown, int] | None = None  # the breakdown, what that pass kept
        self._most_kept = 0

    def forward_began(self, args: Any, entry: Any) -> None:
        self._attributed = False
        if ATTRIBUTION_PART in self.guard.disabled:
            return
        try:
            self.start(args, entry=entry)
        except Exception:
            self.close()
            raise
        self._attributed = True

    def forward_resumed(self, args: Any, entry: Any) -> None:
        if not self._attributed or ATTRIBUTION_PART in self.guard.disabled:
            return
        try:
            self.resume(args, entry=entry)
        except Exception:
            self._attributed = False
            self.close()
            raise

    def inputs_seen(self, args: Any) -> None:
        if self._attributed:
            self.add_inputs(args)

    def forward_left(self) -> None:
        if self._attributed:
            # Skipped once a fault switched it off: the meter then closes it between iterations
            # (a pop here can run inside backward, whose saved-tensor stack is not the thread's).
            self.guard.call(ATTRIBUTION_PART, self.close)

    def forward_closed(self, kept: int | None) -> None:
        attributed, self._attributed = self._attributed, False
        if attributed:
            self._drop_dead()
        if kept is None:
            return
        if (
            attributed
            and self.watching_saved_tensors
            # switched off by a fault during this forward: what it put down so far may be partial
            and ATTRIBUTION_PART not in self.guard.disabled
            and (kept > self._most_kept or self._largest is None)
        ):
            self._largest = (self._current, kept)
        self._most_kept = max(self._most_kept, kept)

    def finish(self) -> LayerFeatureMaps | None:
        """The iteration's part: what the forward pass that kept the most saved, by module
        (``None``: no pass was attributed); what it kept beyond that is ``unattributed``."""
        if self._largest is None:
            return None
        breakdown, kept = self._largest
        total = breakdown.total
        return LayerFeatureMaps(
            by_module=MappingProxyType(dict(breakdown.by_module)),
            calls=MappingProxyType(dict(breakdown.calls)),
            total=total,
            inputs=breakdown.inputs,
            unattributed=kept - total,
        )

    # -- hooks -------------------------------------------------------------
    def _module_pre(self, module: torch.nn.Module, args: Any) -> None:
        try:  # torch calls this: contained as ``guard.wrap`` would
            if ATTRIBUTION_PART in self.guard.disabled or get_ident() != self._thread:
                return
            key = id(module)
            if key == self._root:
                return
            name = self._names.get(key)
            if name is None:  # a module made on the fly: its tensors go to its caller
                name = self._stack[-1][1]
            else:
                self._current.calls[name] = self._current.calls.get(name, 0) + 1
            # None unless the model pushed a pair of its own
            inner = watch_over_inner_hooks() if self._installed is not None else None
            self._stack.append((key, name) if inner is None else (key, name, inner))
        except Exception as exc:  # noqa: BLE001 - any profiler fault must be contained
            self.guard.fault(ATTRIBUTION_PART, exc)

    def _module_post(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        try:  # torch calls this: contained as ``guard.wrap`` would
            if ATTRIBUTION_PART in self.guard.disabled or get_ident() != self._thread:
                return
            key = id(module)
            stack = self._stack
            if stack and len(stack[-1]) == 3 and stack[-1][0] == key:
                inner: InnerWatch = stack[-1][2]
                stack[-1] = stack[-1][:2]
                if not inner.pop():
                    raise RuntimeError(f"the saved-tensor hooks pushed in {self._names.get(key, '?')}'s forward were not popped there")
            if key == self._root or len(stack) <= 1 or stack[-1][0] != key:
                return
            _, name = stack.pop()
            if key in self._tracked:
                if self.on_exit is not None:
                    self.on_exit(name, stack[-1][1])
                if self.on_backward_enter is not None and (self._reach is None or name in self._reach):
                    if isinstance(output, torch.Tensor):  # ``_watch_backward``'s common case, inline
                        node = output.grad_fn
                        if node is not None:
                            node.register_prehook(_BackwardEntered(self.guard, self.on_backward_enter, name))
                    else:
                        self._watch_backward(name, output)
        except Exception as exc:  # noqa: BLE001 - any profiler fault must be contained
            self.guard.fault(ATTRIBUTION_PART, exc)

    def _watch_backward(self, name: str, output: Any) -> None:
        prehook = _BackwardEntered(self.guard, self.on_backward_enter, name)  # type: ignore[arg-type]
        if isinstance(output, torch.Tensor):  # the common case, without walking a structure
            node = output.grad_fn
            if node is not None:
                node.register_prehook(prehook)
            return
        for node in output_grad_nodes(output, limit=4):
            node.register_prehook(prehook)

    def _observe_saved(self, kept: Any) -> None:
        """One saved tensor, as kept for backward: the tensor itself, or what the user's
        pack hook made of it (only what stays on the profiled device counts)."""
        if type(kept) is tuple and len(kept) == 2 and type(kept[1]) is int:
            # What a watcher below (the peak breakdown's) keeps: (tensor, version); the int holds no tensor.
            kept = kept[0]
        if type(kept) in PLAIN_TENSORS and kept.layout is torch.strided:
            # The common case: the tensor is its one piece of memory. ``_attribute``, inline (this
            # runs for every saved tensor): a storage seen already (a view saved again, the next
            # layer's input) or a weight's (Linear saves ``weight.t()``) ends here.
            dev = kept.device
            if not self._on_device[dev]:
                return
            storage = kept.untyped_storage()
            key = (storage.data_ptr(), dev.index or 0)
            if key[0] == 0 or key in self._state_ptrs or (key in self._seen and self._still_held(key)):
                return
            self._count(key, storage, kept)
            return
        for t in tensors_in(kept):
            for part in storage_parts(t):
                self._attribute(part, t)

    def _attribute(self, part: torch.Tensor, saved: torch.Tensor) -> None:
        # ``same_device`` with the attributed device and ``_storage_key(part)``, inline for a plain tensor:
        # this runs for every saved tensor.
        dev = part.device
        if not self._on_device[dev]:
            return
        if type(part) in PLAIN_TENSORS:
            storage = part.untyped_storage()
            key = (storage.data_ptr(), dev.index or 0)
        else:
            key = _storage_key(part)
            storage = None
        if key[0] == 0 or key in self._state_ptrs or (key in self._seen and self._still_held(key)):
            return
        self._count(key, storage if storage is not None else part.untyped_storage(), saved)

    def _still_held(self, key: tuple[int, int]) -> bool:
        """Whether the storage counted at ``key`` is alive (not counted: taken as alive); a dead
        one's bytes are taken out (once), and a storage at its address now is a new one."""
        counted = self._seen[key]
        if counted is None or counted[0]() is not None:
            return True
        _, slot, nbytes = counted
        self._current.by_module[slot] -= nbytes
        self._seen[key] = None
        return False

    def _count(self, key: tuple[int, int], storage: Any, saved: torch.Tensor) -> None:
        """A storage seen for the first time in this forward, not a weight's: its bytes go to the
        model's input or to the module running now."""
        if key in self._inputs:
            module, category = INPUT, ACTIVATIONS
        else:
            module = self._stack[-1][1] if self._stack else ""
            category = WEIGHT_COPIES if self._is_weight_copy(saved) else ACTIVATIONS
        slot = (module, category)
        nbytes = storage.nbytes()
        by_module = self._current.by_module
        by_module[slot] = by_module.get(slot, 0) + nbytes
        try:
            self._seen[key] = (weakref.ref(storage), slot, nbytes)
        except TypeError:  # a storage that takes no weak reference: taken as kept to the end
            self._seen[key] = None

    def _is_weight_copy(self, t: torch.Tensor) -> bool:
        """A cast of a parameter (autocast's bf16/fp16 weight copies), or a view of one.

        Linear saves ``weight.t()``: the view's base is the cast.
        """
        if t._is_view() and t._base is not None:
            t = t._base
        node = t.grad_fn
        if node is None or type(node).__name__ != "ToCopyBackward0":
            return False
        for next_node, _ in node.next_functions:
            variable = getattr(next_node, "variable", None)
            if variable is not None and id(variable) in self._map.param_names:
                return True
        return False


class _BackwardEntered:
    """A prehook on a tracked module's output nodes: tells ``callback`` once that backward reached
    the module. Contained as ``guard.wrap`` would (autograd calls it), without a wrapper made per call."""

    __slots__ = ("guard", "disabled", "callback", "name", "fired")

    def __init__(self, guard: FaultGuard, callback: Callable[[str], None], name: str) -> None:
        self.guard, self.callback, self.name, self.fired = guard, callback, name, False
        self.disabled = guard.disabled  # the guard's own set, added to in place

    def __call__(self, grad_outputs: Any) -> None:
        try:
            if ATTRIBUTION_PART in self.disabled or self.fired:
                return
            self.fired = True
            self.callback(self.name)
        except Exception as exc:  # noqa: BLE001 - any profiler fault must be contained
            self.guard.fault(ATTRIBUTION_PART, exc)


def _storage_key(t: torch.Tensor) -> tuple[int, int]:
    """A strided tensor's storage: (address, device index)."""
    local = getattr(t, "_local_tensor", t)
    return (local.untyped_storage().data_ptr(), local.device.index or 0)
