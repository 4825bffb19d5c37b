"""swiglu(gate, up) = silu(gate) * up, the gated MLP's activation, keeping less for its backward.

PyTorch's ``F.silu(gate) * up`` keeps gate (for SiLU's backward) and both silu(gate) and up (for
the product's), three [tokens, intermediate] tensors per MLP; swiglu keeps gate and up and
recomputes silu(gate) in the backward, one tensor fewer. With ``inplace_backward=True`` the
backward writes d_gate and d_up over gate and up themselves (which no one else needs once the
backward has run, inside an MLP), so it allocates nothing: the gated MLP's backward then holds
one [tokens, intermediate] gradient (the incoming one) instead of three.
"""

from __future__ import annotations

import torch
from torch import Tensor

from fusedops import dispatch
from fusedops._autograd import refuse_double_backward
from fusedops.swiglu import backends as _backends  # noqa: F401  (registers the op's backends)

__all__ = ["swiglu"]

OP = "swiglu"
_SECOND_BACKWARD = ("swiglu(inplace_backward=True) wrote its gradients over gate and up in the "
                    "first backward; a second backward (retain_graph=True) needs "
                    "inplace_backward=False")
_DOUBLE_BACKWARD = "swiglu has no second derivative (create_graph=True then backward again)"


def _impl(backend: str):
    if backend == "triton":
        from fusedops.swiglu import triton as impl
    else:
        from fusedops.swiglu import reference as impl
    return impl


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up, backend, inplace_backward):
        ctx.backend, ctx.inplace, ctx.done = backend, inplace_backward, False
        ctx.save_for_backward(gate, up)
        return _impl(backend).swiglu_fwd(gate, up)

    @staticmethod
    def backward(ctx, dh):
        if ctx.inplace and ctx.done:
            raise RuntimeError(_SECOND_BACKWARD)
        gate, up = ctx.saved_tensors
        dh = dh.contiguous()
        if ctx.inplace:
            d_gate, d_up = gate, up
        else:
            d_gate, d_up = torch.empty_like(gate), torch.empty_like(up)
        with torch.no_grad():
            _impl(ctx.backend).swiglu_bwd(dh, gate, up, d_gate, d_up)
        if ctx.inplace:
            ctx.done = True
            torch.autograd.graph.increment_version(gate)
            torch.autograd.graph.increment_version(up)
        grads = refuse_double_backward(_DOUBLE_BACKWARD, (gate, up, dh), (d_gate, d_up))
        return (*grads, None, None)


def swiglu(gate: Tensor, up: Tensor, *, inplace_backward: bool = False,
           backend: str | None = None) -> Tensor:
    """silu(gate) * up, elementwise, with gradients for gate and up.

    gate, up: tensors of one shape, dtype (float32, float16, bfloat16; float64 on the torch
    backend) and device; non-contiguous ones are copied. Half-precision inputs are computed in
    float32 and rounded once.

    inplace_backward: the backward writes d_gate over gate and d_up over up (no allocation).
    Use it only where nothing reads gate or up after the backward (the MLP's projections'
    outputs); a second backward through the same graph then raises.

    backend: None / "auto" (Triton on CUDA, torch elsewhere), "triton" or "torch"; or the
    FUSEDOPS_BACKEND environment variable.
    """
    for name, t in (("gate", gate), ("up", up)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not isinstance(inplace_backward, bool):
        raise TypeError(f"inplace_backward must be True or False, got {inplace_backward!r}")
    if gate.shape != up.shape:
        raise ValueError(f"gate and up must have one shape, got {tuple(gate.shape)} and "
                         f"{tuple(up.shape)}")
    if gate.dtype != up.dtype:
        raise ValueError(f"gate and up must have one dtype, got {gate.dtype} and {up.dtype}")
    if not gate.dtype.is_floating_point:
        raise ValueError(f"gate must be a floating-point tensor, got {gate.dtype}")
    if gate.device != up.device:
        raise ValueError(f"gate is on {gate.device} but up is on {up.device}")
    if inplace_backward:
        for name, t in (("gate", gate), ("up", up)):
            if t.is_leaf and t.requires_grad:
                raise ValueError(f"inplace_backward=True would write the gradient over {name}, "
                                 "a leaf tensor that requires grad; use inplace_backward=False")
    width = gate.shape[-1] if gate.dim() else 1
    name = dispatch.select(OP, gate, width, backend)
    return _SwiGLU.apply(gate.contiguous(), up.contiguous(), name, inplace_backward)
