"""torch.library ops for linear cross-entropy: fusedops::linear_ce_fwd / linear_ce_bwd.

The forward returns three per-token statistics (lse, target logit, sum of logits); the loss, label
smoothing, z-loss and the reduction are ordinary differentiable torch code on top of them
(fusedops.linear_ce.linear_cross_entropy), so one backward op serves every option:
dz = d_lse * softmax(z) + d_zt * onehot(target) + d_zsum. Both ops carry fake implementations
(for torch.compile and meta tensors) and the forward an autograd formula calling the backward op.
"""

from __future__ import annotations

import torch
from torch import Tensor

from fusedops import _ext  # noqa: F401  (loads torch.ops.fusedops.linear_ce_*_cuda when built)
from fusedops._autograd import refuse_double_backward
from fusedops.dispatch import cuda_arch
from fusedops.linear_ce import chunked, reference

_CUDA = ("cuda-sm90", "cuda-sm80")
DOUBLE_BACKWARD = ("fusedops.linear_cross_entropy: double backward (create_graph=True, "
                   "gradgradcheck) is not supported; the backward kernels are not differentiable")


def _stat_dtype(hidden: Tensor) -> torch.dtype:
    return torch.float64 if hidden.dtype == torch.float64 else torch.float32


class TargetOutOfRangeError(ValueError):
    """A target outside [0, V) that is not ignore_index. `index` is its position in the flat
    target; the message gives it in `shape` (the caller's target shape) when that has more than
    one dimension, so that the ops, which see (N,) targets, raise it and linear_cross_entropy
    re-raises it with `in_shape(the caller's shape)`."""

    def __init__(self, index: int, value: int, vocab_size: int, ignore_index: int,
                 shape: tuple[int, ...] = ()):
        self.index, self.value, self.shape = index, value, tuple(shape)
        self.vocab_size, self.ignore_index = vocab_size, ignore_index
        super().__init__(f"target[{_position(index, self.shape)}] = {value} is outside "
                         f"[0, {vocab_size}) and is not ignore_index ({ignore_index})")

    def __reduce__(self):
        return type(self), (self.index, self.value, self.vocab_size, self.ignore_index,
                            self.shape)

    def in_shape(self, shape) -> TargetOutOfRangeError:
        return TargetOutOfRangeError(self.index, self.value, self.vocab_size, self.ignore_index,
                                     tuple(int(d) for d in shape))


def _position(index: int, shape: tuple[int, ...]) -> str:
    """"1, 1" for flat index 4 of a (2, 3) target (row-major, as reshape(-1) flattens); the
    flat index itself for 0 or 1 dimensions. Host arithmetic, no device access."""
    if len(shape) < 2:
        return str(index)
    pos = []
    for size in reversed(shape):
        index, rem = divmod(index, size)
        pos.append(rem)
    return ", ".join(str(p) for p in reversed(pos))


def check_targets_in_range(target: Tensor, vocab_size: int, ignore_index: int,
                           shape: tuple[int, ...] = ()) -> None:
    """Raises TargetOutOfRangeError (a ValueError) naming the first target outside [0, V) that
    is not ignore_index; `shape`: the caller's shape of `target`, for the message."""
    bad = ((target < 0) | (target >= vocab_size)) & (target != ignore_index)
    if bool(bad.any()):  # one host sync; pass check_targets=False to skip it
        idx = int(torch.nonzero(bad.flatten())[0, 0])
        raise TargetOutOfRangeError(idx, int(target.flatten()[idx]), vocab_size, ignore_index,
                                    shape)


@torch.library.custom_op("fusedops::linear_ce_fwd", mutates_args=())
def linear_ce_fwd(hidden: Tensor, weight: Tensor, bias: Tensor | None, target: Tensor,
                  ignore_index: int, softcap: float, check_targets: bool,
                  backend: str) -> tuple[Tensor, Tensor, Tensor]:
    if check_targets:
        check_targets_in_range(target, weight.shape[0], ignore_index)
    if backend == "torch":
        out = reference.linear_ce_fwd(hidden, weight, bias, target, softcap)
    elif backend == "triton":
        from fusedops.linear_ce import triton as tk
        out = tk.linear_ce_fwd(hidden, weight, bias, target, softcap)
    elif backend in _CUDA:
        out = torch.ops.fusedops.linear_ce_fwd_cuda(hidden, weight, bias, target, softcap,
                                                    cuda_arch("linear_ce", backend))
    else:
        raise ValueError(f"unknown backend {backend!r}")
    return tuple(o.to(_stat_dtype(hidden)) for o in out)


