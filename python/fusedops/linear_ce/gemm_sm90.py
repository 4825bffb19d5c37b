"""Our Hopper GEMMs for the linear cross-entropy (csrc/linear_ce/gemm_sm90*): the op
torch.ops.fusedops.lce_gemm_sm90 for tests and benchmarks, and the opt-in switch
FUSEDOPS_LCE_GEMM=sm90 that makes chunked.py run its three GEMMs (logits, d_hidden, d_weight)
on them instead of cuBLAS where the operands fit (off by default; read at every call).

Layouts (row-major operands; out is written in place):
  LOGITS   = 1: out[M, N] = a[M, K] @ b[N, K].T
  D_HIDDEN = 2: out[M, N] = a[M, K] @ b[K, N]
  D_WEIGHT = 3: out[M, N] (+)= a[K, M].T @ b[K, N]   (accumulate: out = round(out + product))
"""

from __future__ import annotations

import functools
import os

import torch
from torch import Tensor

from fusedops import _ext

LOGITS, D_HIDDEN, D_WEIGHT = 1, 2, 3
ENV = "FUSEDOPS_LCE_GEMM"
# A library holding the op alone (benchmarks/lce_gemm_sm90_standalone.py), loaded at import
# when fusedops._C does not register the op: for device checks without the whole extension.
LIB_ENV = "FUSEDOPS_LCE_GEMM_LIB"


def op_available() -> bool:
    """The op is registered: by fusedops._C, or by a library of the op alone
    (benchmarks/lce_gemm_sm90_standalone.py builds one for quick device checks)."""
    try:
        return hasattr(torch.ops.fusedops, "lce_gemm_sm90")
    except (AttributeError, RuntimeError):
        return False


@functools.cache
def _device_ok(index: int) -> bool:
    # A library of the op alone is built for 9.0a; fusedops._C says what it was built for.
    built = "9.0a" in _ext.built_archs() if _ext.available() else True
    return torch.cuda.get_device_capability(index) == (9, 0) and built


def supported(device: torch.device) -> bool:
    """The op can run on `device`: a compute capability 9.0 GPU and an extension built for 9.0a."""
    device = torch.device(device)
    if device.type != "cuda" or not op_available():
        return False
    return _device_ok(device.index if device.index is not None else torch.cuda.current_device())


def gemm(a: Tensor, b: Tensor, out: Tensor, layout: int, accumulate: bool = False) -> Tensor:
    """out (+)= the product of `layout` (see the module docstring); returns out."""
    torch.ops.fusedops.lce_gemm_sm90(a, b, out, layout, accumulate)
    return out


def enabled() -> bool:
    return os.environ.get(ENV, "").strip().lower() == "sm90"


def _row_major(t: Tensor) -> bool:
    """What the kernel's TMA loads accept (the op's checks, without raising)."""
    return (t.dim() == 2 and (t.stride(1) == 1 or t.size(1) <= 1)
            and (t.size(0) <= 1 or (t.stride(0) % 8 == 0 and t.stride(0) >= t.size(1)))
            and t.data_ptr() % 16 == 0)


def try_mm(out: Tensor, a: Tensor, b: Tensor, accumulate: bool) -> bool:
    """out (+)= a @ b by our GEMM when FUSEDOPS_LCE_GEMM=sm90 is set and the operands fit (one
    of the three layouts, fp16/bf16 everywhere, a Hopper GPU); False, having done nothing,
    otherwise."""
    if not enabled() or not (out.is_cuda and a.is_cuda and b.is_cuda):
        return False
    if out.dtype not in (torch.bfloat16, torch.float16) or not (a.dtype == b.dtype == out.dtype):
        return False
    if out.numel() == 0 or a.shape[1] == 0 or not supported(out.device):
        return False
    if not _row_major(out):
        return False
    if _row_major(a) and _row_major(b.T):
        layout, a_op, b_op = LOGITS, a, b.T
    elif _row_major(a) and _row_major(b):
        layout, a_op, b_op = D_HIDDEN, a, b
    elif _row_major(a.T) and _row_major(b):
        layout, a_op, b_op = D_WEIGHT, a.T, b
    else:
        return False
    if accumulate and layout != D_WEIGHT:
        return False
    gemm(a_op, b_op, out, layout, accumulate)
    return True


def register_fake() -> None:
    """The op's fake (meta) implementation, once the op is registered."""
    global _FAKE
    if _FAKE or not op_available():
        return

    @torch.library.register_fake("fusedops::lce_gemm_sm90")
    def _(a, b, out, layout, accumulate):
        return None

    _FAKE = True


_FAKE = False
if os.environ.get(LIB_ENV) and not op_available():
    torch.ops.load_library(os.environ[LIB_ENV])
register_fake()
