"""Vocab-parallel linear cross-entropy: the LM head's weight split by rows over a process group.

Each rank holds rows [vocab_start, vocab_start + V_r) of the (V, H) weight (and of the bias) and
the same hidden states and targets. Per token, every rank computes the statistics of its shard
(its log-sum-exp, the target's logit when the target falls in the shard, else 0, and the sum of
its logits), and the group combines them with two all-reduces of O(tokens) values: the max of
the shard lses, then the sum of exp(lse_r - max), of the target logits and of the logit sums.
The loss (label smoothing, z-loss, reduction) is then formed from the global statistics as on
one device. Logits are never communicated.

Gradients: each rank turns its shard's logits into dz with the global lse (softmax(z)
restricted to the shard is exp(z - lse)) and the target indicator within the shard; that gives
the shard's d_weight and d_bias (kept local) and its part of d_hidden, summed over the group by
one all-reduce of tokens x H values.

Three implementations of those passes, as on one device:
* _ShardFused (mean and sum): the one-device fast path (chunked.fused_forward) on the shard,
  gradients for an upstream gradient of 1 computed in the forward and scaled in the backward.
  Per token chunk: the logits GEMM, the shard's statistics, their all-reduces (so the group's
  collectives follow the token chunks, of a size every rank agrees on: _common_plan), dz with
  the global lse, and the d_hidden and d_weight GEMMs: three GEMMs over the shard, as on one
  device; d_hidden's all-reduce ends the forward.
* _ShardLoss (reduction "none"): cuBLAS GEMMs and the row kernels of fusedops.linear_ce.chunked,
  chunks sized by memory_budget_mib; the shard is a vocab chunk of the full row. One GEMM in the
  forward, three in the backward (the per-token upstream gradient is known only there).
* _ShardStats (return_lse=True, any upstream gradient of lse): the statistics ops
  fusedops::linear_ce_stats and linear_ce_stats_bwd (the same GEMMs and row kernels, for upstream
  gradients of all three statistics), or with FUSEDOPS_LCE_ALGO=recompute the recompute kernels'
  fusedops::linear_ce_fwd and linear_ce_bwd.
"""

from __future__ import annotations

import functools
import sys

import torch
from torch import Tensor

from fusedops import dispatch
from fusedops._autograd import refuse_double_backward
from fusedops._checks import check_bool, check_int
from fusedops.linear_ce import chunked
from fusedops.linear_ce import ops as _ops

# The layout all-gather's row per rank: ok, rows, vocab_start, has_vocab_start, tokens, hidden
# size, need_dh, bias, dtype, check_replicated, check_targets, the token-chunk rows this rank's
# budget allows the mean/sum sweep (0 on other paths), the path (_path_code), and the smallest
# and largest target that is not ignore_index (_NO_TARGET / -_NO_TARGET when there is none).
_META = 15
_NO_TARGET = 2**62
# vocab_start must leave room for its shard's rows in int64 arithmetic
_MAX_VOCAB_START = 2**62
_DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.float64: 3}


def _dtensor_type():
    """torch.distributed.tensor.DTensor if that module is loaded (no DTensor exists otherwise)."""
    mod = sys.modules.get("torch.distributed.tensor")
    return getattr(mod, "DTensor", None) if mod is not None else None


def is_dtensor(x) -> bool:
    cls = _dtensor_type()
    return cls is not None and isinstance(x, cls)


def _shard0_group(name: str, t):
    """(local tensor, process group) of a DTensor sharded on dim 0 over one mesh dimension and
    replicated over any others."""
    from torch.distributed.tensor import Replicate, Shard

    placements = tuple(t.placements)
    dims = [i for i, p in enumerate(placements) if isinstance(p, Shard) and p.dim == 0]
    others_ok = all(isinstance(p, Replicate) for i, p in enumerate(placements) if i not in dims)
    if len(dims) != 1 or not others_ok or type(placements[dims[0]]) is not Shard:
        raise ValueError(f"{name} is a DTensor with placements {placements}; the vocab-parallel "
                         "loss needs Shard(0) on one mesh dimension and Replicate on the others")
    return t.to_local(), t.device_mesh.get_group(dims[0])