@linear_ce_fwd.register_fake
def _(hidden, weight, bias, target, ignore_index, softcap, check_targets, backend):
    n = hidden.shape[0]
    dt = _stat_dtype(hidden)
    return tuple(hidden.new_empty(n, dtype=dt) for _ in range(3))


@torch.library.custom_op("fusedops::linear_ce_bwd", mutates_args=())
def linear_ce_bwd(hidden: Tensor, weight: Tensor, bias: Tensor | None, target: Tensor,
                  lse: Tensor, d_lse: Tensor, d_zt: Tensor, d_zsum: Tensor, softcap: float,
                  need_dh: bool, need_dw: bool, need_db: bool,
                  backend: str) -> tuple[Tensor, Tensor, Tensor]:
    args = (hidden, weight, bias, target, lse, d_lse, d_zt, d_zsum, softcap, need_dh, need_dw,
            need_db)
    if backend == "torch":
        return reference.linear_ce_bwd(*args)
    if backend == "triton":
        from fusedops.linear_ce import triton as tk
        return tk.linear_ce_bwd(*args)
    if backend in _CUDA:
        return tuple(torch.ops.fusedops.linear_ce_bwd_cuda(*args, cuda_arch("linear_ce", backend)))
    raise ValueError(f"unknown backend {backend!r}")


def _grad_shapes(hidden, weight, bias, need_dh, need_dw, need_db):
    """Backward outputs as every backend returns them: the gradient, or a distinct empty tensor."""
    return (
        torch.empty_like(hidden) if need_dh else hidden.new_empty(0),
        torch.empty_like(weight) if need_dw else hidden.new_empty(0),
        torch.empty_like(bias) if (need_db and bias is not None) else hidden.new_empty(0),
    )


@linear_ce_bwd.register_fake
def _(hidden, weight, bias, target, lse, d_lse, d_zt, d_zsum, softcap, need_dh, need_dw, need_db,
      backend):
    return _grad_shapes(hidden, weight, bias, need_dh, need_dw, need_db)


def _setup_context(ctx, inputs, output):
    hidden, weight, bias, target, _ignore, softcap, _check, backend = inputs
    lse = output[0]
    ctx.save_for_backward(hidden, weight, bias, target, lse)
    ctx.softcap = softcap
    ctx.backend = backend
    ctx.has_bias = bias is not None


def _backward(ctx, g_lse, g_zt, g_zsum):
    hidden, weight, bias, target, lse = ctx.saved_tensors
    need_dh, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    need_db = ctx.has_bias and ctx.needs_input_grad[2]
    grads = [g if g is not None else torch.zeros_like(lse) for g in (g_lse, g_zt, g_zsum)]
    dh, dw, db = linear_ce_bwd(hidden, weight, bias, target, lse, *grads, ctx.softcap, need_dh,
                               need_dw, need_db, ctx.backend)
    return (dh if need_dh else None, dw if need_dw else None, db if need_db else None,
            None, None, None, None, None)


linear_ce_fwd.register_autograd(_backward, setup_context=_setup_context)


def _no_double_backward(ctx, *grads):
    raise RuntimeError(DOUBLE_BACKWARD)


def _no_context(ctx, inputs, output):
    return None


# With create_graph=True the gradients come out of linear_ce_bwd with this formula attached, so a
# second backward through them raises instead of silently returning zero second derivatives.
linear_ce_bwd.register_autograd(_no_double_backward, setup_context=_no_context)


# Fake implementations of the compiled ops, so they can be traced and opcheck'ed too.
if _ext.available():

    @torch.library.register_fake("fusedops::linear_ce_fwd_cuda")
    def _(hidden, weight, bias, target, softcap, arch):
        n = hidden.shape[0]
        return tuple(hidden.new_empty(n, dtype=torch.float32) for _ in range(3))

    @torch.library.register_fake("fusedops::linear_ce_bwd_cuda")
    def _(hidden, weight, bias, target, lse, d_lse, d_zt, d_zsum, softcap, need_dh, need_dw,
          need_db, arch):
        return _grad_shapes(hidden, weight, bias, need_dh, need_dw, need_db)


# ----------------------------------------------------------------------------------------------
# The mean/sum fast path (fusedops.linear_ce.chunked): gradients computed in the forward op for
# an upstream gradient of 1, scaled in the backward.

