"""Our Hopper GEMMs for the linear cross-entropy (csrc/linear_ce/gemm_sm90*): the op
torch.ops.fusedops.lce_gemm_sm90 for tests and benchmarks, and the opt-in switch
FUSEDOPS_LCE_GEMM=sm90 that makes chunked.py run its three GEMMs (logits, d_hidden, d_weight)
on them instead of cuBLAS where the operands fit (off by default; read at every call).
FUSEDOPS_LCE_GEMM=sm90-fused does the same and, for whole-row token chunks, runs the logits
GEMM with the cross-entropy statistics in its epilogue (torch.ops.fusedops.
lce_logits_ce_stats_sm90), so that the row kernel only turns z into dz (stats_route_why_not says
when it applies). FUSEDOPS_LCE_GEMM=sm90-fused2 also drops that pass: d_hidden and d_weight
compute dz from z in their operand path (torch.ops.fusedops.lce_dz_gemm_sm90, dz_gemm;
dz_route_why_not says when).

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
SM90, SM90_FUSED, SM90_FUSED2 = "sm90", "sm90-fused", "sm90-fused2"  # ENV values: our GEMMs on
STATS_BLOCK_N = 256  # vocab columns per partial of the statistics epilogue (the GEMM's tile)
stats_calls = 0  # calls of logits_ce_stats so far: tests and benchmarks see the route ran
dz_calls = 0  # calls of dz_gemm so far
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


def _mode() -> str:
    return os.environ.get(ENV, "").strip().lower()


def enabled() -> bool:
    """Our GEMMs run the products they cover (FUSEDOPS_LCE_GEMM=sm90, sm90-fused or
    sm90-fused2)."""
    return _mode() in (SM90, SM90_FUSED, SM90_FUSED2)


def fused_enabled() -> bool:
    """The logits GEMM also computes the statistics (FUSEDOPS_LCE_GEMM=sm90-fused or
    sm90-fused2)."""
    return _mode() in (SM90_FUSED, SM90_FUSED2)


def dz_enabled() -> bool:
    """d_hidden and d_weight also compute dz from z (FUSEDOPS_LCE_GEMM=sm90-fused2)."""
    return _mode() == SM90_FUSED2


def dz_op_available() -> bool:
    try:
        return hasattr(torch.ops.fusedops, "lce_dz_gemm_sm90")
    except (AttributeError, RuntimeError):
        return False


def stats_op_available() -> bool:
    try:
        return hasattr(torch.ops.fusedops, "lce_logits_ce_stats_sm90")
    except (AttributeError, RuntimeError):
        return False


def stats_tiles(vocab: int) -> int:
    """Column tiles of the statistics' partials per row."""
    return -(-vocab // STATS_BLOCK_N)


def stats_partial_bytes(vocab: int) -> int:
    """Bytes of partials per token row (one float4 per column tile)."""
    return 16 * stats_tiles(vocab)


def _stats_device_ok(device: torch.device) -> bool:
    return device.type == "cuda" and stats_op_available() and supported(device)


def stats_route_why_not(hidden: Tensor, w_mm: Tensor, bias: Tensor | None, target: Tensor,
                        full_rows: bool) -> str | None:
    """Why chunked.fused_forward cannot run the logits GEMM with the statistics epilogue for
    these inputs (None: it can). From the switch, dtypes, shapes, strides, pointer alignment and
    the device only (never tensor values), so the choice is stable for torch.compile."""
    if not fused_enabled():
        return f"{ENV} is not {SM90_FUSED} or {SM90_FUSED2}"
    if not full_rows:
        return "the token chunks are vocab-chunked (the memory budget holds no whole rows)"
    if hidden.dtype not in (torch.bfloat16, torch.float16) or w_mm.dtype != hidden.dtype:
        return f"needs float16/bfloat16 hidden and weight of one dtype, got {hidden.dtype}, " \
               f"{w_mm.dtype}"
    n, h = hidden.shape
    v = w_mm.shape[0]
    if h < 1 or h % 8 or v % 8:
        return f"needs H and V multiples of 8 (TMA row strides), got H={h}, V={v}"
    if not (hidden.is_contiguous() and w_mm.is_contiguous()):
        return "needs contiguous hidden and weight"
    if hidden.data_ptr() % 16 or w_mm.data_ptr() % 16:
        return "needs 16-byte aligned hidden and weight"
    if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()
                             or bias.data_ptr() % 8):
        return "needs a contiguous, 8-byte aligned float32 bias"
    if target.dtype != torch.int64 or not target.is_contiguous():
        return "needs a contiguous int64 target"
    if v > 2**31 - 1 or n > 2**31 - 1:
        return "sizes of 2^31 or more"
    if not _stats_device_ok(hidden.device):
        return "needs a compute capability 9.0 GPU and the lce_logits_ce_stats_sm90 op " \
               "(fusedops._C built for 9.0a)"
    return None


