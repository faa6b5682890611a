"""Walking what a model hands around: the tensors inside a module's inputs or outputs (tensors,
tuples, lists, dicts), the autograd nodes of its outputs, whether it runs through ``torch.compile``.

Example::

    >>> import torch
    >>> a, b = torch.zeros(1), torch.ones(2)
    >>> [t.numel() for t in tensors_in({"x": a, "rest": (b, "not a tensor")})]
    [2, 1]
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["tensors_in", "output_grad_nodes", "is_compiled", "is_compiled_module"]


def tensors_in(obj: Any, limit: int = 64) -> list[torch.Tensor]:
    """Up to ``limit`` tensors found in ``obj`` and the tuples, lists and dicts it nests.

    The limit keeps hooks cheap on models that return huge structures.
    """
    found: list[torch.Tensor] = []
    stack = [obj]
    while stack and len(found) < limit:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            found.append(item)
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
    return found


def output_grad_nodes(output: Any, limit: int = 64) -> list[torch.autograd.graph.Node]:
    """Distinct autograd nodes of the tensors in a module's output: where backward enters it."""
    nodes: list = []
    seen: set[int] = set()
    for tensor in tensors_in(output, limit):
        node = tensor.grad_fn
        if node is not None and id(node) not in seen:
            seen.add(id(node))
            nodes.append(node)
    return nodes


def is_compiled_module(module: torch.nn.Module) -> bool:
    """True when ``module`` itself runs through ``torch.compile`` (its submodules not looked at)."""
    return type(module).__name__ == "OptimizedModule" or getattr(module, "_compiled_call_impl", None) is not None


def is_compiled(model: torch.nn.Module) -> bool:
    """True when ``model`` or one of its submodules runs through ``torch.compile``."""
    if type(model).__name__ == "OptimizedModule":
        return True
    return any(getattr(m, "_compiled_call_impl", None) is not None for m in model.modules())
