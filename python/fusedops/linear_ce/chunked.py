"""Linear cross-entropy with the gradients computed during the forward pass (the fast path).

Used for the mean and sum reductions without gradients through lse: the upstream gradient of the
loss is then one scalar g, so the forward can compute d_hidden, d_weight and d_bias for g = 1 and
the backward only multiplies them by g (in place, skipped on the device when g == 1). Tokens and
vocabulary go in chunks sized by a memory budget:

* full rows (the default whenever a chunk of `rows` tokens x V logits fits the budget): three
  GEMMs per token chunk, z = X_c W^T (cuBLAS, input dtype) -> one pass of our row kernel turns z
  into dz in place (lse, target logit and logit sum first) -> d_hidden[c] = dz W (complete) ->
  d_weight += dz^T X_c (cuBLAS, float32 accumulation, rounded into d_weight once per chunk);
  with FUSEDOPS_LCE_GEMM=sm90-fused on a Hopper GPU (opt-in), the logits GEMM is ours and
  computes lse, target logit and logit sum in its epilogue (gemm_sm90.logits_ce_stats), so the
  row kernel only writes dz (MODE_DZ), and d_hidden, d_weight run on our GEMMs too; with
  FUSEDOPS_LCE_GEMM=sm90-fused2 there is no dz pass either: d_hidden and d_weight compute dz from
  z in their operand path (gemm_sm90.dz_gemm; layout 3 also gives d_bias's chunk sums);
* vocab-chunked (small budgets): per token chunk, one sweep over vocab chunks for the statistics
  (online log-sum-exp) and a second one that recomputes z, turns it into dz, adds each chunk's
  d_hidden product into a float32 buffer (token chunk x H) and d_weight slices as above: four
  GEMMs.

The row kernels (statistics, dz, both in one pass for full rows) exist per backend: CUDA
(csrc/linear_ce/ce_rows*), Triton (fusedops/linear_ce/triton.py) and plain torch (here); the GEMMs
are torch.mm everywhere. Nothing here synchronises with the host, so the loss can be captured in a
CUDA graph (target validation off).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
from torch import Tensor

from fusedops import _ext  # noqa: F401  (loads torch.ops.fusedops.*_cuda when built)
from fusedops.dispatch import cuda_arch
from fusedops.linear_ce import filtered, gemm_sm90

MIB = 1 << 20
DEFAULT_BUDGET_MIB = 512.0
# Row-kernel modes (same numbers in the CUDA and Triton kernels): MERGE folds a vocab chunk into
# the running (m, s, zt, zsum); DZ turns z into dz given the final lse; FULL and FULL_DZ take
# whole rows (cols == V), write lse, zt, zsum directly and, for FULL_DZ, then dz; DZ_GRADS is DZ
# for any upstream gradients of the statistics (w, zt, zsum read as d_lse, d_zt, d_zsum).
MODE_MERGE, MODE_DZ, MODE_FULL_DZ, MODE_FULL, MODE_DZ_GRADS = 1, 2, 3, 4, 5
_CUDA = ("cuda-sm90", "cuda-sm80")
# A full-row chunk must hold at least this many tokens, else vocab chunks. Full rows read and
# write d_weight once per token chunk (its GEMM's inner dimension is the chunk), vocab chunks
# pay a fourth GEMM; per token chunk of r rows that is 2 V H e bytes against 2 r H V / chunk
# FLOPs, so full rows win above r ~ e F / B (F the GEMM rate, B the rate of that read and write:
# ~320 rows at 690 TFLOP/s and 4.3 TB/s, more with cuBLAS's small-K d_weight at about half the
# bandwidth). Measured on the H200 at 64 MiB: Llama-2 (1007 rows) 5.5 ms with full rows against
# 7.2 with vocab chunks, Llama-3 (251 rows) 55.7 against 55.2, Gemma-2 (125 rows) 224 against
# 138. Fewer rows also mean more bf16 roundings of d_weight (one per chunk).
MIN_FULL_ROWS = 512


def min_full_rows() -> int:
    """MIN_FULL_ROWS, or FUSEDOPS_LCE_MIN_FULL_ROWS (a measurement switch, read at each call)."""
    value = os.environ.get("FUSEDOPS_LCE_MIN_FULL_ROWS")
    if value is None:
        return MIN_FULL_ROWS
    try:
        rows = int(value)
    except ValueError:
        rows = 0
    if rows < 1:
        raise ValueError(f"FUSEDOPS_LCE_MIN_FULL_ROWS must be a positive integer, got {value!r}")
    return rows


# Budgets above this many bytes (4 EiB) are all "unlimited"; the ops take the budget as int64.
MAX_BUDGET = 1 << 62


def budget_bytes(memory_budget_mib: float | None) -> int:
    """The scratch budget in bytes: memory_budget_mib, or FUSEDOPS_LCE_MEMORY_MIB, or the
    default; at most MAX_BUDGET."""
    if memory_budget_mib is None:
        raw = os.environ.get("FUSEDOPS_LCE_MEMORY_MIB")
        if raw is None:
            memory_budget_mib = DEFAULT_BUDGET_MIB
        else:
            try:
                memory_budget_mib = float(raw)
            except ValueError:
                memory_budget_mib = math.nan
            if not (memory_budget_mib > 0 and math.isfinite(memory_budget_mib)):
                raise ValueError(f"FUSEDOPS_LCE_MEMORY_MIB must be a positive number of MiB, "
                                 f"got {raw!r}")
    return int(min(float(memory_budget_mib) * MIB, MAX_BUDGET))


@dataclass(frozen=True)
class Plan:
    rows: int  # tokens per chunk
    cols: int  # vocab columns per chunk
    full_rows: bool  # cols == V, three GEMMs; else vocab chunks, four GEMMs and a float32
    #                  d_hidden accumulator of rows x H (when d_hidden is needed)


def _balanced(total: int, most: int, align: int = 128) -> int:
    """A chunk size <= most that splits `total` into as few chunks as `most` does, rounded up to
    a multiple of `align` when that still fits (cuBLAS picks its fast Hopper kernels for
    multiples of 128; the first profile ran 8016-wide chunks on slow sm75 kernels)."""
    most = max(1, min(most, total))
    size = -(-total // -(-total // most))
    up = -(-size // align) * align
    return up if up <= most else size


def _avail(budget: int, n_tokens: int) -> int:
    """The budget's bytes left for the logits chunk and the d_hidden accumulator: less the
    per-token arrays, the targets and small temporaries."""
    return budget - (2 << 20) - 64 * n_tokens


def plan_chunks(n_tokens: int, hidden_size: int, vocab_size: int, elem_bytes: int,
                budget: int, need_dh: bool, extra_row_bytes: int = 0) -> Plan:
    """Chunk sizes whose scratch (logits chunk, d_hidden buffers, per-token arrays) fits
    `budget` bytes. extra_row_bytes: more scratch per token of a whole-row chunk (the
    statistics epilogue's partials). No tokens: nothing to chunk, no scratch."""
    if n_tokens == 0:
        return Plan(1, vocab_size, False)
    n = n_tokens
    avail = _avail(budget, n)
    if avail <= 0:
        raise ValueError(f"memory_budget_mib={budget / MIB:.3f} is too small for {n_tokens} "
                         f"tokens (needs more than {(64 * n + (2 << 20)) / MIB:.3f})")
    rows_full = avail // (vocab_size * elem_bytes + extra_row_bytes)
    if rows_full >= min(n, min_full_rows()):
        return Plan(_balanced(n, rows_full), vocab_size, True)
    # Vocab chunks: per token, a float32 d_hidden accumulator (each chunk's product is added
    # into it by the GEMM itself, cuBLAS with a float32 output).
    per_row_dh = hidden_size * 4 if need_dh else 0
    for rows in (2048, 1024, 512, 256, 128, 64, 32, 16, 8, 4, 2, 1):
        rows = min(rows, n)
        cols = (avail - rows * per_row_dh) // (rows * elem_bytes)
        if cols >= min(vocab_size, 2048) or rows == 1:
            break
    if rows_full >= max(rows, 1) or (rows_full >= 1 and cols < 1):
        return Plan(_balanced(n, rows_full), vocab_size, True)  # whole rows fit as many tokens
    return _vocab_chunks(rows, cols, budget, hidden_size, vocab_size)


def _vocab_chunks(rows: int, cols: int, budget: int, hidden_size: int, vocab_size: int) -> Plan:
    """Vocab chunks of at most `cols` columns (rounded down to a multiple of 256 from 256, then
    balanced) for token chunks of `rows` tokens."""
    if cols < 1:
        raise ValueError(f"memory_budget_mib={budget / MIB:.3f} is too small for "
                         f"H={hidden_size}, V={vocab_size}")
    cols = min(vocab_size, cols if cols < 256 else cols // 256 * 256)
    return Plan(rows, _balanced(vocab_size, cols, 256), False)


def plan_with_rows(rows: int, n_tokens: int, hidden_size: int, vocab_size: int,
                   elem_bytes: int, budget: int, need_dh: bool) -> Plan:
    """The plan for token chunks of `rows` tokens, at most the rows plan_chunks gives for the same
    arguments (so that it fits): whole rows where plan_chunks would take them at that size (or
    where vocab chunks would be as wide or could not fit), else vocab chunks. For vocab shards,
    whose token chunks must be the same on every rank."""
    avail = _avail(budget, n_tokens)
    per_row_dh = hidden_size * 4 if need_dh else 0
    cols = (avail - rows * per_row_dh) // (rows * elem_bytes)
    if rows * vocab_size * elem_bytes <= avail and (
            rows >= min(n_tokens, min_full_rows()) or cols >= vocab_size or cols < 1):
        return Plan(rows, vocab_size, True)
    return _vocab_chunks(rows, cols, budget, hidden_size, vocab_size)


# ----------------------------------------------------------------------------------------------
# Row kernels, plain torch version (the CPU path and the reference for the compiled ones).
# z: (rows, cols) logits of vocab columns [col0, col0 + cols), transformed in place into dz.

def _rows_torch(z, bias, target, col0: int, vocab: int, w, lse, m, s, zt, zsum,
                eps: float, zl: float, softcap: float, mode: int):
    cdt = torch.float64 if z.dtype == torch.float64 else torch.float32
    rows, cols = z.shape
    step = max(1, (1 << 20) // max(cols, 1))  # float32 temporaries of ~4 MiB each
    for r0 in range(0, rows, step):
        r1 = min(r0 + step, rows)
        zc = z[r0:r1].to(cdt)
        if bias is not None:
            zc = zc + bias.to(cdt)
        if softcap:
            zc = torch.tanh(zc / softcap) * softcap
        t = target[r0:r1].long() - col0
        inside = (t >= 0) & (t < cols)
        col = torch.where(inside, t, 0)[:, None]
        if mode not in (MODE_DZ, MODE_DZ_GRADS):
            zt_c = torch.where(inside, zc.gather(1, col)[:, 0], 0.0)
            zs_c = zc.sum(1)
            bm = zc.amax(1)
            if mode in (MODE_FULL, MODE_FULL_DZ):
                lse_c = bm + torch.log(torch.exp(zc - bm[:, None]).sum(1))
                lse[r0:r1] = lse_c
                zt[r0:r1] = zt_c
                zsum[r0:r1] = zs_c
            else:
                m_new = torch.maximum(m[r0:r1], bm)
                s[r0:r1] = (s[r0:r1] * torch.exp(m[r0:r1] - m_new)
                            + torch.exp(zc - m_new[:, None]).sum(1))
                m[r0:r1] = m_new
                zt[r0:r1] += zt_c
                zsum[r0:r1] += zs_c
        if mode in (MODE_DZ, MODE_FULL_DZ, MODE_DZ_GRADS):
            wr = w[r0:r1].to(cdt)
            lr = lse[r0:r1].to(cdt)
            if mode == MODE_DZ_GRADS:
                d_lse, d_zt, d_zs = wr, zt[r0:r1].to(cdt), zsum[r0:r1].to(cdt)
            else:
                d_lse = wr * (1.0 + 2.0 * zl * lr)
                d_zt, d_zs = -wr * (1.0 - eps), -wr * (eps / vocab)
            dz = torch.exp(zc - lr[:, None]) * d_lse[:, None] + d_zs[:, None]
            dz.scatter_add_(1, col, torch.where(inside, d_zt, 0.0)[:, None])
            if softcap:
                dz = dz * (1.0 - (zc / softcap) ** 2)
            z[r0:r1] = dz.to(z.dtype)


def compute_dtype(hidden: Tensor) -> torch.dtype:
    """The per-token statistics' dtype: float64 for float64 hidden, else float32."""
    return torch.float64 if hidden.dtype == torch.float64 else torch.float32


def gemm_operands(hidden: Tensor, weight: Tensor, bias: Tensor | None, cdt: torch.dtype):
    """The weight in hidden's dtype for the GEMMs (mixed precision: a float32 weight is cast)
    and the bias in the statistics' dtype, or None."""
    w_mm = weight if weight.dtype == hidden.dtype else weight.to(hidden.dtype)
    return w_mm, None if bias is None else bias.to(cdt)


def _rows(backend: str, *args):
    if backend == "triton":
        from fusedops.linear_ce import triton as tk
        tk.ce_rows(*args)
    elif backend in _CUDA:
        torch.ops.fusedops.ce_rows_cuda(*args, cuda_arch("linear_ce", backend))
    else:
        _rows_torch(*args)


def scale_grad_(t: Tensor, g: Tensor, backend: str) -> None:
    """t *= g in place; the GPU kernels read g on the device and return at once when g == 1."""
    if t.numel() == 0:
        return
    if backend in _CUDA and t.is_cuda:
        torch.ops.fusedops.scale_if_not_one_cuda(t, g)
    elif backend == "triton" and t.is_cuda:
        from fusedops.linear_ce import triton as tk
        tk.scale_if_not_one(t, g)
    elif t.element_size() < 4:
        # 16-bit: the product in float32 and one rounding (g may be 2^16, inf in float16), by
        # pieces of 4M elements so that the float32 copies stay small
        gf = g.float()
        if not t.is_contiguous():
            t.copy_(t.float() * gf)
            return
        for piece in t.view(-1).split(1 << 22):
            piece.copy_(piece.float() * gf)
    else:
        t.mul_(g.to(t.dtype))


# ----------------------------------------------------------------------------------------------
# GEMMs into (part of) an output, with float32 outputs for bf16/fp16 inputs where needed.

def _mm(out: Tensor, a: Tensor, b: Tensor, accumulate: bool) -> None:
    """out (+)= a @ b. out may be float32 while a and b are float16/bfloat16. With
    FUSEDOPS_LCE_GEMM=sm90 (off by default) our Hopper GEMMs run the products they cover."""
    if gemm_sm90.try_mm(out, a, b, accumulate):
        return
    if out.dtype == a.dtype:
        if accumulate:
            out.addmm_(a, b)
        else:
            torch.mm(a, b, out=out)
    elif out.is_cuda:  # bf16/fp16 x bf16/fp16 -> float32 in cuBLAS, no float32 copies of a, b
        if accumulate:
            torch.addmm(out, a, b, out_dtype=out.dtype, out=out)
        else:
            torch.mm(a, b, out_dtype=out.dtype, out=out)
    else:
        prod = a.to(out.dtype) @ b.to(out.dtype)
        if accumulate:
            out.add_(prod)
        else:
            out.copy_(prod)


def _flat_view(buf: Tensor, rows: int, cols: int) -> Tensor:
    return buf.view(-1)[: rows * cols].view(rows, cols)


def stats_plan(plan: Plan, hidden: Tensor, w_mm: Tensor, bias: Tensor | None, target: Tensor,
               budget: int, need_dh: bool) -> Plan | None:
    """The whole-row plan for the logits GEMM with the statistics epilogue
    (FUSEDOPS_LCE_GEMM=sm90-fused), its partials counted in the budget; None where that route
    does not apply (gemm_sm90.stats_route_why_not) or the budget then holds no whole rows."""
    if gemm_sm90.stats_route_why_not(hidden, w_mm, bias, target, plan.full_rows) is not None:
        return None
    n_tokens, hidden_size = hidden.shape
    vocab = w_mm.shape[0]
    fused = plan_chunks(n_tokens, hidden_size, vocab, hidden.element_size(), budget, need_dh,
                        gemm_sm90.stats_partial_bytes(vocab))
    return fused if fused.full_rows else None


def fused_forward(hidden: Tensor, weight: Tensor, bias: Tensor | None, target: Tensor,
                  ignore_index: int, reduction: str, label_smoothing: float, softcap: float,
                  z_loss: float, budget: int, need_dh: bool, need_dw: bool, need_db: bool,
                  backend: str, filter_eps: float = -1.0, *, combine=None,
                  vocab_total: int | None = None, plan: Plan | None = None,
                  valid: Tensor | None = None):
    """Returns (loss, lse, d_hidden, d_weight, d_bias) with the gradients for upstream g = 1.
    filter_eps >= 0: d_hidden and d_weight skip the dz blocks below filter_eps times the token's
    weight (fusedops.linear_ce.filtered); negative: exact.

    A vocab shard (fusedops.linear_ce.parallel): weight holds some rows of a vocabulary of
    vocab_total entries and targets are relative to its first row; combine(lse, zt, zsum), called
    once per token chunk with that chunk's statistics of the shard, replaces them in place by
    the whole vocabulary's, before any dz is formed; plan fixes the token chunks (the same on
    every rank, so that every rank calls combine equally often); valid: the tokens that are not
    ignore_index (shifted targets cannot tell). The loss and lse are then the whole
    vocabulary's, d_hidden this shard's part of it.

    hidden (N, H) contiguous; weight (V, H) contiguous, of hidden's dtype or float32 (mixed
    precision: the GEMMs run in hidden's dtype, d_weight and d_bias come out float32).
    Gradients not asked for are empty tensors.
    """
    n_tokens, hidden_size = hidden.shape
    vocab = weight.shape[0]  # rows of this weight (a shard's with combine)
    v_all = vocab if vocab_total is None else vocab_total  # columns of the full row
    dev = hidden.device
    cdt = compute_dtype(hidden)
    w_mm, b_in = gemm_operands(hidden, weight, bias, cdt)
    need_grads = need_dh or need_dw or need_db
    d_hidden = torch.empty_like(hidden) if need_dh else hidden.new_empty(0)
    d_weight = torch.empty_like(weight) if need_dw else hidden.new_empty(0)
    d_bias32 = torch.zeros(vocab, dtype=cdt, device=dev) if need_db else None

    if valid is None:
        valid = target != ignore_index
    if reduction == "mean":
        scale = 1.0 / valid.sum().clamp(min=1).to(cdt)
    else:
        scale = torch.ones((), dtype=cdt, device=dev)
    w_tok = valid.to(cdt) * scale  # d loss / d (per-token loss), for g = 1
    thr = w_tok * filter_eps if filter_eps >= 0 else None  # w_tok >= 0
    route = filtered.Route() if thr is not None else None
    lse = torch.empty(n_tokens, dtype=cdt, device=dev)
    zt = torch.zeros(n_tokens, dtype=cdt, device=dev)
    zsum = torch.zeros(n_tokens, dtype=cdt, device=dev)
    eps, zl, cap = float(label_smoothing), float(z_loss), float(softcap)

    if n_tokens > 0:
        if plan is None:
            plan = plan_chunks(n_tokens, hidden_size, vocab, hidden.element_size(), budget,
                               need_dh)
        # FUSEDOPS_LCE_GEMM=sm90-fused: the statistics come from the logits GEMM's epilogue and
        # the row kernel only turns z into dz (MODE_DZ). Not for shards (its partials change
        # the plan).
        splan = None if combine is not None else \
            stats_plan(plan, hidden, w_mm, b_in, target, budget, need_dh)
        partials = None
        dz_in_gemm = False  # FUSEDOPS_LCE_GEMM=sm90-fused2: no dz pass (gemm_sm90.dz_gemm)
        if splan is not None:
            plan = splan
            partials = torch.empty(plan.rows, gemm_sm90.stats_tiles(vocab), 4,
                                   dtype=torch.float32, device=dev)
            dz_in_gemm = thr is None and gemm_sm90.dz_route_why_not(
                hidden, d_weight if need_dw else None, b_in) is None
        db_chunk = None
        if dz_in_gemm and need_db:
            # d_bias's chunk sums come from the d_weight GEMM (a plain sum when d_weight is not
            # needed would need dz itself: keep the dz pass then).
            dz_in_gemm = need_dw
            if dz_in_gemm:
                db_chunk = torch.empty(vocab, dtype=torch.float32, device=dev)
        buf = torch.empty(plan.rows * plan.cols, dtype=hidden.dtype, device=dev)
        acc, part = _dh_accumulator(plan, hidden, cdt, need_dh)
        m = s = None
        if not plan.full_rows:
            m = torch.empty(n_tokens, dtype=cdt, device=dev)
            s = torch.empty(n_tokens, dtype=cdt, device=dev)
        def logits_then_rows(n0, n1, v0, v1, mode):
            """z = hidden[n0:n1] @ weight[v0:v1].T into the buffer, then the row kernel."""
            z = _flat_view(buf, n1 - n0, v1 - v0)
            _mm(z, hidden[n0:n1], w_mm[v0:v1].T, False)
            state = lse if m is None else m, lse if s is None else s  # unused by whole rows
            _rows(backend, z, None if b_in is None else b_in[v0:v1], target[n0:n1], v0, v_all,
                  w_tok[n0:n1], lse[n0:n1], state[0][n0:n1], state[1][n0:n1], zt[n0:n1],
                  zsum[n0:n1], eps, zl, cap, mode)
            return z

        def whole_row_grads(z, n0, n1, dz_pass):
            """d_hidden[n0:n1], d_weight (+)= and d_bias += of a whole-row chunk's z, turned
            into dz first by the row kernel's MODE_DZ where dz_pass (else it already is dz)."""
            if dz_pass:
                _rows(backend, z, b_in, target[n0:n1], 0, v_all, w_tok[n0:n1], lse[n0:n1],
                      lse[n0:n1], lse[n0:n1], zt[n0:n1], zsum[n0:n1], eps, zl, cap, MODE_DZ)
            _grads_from_dz(z, hidden[n0:n1], w_mm, 0, vocab,
                           d_hidden[n0:n1] if need_dh else None, d_weight if need_dw else None,
                           d_bias32, first_dw, None if thr is None else thr[n0:n1], route=route)

        first_dw = True
        for n0 in range(0, n_tokens, plan.rows):
            n1 = min(n0 + plan.rows, n_tokens)
            x = hidden[n0:n1]
            if partials is not None:
                z = _flat_view(buf, n1 - n0, vocab)
                gemm_sm90.logits_ce_stats(x, w_mm, z, b_in, target[n0:n1], cap,
                                          partials[: n1 - n0], lse[n0:n1], zt[n0:n1],
                                          zsum[n0:n1])
                if need_grads and dz_in_gemm:
                    dz_args = (b_in, lse[n0:n1], w_tok[n0:n1], target[n0:n1], eps, zl, cap)
                    if need_dh:
                        gemm_sm90.dz_gemm(z, w_mm, d_hidden[n0:n1], gemm_sm90.D_HIDDEN, False,
                                          *dz_args)
                    if need_dw:
                        gemm_sm90.dz_gemm(z, x, d_weight, gemm_sm90.D_WEIGHT, not first_dw,
                                          *dz_args, dbias=db_chunk)
                        if db_chunk is not None:
                            d_bias32 += db_chunk
                    first_dw = False
                elif need_grads:
                    whole_row_grads(z, n0, n1, True)
                    first_dw = False
                continue
            if plan.full_rows:
                # One pass for the statistics and dz, or for a shard (combine) the statistics,
                # their combination over the group, then dz with the whole row's lse.
                both = need_grads and combine is None
                z = logits_then_rows(n0, n1, 0, vocab, MODE_FULL_DZ if both else MODE_FULL)
                if combine is not None:
                    combine(lse[n0:n1], zt[n0:n1], zsum[n0:n1])
                if need_grads:
                    whole_row_grads(z, n0, n1, not both)
                    first_dw = False
                continue
            m[n0:n1] = -math.inf
            s[n0:n1] = 0.0
            for v0 in range(0, vocab, plan.cols):
                logits_then_rows(n0, n1, v0, min(v0 + plan.cols, vocab), MODE_MERGE)
            torch.add(m[n0:n1], torch.log(s[n0:n1]), out=lse[n0:n1])
            if combine is not None:
                combine(lse[n0:n1], zt[n0:n1], zsum[n0:n1])
            if not need_grads:
                continue
            for v0 in range(0, vocab, plan.cols):
                v1 = min(v0 + plan.cols, vocab)
                z = logits_then_rows(n0, n1, v0, v1, MODE_DZ)
                mask = _grads_from_dz(z, x, w_mm, v0, v1, None, d_weight if need_dw else None,
                                      d_bias32, first_dw, None if thr is None else thr[n0:n1],
                                      need_dh, route)
                if need_dh:
                    _add_dh_chunk(acc, part, z, w_mm[v0:v1], v0 == 0, mask)
            first_dw = False
            if need_dh:
                d_hidden[n0:n1] = acc[: n1 - n0]
    elif need_dw:
        d_weight.zero_()

    per_tok = lse - (1.0 - eps) * zt - (eps / v_all) * zsum if eps else lse - zt
    if zl:
        per_tok = per_tok + zl * lse * lse
    # ignored tokens add exactly 0, also when their logits overflowed (0 * inf would be NaN)
    loss = (torch.where(valid, per_tok, 0.0) * w_tok).sum()
    d_bias = hidden.new_empty(0)
    if need_db:
        d_bias = d_bias32.to(bias.dtype)
    return loss.to(cdt), lse, d_hidden, d_weight, d_bias


def _dh_accumulator(plan: Plan, hidden: Tensor, cdt: torch.dtype, need_dh: bool):
    """(acc, part) for d_hidden over vocab chunks, or (None, None) with whole rows or no d_hidden.
    Each chunk's product is added into the float32 accumulator acc by the GEMM (on CUDA, cuBLAS
    with bf16/fp16 inputs and a float32 output: at Llama-3's 64 MiB setting 55.2 ms against 63.0
    with a partial in the input dtype and a separate add), part is acc then. The CPU path keeps
    that partial (one more rows x H buffer in the input dtype, outside the plan) rather than
    float32 copies of both operands."""
    if not need_dh or plan.full_rows:
        return None, None
    rows, hidden_size = plan.rows, hidden.shape[1]
    acc = torch.empty(rows, hidden_size, dtype=cdt, device=hidden.device)
    if hidden.dtype == cdt or hidden.is_cuda:
        return acc, acc
    return acc, torch.empty(rows, hidden_size, dtype=hidden.dtype, device=hidden.device)


def _add_dh_chunk(acc: Tensor, part: Tensor, dz: Tensor, w_chunk: Tensor, first: bool,
                  mask: Tensor | None = None) -> None:
    """acc[:rows] (=/+=) dz @ w_chunk, a vocab chunk's part of d_hidden in the float32
    accumulator: through cuBLAS's float32 output (part is acc), or a partial in the input dtype
    and an add (the CPU path); over the blocks of `mask` only (filtering, on the GPU), where
    given."""
    rows = dz.shape[0]
    if mask is not None:
        filtered.d_hidden(dz, w_chunk, acc[:rows], not first, mask)
        return
    if part is acc:
        _mm(acc[:rows], dz, w_chunk, not first)
        return
    torch.mm(dz, w_chunk, out=part[:rows])
    if first:
        acc[:rows].copy_(part[:rows])
    else:
        acc[:rows].add_(part[:rows])


def _grads_from_dz(dz, x, w_mm, v0, v1, dh_out, dw_out, db32, first_dw, thr=None,
                   want_mask=False, route=None):
    """d_hidden (dh_out =), d_weight rows v0:v1 (dw_out =, or += unless first_dw) and d_bias
    (db32 +=, always exact) of a dz chunk. thr (rows,): the filter's per-token thresholds, or
    None for exact products; route: the call's filtered.Route, given with thr. Returns the
    filter's block mask when want_mask and the block-sparse kernels take the chunk (the caller's
    d_hidden product then uses it), else None: elsewhere (no GPU kernels, or too many kept
    blocks for them to pay) the dropped blocks are zeroed in dz, so dense products of it are
    the filtered ones."""
    if db32 is not None:
        db32[v0:v1] += dz.sum(0, dtype=db32.dtype)
    mask = None
    if thr is not None:
        mask = filtered.block_mask(dz, thr)
        if not route.sparse(dz, mask):
            filtered.zero_dropped_(dz, mask)
            mask = None
    if dh_out is not None:
        if mask is None:
            _mm(dh_out, dz, w_mm[v0:v1], False)
        else:
            filtered.d_hidden(dz, w_mm[v0:v1], dh_out, False, mask)
    if dw_out is not None:
        if mask is None:
            _mm(dw_out[v0:v1], dz.T, x, not first_dw)
        else:
            filtered.d_weight(dz, x, dw_out[v0:v1], not first_dw, mask)
    return mask if want_mask else None


# ----------------------------------------------------------------------------------------------
# The statistics path (any loss on top of lse, zt, zsum: reduction "none", return_lse, the
# vocab-parallel shards): the forward's statistics by chunks of one GEMM each, the backward's
# logits again (three GEMMs) for whatever upstream gradients the statistics receive.

def statistics(hidden: Tensor, weight: Tensor, bias: Tensor | None, target: Tensor,
               softcap: float, plan: Plan, backend: str, keep: bool = False):
    """Per-token (lse, target logit, logit sum) of hidden @ weight.T (+ bias, softcap) by the
    chunks of `plan`; targets outside [0, V) give a target logit of 0. With keep and a whole-row
    plan, also returns the logits buffer (the plan's size), which then holds the last token
    chunk's raw logits for grads_sweep; else None."""
    n_tokens, vocab = hidden.shape[0], weight.shape[0]
    dev = hidden.device
    cdt = compute_dtype(hidden)
    w_mm, b_in = gemm_operands(hidden, weight, bias, cdt)
    lse = torch.empty(n_tokens, dtype=cdt, device=dev)
    zt = torch.zeros(n_tokens, dtype=cdt, device=dev)
    zsum = torch.zeros(n_tokens, dtype=cdt, device=dev)
    if n_tokens == 0:
        return lse, zt, zsum, None
    unused = torch.zeros(n_tokens, dtype=cdt, device=dev)  # the dz modes' per-token weight
    buf = torch.empty(plan.rows * plan.cols, dtype=hidden.dtype, device=dev)
    m = s = lse
    if not plan.full_rows:
        m = torch.full((n_tokens,), -math.inf, dtype=cdt, device=dev)
        s = torch.zeros(n_tokens, dtype=cdt, device=dev)
    mode = MODE_FULL if plan.full_rows else MODE_MERGE
    for n0 in range(0, n_tokens, plan.rows):
        n1 = min(n0 + plan.rows, n_tokens)
        for v0 in range(0, vocab, plan.cols):
            v1 = min(v0 + plan.cols, vocab)
            z = _flat_view(buf, n1 - n0, v1 - v0)
            _mm(z, hidden[n0:n1], w_mm[v0:v1].T, False)
            _rows(backend, z, None if b_in is None else b_in[v0:v1], target[n0:n1], v0, vocab,
                  unused[n0:n1], lse[n0:n1], m[n0:n1], s[n0:n1], zt[n0:n1], zsum[n0:n1], 0.0,
                  0.0, softcap, mode)
    if not plan.full_rows:
        torch.add(m, torch.log(s), out=lse)
    return lse, zt, zsum, buf if keep and plan.full_rows else None


def grads_sweep(hidden: Tensor, weight: Tensor, bias: Tensor | None, target: Tensor,
                lse: Tensor, coef, plan: Plan, backend: str, need_dh: bool, need_dw: bool,
                need_db: bool, mode: int = MODE_DZ_GRADS, vocab: int | None = None,
                eps: float = 0.0, zl: float = 0.0, softcap: float = 0.0,
                kept: Tensor | None = None, filter_eps: float = -1.0):
    """(d_hidden, d_weight, d_bias) through the logits recomputed chunk by chunk, each turned
    into dz by the row kernel's `mode` with the final lse: MODE_DZ_GRADS, coef = (d_lse, d_zt,
    d_zsum) the statistics' upstream gradients; MODE_DZ, coef = (w,) the loss's per-token
    weights with label smoothing eps and z-loss zl over `vocab` columns (a vocab shard's rows
    are columns of the full row). kept: statistics()'s buffer, whose last token chunk needs no
    GEMM (it is overwritten). filter_eps >= 0: the products skip the dz blocks below filter_eps
    times |coef[0][token]| (fusedops.linear_ce.filtered). Gradients not asked for are empty
    tensors."""
    n_tokens = hidden.shape[0]
    rows = weight.shape[0]
    vocab = rows if vocab is None else vocab
    dev = hidden.device
    cdt = lse.dtype
    w_mm, b_in = gemm_operands(hidden, weight, bias, cdt)
    d_hidden = torch.empty_like(hidden) if need_dh else hidden.new_empty(0)
    d_weight = torch.empty_like(weight) if need_dw else hidden.new_empty(0)
    d_bias32 = torch.zeros(rows, dtype=cdt, device=dev) if need_db else None
    if n_tokens == 0 or not (need_dh or need_dw or need_db):
        d_weight.zero_()
        return d_hidden, d_weight, d_bias32.to(bias.dtype) if need_db else hidden.new_empty(0)
    w_arr = coef[0]
    if mode == MODE_DZ_GRADS:
        zt_arr, zs_arr = coef[1], coef[2]
    else:
        zt_arr = zs_arr = torch.zeros(n_tokens, dtype=cdt, device=dev)  # not read by MODE_DZ
    thr = w_arr.abs() * filter_eps if filter_eps >= 0 else None
    route = filtered.Route() if thr is not None else None
    if kept is not None and not (plan.full_rows and kept.numel() == plan.rows * plan.cols):
        kept = None  # not this plan's buffer (the plan changed since the forward)
    buf = kept if kept is not None else \
        torch.empty(plan.rows * plan.cols, dtype=hidden.dtype, device=dev)
    acc, part = _dh_accumulator(plan, hidden, cdt, need_dh)
    # The last token chunk first, while a kept buffer still holds its logits (always, so that
    # a recomputing second backward sums d_weight in the same order: the same bits).
    starts = list(range(0, n_tokens, plan.rows))
    starts = starts[-1:] + starts[:-1]
    for i, n0 in enumerate(starts):
        n1 = min(n0 + plan.rows, n_tokens)
        x = hidden[n0:n1]
        for v0 in range(0, rows, plan.cols):
            v1 = min(v0 + plan.cols, rows)
            z = _flat_view(buf, n1 - n0, v1 - v0)
            if not (kept is not None and i == 0):
                _mm(z, x, w_mm[v0:v1].T, False)
            _rows(backend, z, None if b_in is None else b_in[v0:v1], target[n0:n1], v0, vocab,
                  w_arr[n0:n1], lse[n0:n1], lse[n0:n1], lse[n0:n1], zt_arr[n0:n1],
                  zs_arr[n0:n1], eps, zl, softcap, mode)
            mask = _grads_from_dz(z, x, w_mm, v0, v1,
                                  d_hidden[n0:n1] if need_dh and plan.full_rows else None,
                                  d_weight if need_dw else None, d_bias32, i == 0,
                                  None if thr is None else thr[n0:n1], acc is not None, route)
            if acc is not None:
                _add_dh_chunk(acc, part, z, w_mm[v0:v1], v0 == 0, mask)
        if acc is not None:
            d_hidden[n0:n1] = acc[: n1 - n0]
    d_bias = d_bias32.to(bias.dtype) if need_db else hidden.new_empty(0)
    return d_hidden, d_weight, d_bias
