"""Folding repeated structure: ``blocks.0.attn`` ... ``blocks.11.attn`` become one line.

Transformers, ResNets and most deep models repeat a block N times, so a ranking
of modules by bytes reads ``blocks.0.self_attn 3 MB``, ``blocks.1.self_attn 3 MB``
... ten times over. :func:`group_repeated` folds names that differ only in their
numeric path parts (``blocks.N.*``, ``layers.N.*``, ``h.N.*``, ``layer1.0.conv1``)
into one :class:`LayerGroup` with the count, the total and the bytes per member.
No torch here: the report, the summary and the HTML report share it.

A number all members share stays as it is (``blocks.[0-11].mlp.1``), and a
last index after an earlier one is kept apart: ``blocks.3.mlp.0`` and
``blocks.3.mlp.2`` are two layers of a Sequential in each block, so they fold
into ``blocks.[0-11].mlp.0`` and ``blocks.[0-11].mlp.2``, one line each.

Example::

    >>> groups = group_repeated({f"blocks.{i}.attn": 3_000_000 for i in range(12)} | {"head": 5})
    >>> [(g.name, g.count, g.total, g.per_member) for g in groups]
    [('blocks.[0-11].attn', 12, 36000000, 3000000), ('head', 1, 5, 5)]
    >>> sizes = {f"blocks.{i}.mlp.{j}": 10 * (j + 1) for i in range(4) for j in (0, 2)}
    >>> [(g.name, g.total) for g in group_repeated(sizes)]
    [('blocks.[0-3].mlp.2', 120), ('blocks.[0-3].mlp.0', 40)]
    >>> groups[0].label("MB")
    'blocks.[0-11].attn  12 x 3 MB'
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping

from .units import format_amount

__all__ = ["LayerGroup", "group_repeated", "numbers_label"]


@dataclass(frozen=True)
class LayerGroup:
    """Names that differ only in their numeric parts, with their bytes.

    Attributes:
        name: the folded name, numeric parts as ranges (``blocks.[0-11].attn``);
            the name itself for a group of one.
        members: the names folded, in the order met.
        total: bytes of all members together.
        per_member: bytes of each member when all are equal, else ``None``.
    """

    name: str
    members: tuple[str, ...]
    total: int
    per_member: int | None

    @property
    def count(self) -> int:
        return len(self.members)

    def label(self, unit: str = "MB") -> str:
        """``name`` with ``count x size`` when several members share one size."""
        if self.count == 1:
            return self.name
        if self.per_member is not None:
            return f"{self.name}  {self.count} x {format_amount(self.per_member, unit)}"
        return f"{self.name}  ({self.count} modules)"


def numbers_label(numbers: Iterable[int]) -> str:
    """``[0-11]`` for a run of consecutive numbers, ``[0,2,5]`` otherwise.

    Example::

        >>> numbers_label([3, 1, 2]), numbers_label([0, 2, 5])
        ('[1-3]', '[0,2,5]')
    """
    values = sorted(set(numbers))
    if len(values) > 2 and values == list(range(values[0], values[-1] + 1)):
        return f"[{values[0]}-{values[-1]}]"
    return "[" + ",".join(str(v) for v in values) + "]"


def _key(name: str) -> tuple[str, ...]:
    parts = name.split(".")
    key = ["#" if part.isdigit() else part for part in parts]
    # A last index after an earlier one (``blocks.3.mlp.0``, ``blocks.3.mlp.2``) picks
    # a different layer of a Sequential inside each block, not another repeat: kept.
    if len(key) > 1 and key[-1] == "#" and "#" in key[:-1]:
        key[-1] = parts[-1]
    return tuple(key)


def group_repeated(sizes: Mapping[str, int] | Iterable[tuple[str, int]]) -> list[LayerGroup]:
    """Fold names that differ only in numeric path parts; largest total first (ties: first met).

    A name with no numeric part, or the only one of its shape, is a group of one; so
    is each child of a Sequential (``mlp.0``, ``mlp.1``, ``mlp.3``) unless all have the
    same size, as a repeated block has (``h.0`` ... ``h.11``).

    Example::

        >>> [g.name for g in group_repeated({"mlp.0": 9, "mlp.1": 4, "mlp.3": 2})]
        ['mlp.0', 'mlp.1', 'mlp.3']
        >>> [g.name for g in group_repeated({f"h.{i}": 7 for i in range(12)})]
        ['h.[0-11]']
    """
    items = list(sizes.items()) if isinstance(sizes, Mapping) else list(sizes)
    shapes: dict[tuple[str, ...], list[tuple[str, int]]] = {}
    for name, nbytes in items:
        shapes.setdefault(_key(name), []).append((name, nbytes))
    groups = []
    for key, members in shapes.items():
        names = tuple(name for name, _ in members)
        total = sum(n for _, n in members)
        sizes_seen = {n for _, n in members}
        per_member = members[0][1] if len(sizes_seen) == 1 else None
        # Children of one Sequential (``mlp.0``, ``mlp.1``...) are different layers unless they
        # are the same block repeated (``h.0`` ... ``h.11``), which shows in equal sizes.
        sequential_children = key[-1] == "#" and "#" not in key[:-1] and per_member is None
        if len(members) == 1 or "#" not in key or sequential_children:
            groups.extend(LayerGroup(name, (name,), n, n) for name, n in members)
            continue
        parts = []
        for i, part in enumerate(key):
            if part == "#":
                numbers = {int(name.split(".")[i]) for name in names}
                # a number all members share (``mlp.1`` in every block) stays as it is
                parts.append(str(numbers.pop()) if len(numbers) == 1 else numbers_label(numbers))
            else:
                parts.append(part)
        groups.append(LayerGroup(".".join(parts), names, total, per_member))
    order = {id(g): i for i, g in enumerate(groups)}
    return sorted(groups, key=lambda g: (-g.total, order[id(g)]))
