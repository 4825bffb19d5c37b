"""Fused linear + cross-entropy: the loss of `hidden @ weight.T + bias` without the full logits."""

from __future__ import annotations

import math
import os

import torch
from torch import Tensor, nn

from fusedops import dispatch
from fusedops._checks import F32_MAX, F32_TINY, check_bool, check_budget_mib, check_int, check_real
from fusedops.linear_ce import backends as _backends  # noqa: F401  (declares the backends)

__all__ = ["linear_cross_entropy", "LinearCrossEntropyLoss"]

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_REDUCTIONS = ("mean", "sum", "none")


def _check_inputs(hidden, weight, target, bias, reduction, label_smoothing, softcap, z_loss,
                  memory_budget_mib, ignore_index, return_lse, check_targets, filter_eps=None):
    if not isinstance(hidden, Tensor):
        raise TypeError(f"hidden must be a Tensor, got {type(hidden).__name__}")
    if not isinstance(weight, Tensor):
        raise TypeError(f"weight must be a Tensor, got {type(weight).__name__}")
    if not isinstance(target, Tensor):
        raise TypeError(f"target must be a Tensor, got {type(target).__name__}")
    if hidden.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"hidden must be float32, float16, bfloat16 or float64, got "
                        f"{hidden.dtype}")
    if hidden.dim() < 1:
        raise ValueError("hidden must have shape (..., H), got a 0-d tensor")
    if weight.dim() != 2:
        raise ValueError(f"weight must have shape (V, H), got {tuple(weight.shape)}")
    hidden_size = hidden.shape[-1]
    if hidden_size == 0:
        raise ValueError("hidden has hidden size 0")
    if weight.shape[1] != hidden_size:
        raise ValueError(f"weight has shape {tuple(weight.shape)}; its second dimension must be "
                         f"hidden's last dimension {hidden_size}")
    if weight.shape[0] == 0:
        raise ValueError("weight has 0 rows (vocabulary size 0)")
    mixed = weight.dtype == torch.float32 and hidden.dtype in (torch.float16, torch.bfloat16)
    if weight.dtype != hidden.dtype and not mixed:
        raise TypeError(f"weight dtype {weight.dtype} differs from hidden dtype {hidden.dtype} "
                        "(only float32 weights with float16/bfloat16 hidden may mix)")
    if bias is not None:
        if not isinstance(bias, Tensor):
            raise TypeError(f"bias must be a Tensor or None, got {type(bias).__name__}")
        if bias.shape != (weight.shape[0],):
            raise ValueError(f"bias must have shape ({weight.shape[0]},), got "
                             f"{tuple(bias.shape)}")
        if bias.dtype != weight.dtype:
            raise TypeError(f"bias dtype {bias.dtype} differs from weight dtype {weight.dtype}")
    if target.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"target must be int64 or int32, got {target.dtype}")
    if target.shape != hidden.shape[:-1]:
        raise ValueError(f"target must have hidden's leading shape {tuple(hidden.shape[:-1])}, "
                         f"got {tuple(target.shape)}")
    for name, t in (("weight", weight), ("target", target), ("bias", bias)):
        if t is not None and t.device != hidden.device:
            raise ValueError(f"{name} is on {t.device} but hidden is on {hidden.device}")
    _check_options(reduction, label_smoothing, softcap, z_loss, memory_budget_mib, ignore_index,
                   return_lse, check_targets, filter_eps)


def _check_options(reduction, label_smoothing, softcap, z_loss, memory_budget_mib, ignore_index,
                   return_lse, check_targets, filter_eps=None):
    """The checks of the plain options (no tensor); LinearCrossEntropyLoss runs them at
    construction."""
    if not isinstance(reduction, str) or reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    if not -2**63 <= check_int("ignore_index", ignore_index) < 2**63:
        raise ValueError(f"ignore_index must fit in int64 (targets' widest dtype), got "
                         f"{ignore_index}")
    check_bool("return_lse", return_lse)
    if check_targets is not None:
        check_bool("check_targets", check_targets)
    label_smoothing = check_real("label_smoothing", label_smoothing)
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    softcap = check_real("softcap", softcap, optional=True)
    if softcap is not None and not (F32_TINY <= softcap < F32_MAX):
        raise ValueError(f"softcap must be a positive finite number or None, within float32's "
                         f"normal range [{F32_TINY:.4g}, {F32_MAX:.4g}], got {softcap}")
    z_loss = check_real("z_loss", z_loss)
    if not (z_loss >= 0.0 and math.isfinite(z_loss)):
        raise ValueError(f"z_loss must be a finite number >= 0, got {z_loss}")
    check_budget_mib("memory_budget_mib", memory_budget_mib)
    filter_eps = check_real("filter_eps", filter_eps, optional=True)
    if filter_eps is not None and not (0.0 <= filter_eps < 1.0):
        raise ValueError(f"filter_eps must be None or a number in [0, 1), got {filter_eps}")


