"""A compiled module's outputs as AOTAutograd can carry them: objects pytree does not know, taken apart and put back.

AOTAutograd traces a function whose outputs are tensors, numbers, strings and ``None`` in
containers pytree knows (tuples, lists, dicts, dataclasses registered with it). A model's
forward may return other objects holding tensors: a Hugging Face causal language model returns
its key-value cache (``transformers.cache_utils.DynamicCache``, its ``layers`` each holding
``keys`` and ``values``), which no pytree registration covers. ``torch.compile`` returns such an
object with its tensors made by the compiled graph (dynamo rebuilds it); AOTAutograd alone
refuses it (``Found <class ...> in output, which is not a known type``).

:func:`to_tree` turns every such object into an :class:`Opaque` node: its class, the attributes
that hold tensors as children (taken apart the same way, to any depth), the others kept as they
are; any other leaf of an unknown type becomes a :class:`Constant`. Both are pytree nodes of this
module's own classes, so the traced function's outputs are tensors and known leaves only, and
the tensors an object holds are outputs of the forward graph, as they are of Inductor's.
:func:`from_tree` puts the objects back, with the tensors the compiled graph returned.

Example::

    >>> import torch
    >>> class Cache:
    ...     def __init__(self, keys): self.keys, self.layer, self.device = keys, 3, torch.device("cpu")
    >>> tree = to_tree({"logits": torch.ones(2), "cache": Cache(torch.zeros(4))})
    >>> [type(leaf).__name__ for leaf in torch.utils._pytree.tree_leaves(tree)]
    ['Tensor', 'Tensor']
    >>> back = from_tree(tree)
    >>> type(back["cache"]).__name__, back["cache"].keys.shape, back["cache"].layer
    ('Cache', torch.Size([4]), 3)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils import _pytree as pytree

__all__ = ["Opaque", "Constant", "to_tree", "from_tree"]

#: How deep objects are taken apart (a cache's layers' tensors are two down); deeper ones are constants.
DEPTH = 6


@dataclass
class Opaque:
    """An object pytree does not know: its class, the attributes holding tensors (``children``), the rest."""

    cls: type
    children: dict[str, Any] = field(default_factory=dict)
    constants: dict[str, Any] = field(default_factory=dict)


@dataclass
class Constant:
    """A leaf of a type AOTAutograd does not carry (a ``torch.dtype``, a config object): kept as it is."""

    value: Any


def _flatten_opaque(node: Opaque) -> tuple[list[Any], Any]:
    keys = list(node.children)
    return [node.children[k] for k in keys], (node.cls, keys, node.constants)


def _unflatten_opaque(values: Any, context: Any) -> Opaque:
    cls, keys, constants = context
    return Opaque(cls, dict(zip(keys, values)), constants)


pytree.register_pytree_node(Opaque, _flatten_opaque, _unflatten_opaque)
pytree.register_pytree_node(Constant, lambda node: ([], node.value), lambda _values, value: Constant(value))

#: The leaves AOTAutograd carries as they are (its ``KNOWN_TYPES``, symbolic numbers aside).
_CARRIED = (torch.Tensor, int, float, bool, str, type(None))


def _take_apart(leaf: Any, depth: int) -> Any:
    if isinstance(leaf, _CARRIED):
        return leaf
    attributes = getattr(leaf, "__dict__", None)
    if depth <= 0 or not isinstance(attributes, dict):
        return Constant(leaf)
    node = Opaque(type(leaf))
    for name, value in attributes.items():
        tree = _to_tree(value, depth - 1)
        if any(isinstance(t, torch.Tensor) for t in pytree.tree_leaves(tree)):
            node.children[name] = tree
        else:
            node.constants[name] = value
    return node if node.children else Constant(leaf)


def _to_tree(value: Any, depth: int) -> Any:
    return pytree.tree_map(lambda leaf: _take_apart(leaf, depth), value)


def to_tree(value: Any) -> Any:
    """``value`` with every object pytree does not know made an :class:`Opaque` (its tensors its children)
    and every other unknown leaf a :class:`Constant`."""
    return _to_tree(value, DEPTH)


def _put_back(leaf: Any) -> Any:
    if isinstance(leaf, Constant):
        return leaf.value
    if not isinstance(leaf, Opaque):
        return leaf
    obj = leaf.cls.__new__(leaf.cls)
    obj.__dict__.update(leaf.constants)
    obj.__dict__.update({name: from_tree(child) for name, child in leaf.children.items()})
    return obj


def from_tree(value: Any) -> Any:
    """What :func:`to_tree` took apart, put back: objects of their classes, their tensors ``value``'s."""
    return pytree.tree_map(_put_back, value, is_leaf=lambda node: isinstance(node, (Opaque, Constant)))
