"""Type checks of plain arguments shared by the ops: errors that name the argument."""

from __future__ import annotations

import math
import numbers


def check_bool(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")
    return value


def check_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    return int(value)


def check_real(name: str, value, *, optional: bool = False) -> float | None:
    """A real number (int or float, not bool); None allowed when optional."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        kind = "a number or None" if optional else "a number"
        raise TypeError(f"{name} must be {kind}, got {type(value).__name__} {value!r}")
    value = float(value)
    if math.isnan(value):
        raise ValueError(f"{name} must not be NaN")
    return value
