"""Where a training forward enters the model: found without the root's ``forward`` being called.

Frameworks often never call the profiled module's own ``forward``: Lightning calls
``LightningModule.training_step``, which calls ``self.net(x)``; a training step may
call ``self.encoder(x)`` and then ``self.decoder(z)``. A forward is found as the
first module *of this model* entered from outside the model's other modules
(depth tracking: calls nested in a running module of the model are not entries).

Why hooks are placed this way (host time measured on CPU, torch 2.13, one thread,
a model of 51 trivial modules, 30 interleaved rounds, medians):

- global module hooks (``register_module_forward_pre_hook``) cost about 2.1 us
  per module call, and tax every module of every model in the process;
- a pre- and post-hook on every module of the model cost about 1.8 us per
  module call (2.7 us with the depth tracking below): 180-270 us per
  iteration for a 100-module model;
- hooks on one module cost about 4.6 us per call of that module.

So every module of the model is hooked only until the first training forward
has shown which modules it enters through (*learning*, one iteration); from then
on only the root and those entry modules keep hooks: the cost per iteration is
about 5 us per entry call, whatever the model's size; between reported
iterations :meth:`EntryWatch.pause` takes even those off (the model then runs
exactly as unprofiled) and :meth:`EntryWatch.resume` puts them back. Should an iteration
step an optimizer with no forward found (the framework started entering
through another module), learning starts again for one forward.

A forward is one thread's: while it runs, module calls from other threads are not part of it.
``nn.DataParallel`` (which the Hugging Face Trainer uses on a machine with several GPUs when
not launched by ``torchrun``) runs a copy of the model on each GPU, each in a thread of its
own, and the copies carry the model's hooks: only the copy on the profiled device is measured
(:func:`replica_device`), and its thread's calls alone make its depth.

Modules inside a compiled module (``torch.compile``) are never hooked: a hook
there would run inside the compiled region. The compiled module itself is. Nor are
``nn.TransformerEncoderLayer`` and its submodules (:data:`HOOK_SENSITIVE`): torch takes its
fused fast path (eval mode, no gradients: a frozen encoder) only while none of them has a hook.

Example::

    >>> import torch
    >>> wrapper = torch.nn.Module(); wrapper.net = torch.nn.Linear(4, 4)
    >>> seen = []
    >>> watch = EntryWatch(wrapper, lambda grad, a, m: seen.append(m) or grad, lambda m, a, o: None)
    >>> watch.install()
    >>> _ = wrapper.net(torch.randn(2, 4))       # the root's forward is never called
    >>> seen == [wrapper.net]
    True
    >>> watch.finish_learning(); watch.hooked_modules() == [wrapper, wrapper.net]
    True
    >>> watch.remove()
"""

from __future__ import annotations

import threading
from threading import get_ident
from typing import Any, Callable

import torch

from ..faults import FaultGuard
from .devices import device_index
from .trees import is_compiled_module

__all__ = ["EntryWatch", "FORWARD_PART", "HOOK_SENSITIVE", "replica_device"]

#: The part of the profiler a fault in these hooks switches off.
FORWARD_PART = "forward hooks"


#: Modules that take a fused kernel (torch's "fast path": ``_transformer_encoder_layer_fwd``, in
#: eval mode without gradients) only while no module hook is on them or their submodules: a
#: hook there would change what the model computes and holds, so they and their submodules are
#: never hooked but as the root (a forward entering through one enters through its parent).
HOOK_SENSITIVE: tuple[type[torch.nn.Module], ...] = (torch.nn.TransformerEncoderLayer,)


