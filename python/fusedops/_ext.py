"""Loads the compiled extension fusedops._C if it was built; never raises."""

from __future__ import annotations

import importlib
import warnings

import torch  # the extension links against torch's libraries

try:
    _C = importlib.import_module("fusedops._C")  # registers torch.ops.fusedops.*_cuda
    EXT_ERROR: str | None = None
except ImportError as exc:  # not built (CPU-only install) or built against another torch
    _C = None
    EXT_ERROR = f"{type(exc).__name__}: {exc}"

_WARNED = False


def built_archs() -> tuple[str, ...]:
    """The CUDA architectures the extension holds device code for, e.g. ('8.0', '9.0a')."""
    if _C is None:
        return ()
    return tuple(a for a in getattr(_C, "built_archs", "").split(";") if a)


def available() -> bool:
    return _C is not None


def warn_if_missing() -> bool:
    """Warns once when a CUDA GPU is visible but the extension is not loaded (pip hides the
    build's own message); returns whether it warned."""
    global _WARNED
    if _C is not None or _WARNED or not torch.cuda.is_available():
        return False
    _WARNED = True
    warnings.warn(
        f"fusedops: the CUDA extension fusedops._C is not loaded ({EXT_ERROR}); the CUDA "
        "backends are off and Triton or torch run instead. Reinstall where nvcc and a "
        "CUDA-enabled torch are present (pip install --no-build-isolation .); "
        "`python -m fusedops.info` tells more.", RuntimeWarning, stacklevel=3)
    return True