def _replicated_local(name: str, t):
    from torch.distributed.tensor import Replicate

    if not all(isinstance(p, Replicate) for p in t.placements):
        raise ValueError(f"{name} is a DTensor with placements {tuple(t.placements)}; it must be "
                         "replicated (the same on every rank of the vocab-parallel group)")
    return t.to_local()


def _comm_device(group, device) -> torch.device:
    """Where the collectives' tensors live: the CPU for gloo, else the inputs' device (the
    current CUDA device for NCCL when the inputs are not CUDA tensors, so that the layout
    all-gather still runs and every rank raises)."""
    import torch.distributed as dist

    backend = dist.get_backend(group)
    if backend == "gloo":
        return torch.device("cpu")
    if device is not None and (device.type == "cuda" or backend != "nccl"):
        return device
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")


def check_group_device(backend: str, hidden: Tensor) -> None:
    """NCCL moves CUDA tensors only."""
    if backend == "nccl" and hidden.device.type != "cuda":
        raise ValueError(f"hidden is on {hidden.device}, but process_group's backend is NCCL, "
                         "which needs CUDA tensors (use a gloo group for CPU tensors)")


def _all_reduce_(t: Tensor, op, group, comm_dev: torch.device) -> Tensor:
    """t reduced over the group in place (through a copy on comm_dev when t lives elsewhere)."""
    import torch.distributed as dist

    if t.device == comm_dev:
        dist.all_reduce(t, op=op, group=group)
        return t
    c = t.to(comm_dev)
    dist.all_reduce(c, op=op, group=group)
    t.copy_(c)
    return t


def _combine_(lse: Tensor, zt: Tensor, zsum: Tensor, group, comm_dev) -> None:
    """The shard's per-token statistics made the group's, in place: lse = log sum_r exp(lse_r)
    (two all-reduces of O(tokens) values: the max, then the sums with the target logits and the
    logit sums)."""
    import torch.distributed as dist

    gmax = _all_reduce_(lse.clone(), dist.ReduceOp.MAX, group, comm_dev)
    packed = torch.stack([torch.exp(lse - gmax), zt, zsum])
    _all_reduce_(packed, dist.ReduceOp.SUM, group, comm_dev)
    torch.add(gmax, torch.log(packed[0]), out=lse)
    zt.copy_(packed[1])
    zsum.copy_(packed[2])


