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
        # Only an input that required grad in the forward is written over: one that did not may
        # be the caller's own tensor (data, a frozen activation). (needs_input_grad is set in
        # the forward: a backward that asks for d_up alone still writes d_gate over gate.)
        over_gate = ctx.inplace and ctx.needs_input_grad[0]
        over_up = ctx.inplace and ctx.needs_input_grad[1]
        d_gate = gate if over_gate else torch.empty_like(gate)
        d_up = up if over_up else torch.empty_like(up)
        with torch.no_grad():
            _impl(ctx.backend).swiglu_bwd(dh, gate, up, d_gate, d_up)
        for written, t in ((over_gate, gate), (over_up, up)):
            if written:
                ctx.done = True
                torch.autograd.graph.increment_version(t)
        grads = refuse_double_backward(_DOUBLE_BACKWARD, (gate, up, dh), (d_gate, d_up))
        needs = ctx.needs_input_grad[:2]
        grads = tuple(g if need else None for g, need in zip(grads, needs, strict=True))
        return (*grads, None, None)


def _overlap(a: Tensor, b: Tensor) -> bool:
    """Whether two contiguous tensors share memory (one tensor, or views of one buffer whose
    ranges meet). Under torch.compile only identity is visible."""
    if a is b:
        return True
    if torch.compiler.is_compiling() or not a.numel() or not b.numel():
        return False
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


def swiglu(gate: Tensor, up: Tensor, *, inplace_backward: bool = False,
           backend: str | None = None) -> Tensor:
    """silu(gate) * up, elementwise, with gradients for gate and up.

    gate, up: tensors of one shape, dtype (float32, float16, bfloat16; float64 on the torch
    backend) and device; non-contiguous ones are copied. Half-precision inputs are computed in
    float32 and rounded once.

    inplace_backward: the backward writes d_gate over gate and d_up over up (no allocation).
    Use it only where nothing reads gate or up after the backward (the MLP's projections'
    outputs); a second backward through the same graph then raises. Only an input that
    requires grad is written over (also when a backward asks for the other's gradient alone);
    where gate and up share memory (one tensor, or
    overlapping views of one buffer) the backward allocates its gradients instead, since
    writing one would overwrite the other before it is read. A leaf that requires grad, or a
    view of one, is refused (its gradient would overwrite its value).

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
            base = t if t._base is None else t._base
            if t.requires_grad and base.is_leaf:
                what = "a leaf tensor" if base is t else "a view of a leaf tensor"
                raise ValueError(f"inplace_backward=True would write the gradient over {name}, "
                                 f"{what} that requires grad; use inplace_backward=False")
    width = gate.shape[-1] if gate.dim() else 1
    name = dispatch.select(OP, gate, width, backend)
    gate, up = gate.contiguous(), up.contiguous()
    if inplace_backward and _overlap(gate, up):
        inplace_backward = False
    return _SwiGLU.apply(gate, up, name, inplace_backward)