def _env_check_targets() -> bool:
    """check_targets=None: FUSEDOPS_CHECK_TARGETS=0 turns the check off."""
    return os.environ.get("FUSEDOPS_CHECK_TARGETS", "1") != "0"


def _env_algo() -> str:
    algo = os.environ.get("FUSEDOPS_LCE_ALGO", "auto")
    if algo not in ("auto", "recompute"):
        raise ValueError(f"FUSEDOPS_LCE_ALGO must be 'auto' or 'recompute', got {algo!r}")
    return algo


def _flat_inputs(hidden, weight, bias, target):
    """(lead_shape, hidden as contiguous (N, H), weight, bias, target as contiguous (N,)), the
    weight and bias made contiguous; a float32 hidden under CUDA autocast in autocast's dtype."""
    if hidden.is_cuda and hidden.dtype == torch.float32 and torch.is_autocast_enabled("cuda"):
        hidden = hidden.to(torch.get_autocast_dtype("cuda"))
    h2 = hidden.reshape(-1, hidden.shape[-1])
    if not h2.is_contiguous():
        h2 = h2.contiguous()
    w = weight if weight.is_contiguous() else weight.contiguous()
    b = bias if (bias is None or bias.is_contiguous()) else bias.contiguous()
    t1 = target.reshape(-1)
    if not t1.is_contiguous():
        t1 = t1.contiguous()
    return hidden.shape[:-1], h2, w, b, t1


