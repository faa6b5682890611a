"""Watching what autograd saves for backward, behind the saved-tensor hooks already active.

``torch.autograd.graph.saved_tensors_hooks`` is a stack and only its top pair runs.
A watcher that pushed a pair of its own would switch off the user's
(``save_on_cpu()``, compression or offloading libraries, a hand-written pair) and
change both the memory and the numbers of the run it measures. So
:class:`ChainedSavedTensorsHooks` reads the pair on top when it is pushed and
chains to it: every tensor goes through the user's pack hook exactly as without
the watcher, the watcher sees what the user's hook returned (what stays where,
e.g. a CPU copy or a half-precision cast), and unpacking is the user's own.
With no user's hooks, the watcher's own unpack runs the check autograd runs
only when no hooks are set: a saved tensor modified in place still raises.

Torch tells which pair is on top from 2.8 on
(``torch._C._autograd._top_saved_tensors_default_hooks``). Torch 2.4 to 2.7 cannot
tell: there the watcher must not push anything, and :func:`can_chain` is False.
This module is the one place that knows the difference.

A model may push a pair of its own *inside* its forward (a block whose forward
runs its layers under ``save_on_cpu()`` or a compressing pair). That pair is then
above the watchers, and only it runs: what the block's layers save would go
unseen. :func:`watch_over_inner_hooks`, called as each module's forward begins,
pushes one pair over such a pair (chained to it, as :meth:`ChainedSavedTensorsHooks.push`
chains) whose pack lets every watcher of the thread observe what that pair keeps;
:meth:`InnerWatch.pop` takes it off where the module's forward ends.

Example::

    >>> import torch
    >>> seen = []
    >>> x = torch.randn(3, requires_grad=True)
    >>> with torch.autograd.graph.saved_tensors_hooks(lambda t: ("mine", t.half()), lambda p: p[1].float()):
    ...     hooks = ChainedSavedTensorsHooks(seen.append)
    ...     if hooks.push():
    ...         y = x.exp()                       # exp saves its result
    ...         hooks.pop()
    ...     else:
    ...         y = x.exp(); seen.append(("mine", y.half()))   # torch < 2.8
    >>> seen[0][0], seen[0][1].dtype               # what the user's hook kept
    ('mine', torch.float16)
"""

from __future__ import annotations

import logging
from threading import get_ident
from typing import Any, Callable

import torch

__all__ = [
    "ChainedSavedTensorsHooks",
    "InnerWatch",
    "can_chain",
    "kept_without_node",
    "top_saved_tensors_hooks",
    "watch_over_inner_hooks",
]

_log = logging.getLogger("pytorch_mem_profiler")

# torch >= 2.8: the pair on top of the thread's saved-tensor hooks stack, or None.
# Its argument (True) asks for the real top even while a compiler is tracing.
_TOP = getattr(getattr(torch._C, "_autograd", None), "_top_saved_tensors_default_hooks", None)

#: The pack hooks of the pairs the watchers pushed and have not popped, by ``id`` (any thread).
_OWN_PACKS: dict[int, Callable[[torch.Tensor], Any]] = {}
#: The watchers pushed and not popped, by thread: those a pair pushed over a model's own
#: inner pair lets observe (:func:`watch_over_inner_hooks`).
_PUSHED: dict[int, list["ChainedSavedTensorsHooks"]] = {}


def can_chain() -> bool:
    """Whether this torch can tell which saved-tensor hooks are active (2.8 and later)."""
    return _TOP is not None


def top_saved_tensors_hooks() -> tuple[Callable[[torch.Tensor], Any], Callable[[Any], torch.Tensor]] | None:
    """The (pack, unpack) pair active on this thread now, ``None`` when there is none.

    Raises ``RuntimeError`` on torch older than 2.8, which cannot tell.
    """
    if _TOP is None:
        raise RuntimeError(f"torch {torch.__version__} cannot tell which saved-tensor hooks are active")
    top = _TOP(True)
    return None if top is None else (top[0], top[1])


def _unpack_checked(packed: tuple[torch.Tensor, int]) -> torch.Tensor:
    """Torch checks a saved tensor's version only when no hooks are set: do it here, so that a
    tensor modified in place after it was saved still raises as it would without the watcher."""
    try:  # autograd calls this: a fault of the check itself must not fail backward
        tensor, version = packed
        stale = tensor._version != version
    except Exception as exc:  # noqa: BLE001 - the tensor is handed back unchecked
        _unchecked(exc)
        return packed[0]
    if stale:
        raise RuntimeError(
            "one of the variables needed for gradient computation has been modified by an inplace "
            f"operation: [{tensor.type()} {list(tensor.shape)}] is at version {tensor._version}; "
            f"expected version {version} instead. Hint: the tensor was saved for backward and changed "
            "in place afterwards (this check is run by pytorch_mem_profiler's per-layer watcher, "
            "as autograd runs it without one)"
        )
    return tensor


