"""Type checks of plain arguments shared by the ops: errors that name the argument."""

from __future__ import annotations

import math
import numbers


def check_bool(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")
    return value


def is_int(value) -> bool:
    """A Python or NumPy integer, not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_int(name: str, value) -> int:
    if not is_int(value):
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


# The kernels take scale and softcap as float32: values past its range would become inf or 0.
# Magnitudes below F32_MAX round to a finite float32 (its largest, 3.4028234663852886e38, plus
# half an ulp); F32_TINY is its smallest normal.
F32_MAX = 2.0**128 * (1 - 2.0**-25)
F32_TINY = 1.1754943508222875e-38


def check_attention_options(window_size, softcap, softmax_scale) -> None:
    """window_size a (left, right) pair of ints >= -1 (-1 = unlimited); softcap None or a
    positive number within float32's normal range; softmax_scale None or a number whose
    magnitude float32 holds."""
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2:
        raise TypeError(f"window_size must be a (left, right) pair of ints, got {window_size!r}")
    for side, w in zip(("left", "right"), window_size, strict=True):
        check_int(f"window_size {side}", w)
        if w < -1:
            raise ValueError(f"window_size entries must be >= -1 (-1 = unlimited), got "
                             f"{window_size!r}")
    softcap = check_real("softcap", softcap, optional=True)
    if softcap is not None and not (F32_TINY <= softcap < F32_MAX):
        raise ValueError(f"softcap must be a positive finite number or None, within float32's "
                         f"normal range [{F32_TINY:.4g}, {F32_MAX:.4g}], got {softcap}")
    softmax_scale = check_real("softmax_scale", softmax_scale, optional=True)
    if softmax_scale is not None and not abs(softmax_scale) < F32_MAX:
        raise ValueError(f"softmax_scale must be finite and below float32's largest in "
                         f"magnitude ({F32_MAX:.4g}), got {softmax_scale}")


def check_budget_mib(name: str, value) -> float | None:
    """A memory budget in MiB: None or a positive finite number."""
    budget = check_real(name, value, optional=True)
    if budget is not None and not (budget > 0 and math.isfinite(budget)):
        raise ValueError(f"{name} must be a positive number or None, got {value}")
    return budget


def cli_number(kind, ok, what: str):
    """An argparse type: `kind` of the text, refused with `what` unless ok(value)."""
    import argparse

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not ok(value):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value
    return parse


cli_positive_int = cli_number(int, lambda v: v >= 1, "an integer >= 1")