_REDUCTION_NAMES = ("mean", "sum")


def _check_backend(backend: str) -> None:
    if backend not in ("torch", "triton") + _CUDA:
        raise ValueError(f"unknown backend {backend!r}")


@torch.library.custom_op("fusedops::linear_ce_fused", mutates_args=())
def linear_ce_fused(hidden: Tensor, weight: Tensor, bias: Tensor | None, target: Tensor,
                    ignore_index: int, reduction: str, label_smoothing: float, softcap: float,
                    z_loss: float, budget_bytes: int, check_targets: bool, need_dh: bool,
                    need_dw: bool, need_db: bool, backend: str,
                    filter_eps: float = -1.0) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    if check_targets:
        check_targets_in_range(target, weight.shape[0], ignore_index)
    if reduction not in _REDUCTION_NAMES:
        raise ValueError(f"reduction must be one of {_REDUCTION_NAMES} here, got {reduction!r}")
    _check_backend(backend)
    return chunked.fused_forward(hidden, weight, bias, target.long(), ignore_index, reduction,
                                 label_smoothing, softcap, z_loss, budget_bytes, need_dh, need_dw,
                                 need_db and bias is not None, backend, filter_eps)


@linear_ce_fused.register_fake
def _(hidden, weight, bias, target, ignore_index, reduction, label_smoothing, softcap, z_loss,
      budget_bytes, check_targets, need_dh, need_dw, need_db, backend, filter_eps=-1.0):
    dt = _stat_dtype(hidden)
    return (hidden.new_empty((), dtype=dt), hidden.new_empty(hidden.shape[0], dtype=dt),
            *_grad_shapes(hidden, weight, bias, need_dh, need_dw, need_db))


@torch.library.custom_op("fusedops::scale_grad_", mutates_args=("grad",))
def scale_grad_(grad: Tensor, g: Tensor, backend: str) -> None:
    chunked.scale_grad_(grad, g, backend)


@scale_grad_.register_fake
def _(grad, g, backend):
    return None


class _FusedLoss(torch.autograd.Function):
    """loss = linear_ce_fused(...)[0]; backward = the forward's gradients times the upstream g.

    Eager mode keeps the gradients as plain ctx attributes and drops them in the first backward,
    so the tensor handed to autograd has no other owner and AccumulateGrad adopts it as .grad
    without a copy (saved tensors would still be referenced then: a 1 GiB d_weight copy at
    Llama-3 size). A second backward of the same graph (retain_graph=True) recomputes them from
    the saved inputs. Under torch.compile the saved-tensor form is used (the compiler manages
    that memory) and the scaling is out of place, so a retained graph can run again.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, target, ignore_index, reduction, label_smoothing,
                softcap, z_loss, budget, check_targets, need_dh, need_dw, need_db, backend,
                filter_eps):
        args = (hidden, weight, bias, target, ignore_index, reduction, label_smoothing, softcap,
                z_loss, budget, False, need_dh, need_dw, need_db, backend, filter_eps)
        loss, _lse, dh, dw, db = linear_ce_fused(*args[:10], check_targets, *args[11:])
        ctx.backend = backend
        ctx.need = (need_dh, need_dw, need_db)
        ctx.compiled = torch.compiler.is_compiling()
        if ctx.compiled:
            ctx.save_for_backward(dh, dw, db)
        else:
            ctx.save_for_backward(hidden, weight, bias, target)
            ctx.options = args[4:]
            ctx.grads = [dh, dw, db]
        return loss

    @staticmethod
    def backward(ctx, g_loss):
        if ctx.compiled:
            grads = [(g.to(g_loss.dtype) * g_loss).to(g.dtype) if need else None
                     for need, g in zip(ctx.need, ctx.saved_tensors, strict=True)]
        else:
            grads = hand_over_grads(
                ctx, g_loss, ctx.need, ctx.backend,
                lambda inputs: list(linear_ce_fused(*inputs, *ctx.options)[2:]))
        return (*grads, *([None] * 13))


def hand_over_grads(ctx, g_loss: Tensor, need, backend: str, recompute) -> list:
    """The backward of a loss whose forward computed its (hidden, weight, bias) gradients for
    an upstream gradient of 1 and kept them as ctx.grads: they are dropped from ctx here (so
    that AccumulateGrad adopts them without a copy) and scaled in place by g_loss; a second
    backward of a retained graph gets them from recompute(ctx.saved_tensors) instead. None
    where need is false; a second-order backward through them raises."""
    inputs = ctx.saved_tensors
    grads, ctx.grads = ctx.grads, None
    if grads is None:  # a second backward through a retained graph
        with torch.no_grad():
            grads = recompute(inputs)
    for want, grad in zip(need, grads, strict=True):
        if want:
            scale_grad_(grad, g_loss, backend)
    grads = [grad if want else None for want, grad in zip(need, grads, strict=True)]
    return refuse_double_backward(DOUBLE_BACKWARD, (*inputs[:3], g_loss), grads)


def fused_loss(hidden, weight, bias, target, ignore_index, reduction, label_smoothing, softcap,
               z_loss, memory_budget_mib, check_targets, backend, filter_eps=-1.0):
    """The loss through linear_ce_fused; gradients flow to hidden, weight and bias.
    filter_eps: negative for exact gradients, else fusedops.linear_ce.filtered's threshold."""
    grad_on = torch.is_grad_enabled()
    need = [grad_on and t is not None and t.requires_grad for t in (hidden, weight, bias)]
    return _FusedLoss.apply(hidden, weight, bias, target, ignore_index, reduction,
                            label_smoothing, softcap, z_loss,
                            chunked.budget_bytes(memory_budget_mib), check_targets, *need, backend,
                            float(filter_eps))


