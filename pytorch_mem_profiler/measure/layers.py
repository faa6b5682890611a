"""Feature maps by layer: which module's forward saved the tensors autograd keeps for backward.

During a reported iteration's forward (only then: the cost is divided by
``print_period``) a ``saved_tensors_hooks`` pack hook sees every tensor autograd
really keeps for backward, and global module hooks keep a stack of the modules
running, so each saved storage is put down to the innermost module whose
forward saved it (its fully qualified name, e.g. ``encoder.layers.3.self_attn``).

- each storage counts once (views of it, the same tensor saved twice);
- parameters and buffers are left out (they are weights and buffers already);
- the model's inputs count apart, as ``(input)``;
- copies of weights that autocast made (bf16/fp16) are their own category,
  ``weight copies``, under the module that saved them;
- a module called several times in one forward is summed, with a call count;
- checkpointed blocks (``torch.utils.checkpoint``) save nothing through these
  hooks: what they keep (their inputs) shows in what no module saved.

The same module hooks mark where a few modules (those at the depth where
there are at most ``MAX_LOCATIONS`` of them) end their forward, and where
backward reaches their outputs, so the profiler can tell in which module an
iteration's peak was reached: a forward interval ending with a module's
forward is put down to that module.

Example::

    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU())
    >>> attribution = LayerAttribution(model, torch.device("cpu"))
    >>> x = torch.randn(4, 8)
    >>> attribution.start((x,))
    >>> y = model(x)
    >>> breakdown = attribution.stop()
    >>> breakdown.by_module[("1", "activations")] == 4 * 16 * 4   # ReLU keeps its output
    True
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

from ..stats import ACTIVATIONS, INPUT, WEIGHT_COPIES
from .accounting import same_device
from .trees import output_grad_nodes, tensors_in

__all__ = [
    "LayerAttribution",
    "LayerBreakdown",
    "INPUT",
    "ACTIVATIONS",
    "WEIGHT_COPIES",
    "MAX_LOCATIONS",
    "is_compiled",
]

_log = logging.getLogger("pytorch_mem_profiler")

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


def is_compiled(model: torch.nn.Module) -> bool:
    """True when ``model`` or one of its submodules runs through ``torch.compile``."""
    if type(model).__name__ == "OptimizedModule":
        return True
    return any(getattr(m, "_compiled_call_impl", None) is not None for m in model.modules())


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


class LayerAttribution:
    """Attributes saved tensors to modules during one forward at a time.

    Args:
        model: the root module.
        device: only storages on this device are counted.
        on_exit: called with two module names when a tracked module's forward
            ends: the one that ended and the one the running code is back in.
        on_backward_enter: called with a module name when backward reaches the
            outputs of a tracked module.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        device: torch.device,
        on_exit: Callable[[str, str], None] | None = None,
        on_backward_enter: Callable[[str], None] | None = None,
        max_locations: int = MAX_LOCATIONS,
    ) -> None:
        self.model = model
        self.device = device
        self.on_exit = on_exit
        self.on_backward_enter = on_backward_enter
        self.max_locations = max_locations
        self.refresh()
        self._handles: list = []
        self._hooks_ctx: Any = None
        self._stack: list[tuple[int, str]] = []
        self._seen: set[tuple[int, int]] = set()
        self._inputs: set[tuple[int, int]] = set()
        self._current = LayerBreakdown()

    def refresh(self) -> None:
        """Learn the model's module names, parameters and buffers again (after it changed)."""
        self._names = {id(m): name for name, m in self.model.named_modules()}
        self._root = id(self.model)
        self._tracked = _tracked_modules(self.model, self.max_locations)
        self._state_ptrs: set[tuple[int, int]] = set()
        self._param_names: dict[int, str] = {}
        for name, p in self.model.named_parameters():
            self._param_names[id(p)] = name
            self._state_ptrs.add(_storage_key(p))
        for b in self.model.buffers():
            if b is not None:
                self._state_ptrs.add(_storage_key(b))

    # -- one forward -------------------------------------------------------
    def start(self, inputs: Any) -> None:
        """Begin attributing: call at the start of the model's forward."""
        self._current = LayerBreakdown()
        self._seen = set()
        self._inputs = set()
        for t in tensors_in(inputs):
            self._inputs.add(_storage_key(t))
        self._stack = [(self._root, "")]
        self._handles = [
            register_module_forward_pre_hook(self._module_pre),
            register_module_forward_hook(self._module_post, always_call=True),
        ]
        self._hooks_ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
        self._hooks_ctx.__enter__()

    def stop(self) -> LayerBreakdown:
        """End attributing (at the end of the forward) and hand back what was saved."""
        self.close()
        return self._current

    def close(self) -> None:
        """Remove the hooks, if installed; safe to call at any time."""
        ctx, self._hooks_ctx = self._hooks_ctx, None
        if ctx is not None:
            ctx.__exit__(None, None, None)
        for handle in self._handles:
            handle.remove()
        self._handles = []

    # -- hooks -------------------------------------------------------------
    def _module_pre(self, module: torch.nn.Module, args: Any) -> None:
        key = id(module)
        if key == self._root:
            return
        name = self._names.get(key)
        if name is None:  # a module made on the fly: its tensors go to its caller
            name = self._stack[-1][1]
        else:
            self._current.calls[name] = self._current.calls.get(name, 0) + 1
        self._stack.append((key, name))

    def _module_post(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        key = id(module)
        if key == self._root or len(self._stack) <= 1 or self._stack[-1][0] != key:
            return
        _, name = self._stack.pop()
        if key in self._tracked:
            if self.on_exit is not None:
                self.on_exit(name, self._stack[-1][1])
            if self.on_backward_enter is not None:
                self._watch_backward(name, output)

    def _watch_backward(self, name: str, output: Any) -> None:
        callback = self.on_backward_enter
        fired = [False]

        def prehook(grad_outputs: Any) -> None:
            if not fired[0]:
                fired[0] = True
                callback(name)  # type: ignore[misc]

        for node in output_grad_nodes(output, limit=4):
            node.register_prehook(prehook)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        try:
            if not same_device(t, self.device):
                return t
            key = _storage_key(t)
            if key[0] == 0 or key in self._seen:
                return t
            self._seen.add(key)
            if key in self._state_ptrs:
                return t
            nbytes = t.untyped_storage().nbytes()
            if key in self._inputs:
                module, category = INPUT, ACTIVATIONS
            else:
                module = self._stack[-1][1] if self._stack else ""
                category = WEIGHT_COPIES if self._is_weight_copy(t) else ACTIVATIONS
            slot = (module, category)
            by_module = self._current.by_module
            by_module[slot] = by_module.get(slot, 0) + nbytes
        except Exception:  # noqa: BLE001 - a tensor we cannot inspect is simply not attributed
            pass
        return t

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
            if variable is not None and id(variable) in self._param_names:
                return True
        return False


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t


def _storage_key(t: torch.Tensor) -> tuple[int, int]:
    local = getattr(t, "_local_tensor", t)
    return (local.untyped_storage().data_ptr(), local.device.index or 0)