def _hookable_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's modules, each once, leaving out those inside a compiled module and the
    :data:`HOOK_SENSITIVE` ones below the root with their submodules."""
    found: list[torch.nn.Module] = []
    seen: set[int] = set()
    stack = [model]
    while stack:
        module = stack.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        if module is not model and isinstance(module, HOOK_SENSITIVE):
            continue
        found.append(module)
        if not is_compiled_module(module) and not isinstance(module, torch.jit.ScriptModule):
            stack.extend(reversed(list(module.children())))
    return found


def replica_device(module: torch.nn.Module) -> torch.device | None:
    """The device an ``nn.DataParallel`` replica of a module runs on (``None``: not a replica, or
    one holding no tensor).

    ``DataParallel.forward`` copies the model to each GPU for the call (``replicate``): a
    replica is marked ``_is_replica`` and holds its copies of the parameters as plain tensors,
    in ``_former_parameters``, and its buffers as buffers.

    Example::

        >>> import torch
        >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2))
        >>> replica_device(net) is None                     # the model itself
        True
        >>> copy = net._replicate_for_data_parallel(); copy._modules["0"] = net[0]._replicate_for_data_parallel()
        >>> copy[0]._former_parameters = {"weight": torch.zeros(2, 2)}
        >>> replica_device(copy)
        device(type='cpu')
    """
    if not getattr(module, "_is_replica", False):
        return None
    for m in module.modules():
        for t in (*getattr(m, "_former_parameters", {}).values(), *m._buffers.values()):
            if isinstance(t, torch.Tensor):
                return t.device
    return None


def _refuse(grad_enabled: bool, args: Any, module: torch.nn.Module) -> bool:
    return False


def _ignore(module: torch.nn.Module, args: Any, output: Any) -> None:
    return None


class EntryWatch:
    """Hooks the modules a forward may enter the model through, and tracks the call depth.

    Args:
        model: the root module.
        on_enter: called as ``on_enter(grad_enabled, args, module)`` when a call enters the
            model from outside it (``grad_enabled``: ``torch.is_grad_enabled()`` then); returns
            whether that call is a training forward (only those teach which modules are entries).
        on_exit: called as ``on_exit(module, args, output)`` when such a call,
            one ``on_enter`` accepted, returns (or raises).
        guard: contains faults of the hooks.
        device: the device measured: a forward of an ``nn.DataParallel`` replica on another
            device is not watched (``None``: every forward is).
    """

    def __deepcopy__(self, memo: dict) -> EntryWatch:
        # ``copy.deepcopy(model)`` (an EMA copy, a reference model) copies the hooks on the
        # model's modules, and a bound method's copy would copy this watch and, through it, the
        # profiler's counters: the copy shares the hook instead, as it shares a plain function hook.
        return self

    def __init__(
        self,
        model: torch.nn.Module,
        on_enter: Callable[[bool, Any, torch.nn.Module], bool],
        on_exit: Callable[[torch.nn.Module, Any, Any], None],
        guard: FaultGuard | None = None,
        device: torch.device | None = None,
    ) -> None:
        self.model = model
        self.on_enter = on_enter
        self.on_exit = on_exit
        self.guard = guard or FaultGuard()
        # indexed as the counters index it (``cuda`` is ``cuda:0``), as a replica's tensors are
        self._device = None if device is None else torch.device(device.type, device_index(device))
        #: modules of the model currently running (those hooked) in the forward's thread
        self.depth = 0
        # the thread the running forward belongs to (None: none runs), and the lock two threads
        # entering at once take turns at (DataParallel's replicas on one device)
        self._thread: int | None = None
        self._taking = threading.Lock()
        # the calls running in other threads (not watched), by thread, each thread's for the whole
        # of its call: the replica's modules below its root are replicas too, of tensors or none
        self._others: dict[int, int] = {}
        #: whether every module is hooked (until a training forward shows the entries)
        self.learning = False
        self._entries: dict[int, torch.nn.Module] = {}
        self._handles: dict[int, tuple[Any, Any]] = {}
        self._accepted = False
        #: whether the hooks are taken off for a while (:meth:`pause`)
        self.paused = False
        #: whether the hooks are taken off for good (:meth:`switch_off`)
        self.off = False

    # -- installation ----------------------------------------------------------
    def install(self) -> None:
        """Hook every module of the model (learning), the root always."""
        self._hook(self.model)
        self.relearn()

    def relearn(self) -> None:
        """Hook every module again until the next training forward shows its entries."""
        if self.depth or self.off:
            return  # never while a module of the model runs: its exit would be lost
        self.learning = True
        self.paused = False
        self._others.clear()
        for module in _hookable_modules(self.model):
            self._hook(module)

    def finish_learning(self) -> None:
        """Keep hooks only on the root and the modules seen entering the model."""
        if not self.learning or self.depth:
            return
        self.learning = False
        keep = {id(self.model), *self._entries}
        for key in [k for k in self._handles if k not in keep]:
            for handle in self._handles.pop(key):
                handle.remove()

    def pause(self) -> bool:
        """Take every hook off until :meth:`resume`, keeping the entries learned; whether it did.

        Refused while learning (the entries are not known yet) or while a module of
        the model runs (its exit would be lost). A module with no hooks takes
        torch's fast call path: the model then costs what it costs unprofiled.
        """
        if self.learning or self.depth or self.paused:
            return False
        self._unhook_all()
        # other threads' calls ended with their iteration (DataParallel joins its threads); a count
        # left over would hold a later thread given the same ident off the next forward
        self._others.clear()
        self.paused = True
        return True

    def resume(self) -> None:
        """Hook the root and the entry modules again after :meth:`pause`."""
        if not self.paused:
            return
        self.paused = False
        self._hook(self.model)
        for module in list(self._entries.values()):
            self._hook(module)

    def remove(self) -> None:
        """Remove every hook."""
        self._unhook_all()
        self.depth = 0
        self._thread = None
        self._others.clear()
        self.learning = False
        self.paused = False

    def switch_off(self) -> None:
        """Remove every hook for good (a fault switched them off): :meth:`resume` and
        :meth:`relearn` put none back, and :meth:`pause` has nothing left to take off."""
        self.remove()
        self.off = True

    def _unhook_all(self) -> None:
        for handles in self._handles.values():
            for handle in handles:
                handle.remove()
        self._handles.clear()

    def release(self) -> None:
        """Remove every hook and drop the callbacks (which refer back to their owner)."""
        self.remove()
        self.on_enter = _refuse
        self.on_exit = _ignore
        self._entries.clear()

    def hooked_modules(self) -> list[torch.nn.Module]:
        """The modules hooked now, the root first."""
        by_id = {id(m): m for m in _hookable_modules(self.model)}
        return [by_id[k] for k in by_id if k in self._handles]

    def _hook(self, module: torch.nn.Module) -> None:
        key = id(module)
        if key in self._handles or self.off:
            return
        if isinstance(module, torch.jit.ScriptModule):
            return  # TorchScript modules take no Python hooks; their callers are hooked
        # The bound methods themselves, each its guard's try inline (no wrapper frame on the
        # hot path); a removed hook leaves no reference cycle.
        pre = module.register_forward_pre_hook(self._enter)
        # always_call: a forward that raises still closes its phase.
        post = module.register_forward_hook(self._exit, always_call=True)
        self._handles[key] = (pre, post)

    def _measured(self, replica: torch.nn.Module) -> bool:
        """Whether a DataParallel replica runs on the device measured."""
        found = replica_device(replica)
        return found is None or found == self._device

    # -- the hooks (the hot path: one pair per entry call per iteration) --------
    # Torch calls them: each is contained as ``FaultGuard.wrap(FORWARD_PART, ...)`` would, inline.
    def _enter(self, module: torch.nn.Module, args: Any) -> None:
        try:
            if FORWARD_PART in self.guard.disabled:
                return None
            thread = get_ident()
            if self.depth:
                if thread == self._thread:
                    self.depth += 1
                else:  # another thread's call while this forward runs: not this forward's
                    self._others[thread] = self._others.get(thread, 0) + 1
                return None
            if thread in self._others:
                self._others[thread] += 1
                return None
            if self._device is not None and getattr(module, "_is_replica", False) and not self._measured(module):
                self._others[thread] = 1  # a DataParallel replica on another GPU, for the whole of its call
                return None
            with self._taking:
                if self.depth:  # another thread's forward began first
                    self._others[thread] = 1
                    return None
                self._thread = thread
                self.depth = 1
            accepted = self._accepted = bool(self.on_enter(torch.is_grad_enabled(), args, module))
            # A replica is made again at each call: the model it copies is the entry.
            if accepted and self.learning and not getattr(module, "_is_replica", False):
                self._entries[id(module)] = module
        except Exception as exc:  # noqa: BLE001 - contained: training goes on without it
            self.guard.fault(FORWARD_PART, exc)
        return None

    def _exit(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        try:
            if FORWARD_PART in self.guard.disabled:
                return None
            thread = get_ident()
            if self.depth and thread == self._thread:
                self.depth -= 1
                if self.depth == 0:
                    self._thread = None
                    if self._accepted:
                        self._accepted = False
                        self.on_exit(module, args, output)
                return None
            calls = self._others.get(thread)
            if calls is not None:
                if calls > 1:
                    self._others[thread] = calls - 1
                else:
                    del self._others[thread]
        except Exception as exc:  # noqa: BLE001 - contained: training goes on without it
            self.guard.fault(FORWARD_PART, exc)
        return None