# ----------------------------------------------------------------------------------------------
# The statistics path (fusedops.linear_ce.chunked.statistics / grads_sweep): any loss on the
# per-token (lse, target logit, logit sum), reduction "none" and return_lse included. One GEMM
# per chunk in the forward, three in the backward; the last token chunk's logits may be kept from
# the forward for the backward (its GEMM is then not repeated).

def _stats_plan(hidden: Tensor, weight: Tensor, budget_bytes: int, need_dh: bool):
    return chunked.plan_chunks(hidden.shape[0], hidden.shape[1], weight.shape[0],
                               hidden.element_size(), budget_bytes, need_dh)


@torch.library.custom_op("fusedops::linear_ce_stats", mutates_args=())
def linear_ce_stats(hidden: Tensor, weight: Tensor, bias: Tensor | None, target: Tensor,
                    ignore_index: int, softcap: float, budget_bytes: int, check_targets: bool,
                    need_dh: bool, keep: bool, backend: str) -> tuple[Tensor, Tensor, Tensor,
                                                                      Tensor]:
    """(lse, target logit, logit sum, kept): kept is the logits buffer holding the last token
    chunk's logits when `keep` and whole rows fit the budget, else an empty tensor."""
    if check_targets:
        check_targets_in_range(target, weight.shape[0], ignore_index)
    _check_backend(backend)
    plan = _stats_plan(hidden, weight, budget_bytes, need_dh)
    lse, zt, zsum, kept = chunked.statistics(hidden, weight, bias, target.long(), softcap, plan,
                                             backend, keep)
    return lse, zt, zsum, kept if kept is not None else hidden.new_empty(0)


@linear_ce_stats.register_fake
def _(hidden, weight, bias, target, ignore_index, softcap, budget_bytes, check_targets, need_dh,
      keep, backend):
    n = hidden.shape[0]
    dt = _stat_dtype(hidden)
    kept = 0
    if keep and n > 0:
        plan = _stats_plan(hidden, weight, budget_bytes, need_dh)
        kept = plan.rows * plan.cols if plan.full_rows else 0
    return (*(hidden.new_empty(n, dtype=dt) for _ in range(3)), hidden.new_empty(kept))


@torch.library.custom_op("fusedops::linear_ce_stats_bwd", mutates_args=("kept",))
def linear_ce_stats_bwd(hidden: Tensor, weight: Tensor, bias: Tensor | None, target: Tensor,
                        lse: Tensor, d_lse: Tensor, d_zt: Tensor, d_zsum: Tensor, kept: Tensor,
                        softcap: float, budget_bytes: int, need_dh: bool, need_dw: bool,
                        need_db: bool, backend: str,
                        filter_eps: float = -1.0) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients for the statistics' upstream gradients; kept (linear_ce_stats' buffer, or
    empty) is overwritten. filter_eps: as linear_ce_fused's."""
    _check_backend(backend)
    plan = _stats_plan(hidden, weight, budget_bytes, need_dh)
    coef = tuple(g.to(lse.dtype).contiguous() for g in (d_lse, d_zt, d_zsum))
    return chunked.grads_sweep(hidden, weight, bias, target.long(), lse, coef, plan, backend,
                               need_dh, need_dw, need_db and bias is not None,
                               softcap=softcap, kept=kept if kept.numel() else None,
                               filter_eps=filter_eps)


