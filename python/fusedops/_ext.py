"""Loads the compiled extension fusedops._C if it was built; never raises."""

from __future__ import annotations

import importlib

import torch  # noqa: F401  (the extension links against torch's libraries)

try:
    _C = importlib.import_module("fusedops._C")  # registers torch.ops.fusedops.*_cuda
    EXT_ERROR: str | None = None
except ImportError as exc:  # not built (CPU-only install) or built against another torch
    _C = None
    EXT_ERROR = f"{type(exc).__name__}: {exc}"


def built_archs() -> tuple[str, ...]:
    """The CUDA architectures the extension holds device code for, e.g. ('8.0', '9.0a')."""
    if _C is None:
        return ()
    return tuple(a for a in getattr(_C, "built_archs", "").split(";") if a)


def available() -> bool:
    return _C is not None
