"""A fill whose number does not fit its tensor's dtype fails in the fake step as the real step fails.

Real kernels that write one number into a tensor convert it to the tensor's dtype with
an overflow check (``Scalar::to<scalar_t>()``): ``masked_fill(mask, torch.finfo(torch.float32).min)``
on a bfloat16 or float16 tensor raises ``RuntimeError: value cannot be converted to type
c10::BFloat16 without overflow`` (DeBERTa's attention masks its scores so under bf16 autocast).
torch's fake and meta kernels never look at the number, so without this check the estimate
gave a figure for a step that cannot run. :func:`check_fill_fits` raises torch's own error,
naming the operator and the user's line, for the fills measured to check (on the CPU, torch
2.13): ``fill``, ``masked_fill`` (a number or a 0-dimensional tensor with its value),
``index_fill``, ``scatter`` of a value, ``full``, ``new_full`` and ``full_like``, into
bfloat16, float16 and float32. A Python number in arithmetic (``scores + finfo.min``,
``torch.where(mask, x, finfo.min)``) is wrapped in a tensor and converted without a check,
as on the device: those are not refused. Infinities and NaN convert.

Example::

    >>> import torch
    >>> from pytorch_mem_profiler.estimate.fake import fake_mode
    >>> with fake_mode():
    ...     scores = torch.empty(2, 4, dtype=torch.bfloat16)
    ...     try:
    ...         scores.masked_fill(torch.empty(2, 4, dtype=torch.bool), torch.finfo(torch.float32).min)
    ...     except ScalarOverflow as err:
    ...         print(str(err).split(" (")[0])
    value cannot be converted to type c10::BFloat16 without overflow
"""

from __future__ import annotations

import math
import traceback
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._mode_utils import no_dispatch

from .draws import user_line
from .operator_args import bound_arguments

__all__ = ["ScalarOverflow", "check_fill_fits"]

#: torch's names for the dtypes in its overflow message (``c10::typeName``)
_TYPE_NAMES = {torch.bfloat16: "c10::BFloat16", torch.float16: "c10::Half", torch.float32: "float"}

_aten = torch.ops.aten
#: fills whose number is converted to the written tensor's dtype with a check: operator -> the
#: number's argument name, and whether the result's dtype comes from a ``dtype`` argument (else
#: from the first tensor argument)
_FILLS: dict[Any, tuple[str, bool]] = {}
for _name, _overloads, _value, _factory in (
    ("fill", ("Scalar",), "value", False),
    ("fill_", ("Scalar",), "value", False),
    ("masked_fill", ("Scalar", "Tensor"), "value", False),
    ("masked_fill_", ("Scalar", "Tensor"), "value", False),
    ("index_fill", ("int_Scalar",), "value", False),
    ("index_fill_", ("int_Scalar",), "value", False),
    ("scatter", ("value",), "value", False),
    ("scatter_", ("value",), "value", False),
    ("full", ("default",), "fill_value", True),
    ("new_full", ("default",), "fill_value", True),
    ("full_like", ("default",), "fill_value", True),
):
    _packet = getattr(_aten, _name, None)
    for _overload in _overloads:
        if _packet is not None and hasattr(_packet, _overload):
            _FILLS[getattr(_packet, _overload)] = (_value, _factory)


class ScalarOverflow(RuntimeError):
    """The real kernel's overflow error for a fill: the step fails for real too."""


def check_fill_fits(func: Any, args: tuple, kwargs: dict) -> None:
    """Raise :class:`ScalarOverflow` where ``func`` is a fill whose number overflows the dtype it
    is written in (see the module's docstring); else nothing. One dict lookup for other operators."""
    found = _FILLS.get(func)
    if found is None:
        return
    name, factory = found
    bound = bound_arguments(func, args, kwargs)
    value = _number(bound.get(name))
    if value is None or not math.isfinite(value):
        return
    dtype = bound.get("dtype") if factory else None
    if dtype is None:
        first = next((v for v in bound.values() if isinstance(v, torch.Tensor)), None)
        dtype = first.dtype if first is not None else (torch.get_default_dtype() if isinstance(value, float) else None)
    type_name = _TYPE_NAMES.get(dtype)
    if type_name is None or abs(value) <= torch.finfo(dtype).max:
        return
    where = user_line(traceback.extract_stack())
    raise ScalarOverflow(
        f"value cannot be converted to type {type_name} without overflow ({func}{f' at {where}' if where else ''}: "
        f"{value!r} does not fit {dtype}; the real step raises this too)"
    )


def _number(value: Any) -> float | int | None:
    """The number a fill writes: a Python number, or a 0-dimensional tensor's value where it has one
    (a fake tensor's ``constant``, a real tensor's own)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return value
    if isinstance(value, torch.Tensor) and value.dim() == 0 and not value.is_complex():
        held = value.constant if isinstance(value, FakeTensor) else value
        if held is None:
            return None
        with no_dispatch():
            return held.item()
    return None
