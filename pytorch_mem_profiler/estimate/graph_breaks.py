"""Whether dynamo would break a compiled module's forward into several graphs, found without touching the user's.

Inductor partitions each graph dynamo captures apart: a module whose forward dynamo breaks is
not one graph, and :mod:`.compiled` estimates it uncompiled. :func:`graph_breaks` asks dynamo
on a copy of the module and its inputs on the ``meta`` device, through a backend that only
counts graphs, and remembers the answer for the estimate's other batch sizes
(:func:`remembered_breaks`).

Example::

    >>> import torch
    >>> class Twice(torch.nn.Module):
    ...     def forward(self, x):
    ...         x = x + 1
    ...         torch._dynamo.graph_break()
    ...         return x * 2
    >>> print(graph_breaks(Twice(), torch.zeros(4)))  # doctest: +ELLIPSIS
    1 graph break (first: ...graph_break...)
"""

from __future__ import annotations

import contextlib
import copy
import gc
import types
import weakref
from typing import Any, Callable, Iterator

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

__all__ = ["graph_breaks", "remembered_breaks"]

#: Graph breaks found, by what a step's model is made from, then by module name and input signature.
_BREAKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def remembered_breaks(check: Callable[..., str | None], key: Any) -> Callable[..., str | None]:
    """``check``, its answer for a module and its inputs' structure (not their sizes) remembered for ``key``."""
    try:
        seen = _BREAKS.setdefault(key, {})
    except TypeError:  # not weakly referable: nothing remembered
        return check

    def remembered(module: nn.Module, *args: Any, **kwargs: Any) -> str | None:
        flat, spec = pytree.tree_flatten((args, kwargs))
        shape = tuple(
            (v.dtype, v.dim(), v.requires_grad) if isinstance(v, torch.Tensor) else repr(v)[:100] for v in flat
        )
        sig = (type(module).__qualname__, str(spec), shape)
        if sig not in seen:
            seen[sig] = check(module, *args, **kwargs)
        return seen[sig]

    return remembered


def graph_breaks(module: nn.Module, *args: Any, **kwargs: Any) -> str | None:
    """Whether dynamo breaks ``module``'s forward into several graphs at these inputs, or captures none
    (it then runs eagerly): how, or ``None``.

    Dynamo traces a copy of the module and inputs on the ``meta`` device, with the estimate's
    dispatch and function modes put aside, through a backend that only counts graphs. Its
    forward runs as a copy of its code: dynamo keeps what it compiles on the code object it
    ran, and the user's own compiled module must find no entry of ours there
    (``torch._dynamo.explain`` would reset every compiled module of the process instead).
    ``None`` too where dynamo cannot trace the copy (no break is then known).
    """
    from torch.utils._python_dispatch import _disable_current_modes

    try:
        import torch._dynamo  # noqa: F401
    except Exception:  # noqa: BLE001 - no dynamo: nothing to check
        return None
    graphs: list[Any] = []
    reasons: list[str] = []

    def count(gm: fx.GraphModule, _inputs: Any) -> Callable[..., Any]:
        graphs.append(gm)
        why = getattr(gm, "compile_subgraph_reason", None)
        if why is not None and getattr(why, "graph_break", False):
            reasons.append(str(getattr(why, "reason", why)))
        return gm.forward

    with _disable_current_modes(), _no_function_modes():
        meta_module, meta_args, meta_kwargs = _on_meta(module, args, kwargs)
        forward = _copied_function(type(meta_module).forward)
        try:
            torch.compile(types.MethodType(forward, meta_module), backend=count, dynamic=False)(*meta_args, **meta_kwargs)
        except Exception:  # noqa: BLE001 - dynamo cannot trace the meta copy: no break known
            return None
        finally:
            gc.collect()  # dynamo leaves its tracing state in reference cycles: freed now, not in the step
    if not graphs:  # dynamo skipped the frame: it runs eagerly (an RNN module under allow_rnn=False)
        return "dynamo captured no graph of it: it runs eagerly"
    breaks = max(len(graphs) - 1, len(reasons))
    if not breaks:
        return None
    first = reasons[0].strip().splitlines()[0][:160] if reasons else "unknown"
    return f"{breaks} graph break{'s' if breaks > 1 else ''} (first: {first})"


def _copied_function(function: Callable[..., Any]) -> Callable[..., Any]:
    """``function`` with a code object of its own (dynamo's caches are kept on code objects)."""
    function = getattr(function, "__func__", function)
    code = function.__code__
    copied_code = code.replace(co_name=code.co_name)
    copied = types.FunctionType(copied_code, function.__globals__, function.__name__, function.__defaults__, function.__closure__)
    copied.__kwdefaults__ = function.__kwdefaults__
    copied.__qualname__ = function.__qualname__
    return copied


@contextlib.contextmanager
def _no_function_modes() -> Iterator[None]:
    """The torch function modes (the estimate's RNN rules) put aside for the block."""
    from torch.overrides import _pop_mode_temporarily

    with contextlib.ExitStack() as stack:
        for _ in range(torch._C._len_torch_function_stack()):
            stack.enter_context(_pop_mode_temporarily())
        yield


def _on_meta(module: nn.Module, args: tuple, kwargs: dict) -> tuple[nn.Module, tuple, dict]:
    """``module`` (deep-copied) and the inputs with every tensor a ``meta`` tensor of its shape, strides and type."""
    memo: dict[int, Any] = {}

    def meta(t: torch.Tensor) -> torch.Tensor:
        made = torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype, device="meta")
        if isinstance(t, nn.Parameter):
            return nn.Parameter(made, requires_grad=t.requires_grad)
        return made.requires_grad_(t.requires_grad) if t.is_floating_point() or t.is_complex() else made

    for t in [*module.parameters(), *module.buffers()]:
        if id(t) not in memo:
            memo[id(t)] = meta(t)
    copied = copy.deepcopy(module, memo)
    mapped = pytree.tree_map(lambda v: meta(v) if isinstance(v, torch.Tensor) else v, (args, kwargs))
    return copied, mapped[0], mapped[1]
