"""torch.library ops for attention: fusedops::attention_fwd / attention_bwd (packed layout).

Inputs are always packed: q (total_q, Hq, D), k/v (total_k, Hkv, D) with int32 cu_seqlens; the
dense API builds cu_seqlens = arange(B + 1) * S. lse is (Hq, total_q). The backward op is its own
op so torch.compile sees both directions; lse is returned as a non-differentiable output.

`forward` is the entry of the API: under torch.compile it calls the custom op, in eager mode an
autograd.Function over the same implementations, which skips the custom op's Python dispatch
(about 40 us a call on the CPU, more with autograd; measured in docs/attention.md).
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from fusedops._autograd import refuse_double_backward
from fusedops.attention import reference
from fusedops.dispatch import bwd_backend, cuda_arch

DOUBLE_BACKWARD = ("fusedops.attention: double backward (create_graph=True, gradgradcheck) is not "
                   "supported; the backward kernels are not differentiable")


def _stat_dtype(q: Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def check_seqlens(cu_q: Tensor, cu_k: Tensor, total_q: int, total_k: int, max_q: int,
                  max_k: int) -> None:
    """Value checks of cu_seqlens (one host synchronisation; only for user-given cu_seqlens)."""
    for name, cu, total, mx in (("cu_seqlens_q", cu_q, total_q, max_q),
                                ("cu_seqlens_k", cu_k, total_k, max_k)):
        c = cu.tolist()
        if c[0] != 0:
            raise ValueError(f"{name}[0] must be 0, got {c[0]}")
        if c[-1] != total:
            raise ValueError(f"{name}[-1] must equal the packed length {total}, got {c[-1]}")
        lens = [b - a for a, b in zip(c, c[1:], strict=False)]
        if any(n < 0 for n in lens):
            raise ValueError(f"{name} must be non-decreasing, got {c}")
        if lens and max(lens) > mx:
            raise ValueError(f"a sequence in {name} has length {max(lens)} > the given maximum "
                             f"{mx}")


def _fwd_impl(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, causal,
              window_left, window_right, softcap, check, backend):
    if check:
        check_seqlens(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0], max_seqlen_q,
                      max_seqlen_k)
    if backend == "torch":
        return reference.attention_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, causal,
                                       window_left, window_right, softcap)
    if backend == "triton":
        from fusedops.attention import triton as ta
        return ta.attention_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                scale, causal, window_left, window_right, softcap)
    if backend in ("cuda-sm80", "cuda-sm90"):
        return torch.ops.fusedops.attention_fwd_cuda(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, causal,
            window_left, window_right, softcap, cuda_arch("attention", backend))
    raise ValueError(f"unknown attention backend {backend!r}")


@torch.library.custom_op("fusedops::attention_fwd", mutates_args=())
def attention_fwd(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                  max_seqlen_q: int, max_seqlen_k: int, scale: float, causal: bool,
                  window_left: int, window_right: int, softcap: float, check: bool,
                  backend: str) -> tuple[Tensor, Tensor]:
    return _fwd_impl(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale,
                     causal, window_left, window_right, softcap, check, backend)


@attention_fwd.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, causal,
      window_left, window_right, softcap, check, backend):
    return torch.empty_like(q), q.new_empty((q.shape[1], q.shape[0]), dtype=_stat_dtype(q))


def _bwd_impl(q, k, v, out, lse, dout, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
              scale, causal, window_left, window_right, softcap, deterministic, backend):
    # A forward backend without a backward at this head dim (cuda-sm90 at 256) hands it to the
    # one its table names; the lse layout is common to all of them.
    # Without Triton the torch reference takes it (slower, same lse contract), so a forward
    # that auto picked never leaves its backward without a kernel.
    by = bwd_backend("attention", backend, q.shape[-1])
    if by != backend:
        if by == "triton":
            try:
                import triton  # noqa: F401
            except ImportError:
                by = "torch"
        backend = by
    if backend == "torch":
        return reference.attention_bwd(q, k, v, out, lse, dout, cu_seqlens_q, cu_seqlens_k,
                                       scale, causal, window_left, window_right, softcap)
    if backend == "triton":
        from fusedops.attention import triton as ta
        return ta.attention_bwd(q, k, v, out, lse, dout.contiguous(), cu_seqlens_q,
                                cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, causal,
                                window_left, window_right, softcap, deterministic)
    if backend in ("cuda-sm80", "cuda-sm90"):
        return torch.ops.fusedops.attention_bwd_cuda(
            q, k, v, out, lse, dout.contiguous(), cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
            max_seqlen_k, scale, causal, window_left, window_right, softcap, deterministic,
            cuda_arch("attention", backend))
    raise ValueError(f"unknown attention backend {backend!r}")


@torch.library.custom_op("fusedops::attention_bwd", mutates_args=())
def attention_bwd(q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dout: Tensor,
                  cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int,
                  max_seqlen_k: int, scale: float, causal: bool, window_left: int,
                  window_right: int, softcap: float, deterministic: bool,
                  backend: str) -> tuple[Tensor, Tensor, Tensor]:
    return _bwd_impl(q, k, v, out, lse, dout, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                     max_seqlen_k, scale, causal, window_left, window_right, softcap,
                     deterministic, backend)


@attention_bwd.register_fake
def _(q, k, v, out, lse, dout, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale,
      causal, window_left, window_right, softcap, deterministic, backend):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    (q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, left, right, softcap, _check,
     backend) = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k)
    ctx.args = (max_q, max_k, scale, causal, left, right, softcap)
    ctx.backend = backend
    ctx.mark_non_differentiable(lse)


def _default_dq(backend, head_dim):
    """The faster dQ mode on the H200 (docs/attention.md): Triton's separate pass
    is about twice as fast as its fp32 atomics; CUDA's atomics from the 8-warp dK/dV kernel are
    1.36x faster than its separate pass at D=128 and 1.12x at D=64 (git 83c3866). On a GPU
    whose shared memory per block is below that kernel's (193 KiB at D=128, 226 KiB at D=64: not
    an A100), the CUDA backward computes dQ in the separate pass whatever the mode says. The mode
    is that of the backend running the backward (Triton's after cuda-sm90 at D=256)."""
    backend = bwd_backend("attention", backend, head_dim)
    return "atomic" if backend in ("cuda-sm80", "cuda-sm90") else "separate"


def dq_mode(backend, head_dim):
    """How the backward computes dQ: "separate" (deterministic, bit-reproducible: its own pass,
    or in cuda-sm90's backward at D=64/128 fp32 reductions in a fixed order) or "atomic" (fp32
    atomics from the dK/dV kernel, in any order). Always "separate" under
    torch.use_deterministic_algorithms(True); else FUSEDOPS_ATTN_DQ, else the faster one for the
    backend and head dim."""
    if torch.are_deterministic_algorithms_enabled():
        return "separate"
    mode = os.environ.get("FUSEDOPS_ATTN_DQ") or _default_dq(backend, head_dim)
    if mode not in ("separate", "atomic"):
        raise ValueError(f"FUSEDOPS_ATTN_DQ must be 'separate' or 'atomic', got {mode!r}")
    return mode


def _backward(ctx, dout, _dlse, bwd=attention_bwd, saved=None):
    # saved: ctx.saved_tensors already unpacked by the caller (non-reentrant activation
    # checkpointing allows one unpack per backward)
    q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors if saved is None else saved
    deterministic = dq_mode(ctx.backend, q.shape[-1]) == "separate"
    dq, dk, dv = bwd(q, k, v, out, lse, dout, cu_q, cu_k, *ctx.args, deterministic, ctx.backend)
    return dq, dk, dv, None, None, None, None, None, None, None, None, None, None, None


attention_fwd.register_autograd(_backward, setup_context=_setup_context)


def _no_double_backward(ctx, *grads):
    raise RuntimeError(DOUBLE_BACKWARD)


# With create_graph=True the gradients come out of attention_bwd with this formula attached, so a
# second backward through them raises instead of silently returning zero second derivatives.
attention_bwd.register_autograd(_no_double_backward, setup_context=lambda ctx, inputs, output: None)


class _Eager(torch.autograd.Function):
    """The eager path: the custom op's implementation and autograd without its dispatch."""

    @staticmethod
    def forward(ctx, *inputs):
        output = _fwd_impl(*inputs)
        _setup_context(ctx, inputs, output)
        return output

    @staticmethod
    def backward(ctx, dout, dlse):
        saved = ctx.saved_tensors
        # A backward called inside torch.autocast must not recast the reference's products.
        with torch.autocast(dout.device.type, enabled=False):
            grads = _backward(ctx, dout, dlse, bwd=_bwd_impl, saved=saved)
        return refuse_double_backward(DOUBLE_BACKWARD, (*saved[:3], dout), grads)


def forward(*inputs) -> tuple[Tensor, Tensor]:
    """(out, lse) = fusedops::attention_fwd(*inputs), differentiable in q, k, v."""
    # Meta tensors (shape inference) take the op too, whose fake implementation gives the shapes
    # the implementations would read values for.
    if torch.compiler.is_compiling() or inputs[0].device.type == "meta":
        return attention_fwd(*inputs)
    if torch.is_grad_enabled() and any(t.requires_grad for t in inputs[:3]):
        return _Eager.apply(*inputs)
    return _fwd_impl(*inputs)
