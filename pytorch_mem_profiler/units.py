"""Bytes to text: the units every printed or exported figure is in, and the one amount formatter.

Figures are bytes everywhere inside the package; only outputs convert, through
this module. Units are decimal (``MB`` = 10^6 bytes, as the original tool
printed) or binary (``MiB`` = 2^20 bytes). No torch here.

Example::

    >>> format_amount(35_454_208, "MB"), format_amount(131_072, "MB")
    ('35 MB', '0.13 MB')
    >>> format_amount(12_345_678, "MB", digits=3), format_amount(33_554_432, "GB", decimals=2)
    ('12.3 MB', '0.03 GB')
"""

from __future__ import annotations

import math
from typing import Mapping

__all__ = ["UNITS", "check_unit", "format_amount", "significant"]

#: Bytes per unit; every printed or exported figure is in one of these.
UNITS: Mapping[str, int] = {
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "KiB": 2**10,
    "MiB": 2**20,
    "GiB": 2**30,
}


def check_unit(unit: object, name: str = "unit") -> str:
    """``unit`` if it is one of :data:`UNITS`; ``ValueError`` naming the argument ``name`` if not.

    Example::

        >>> check_unit("GiB")
        'GiB'
    """
    if not isinstance(unit, str) or unit not in UNITS:
        raise ValueError(f"{name} must be one of {', '.join(UNITS)}; got {unit!r}")
    return unit


def _missing(value: float | None) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def significant(value: float, digits: int = 3) -> str:
    """``value`` to ``digits`` significant digits, thousands separated, never in exponent form.

    Example::

        >>> significant(13752.4), significant(66.64), significant(0.001234)
        ('13,752', '66.6', '0.00123')
    """
    size = abs(value)
    if size == 0:
        return "0"
    if size >= 10 ** (digits - 1):
        return f"{value:,.0f}"
    decimals = digits - 1 - math.floor(math.log10(size))
    return f"{value:.{decimals}f}"


def _report_style(value: float) -> str:
    """Whole units from 1 up, as the original tool printed them; two significant digits
    below 1, so small layers do not all read 0."""
    if value == 0:
        return "0"
    if abs(value) >= 1:
        return f"{value:.0f}"
    text = f"{value:.2g}"
    if "e" in text:  # 2.5e-05 reads worse than 0.000025
        digits, scaled = 0, value
        while abs(scaled) < 10 and digits < 12:
            scaled *= 10
            digits += 1
        text = f"{value:.{digits}f}"
    return text


def format_amount(
    nbytes: float | None, unit: str = "MB", *, digits: int | None = None, decimals: int | None = None
) -> str:
    """``nbytes`` in ``unit``, followed by the unit; ``None`` or NaN is ``n/a``.

    Args:
        nbytes: a number of bytes.
        unit: one of :data:`UNITS`.
        digits: that many significant digits, thousands separated (tables and summaries).
        decimals: that many decimals (one-line block reports).

    Without ``digits`` or ``decimals``: the report's style, whole units from 1 up
    and two significant digits below.
    """
    if _missing(nbytes):
        return "n/a"
    value = nbytes / UNITS[unit]  # type: ignore[operator]
    if decimals is not None:
        text = f"{value:.{decimals}f}"
    elif digits is not None:
        text = significant(value, digits)
    else:
        text = _report_style(value)
    return f"{text} {unit}"