def linear_cross_entropy(hidden: Tensor, weight: Tensor, target: Tensor, bias: Tensor | None = None,
                         *, ignore_index: int = -100, reduction: str = "mean",
                         label_smoothing: float = 0.0, softcap: float | None = None,
                         z_loss: float = 0.0, return_lse: bool = False,
                         backend: str | None = None, check_targets: bool | None = None,
                         memory_budget_mib: float | None = None, process_group=None,
                         vocab_start: int | None = None, check_replicated: bool = False,
                         filter_eps: float | None = None):
    """Cross-entropy of `hidden @ weight.T + bias` against `target`, never materialising logits.

    Equals, within rounding, ``F.cross_entropy(z.float(), target, ignore_index=ignore_index,
    reduction=reduction, label_smoothing=label_smoothing)`` with
    ``z = softcap * tanh((hidden @ weight.T + bias) / softcap)`` (no tanh when softcap is None),
    plus ``z_loss * lse**2`` for each non-ignored token (lse = logsumexp of z), reduced the same
    way.

    * hidden (..., H); weight (V, H); bias (V,) or None; one dtype (float32, float16, bfloat16;
      float64 runs on the torch backend only), or a float32 weight and bias with float16/bfloat16
      hidden (below). target int64/int32 with hidden's leading shape, on hidden's device.
    * reduction "mean" divides by the number of non-ignored tokens and returns 0 (with zero
      gradients) when there are none, or the batch is empty; "none" returns per-token losses of the
      leading shape with 0 at ignored tokens. Loss and lse are float32 (float64 for float64
      inputs).
    * return_lse=True returns (loss, lse), lse of the leading shape.
    * Targets outside [0, V) other than ignore_index raise ValueError. The check costs one host
      synchronisation; check_targets=False (or FUSEDOPS_CHECK_TARGETS=0) skips it, and such a target
      then contributes its lse alone as loss (no memory outside the inputs is ever read).
    * backend: None (automatic), "cuda", "cuda-sm90", "cuda-sm80", "triton" or "torch"; see
      fusedops.dispatch and fusedops/linear_ce/backends.py.
    * Gradients flow to hidden, weight and bias for any upstream gradient; backward may run more
      than once (retain_graph=True). Double backward (create_graph=True) raises.
    * Mixed precision: float32 weight (and bias) with float16/bfloat16 hidden (what torch.autocast
      training holds) runs the GEMMs in hidden's dtype and returns float32 d_weight, accumulated
      in float32. Under torch.autocast, float32 hidden is cast to the autocast dtype first.
    * memory_budget_mib (default 512, or FUSEDOPS_LCE_MEMORY_MIB): the scratch a call may hold, a
      chunk of materialised logits. Reduction "mean"/"sum" with return_lse=False computes the
      gradients during the forward pass (three GEMMs); reduction "none" or return_lse=True
      computes per-token statistics in the forward (one GEMM) and recomputes the logits in the
      backward (three more; the forward's last chunk is kept for it, so when one chunk holds all
      tokens there are three in all). Budgets too small for 512 whole rows (e.g. 64 at Llama-3's
      head) switch to vocab chunks (one GEMM more). FUSEDOPS_LCE_ALGO=recompute selects the
      recompute kernels instead (~N*H*2 + 32 MiB of scratch, slower).
    * Vocab parallel (tensor parallelism): with process_group (a torch.distributed ProcessGroup)
      weight and bias are this rank's rows [vocab_start, vocab_start + V_r) of the (V, H) head,
      V the sum over the group; hidden and target are the same on every rank. vocab_start
      defaults to the rows of the lower ranks (shards in rank order; uneven splits allowed);
      given on every rank, the shards may come in any order but must tile [0, V). A DTensor
      weight (and bias) sharded on dim 0 is recognised without arguments. Loss, lse and d_hidden
      (summed over the group) are those of one device on the full weight; d_weight and d_bias
      are this rank's rows. Per token the ranks exchange 4 statistics (not logits) and d_hidden
      (H values). The mean and sum losses take three GEMMs over the shard, as on one device
      (the statistics are combined per token chunk, then the gradients formed in the forward);
      reduction "none", return_lse and FUSEDOPS_LCE_ALGO=recompute recompute the shard's logits
      in the backward (four). Every rank must pass the same reduction and return_lse and see
      the same FUSEDOPS_LCE_ALGO. check_replicated=True also checks that hidden
      and target agree across ranks (an all-reduce of a few sums).
      fusedops/linear_ce/parallel.py and docs/linear_ce.md have the design.
    * filter_eps (default None: exact gradients): gradient filtering. Blocks of 128 tokens x 128
      vocabulary entries of d logits whose every entry is at most filter_eps times the token's
      weight in the loss (1/N for the mean; for reduction "none" and return_lse the upstream
      gradient of the token's lse) in magnitude count as zero in d_hidden and d_weight, so those
      products run over the other blocks only (block-sparse Triton kernels on the GPU for
      float16/bfloat16). On a trained model's outputs, where most of each row's probability lies
      in entries far below 2^-12, 2**-12 skips most of the two gradient GEMMs; on spread-out
      logits nearly nothing is skipped and the products run slower than cuBLAS's. The loss, lse
      and d_bias stay exact; the dropped entries (the softmax tail, label smoothing's uniform
      part away from kept blocks) are an approximation the caller accepts: where that tail holds
      most of the probability it moves d_hidden by about 1e-2 relative, 2-5 times bf16's
      own error (benchmarks/filter_accuracy.py). Not with process_group or
      FUSEDOPS_LCE_ALGO=recompute.
    """
    if (process_group is not None or vocab_start is not None or _parallel.is_dtensor(weight)
            or _parallel.is_dtensor(bias)):
        if filter_eps is not None:
            raise ValueError("filter_eps is not supported with vocab parallelism (process_group, "
                             "vocab_start or a DTensor weight); pass filter_eps=None")
        return _parallel.linear_cross_entropy(
            hidden, weight, target, bias, ignore_index=ignore_index, reduction=reduction,
            label_smoothing=label_smoothing, softcap=softcap, z_loss=z_loss,
            return_lse=return_lse, backend=backend, check_targets=check_targets,
            memory_budget_mib=memory_budget_mib, process_group=process_group,
            vocab_start=vocab_start, check_replicated=check_replicated)
    if check_bool("check_replicated", check_replicated):
        raise ValueError("check_replicated=True compares hidden and target across the ranks of "
                         "process_group; pass process_group (or a DTensor weight) with it")
    _check_inputs(hidden, weight, target, bias, reduction, label_smoothing, softcap, z_loss,
                  memory_budget_mib, ignore_index, return_lse, check_targets, filter_eps)
    lead_shape, h2, w, b, t1 = _flat_inputs(hidden, weight, bias, target)
    hidden_size = h2.shape[1]
    vocab_size = weight.shape[0]
    name = dispatch.select("linear_ce", h2, hidden_size, backend)
    if check_targets is None:
        check_targets = _env_check_targets()
    algo = _env_algo()
    if filter_eps is not None and algo != "auto":
        raise ValueError("filter_eps applies to the default algorithm; FUSEDOPS_LCE_ALGO="
                         f"{algo} is set (unset it, or pass filter_eps=None)")
    feps = -1.0 if filter_eps is None else float(filter_eps)
    # The ops check the flat target; the error is re-raised here with the caller's index (eager
    # only: under torch.compile the op's own error, with the flat index, comes out).
    try:
        if reduction != "none" and not return_lse and algo == "auto":
            return _ops.fused_loss(h2, w, b, t1, int(ignore_index), reduction,
                                   float(label_smoothing), float(softcap or 0.0), float(z_loss),
                                   memory_budget_mib, bool(check_targets), name, feps)
        if algo == "auto":
            lse, z_target, z_sum = _ops.stats(h2, w, b, t1, int(ignore_index),
                                              float(softcap or 0.0), memory_budget_mib,
                                              bool(check_targets), name, feps)
        else:
            if w.dtype != h2.dtype:  # mixed precision on the recompute path: cast (autograd
                w = w.to(h2.dtype)   # casts back)
                b = None if b is None else b.to(h2.dtype)
            lse, z_target, z_sum = torch.ops.fusedops.linear_ce_fwd(
                h2, w, b, t1, int(ignore_index), float(softcap or 0.0), bool(check_targets), name)
    except _ops.TargetOutOfRangeError as e:
        raise e.in_shape(lead_shape) from None
    return _ops.loss_from_statistics(lse, z_target, z_sum, t1 != ignore_index, vocab_size,
                                     label_smoothing, z_loss, reduction, lead_shape, return_lse)