@linear_ce_stats_bwd.register_fake
def _(hidden, weight, bias, target, lse, d_lse, d_zt, d_zsum, kept, softcap, budget_bytes,
      need_dh, need_dw, need_db, backend, filter_eps=-1.0):
    return _grad_shapes(hidden, weight, bias, need_dh, need_dw, need_db)


class _StatsFn(torch.autograd.Function):
    """(lse, zt, zsum) = linear_ce_stats(...); the backward runs linear_ce_stats_bwd. Eager mode
    keeps the forward's last logits chunk as a plain ctx attribute, used (and dropped) by the
    first backward; a second backward (retain_graph=True) recomputes it. Under torch.compile
    nothing is kept."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, target, ignore_index, softcap, budget,
                check_targets, need_dh, need_dw, need_db, backend, filter_eps):
        keep = (need_dh or need_dw or need_db) and not torch.compiler.is_compiling()
        lse, zt, zsum, kept = linear_ce_stats(hidden, weight, bias, target, ignore_index,
                                              softcap, budget, check_targets, need_dh, keep,
                                              backend)
        ctx.save_for_backward(hidden, weight, bias, target, lse)
        ctx.kept = kept if kept.numel() else None
        ctx.options = (softcap, budget, need_dh, need_dw, need_db, backend, filter_eps)
        return lse, zt, zsum

    @staticmethod
    def backward(ctx, g_lse, g_zt, g_zsum):
        hidden, weight, bias, target, lse = ctx.saved_tensors
        softcap, budget, need_dh, need_dw, need_db, backend, filter_eps = ctx.options
        kept, ctx.kept = ctx.kept, None
        if kept is None:
            kept = hidden.new_empty(0)
        grads = [g if g is not None else torch.zeros_like(lse) for g in (g_lse, g_zt, g_zsum)]
        dh, dw, db = linear_ce_stats_bwd(hidden, weight, bias, target, lse, *grads, kept,
                                         softcap, budget, need_dh, need_dw, need_db, backend,
                                         filter_eps)
        grads = (dh if need_dh else None, dw if need_dw else None, db if need_db else None)
        if not torch.compiler.is_compiling():
            grads = refuse_double_backward(DOUBLE_BACKWARD, (hidden, weight, bias, g_lse, g_zt,
                                                             g_zsum), grads)
        return (*grads, *([None] * 10))


def stats(hidden, weight, bias, target, ignore_index, softcap, memory_budget_mib, check_targets,
          backend, filter_eps=-1.0):
    """Per-token (lse, target logit, logit sum) through the statistics path, differentiable
    for hidden, weight and bias; filter_eps as fused_loss's."""
    grad_on = torch.is_grad_enabled()
    need = [grad_on and t is not None and t.requires_grad for t in (hidden, weight, bias)]
    return _StatsFn.apply(hidden, weight, bias, target, ignore_index, softcap,
                          chunked.budget_bytes(memory_budget_mib), check_targets, *need, backend,
                          float(filter_eps))


def loss_from_statistics(lse: Tensor, z_target: Tensor, z_sum: Tensor, valid: Tensor,
                         vocab_size: int, label_smoothing: float, z_loss: float, reduction: str,
                         lead_shape, return_lse: bool):
    """The loss from per-token statistics (log-sum-exp, target logit, logit sum), as
    linear_cross_entropy returns it: label smoothing over the vocabulary, z-loss, tokens outside
    `valid` giving 0, then the reduction (and lse shaped as the loss when asked)."""
    eps = float(label_smoothing)
    if eps == 0.0:
        loss = lse - z_target
    else:
        loss = lse - (1.0 - eps) * z_target - (eps / vocab_size) * z_sum
    if z_loss:
        loss = loss + float(z_loss) * lse * lse
    loss = torch.where(valid, loss, torch.zeros_like(loss))
    if reduction == "mean":
        loss = loss.sum() / valid.sum().clamp(min=1).to(loss.dtype)
    elif reduction == "sum":
        loss = loss.sum()
    else:
        loss = loss.view(lead_shape)
    if return_lse:
        return loss, lse.view(lead_shape)
    return loss