_UNCHECKED_LOGGED: list[bool] = []


def _unchecked(exc: BaseException) -> None:
    if not _UNCHECKED_LOGGED:
        _UNCHECKED_LOGGED.append(True)
        _log.warning(
            "pytorch_mem_profiler: checking a saved tensor's version failed; it is handed back unchecked (%s: %s)",
            type(exc).__name__,
            exc,
            exc_info=exc,
        )


def kept_without_node(tensor: torch.Tensor) -> torch.Tensor:
    """What a watcher's own pack keeps of ``tensor``: itself, or where it has a ``grad_fn`` an alias
    without it (same storage and version counter). Autograd hands a pack hook an operator's saved
    *output* with its ``grad_fn``, the node that saves it: kept as it is, node and tensor would hold
    each other through C++, where no garbage collection sees them, and a branch backward never
    reaches (a pooler's output the loss does not use) would stay alive for good. Without hooks
    autograd saves an output without its node; so does this."""
    return tensor.detach() if tensor.grad_fn is not None else tensor


def _own_watcher(pair: tuple[Callable[[torch.Tensor], Any], Callable[[Any], torch.Tensor]]) -> ChainedSavedTensorsHooks | None:
    """The watcher whose own pair (no user's hooks below it) ``pair`` is, else ``None``."""
    pack, unpack = pair
    watcher = getattr(pack, "__self__", None)
    if (
        unpack is _unpack_checked
        and isinstance(watcher, ChainedSavedTensorsHooks)
        and getattr(pack, "__func__", None) is ChainedSavedTensorsHooks._watch
    ):
        return watcher
    return None


class ChainedSavedTensorsHooks:
    """A pack hook that watches what autograd keeps, chained to the pair that was on top.

    Args:
        observe: called with what is kept for each saved tensor: the tensor
            itself, or what the user's pack hook made of it. A fault in it is
            left to ``on_fault``; the tensor is kept all the same.
        on_fault: called with an exception ``observe`` raised (default: ignore).
    """

    def __init__(self, observe: Callable[[Any], None], on_fault: Callable[[BaseException], None] | None = None) -> None:
        self.observe = observe
        self.on_fault = on_fault
        self._context: Any = None
        self._thread = 0

    def push(self) -> bool:
        """Start watching; False (nothing pushed) where torch cannot tell what is on top."""
        if self._context is not None:
            return True
        if _TOP is None:
            return False
        below = top_saved_tensors_hooks()
        if below is None:
            pack, unpack = self._watch, _unpack_checked
        elif (watcher := _own_watcher(below)) is not None:
            # Another watcher's own pair, over the raw tensors (the peak breakdown's under the
            # per-layer attribution's): one pack hook does both, without a call through the other.
            pack, unpack = self._beside(watcher), _unpack_checked
        else:
            pack, unpack = self._chain(below[0]), below[1]
        context = torch.autograd.graph.saved_tensors_hooks(pack, unpack)
        context.__enter__()
        self._context = context
        _OWN_PACKS[id(pack)] = pack
        self._thread = get_ident()
        _PUSHED.setdefault(self._thread, []).append(self)
        return True

    def pop(self) -> None:
        """Stop watching (pop what :meth:`push` pushed); safe when nothing was pushed."""
        context, self._context = self._context, None
        if context is not None:
            _OWN_PACKS.pop(id(context.pack_hook), None)
            pushed = _PUSHED.get(self._thread, [])
            if self in pushed:
                pushed.remove(self)
            if not pushed:
                _PUSHED.pop(self._thread, None)
            context.__exit__(None, None, None)

    @property
    def active(self) -> bool:
        return self._context is not None

    def _watch(self, tensor: torch.Tensor) -> tuple[torch.Tensor, int]:
        # What ``_observe`` does, without its frame: this runs for every saved tensor.
        try:  # autograd calls this: whatever fails, the tensor is kept unchanged
            self.observe(tensor)
        except Exception as exc:  # noqa: BLE001 - watching must never break the forward
            self._fault(exc)
        try:  # ``kept_without_node``, inline (per saved tensor): a fault keeps the tensor itself
            kept = tensor.detach() if tensor.grad_fn is not None else tensor
        except Exception as exc:  # noqa: BLE001 - watching must never break the forward
            self._fault(exc)
            kept = tensor
        return kept, tensor._version

    def _beside(self, below: ChainedSavedTensorsHooks) -> Callable[[torch.Tensor], tuple[torch.Tensor, int]]:
        """What chaining to ``below``'s own pack (:meth:`_watch`) would do, in one frame: ``below``
        observes the tensor, then this watcher does, and the tensor is kept as ``below`` keeps it."""

        def pack(tensor: torch.Tensor) -> tuple[torch.Tensor, int]:
            # Autograd calls this: whatever fails, the tensor is kept unchanged, and a fault
            # switches off only the watcher it happened in. The observers are called directly
            # (each watcher's ``_observe`` is this same ``try``): this runs for every saved tensor.
            try:
                below.observe(tensor)
            except Exception as exc:  # noqa: BLE001 - watching must never break the forward
                below._fault(exc)
            try:
                self.observe(tensor)
            except Exception as exc:  # noqa: BLE001 - watching must never break the forward
                self._fault(exc)
            try:  # ``kept_without_node``, inline (per saved tensor): a fault keeps the tensor itself
                kept = tensor.detach() if tensor.grad_fn is not None else tensor
            except Exception as exc:  # noqa: BLE001 - watching must never break the forward
                self._fault(exc)
                kept = tensor
            return kept, tensor._version

        return pack

    def _chain(self, user_pack: Callable[[torch.Tensor], Any]) -> Callable[[torch.Tensor], Any]:
        def pack(tensor: torch.Tensor) -> Any:
            try:  # autograd calls this: a fault of ours must neither escape nor skip the user's hook
                observe: Callable[[Any], None] | None = self._observe
            except Exception as exc:  # noqa: BLE001 - the user's hook still runs, unwatched
                self._fault(exc)
                observe = None
            packed = user_pack(tensor)  # the user's hook, exactly once; its errors are the user's
            if observe is not None:
                observe(packed)
            return packed

        return pack

    def _observe(self, kept: Any) -> None:
        try:
            self.observe(kept)
        except Exception as exc:  # noqa: BLE001 - watching must never break the forward
            self._fault(exc)

    def _fault(self, exc: BaseException) -> None:
        if self.on_fault is not None:
            self.on_fault(exc)  # a guard re-raises only when strict (tests)