class LinearCrossEntropyLoss(nn.Module):
    """Module form of :func:`linear_cross_entropy`; forward(hidden, weight, target, bias=None)."""

    def __init__(self, *, ignore_index: int = -100, reduction: str = "mean",
                 label_smoothing: float = 0.0, softcap: float | None = None, z_loss: float = 0.0,
                 return_lse: bool = False, backend: str | None = None,
                 check_targets: bool | None = None, memory_budget_mib: float | None = None,
                 process_group=None, vocab_start: int | None = None,
                 check_replicated: bool = False, filter_eps: float | None = None):
        super().__init__()
        # Bad options raise here, with linear_cross_entropy's messages, not at the first forward.
        _check_options(reduction, label_smoothing, softcap, z_loss, memory_budget_mib,
                       ignore_index, return_lse, check_targets, filter_eps)
        if filter_eps is not None and (process_group is not None or vocab_start is not None):
            raise ValueError("filter_eps is not supported with vocab parallelism (process_group "
                             "or vocab_start); pass filter_eps=None")
        if backend is not None:
            dispatch.check_backend(backend)
        check_bool("check_replicated", check_replicated)
        if process_group is not None or vocab_start is not None or check_replicated:
            _parallel.check_options(process_group, vocab_start, check_replicated)
        self.options = dict(ignore_index=ignore_index, reduction=reduction,
                            label_smoothing=label_smoothing, softcap=softcap, z_loss=z_loss,
                            return_lse=return_lse, backend=backend, check_targets=check_targets,
                            memory_budget_mib=memory_budget_mib)
        if filter_eps is not None:
            self.options.update(filter_eps=filter_eps)
        if process_group is not None or vocab_start is not None or check_replicated:
            self.options.update(process_group=process_group, vocab_start=vocab_start,
                                check_replicated=check_replicated)

    def forward(self, hidden: Tensor, weight: Tensor, target: Tensor, bias: Tensor | None = None):
        return linear_cross_entropy(hidden, weight, target, bias, **self.options)

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in self.options.items())


from fusedops.linear_ce import ops as _ops  # noqa: E402,F401  (registers torch.ops.fusedops.*)
from fusedops.linear_ce import parallel as _parallel  # noqa: E402
