"""An ATen operator's arguments by its schema's names, as a rule that stands in for it reads them.

Example::

    >>> import torch
    >>> bound_arguments(torch.ops.aten.add.Tensor, (1, 2), {})
    {'self': 1, 'other': 2, 'alpha': 1}
"""

from __future__ import annotations

from typing import Any

__all__ = ["bound_arguments"]


def bound_arguments(func: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    """``func``'s arguments (an ``OpOverload``) by their schema's names, in the schema's order:
    given positionally or by name, else the schema's default (``None`` where it has none)."""
    given: dict[str, Any] = {}
    for i, argument in enumerate(func._schema.arguments):
        if i < len(args):
            given[argument.name] = args[i]
        elif argument.name in kwargs:
            given[argument.name] = kwargs[argument.name]
        else:
            given[argument.name] = argument.default_value if argument.has_default_value() else None
    return given
