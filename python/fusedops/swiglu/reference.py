"""Plain PyTorch swiglu: the oracle of the tests and the CPU path.

Forward h = silu(g) * u; backward, for the incoming dh: du = dh * silu(g) and
dg = dh * u * s * (1 + g * (1 - s)) with s = sigmoid(g). Half-precision inputs are computed in
float32 and rounded once (PyTorch's own silu(g) * u rounds twice). Work goes in slices of 2^22
elements, so the float32 temporaries stay small next to the inputs: the backward holds three
float32 slices, six for half-precision inputs (their upcasts).
"""

from __future__ import annotations

import torch
from torch import Tensor

_SLICE = 1 << 22


def _compute_dtype(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def swiglu_fwd(gate: Tensor, up: Tensor) -> Tensor:
    out = torch.empty_like(gate)
    g_flat, u_flat, o_flat = gate.view(-1), up.view(-1), out.view(-1)
    cdt = _compute_dtype(gate)
    for i in range(0, g_flat.numel(), _SLICE):
        g = g_flat[i:i + _SLICE].to(cdt)
        o_flat[i:i + _SLICE] = (torch.nn.functional.silu(g) * u_flat[i:i + _SLICE].to(cdt))
    return out


def swiglu_bwd(dh: Tensor, gate: Tensor, up: Tensor, d_gate: Tensor, d_up: Tensor) -> None:
    """Writes the gradients into d_gate and d_up, which may be gate and up themselves (each
    slice is read completely before it is written)."""
    cdt = _compute_dtype(gate)
    flats = [t.view(-1) for t in (dh, gate, up, d_gate, d_up)]
    for i in range(0, flats[0].numel(), _SLICE):
        d, g, u = (f[i:i + _SLICE].to(cdt) for f in flats[:3])
        # three slice-sized temporaries (besides the upcasts of half-precision inputs):
        # s (1 + g (1 - s)) = s + silu (1 - s)
        s = torch.sigmoid(g)
        silu = g * s
        dg = silu * s
        dg.neg_().add_(silu).add_(s)
        del s
        dg.mul_(d).mul_(u)
        du = silu.mul_(d)
        flats[3][i:i + _SLICE] = dg
        flats[4][i:i + _SLICE] = du
