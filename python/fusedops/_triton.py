"""What the Triton kernels of every op share: the interpreter flag, exp2 constants, tanh and
attention scores."""

from __future__ import annotations

import os

import triton
import triton.language as tl
from triton.language.extra import libdevice

LOG2E = tl.constexpr(1.4426950408889634)  # log2(e): exp(x) = exp2(x * LOG2E)


def interpreting() -> bool:
    """Whether Triton runs kernels on the CPU through its interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


INTERPRET = tl.constexpr(interpreting())


@triton.jit
def tanh(x):
    if INTERPRET:  # the interpreter has no libdevice; this form is exact to a few float32 ulps
        e = tl.exp(-2.0 * tl.abs(x))
        t = (1.0 - e) / (1.0 + e)
        return tl.where(x < 0, -t, t)
    else:
        return libdevice.tanh(x)


@triton.jit
def scores_log2(q, k, sm_scale, softcap, SOFTCAP: tl.constexpr, IEEE: tl.constexpr):
    """Attention scores q k^T of a tile in log2 units: scaled, soft-capped when SOFTCAP
    (softcap * tanh(s / softcap)), times log2(e); IEEE asks tl.dot for full float32."""
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    s = s * sm_scale
    if SOFTCAP:
        s = softcap * tanh(s / softcap)
    return s * LOG2E