class _ShardStats(torch.autograd.Function):
    """Global per-token (lse, target logit, logit sum) from the local shard; backward gives the
    shard's d_weight, d_bias and the group's summed d_hidden."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, target, softcap, backend, group, comm_dev, need_dh,
                budget, recompute):
        if recompute:
            lse_r, zt, zsum = torch.ops.fusedops.linear_ce_fwd(hidden, weight, bias, target, 0,
                                                               softcap, False, backend)
        else:
            lse_r, zt, zsum, _ = _ops.linear_ce_stats(hidden, weight, bias, target, 0, softcap,
                                                      budget, False, need_dh, False, backend)
        if hidden.shape[0] > 0:
            _combine_(lse_r, zt, zsum, group, comm_dev)
        lse = lse_r
        ctx.save_for_backward(hidden, weight, bias, target, lse)
        ctx.options = (softcap, backend, group, comm_dev, need_dh, budget, recompute)
        return lse, zt, zsum

    @staticmethod
    def backward(ctx, g_lse, g_zt, g_zsum):
        import torch.distributed as dist

        hidden, weight, bias, target, lse = ctx.saved_tensors
        softcap, backend, group, comm_dev, need_dh, budget, recompute = ctx.options
        need_dw = ctx.needs_input_grad[1]
        need_db = bias is not None and ctx.needs_input_grad[2]
        g = [x if x is not None else torch.zeros_like(lse) for x in (g_lse, g_zt, g_zsum)]
        with torch.no_grad():
            # need_dh is the same on every rank (checked), so every rank joins the all-reduce.
            if recompute:
                dh, dw, db = _ops.linear_ce_bwd(hidden, weight, bias, target, lse, *g, softcap,
                                                need_dh, need_dw, need_db, backend)
            else:
                dh, dw, db = _ops.linear_ce_stats_bwd(hidden, weight, bias, target, lse, *g,
                                                      hidden.new_empty(0), softcap, budget,
                                                      need_dh, need_dw, need_db, backend)
            if need_dh and dh.numel() > 0:
                _all_reduce_(dh, dist.ReduceOp.SUM, group, comm_dev)
        grads = (dh if need_dh and ctx.needs_input_grad[0] else None,
                 dw if need_dw else None, db if need_db else None)
        grads = refuse_double_backward(_ops.DOUBLE_BACKWARD,
                                       (hidden, weight, bias, g_lse, g_zt, g_zsum), grads)
        return (*grads, *([None] * 8))


class _ShardFused(torch.autograd.Function):
    """Mean or sum loss of a shard through chunked.fused_forward: the forward computes the
    whole loss and this rank's gradients for an upstream gradient of 1 (d_hidden summed over
    the group), the backward scales them by the upstream gradient (ops.hand_over_grads, as for
    one device); a second backward of a retained graph runs the forward's sweep again (every
    rank does, so the collectives stay matched)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, target, valid, reduction, vocab, eps, zl, cap, plan,
                backend, group, comm_dev, need):
        ctx.save_for_backward(hidden, weight, bias, target, valid)
        ctx.options = (reduction, vocab, eps, zl, cap, plan, backend, group, comm_dev, need)
        loss, grads = _ShardFused.sweep(hidden, weight, bias, target, valid, *ctx.options)
        ctx.grads = grads
        return loss

    @staticmethod
    def sweep(hidden, weight, bias, target, valid, reduction, vocab, eps, zl, cap, plan, backend,
              group, comm_dev, need):
        import torch.distributed as dist

        need_dh, need_dw, need_db = need
        # (ignore_index is not read: valid says which tokens count)
        loss, _lse, dh, dw, db = chunked.fused_forward(
            hidden, weight, bias, target, 0, reduction, eps, cap, zl, 0, need_dh, need_dw,
            need_db, backend, combine=functools.partial(_combine_, group=group, comm_dev=comm_dev),
            vocab_total=vocab, plan=plan, valid=valid)
        if need_dh and dh.numel() > 0:  # need_dh is the same on every rank (checked)
            _all_reduce_(dh, dist.ReduceOp.SUM, group, comm_dev)
        return loss, [dh, dw, db]

    @staticmethod
    def backward(ctx, g_loss):
        grads = _ops.hand_over_grads(
            ctx, g_loss, ctx.options[-1], ctx.options[6],
            lambda inputs: _ShardFused.sweep(*inputs, *ctx.options)[1])
        return (*grads, *([None] * 12))