class InnerWatch:
    """A pair pushed over a pair the model pushed inside its forward (:func:`watch_over_inner_hooks`):
    its pack runs the model's pack once and lets each watcher observe what it kept."""

    def __init__(self, watchers: list[ChainedSavedTensorsHooks], below: tuple[Callable[[torch.Tensor], Any], Callable[[Any], torch.Tensor]]) -> None:
        self._watchers = tuple(watchers)
        user_pack, user_unpack = below

        def pack(tensor: torch.Tensor) -> Any:
            packed = user_pack(tensor)  # the model's hook, exactly once; its errors are its own
            for watcher in self._watchers:
                watcher._observe(packed)  # each contains its own faults
            return packed

        self._context: Any = torch.autograd.graph.saved_tensors_hooks(pack, user_unpack)
        self._context.__enter__()
        _OWN_PACKS[id(pack)] = pack

    def pop(self) -> bool:
        """Take the pair off where the module whose forward began under it ends; False (nothing
        popped) where another pair is on top: the stack is the model's to unwind then."""
        context, self._context = self._context, None
        if context is None:
            return True
        _OWN_PACKS.pop(id(context.pack_hook), None)
        top = _TOP(True) if _TOP is not None else None
        if top is None or top[0] is not context.pack_hook:
            return False
        context.__exit__(None, None, None)
        return True


def watch_over_inner_hooks() -> InnerWatch | None:
    """Where the pair on top of this thread's stack is not a watcher's but the watchers of this
    thread are pushed below it (a model's forward pushed it), push an :class:`InnerWatch` over it;
    else ``None`` (nothing pushed). Call as a module's forward begins, :meth:`InnerWatch.pop` as it ends.

    Example::

        >>> import torch
        >>> seen = []
        >>> outer = ChainedSavedTensorsHooks(seen.append)
        >>> pushed = outer.push()
        >>> x = torch.randn(3, requires_grad=True)
        >>> with torch.autograd.graph.saved_tensors_hooks(lambda t: t.half(), lambda p: p.float()):  # the model's
        ...     inner = watch_over_inner_hooks()
        ...     y = x.exp()                                 # saved through the model's pair, watched
        ...     popped = inner is None or inner.pop()
        >>> outer.pop()
        >>> [t.dtype for t in seen] == ([torch.float16] if pushed else [])
        True
    """
    if _TOP is None:
        return None
    watchers = _PUSHED.get(get_ident())
    if not watchers:
        return None
    top = _TOP(True)
    if top is None or id(top[0]) in _OWN_PACKS:
        return None
    return InnerWatch(watchers, (top[0], top[1]))