def logits_ce_stats(x: Tensor, w: Tensor, z: Tensor, bias: Tensor | None, target: Tensor,
                    softcap: float, partials: Tensor, lse: Tensor, zt: Tensor,
                    zsum: Tensor) -> None:
    """z = x @ w.T (rounded to z's dtype) and per row of z the statistics of softcap(z + bias):
    partials (M, stats_tiles(V), 4) float32 per 256-column tile (max, sum of exp, target logit,
    logit sum), then lse, zt, zsum (M,) float32 merged from them. Targets outside [0, V) get
    zt = 0."""
    global stats_calls
    stats_calls += 1
    torch.ops.fusedops.lce_logits_ce_stats_sm90(x, w, z, bias, target, float(softcap), partials,
                                                lse, zt, zsum)


def dz_route_why_not(hidden: Tensor, d_weight: Tensor | None, bias: Tensor | None) -> str | None:
    """Why chunked.fused_forward, on the statistics route, cannot also compute dz inside the
    d_hidden and d_weight GEMMs (None: it can; it then skips the row kernel's dz pass).
    d_weight: the gradient buffer (None when not needed); bias: the float32 bias or None. From
    the switch, dtypes, strides and the device only."""
    if not dz_enabled():
        return f"{ENV} is not {SM90_FUSED2}"
    if not dz_op_available():
        return "needs the lce_dz_gemm_sm90 op (fusedops._C built for 9.0a)"
    if d_weight is not None and (d_weight.dtype != hidden.dtype or not _row_major(d_weight)):
        return f"needs d_weight in hidden's dtype {hidden.dtype}, got {d_weight.dtype} " \
               "(float32 weights keep the dz pass and cuBLAS)"
    if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()
                             or bias.data_ptr() % 8):
        return "needs a contiguous, 8-byte aligned float32 bias"
    return None


def dz_gemm(z: Tensor, b: Tensor, out: Tensor, layout: int, accumulate: bool,
            bias: Tensor | None, lse: Tensor, w: Tensor, target: Tensor, eps: float,
            z_loss: float, softcap: float, dbias: Tensor | None = None) -> Tensor:
    """The d_hidden (layout 2: out[tokens, H] = dz @ b[V, H]) or d_weight (layout 3: out[V, H]
    (+)= dz.T @ b[tokens, H]) product with dz computed from the stored logits z [tokens, V]
    (no bias or softcap applied) as the row kernel's dz pass does: dz = w (softmax(z') (1 + 2
    z_loss lse) - eps / V - (1 - eps) onehot(target)) times the softcap derivative, z' =
    softcap(z + bias). lse, w float32 [tokens]; target int64 (outside [0, V): no one-hot term).
    Layout 3 also writes dbias [V] float32 = dz.sum(0) when given. Returns out."""
    global dz_calls
    dz_calls += 1
    torch.ops.fusedops.lce_dz_gemm_sm90(z, b, out, layout, accumulate, bias, lse, w, target,
                                        float(eps), float(z_loss), float(softcap), dbias)
    return out


def _row_major(t: Tensor) -> bool:
    """What the kernel's TMA loads accept (the op's checks, without raising)."""
    return (t.dim() == 2 and (t.stride(1) == 1 or t.size(1) <= 1)
            and (t.size(0) <= 1 or (t.stride(0) % 8 == 0 and t.stride(0) >= t.size(1)))
            and t.data_ptr() % 16 == 0)


def try_mm(out: Tensor, a: Tensor, b: Tensor, accumulate: bool) -> bool:
    """out (+)= a @ b by our GEMM when FUSEDOPS_LCE_GEMM=sm90 (or sm90-fused) is set and the
    operands fit (one of the three layouts, fp16/bf16 everywhere, a Hopper GPU); False, having
    done nothing, otherwise."""
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

    if stats_op_available():
        @torch.library.register_fake("fusedops::lce_logits_ce_stats_sm90")
        def _(x, w, z, bias, target, softcap, partials, lse, zt, zsum):
            return None

    if dz_op_available():
        @torch.library.register_fake("fusedops::lce_dz_gemm_sm90")
        def _(z, b, out, layout, accumulate, bias, lse, w, target, eps, z_loss, softcap, dbias):
            return None

    _FAKE = True


_FAKE = False
if os.environ.get(LIB_ENV) and not op_available():
    torch.ops.load_library(os.environ[LIB_ENV])
register_fake()
