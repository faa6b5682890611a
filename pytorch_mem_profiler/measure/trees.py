"""Finding the tensors inside a module's inputs or outputs (tensors, tuples, lists, dicts).

Example::

    >>> import torch
    >>> a, b = torch.zeros(1), torch.ones(2)
    >>> [t.numel() for t in tensors_in({"x": a, "rest": (b, "not a tensor")})]
    [2, 1]
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["tensors_in", "output_grad_nodes"]


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
