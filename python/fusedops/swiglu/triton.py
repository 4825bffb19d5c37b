"""Triton kernels of swiglu: elementwise, float32 arithmetic, 64-bit offsets.

Constraints: gate, up, dh contiguous and of one shape and dtype (float32, float16, bfloat16);
the outputs likewise. The backward may be given gate and up as its outputs: each element is
read before it is written, by the same program.
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from fusedops._triton import INTERPRET

_BLOCK = 1024 if not INTERPRET else 64


@triton.jit
def _fwd_kernel(G, U, OUT, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    g = tl.load(G + offs, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=ok, other=0.0).to(tl.float32)
    s = 1.0 / (1.0 + tl.exp(-g))
    tl.store(OUT + offs, (g * s * u).to(OUT.dtype.element_ty), mask=ok)


@triton.jit
def _bwd_kernel(DH, G, U, DG, DU, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    d = tl.load(DH + offs, mask=ok, other=0.0).to(tl.float32)
    g = tl.load(G + offs, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=ok, other=0.0).to(tl.float32)
    s = 1.0 / (1.0 + tl.exp(-g))
    tl.store(DU + offs, (d * g * s).to(DU.dtype.element_ty), mask=ok)
    tl.store(DG + offs, (d * u * s * (1.0 + g * (1.0 - s))).to(DG.dtype.element_ty), mask=ok)


def _grid(n: int):
    return (triton.cdiv(n, _BLOCK),)


def swiglu_fwd(gate: Tensor, up: Tensor) -> Tensor:
    out = gate.new_empty(gate.shape)
    n = gate.numel()
    if n:
        _fwd_kernel[_grid(n)](gate, up, out, n, BLOCK=_BLOCK, num_warps=4)
    return out


def swiglu_bwd(dh: Tensor, gate: Tensor, up: Tensor, d_gate: Tensor, d_up: Tensor) -> None:
    n = gate.numel()
    if n:
        _bwd_kernel[_grid(n)](dh, gate, up, d_gate, d_up, n, BLOCK=_BLOCK, num_warps=4)