class _ShardLoss(torch.autograd.Function):
    """Per-token losses (0 at ignored tokens) through the chunked path's GEMMs and row kernels.

    Forward: one GEMM per chunk of the shard's logits and the row kernel's statistics modes
    (whole shard rows, or vocab chunks merged online), then the all-reduces. Backward, for the
    per-token upstream gradient g: the shard's logits again chunk by chunk, the row kernel's dz
    mode with the global lse and the per-token weight g (a vocab chunk of the full row, at column
    vocab_start + v0 of V), and the d_hidden, d_weight products (three GEMMs); d_hidden then
    summed over the group.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, target, valid, vocab, eps, zl, cap, budget, backend,
                group, comm_dev, need_dh):
        plan = _ops._stats_plan(hidden, weight, budget, need_dh)
        n_tokens = hidden.shape[0]
        lse, zt, zsum, _ = chunked.statistics(hidden, weight, bias, target, cap, plan, backend)
        if n_tokens > 0:
            _combine_(lse, zt, zsum, group, comm_dev)
        per_tok = lse - (1.0 - eps) * zt - (eps / vocab) * zsum if eps else lse - zt
        if zl:
            per_tok = per_tok + zl * lse * lse
        per_tok = torch.where(valid, per_tok, torch.zeros_like(per_tok))
        ctx.save_for_backward(hidden, weight, bias, target, valid, lse)
        ctx.options = (vocab, eps, zl, cap, plan, backend, group, comm_dev, need_dh)
        return per_tok

    @staticmethod
    def backward(ctx, g):
        import torch.distributed as dist

        hidden, weight, bias, target, valid, lse = ctx.saved_tensors
        vocab, eps, zl, cap, plan, backend, group, comm_dev, need_dh = ctx.options
        need_dw = ctx.needs_input_grad[1]
        need_db = bias is not None and ctx.needs_input_grad[2]
        with torch.no_grad():
            w_tok = (g.to(lse.dtype) * valid).contiguous()
            dh, dw, db = chunked.grads_sweep(hidden, weight, bias, target, lse, (w_tok,), plan,
                                             backend, need_dh, need_dw, need_db, chunked.MODE_DZ,
                                             vocab, eps, zl, cap)
            if need_dh and dh.numel() > 0:
                _all_reduce_(dh, dist.ReduceOp.SUM, group, comm_dev)
        grads = (dh if need_dh and ctx.needs_input_grad[0] else None,
                 dw if need_dw else None, db if need_db else None)
        grads = refuse_double_backward(_ops.DOUBLE_BACKWARD, (hidden, weight, bias, g), grads)
        return (*grads, *([None] * 11))


def _fingerprint(h2: Tensor, t1: Tensor) -> tuple[Tensor, Tensor]:
    """Sums that differ when hidden or target differ (values or token order): float64 sums of
    the finite values (the scale, then two compared within a tolerance) and int64 sums of the
    targets and of where the non-finite values sit and what they are (compared exactly; int64
    sums do not depend on the order of the additions, even when they wrap), so that a NaN or
    inf compares equal to itself and unequal to anything else."""
    dev = h2.device
    n, h = h2.shape
    hd = h2.detach().to(torch.float64)
    finite = torch.isfinite(hd)
    # 1 for NaN, 2 for +inf, 3 for -inf, weighted by the element's (row, column) position
    code = torch.where(finite, 0, torch.where(torch.isnan(hd), 1, torch.where(hd > 0, 2, 3)))
    code = code.to(torch.int64)
    pos_i = torch.arange(1, n + 1, dtype=torch.int64, device=dev)
    col_i = torch.arange(1, h + 1, dtype=torch.int64, device=dev)
    code_at = (code.sum(-1) * pos_i).sum() * (h + 1) + (code * col_i).sum()
    hd = torch.where(finite, hd, 0.0)
    row = hd.sum(-1)
    pos = pos_i.to(torch.float64)
    tt = t1.to(torch.int64)
    return (torch.stack([hd.abs().sum(), row.sum(), (row * pos).sum()]),
            torch.stack([tt.sum(), (tt * pos_i).sum(), code.sum(), code_at]))


def _require_dist() -> None:
    import torch.distributed as dist

    if not dist.is_available():
        raise RuntimeError("process_group / vocab_start need torch.distributed, which this "
                           "torch build lacks")


def _check_group_type(group) -> None:
    import torch.distributed as dist

    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"process_group must be a torch.distributed.ProcessGroup, got "
                        f"{type(group).__name__} (for a DeviceMesh, pass mesh.get_group())")


def check_options(process_group, vocab_start, check_replicated) -> None:
    """The checks of the vocab-parallel options that need no tensor and no collective
    (LinearCrossEntropyLoss runs them at construction; linear_cross_entropy below runs each)."""
    _require_dist()
    if process_group is not None:
        _check_group_type(process_group)
    if vocab_start is not None:
        _check_vocab_start(vocab_start)
    check_bool("check_replicated", check_replicated)


def _check_vocab_start(vocab_start) -> int:
    vocab_start = check_int("vocab_start", vocab_start)
    if not 0 <= vocab_start < _MAX_VOCAB_START:
        raise ValueError(f"vocab_start must be in [0, V) (the first vocabulary row of this "
                         f"rank's shard), got {vocab_start}")
    return vocab_start


def _target_range(target: Tensor, ignore_index: int) -> Tensor:
    """(smallest, largest) target that is not ignore_index, as an int64 pair on target's device
    (no host synchronisation); (_NO_TARGET, -_NO_TARGET) when every target is ignored."""
    t = target.reshape(-1).long()
    if t.numel() == 0:
        return torch.tensor([_NO_TARGET, -_NO_TARGET], dtype=torch.int64, device=t.device)
    keep = t != ignore_index
    return torch.stack([torch.where(keep, t, _NO_TARGET).min(),
                        torch.where(keep, t, -_NO_TARGET).max()])


def linear_cross_entropy(hidden, weight, target, bias, *, ignore_index, reduction,
                         label_smoothing, softcap, z_loss, return_lse, backend, check_targets,
                         memory_budget_mib, process_group, vocab_start, check_replicated):
    """The vocab-parallel form of fusedops.linear_cross_entropy (see its docstring)."""
    import torch.distributed as dist

    from fusedops.linear_ce import _check_inputs, _env_algo, _env_check_targets, _flat_inputs

    _require_dist()
    group = process_group
    if is_dtensor(weight):
        weight, mesh_group = _shard0_group("weight", weight)
        if group is not None and group is not mesh_group:
            raise ValueError("process_group differs from the process group of weight's "
                             "DTensor mesh dimension; pass one or the other")
        group = mesh_group
    if is_dtensor(bias):
        bias, bias_group = _shard0_group("bias", bias)
        if group is not None and bias_group is not group:
            raise ValueError("bias is a DTensor sharded over another process group than weight "
                             "(or process_group); the two must be split over one group")
        group = bias_group
    if is_dtensor(hidden):
        hidden = _replicated_local("hidden", hidden)
    if is_dtensor(target):
        target = _replicated_local("target", target)
    if group is None:
        raise ValueError("vocab_start needs process_group (the group the weight is split over) "
                         "or a DTensor weight sharded on dim 0")
    _check_group_type(group)
    if not dist.is_initialized():
        raise RuntimeError("process_group given but torch.distributed is not initialised")
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("this process is not a member of process_group")
    world = dist.get_world_size(group)

    # Local checks first; their outcome travels with the layout all-gather, so that a rank with
    # bad input raises its own error and the others raise too instead of waiting in a collective.
    # So do the options every rank must agree on and the range of the targets (checked against
    # V, which only the all-gather tells).
    local_error = None
    chunk_rows = path = 0
    try:
        check_bool("check_replicated", check_replicated)
        if vocab_start is not None:
            vocab_start = _check_vocab_start(vocab_start)
        if isinstance(weight, Tensor) and weight.dim() == 2 and weight.shape[0] == 0:
            raise ValueError(f"weight shard on rank {rank} has 0 rows; every rank of the group "
                             "must hold at least one vocabulary row")
        _check_inputs(hidden, weight, target, bias, reduction, label_smoothing, softcap, z_loss,
                      memory_budget_mib, ignore_index, return_lse, check_targets)
        check_group_device(dist.get_backend(group), hidden)
        algo = _env_algo()
        if check_targets is None:
            check_targets = _env_check_targets()
        # the budget (FUSEDOPS_LCE_MEMORY_MIB too) and whether this rank's shard fits it
        budget = chunked.budget_bytes(memory_budget_mib)
        if algo != "recompute" and not return_lse:
            chunk_rows = _ops._stats_plan(hidden.reshape(-1, hidden.shape[-1]), weight, budget,
                                          hidden.requires_grad and torch.is_grad_enabled()).rows
        path = _path_code(reduction, return_lse, algo)
    except (TypeError, ValueError) as e:
        local_error = e
    ok = local_error is None
    comm_dev = _comm_device(group, hidden.device if isinstance(hidden, Tensor) else None)
    meta = torch.tensor([
        int(ok),
        weight.shape[0] if ok else 0,
        vocab_start if (ok and vocab_start is not None) else -1,
        int(vocab_start is not None),
        hidden.numel() // hidden.shape[-1] if ok else 0,
        hidden.shape[-1] if ok else 0,
        int(ok and hidden.requires_grad and torch.is_grad_enabled()),
        int(ok and bias is not None),
        _DTYPE_CODES.get(hidden.dtype, -1) if ok else -1,
        int(ok and check_replicated),
        int(ok and check_targets),
        chunk_rows if ok else 0,
        path if ok else 0,
    ], dtype=torch.int64, device=comm_dev)
    span = (_target_range(target, ignore_index).to(comm_dev) if ok and check_targets else
            torch.tensor([_NO_TARGET, -_NO_TARGET], dtype=torch.int64, device=comm_dev))
    meta = torch.cat([meta, span])
    gathered = [torch.empty_like(meta) for _ in range(world)]
    dist.all_gather(gathered, meta, group=group)
    rows_meta = torch.stack(gathered).cpu().tolist()  # one host sync, O(world) values
    if local_error is not None:
        raise local_error
    failed = [r for r, row in enumerate(rows_meta) if not row[0]]
    if failed:
        raise ValueError(f"linear_cross_entropy: rank(s) {failed} of process_group rejected "
                         "their inputs (see the error raised there)")
    vocab_start = _check_layout(rows_meta, rank)
    vocab_size = sum(row[1] for row in rows_meta)

    lead_shape, h2, w, b, t1 = _flat_inputs(hidden, weight, bias, target)
    if check_targets:
        bad = [r for r, row in enumerate(rows_meta) if row[13] <= row[14]
               and (row[13] < 0 or row[14] >= vocab_size)]
        if rank in bad:  # this rank's own error, naming the first bad target
            _ops.check_targets_in_range(t1, vocab_size, int(ignore_index), lead_shape)
        if bad:
            raise ValueError(f"linear_cross_entropy: rank(s) {bad} of process_group have targets "
                             f"outside [0, {vocab_size}) that are not ignore_index "
                             f"({ignore_index})")
    hidden_size = h2.shape[1]
    if check_replicated and h2.shape[0] > 0:
        fp, fp_int = (x.to(comm_dev) for x in _fingerprint(h2, t1))
        both = torch.cat([fp, -fp])
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
        hi, lo = both[:3], -both[3:]
        tol = 1e-9 * (hi[0].abs() + 1.0)
        # the integer sums: the same on every rank iff their maximum equals their minimum
        # (MIN as the MAX of the bitwise complement, which no int64 value overflows)
        both_i = torch.cat([fp_int, ~fp_int])
        dist.all_reduce(both_i, op=dist.ReduceOp.MAX, group=group)
        if bool(((hi[1:3] - lo[1:3]).abs() > tol).any()) or bool((both_i[:4] != ~both_i[4:]).any()):
            raise ValueError("hidden or target differs across the ranks of process_group (the "
                             "vocab-parallel loss needs the same hidden and target everywhere)")
    name = dispatch.select("linear_ce", h2, hidden_size, backend)
    # Targets relative to the shard: those of other shards (and ignore_index) fall outside
    # [0, V_r), where the row kernels and the single-device op give a target logit of 0 and no
    # one-hot gradient.
    t_local = t1 - vocab_start
    need_dh = bool(rows_meta[rank][6])
    valid = t1 != ignore_index
    recompute = algo == "recompute"
    if not return_lse and not recompute and reduction != "none":
        grad_on = torch.is_grad_enabled()
        need = (need_dh, grad_on and w.requires_grad,
                grad_on and b is not None and b.requires_grad)
        plan = _common_plan(rows_meta, h2, w.shape[0], budget, need_dh)
        return _ShardFused.apply(h2, w, b, t_local.long(), valid, reduction, vocab_size,
                                 float(label_smoothing), float(z_loss), float(softcap or 0.0),
                                 plan, name, group, comm_dev, need)
    if not return_lse and not recompute:  # reduction "none"
        per_tok = _ShardLoss.apply(h2, w, b, t_local.long(), valid, vocab_size,
                                   float(label_smoothing), float(z_loss), float(softcap or 0.0),
                                   budget, name, group, comm_dev, need_dh)
        return per_tok.view(lead_shape)
    if recompute and w.dtype != h2.dtype:  # mixed precision: the GEMMs in hidden's dtype
        w = w.to(h2.dtype)                  # (autograd casts back)
        b = None if b is None else b.to(h2.dtype)
    lse, z_target, z_sum = _ShardStats.apply(h2, w, b, t_local.long(), float(softcap or 0.0),
                                             name, group, comm_dev, need_dh,
                                             budget, recompute)
    return _ops.loss_from_statistics(lse, z_target, z_sum, valid, vocab_size, label_smoothing,
                                     z_loss, reduction, lead_shape, return_lse)


def _path_code(reduction: str, return_lse: bool, algo: str) -> int:
    """What decides the path, hence the collectives (once per token chunk, or once per call),
    as one integer that every rank must agree on."""
    return ("mean", "sum", "none").index(reduction) * 4 + 2 * bool(return_lse) + \
        (algo == "recompute")


def _common_plan(rows_meta, h2: Tensor, shard_rows: int, budget: int,
                 need_dh: bool) -> chunked.Plan:
    """The plan of the mean/sum sweep over this rank's shard: token chunks of the fewest rows
    any rank's own plan allows (every rank then makes as many rounds of collectives, one per
    chunk, and each chunk fits its rank's budget), whole rows or vocab chunks as this rank's
    shard and budget take them."""
    rows = min(row[11] for row in rows_meta)
    return chunked.plan_with_rows(rows, h2.shape[0], h2.shape[1], shard_rows, h2.element_size(),
                                  budget, need_dh)


def _check_layout(rows_meta, rank: int) -> int:
    """This rank's vocab_start after checking that the shards tile [0, V) and that every rank
    passes the same tokens, hidden size, dtype, bias and requires_grad."""
    world = len(rows_meta)
    for col, what in ((4, "the number of tokens"), (5, "the hidden size"),
                      (8, "hidden's dtype"), (7, "whether a bias is given"),
                      (6, "whether hidden requires grad"),
                      (3, "whether vocab_start is given"),
                      (9, "check_replicated"), (10, "whether targets are checked"),
                      (12, "reduction, return_lse or FUSEDOPS_LCE_ALGO")):
        values = [row[col] for row in rows_meta]
        if len(set(values)) > 1:
            raise ValueError(f"{what} differs across the ranks of process_group "
                             f"({values}); hidden, target and the options must match")
    sizes = [row[1] for row in rows_meta]
    vocab_size = sum(sizes)
    if not rows_meta[0][3]:  # shards in rank order
        return sum(sizes[:rank])
    starts = [row[2] for row in rows_meta]
    for r, s in enumerate(starts):
        if not 0 <= s < vocab_size:
            raise ValueError(f"vocab_start={s} on rank {r} is outside [0, {vocab_size}) "
                             f"(V = {vocab_size}, the sum of the shards' rows)")
    order = sorted(range(world), key=lambda r: starts[r])
    pos = 0
    for r in order:
        if starts[r] != pos:
            spans = ", ".join(f"rank {q}: [{starts[q]}, {starts[q] + sizes[q]})"
                              for q in range(world))
            raise ValueError(f"the weight shards do not tile [0, {vocab_size}): {spans}")
        pos += sizes[r]
    return starts[rank]
