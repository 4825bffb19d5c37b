"""Triton kernels for exact tiled attention (same op contract as fusedops.attention.reference).

Packed ("varlen") layout throughout: q (total_q, Hq, D), k and v (total_k, Hkv, D), int32
cu_seqlens. One program per (block, head, sequence). Query i of a sequence sees key j when
j <= i + off + right and, with a left window, j >= i + off - left, where off = Lk - Lq
(bottom-right alignment; causal is right = 0). Loops visit only key (or query) blocks that can
be visible, so causal and windowed attention skip the masked tiles.

Forward: online softmax in registers (exp2 with log2(e) folded after the softcap), output
normalised once, lse (natural log) written as (Hq, total_q); rows that see no key get out = 0 and
lse = -inf. Backward: delta = rowsum(dO * O); a dK/dV kernel per key block that loops over the
query heads of its GQA group and their visible query blocks, keeping dK/dV in registers; dQ either
by float32 atomics from that kernel, or (deterministic) by a separate per-query-block kernel.
Constraints: head dim <= 256 (padded to a power of two with masks); last dimension contiguous.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fusedops._triton import INTERPRET, LOG2E, scores_log2
from fusedops._triton import tanh as _tanh


@triton.jit
def _mask(offs_m, offs_n, lq, lk, off, left, right, HAS_LEFT: tl.constexpr,
          HAS_RIGHT: tl.constexpr):
    """[M, N] visibility of keys offs_n to queries offs_m (within-sequence indices)."""
    valid = (offs_m[:, None] < lq) & (offs_n[None, :] < lk)
    if HAS_RIGHT:
        valid &= offs_n[None, :] <= offs_m[:, None] + off + right
    if HAS_LEFT:
        valid &= offs_n[None, :] >= offs_m[:, None] + off - left
    return valid


@triton.jit
def _mask_t(offs_n, offs_m, lq, lk, off, left, right, HAS_LEFT: tl.constexpr,
            HAS_RIGHT: tl.constexpr):
    """[N, M]: the transpose of _mask, built directly (keys along rows)."""
    valid = (offs_n[:, None] < lk) & (offs_m[None, :] < lq)
    if HAS_RIGHT:
        valid &= offs_n[:, None] <= offs_m[None, :] + off + right
    if HAS_LEFT:
        valid &= offs_n[:, None] >= offs_m[None, :] + off - left
    return valid


@triton.jit
def _seq(CU_Q, CU_K, b):
    q_start = tl.load(CU_Q + b)
    k_start = tl.load(CU_K + b)
    lq = tl.load(CU_Q + b + 1) - q_start
    lk = tl.load(CU_K + b + 1) - k_start
    return q_start, k_start, lq, lk


@triton.jit
def _load_rows(PTR, start, rows, n_rows, head, stride_t, stride_h, offs_d, HEAD_DIM: tl.constexpr):
    ptrs = PTR + (start + rows).to(tl.int64)[:, None] * stride_t + head * stride_h + offs_d[None, :]
    return tl.load(ptrs, mask=(rows[:, None] < n_rows) & (offs_d[None, :] < HEAD_DIM), other=0.0)


@triton.jit
def _key_range(m0, lq, lk, left, right, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    off = lk - lq
    lo = 0
    hi = lk
    if HAS_RIGHT:
        hi = tl.minimum(lk, m0 + BLOCK_M - 1 + off + right + 1)
    if HAS_LEFT:
        lo = tl.maximum(0, m0 + off - left)
        lo = (lo // BLOCK_N) * BLOCK_N
    return lo, hi


@triton.jit
def _fwd_kernel(Q, K, V, OUT, LSE, CU_Q, CU_K, sm_scale, softcap, left, right,
                stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                stride_ot, stride_oh, total_q,
                GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_LEFT: tl.constexpr,
                HAS_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr, IEEE: tl.constexpr):
    pid_m = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    q_start, k_start, lq, lk = _seq(CU_Q, CU_K, b)
    m0 = pid_m * BLOCK_M
    if m0 >= lq:
        return
    kvh = h // GROUP
    off = lk - lq
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    q = _load_rows(Q, q_start, offs_m, lq, h, stride_qt, stride_qh, offs_d, HEAD_DIM)
    lo, hi = _key_range(m0, lq, lk, left, right, HAS_LEFT, HAS_RIGHT, BLOCK_M, BLOCK_N)
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        k = _load_rows(K, k_start, cols, lk, kvh, stride_kt, stride_kh, offs_d, HEAD_DIM)
        s = scores_log2(q, k, sm_scale, softcap, SOFTCAP, IEEE)  # log2 units from here on
        valid = _mask(offs_m, cols, lq, lk, off, left, right, HAS_LEFT, HAS_RIGHT)
        s = tl.where(valid, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw nothing yet
        p = tl.exp2(s - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        v = _load_rows(V, k_start, cols, lk, kvh, stride_vt, stride_vh, offs_d, HEAD_DIM)
        if IEEE:
            acc = tl.dot(p.to(v.dtype), v, acc, input_precision="ieee")
        else:
            acc = tl.dot(p.to(v.dtype), v, acc)
        m_i = m_new
    seen = l_i > 0.0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) / LOG2E,
                   float("-inf"))
    o_ptrs = (OUT + (q_start + offs_m).to(tl.int64)[:, None] * stride_ot + h * stride_oh
              + offs_d[None, :])
    tl.store(o_ptrs, out.to(OUT.dtype.element_ty),
             mask=(offs_m[:, None] < lq) & (offs_d[None, :] < HEAD_DIM))
    tl.store(LSE + h.to(tl.int64) * total_q + q_start + offs_m, lse, mask=offs_m < lq)


@triton.jit
def _delta_kernel(OUT, DO, DELTA, total_q, stride_ot, stride_oh, stride_dt, stride_dh,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    h = tl.program_id(1)
    offs_d = tl.arange(0, BLOCK_D)
    o = _load_rows(OUT, 0, rows, total_q, h, stride_ot, stride_oh, offs_d, HEAD_DIM)
    do = _load_rows(DO, 0, rows, total_q, h, stride_dt, stride_dh, offs_d, HEAD_DIM)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(DELTA + h.to(tl.int64) * total_q + rows, delta, mask=rows < total_q)


@triton.jit
def _dkdv_kernel(Q, K, V, DO, LSE, DELTA, DQ, DK, DV, CU_Q, CU_K, sm_scale, softcap, left, right,
                 stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                 stride_dot, stride_doh, stride_dkt, stride_dkh, stride_dqt, stride_dqh, total_q,
                 GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_LEFT: tl.constexpr,
                 HAS_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr, IEEE: tl.constexpr,
                 ATOMIC_DQ: tl.constexpr):
    pid_n = tl.program_id(0)
    kvh = tl.program_id(1)
    b = tl.program_id(2)
    q_start, k_start, lq, lk = _seq(CU_Q, CU_K, b)
    n0 = pid_n * BLOCK_N
    if n0 >= lk:
        return
    off = lk - lq
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    k = _load_rows(K, k_start, offs_n, lk, kvh, stride_kt, stride_kh, offs_d, HEAD_DIM)
    v = _load_rows(V, k_start, offs_n, lk, kvh, stride_vt, stride_vh, offs_d, HEAD_DIM)
    dk = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)
    dv = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)
    # Queries that can see this key block: i >= j - off - right, i <= j - off + left.
    q_lo = 0
    q_hi = lq
    if HAS_RIGHT:
        q_lo = tl.maximum(0, n0 - off - right)
        q_lo = (q_lo // BLOCK_M) * BLOCK_M
    if HAS_LEFT:
        q_hi = tl.minimum(lq, n0 + BLOCK_N - 1 - off + left + 1)
    for g in range(0, GROUP):
        h = kvh * GROUP + g
        for start_m in range(q_lo, q_hi, BLOCK_M):
            rows = start_m + offs_m
            q = _load_rows(Q, q_start, rows, lq, h, stride_qt, stride_qh, offs_d, HEAD_DIM)
            do = _load_rows(DO, q_start, rows, lq, h, stride_dot, stride_doh, offs_d, HEAD_DIM)
            lse = tl.load(LSE + h.to(tl.int64) * total_q + q_start + rows, mask=rows < lq,
                          other=float("inf"))
            lse = tl.where(lse == float("-inf"), float("inf"), lse)  # rows that saw no key
            delta = tl.load(DELTA + h.to(tl.int64) * total_q + q_start + rows, mask=rows < lq,
                            other=0.0)
            if IEEE:
                s_t = tl.dot(k, tl.trans(q), input_precision="ieee")
            else:
                s_t = tl.dot(k, tl.trans(q))
            s_t = s_t * sm_scale
            if SOFTCAP:
                t_t = _tanh(s_t / softcap)
                s_t = softcap * t_t
            valid_t = _mask_t(offs_n, rows, lq, lk, off, left, right, HAS_LEFT, HAS_RIGHT)
            p_t = tl.where(valid_t, tl.exp2((s_t - lse[None, :]) * LOG2E), 0.0)
            if IEEE:
                dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision="ieee")
                dp_t = tl.dot(v, tl.trans(do), input_precision="ieee")
            else:
                dv = tl.dot(p_t.to(do.dtype), do, dv)
                dp_t = tl.dot(v, tl.trans(do))
            ds_t = p_t * (dp_t - delta[None, :])
            if SOFTCAP:
                ds_t = ds_t * (1.0 - t_t * t_t)
            if IEEE:
                dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision="ieee")
            else:
                dk = tl.dot(ds_t.to(q.dtype), q, dk)
            if ATOMIC_DQ:
                if IEEE:
                    dq = tl.dot(tl.trans(ds_t).to(k.dtype), k, input_precision="ieee")
                else:
                    dq = tl.dot(tl.trans(ds_t).to(k.dtype), k)
                dq_ptrs = (DQ + (q_start + rows).to(tl.int64)[:, None] * stride_dqt
                           + h * stride_dqh + offs_d[None, :])
                tl.atomic_add(dq_ptrs, dq * sm_scale,
                              mask=(rows[:, None] < lq) & (offs_d[None, :] < HEAD_DIM))
    out_mask = (offs_n[:, None] < lk) & (offs_d[None, :] < HEAD_DIM)
    base = ((k_start + offs_n).to(tl.int64)[:, None] * stride_dkt + kvh * stride_dkh
            + offs_d[None, :])
    tl.store(DK + base, (dk * sm_scale).to(DK.dtype.element_ty), mask=out_mask)
    tl.store(DV + base, dv.to(DV.dtype.element_ty), mask=out_mask)


@triton.jit
def _dq_kernel(Q, K, V, DO, LSE, DELTA, DQ, CU_Q, CU_K, sm_scale, softcap, left, right,
               stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
               stride_dot, stride_doh, stride_dqt, stride_dqh, total_q,
               GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_LEFT: tl.constexpr,
               HAS_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr, IEEE: tl.constexpr):
    """Deterministic dQ: one program per query block, summing over its visible key blocks."""
    pid_m = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    q_start, k_start, lq, lk = _seq(CU_Q, CU_K, b)
    m0 = pid_m * BLOCK_M
    if m0 >= lq:
        return
    kvh = h // GROUP
    off = lk - lq
    rows = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    q = _load_rows(Q, q_start, rows, lq, h, stride_qt, stride_qh, offs_d, HEAD_DIM)
    do = _load_rows(DO, q_start, rows, lq, h, stride_dot, stride_doh, offs_d, HEAD_DIM)
    lse = tl.load(LSE + h.to(tl.int64) * total_q + q_start + rows, mask=rows < lq,
                  other=float("inf"))
    lse = tl.where(lse == float("-inf"), float("inf"), lse)
    delta = tl.load(DELTA + h.to(tl.int64) * total_q + q_start + rows, mask=rows < lq, other=0.0)
    dq = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    lo, hi = _key_range(m0, lq, lk, left, right, HAS_LEFT, HAS_RIGHT, BLOCK_M, BLOCK_N)
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        k = _load_rows(K, k_start, cols, lk, kvh, stride_kt, stride_kh, offs_d, HEAD_DIM)
        v = _load_rows(V, k_start, cols, lk, kvh, stride_vt, stride_vh, offs_d, HEAD_DIM)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
            dp = tl.dot(do, tl.trans(v), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
            dp = tl.dot(do, tl.trans(v))
        s = s * sm_scale
        if SOFTCAP:
            t = _tanh(s / softcap)
            s = softcap * t
        valid = _mask(rows, cols, lq, lk, off, left, right, HAS_LEFT, HAS_RIGHT)
        p = tl.where(valid, tl.exp2((s - lse[:, None]) * LOG2E), 0.0)
        ds = p * (dp - delta[:, None])
        if SOFTCAP:
            ds = ds * (1.0 - t * t)
        if IEEE:
            dq = tl.dot(ds.to(k.dtype), k, dq, input_precision="ieee")
        else:
            dq = tl.dot(ds.to(k.dtype), k, dq)
    ptrs = (DQ + (q_start + rows).to(tl.int64)[:, None] * stride_dqt + h * stride_dqh
            + offs_d[None, :])
    tl.store(ptrs, (dq * sm_scale).to(DQ.dtype.element_ty),
             mask=(rows[:, None] < lq) & (offs_d[None, :] < HEAD_DIM))


def _configs(head_dim: int, dtype: torch.dtype, causal: bool = False):
    """(fwd BM, BN, warps, stages), (dkdv BM, BN, warps, stages), (dq BM, BN, warps, stages)."""
    if INTERPRET:
        return (16, 16, 1, 1), (16, 16, 1, 1), (16, 16, 1, 1)
    if head_dim > 128:
        return (64, 32, 4, 2), (32, 32, 4, 1), (64, 32, 4, 1)
    if dtype == torch.float32:
        return (64, 32, 4, 2), (32, 64, 4, 1), (64, 32, 4, 1)
    if head_dim > 64:
        return (128, 64, 8, 3), (64, 128, 8, 2), (128, 64, 8, 2)
    # D <= 64: the backward configs are the best of benchmarks/tune_attention.py's sweep on the
    # H200 (bf16, L=4096, 2026-11-29; benchmarks/results/attention_tune.jsonl): 296 TFLOP/s
    # non-causal, 242 causal, from 134 / 114.
    # A causal dK/dV block with few queries (32) wastes less on the diagonal.
    dkdv = (32, 128, 4, 2) if causal else (128, 64, 4, 2)
    return (128, 64, 4, 3), dkdv, (128, 64, 8, 3)


def _common(q, k, causal, left, right, softcap):
    head_dim = q.shape[2]
    group = q.shape[1] // k.shape[1]
    right = 0 if causal else right
    return dict(GROUP=group, HEAD_DIM=head_dim, BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
                HAS_LEFT=left >= 0, HAS_RIGHT=right >= 0, SOFTCAP=bool(softcap),
                IEEE=q.dtype == torch.float32), max(left, 0), max(right, 0)


def attention_fwd(q, k, v, cu_q, cu_k, max_q: int, max_k: int, scale: float, causal: bool,
                  left: int, right: int, softcap: float):
    total_q, hq, _ = q.shape
    batch = cu_q.shape[0] - 1
    out = torch.empty_like(q)
    lse = torch.empty((hq, total_q), dtype=torch.float32, device=q.device)
    if total_q == 0 or batch == 0 or max_q == 0:
        return out, lse.fill_(float("-inf"))
    meta, left, right = _common(q, k, causal, left, right, softcap)
    (bm, bn, warps, stages), _, _ = _configs(q.shape[2], q.dtype)
    _fwd_kernel[(triton.cdiv(max_q, bm), hq, batch)](
        q, k, v, out, lse, cu_q, cu_k, float(scale), float(softcap), left, right,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1), total_q, BLOCK_M=bm, BLOCK_N=bn, num_warps=warps,
        num_stages=stages, **meta)
    return out, lse


def attention_bwd(q, k, v, out, lse, dout, cu_q, cu_k, max_q: int, max_k: int, scale: float,
                  causal: bool, left: int, right: int, softcap: float, deterministic: bool):
    total_q, hq, head_dim = q.shape
    batch = cu_q.shape[0] - 1
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    if total_q == 0 or batch == 0 or max_q == 0 or k.shape[0] == 0:
        return torch.zeros_like(q), dk.zero_(), dv.zero_()
    meta, left, right = _common(q, k, causal, left, right, softcap)
    _, (bm1, bn1, w1, s1), (bm2, bn2, w2, s2) = _configs(head_dim, q.dtype, causal)
    delta = torch.empty((hq, total_q), dtype=torch.float32, device=q.device)
    blk = 16 if INTERPRET else 64
    _delta_kernel[(triton.cdiv(total_q, blk), hq)](
        out, dout, delta, total_q, out.stride(0), out.stride(1), dout.stride(0), dout.stride(1),
        HEAD_DIM=head_dim, BLOCK_D=meta["BLOCK_D"], BLOCK_M=blk)
    if deterministic:
        dq = torch.empty_like(q)
        dq_acc = dq  # unused by the dK/dV kernel
    else:
        dq_acc = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dkdv_args = (q, k, v, dout, lse, delta, dq_acc, dk, dv, cu_q, cu_k, float(scale),
                 float(softcap), left, right, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
                 v.stride(0), v.stride(1), dout.stride(0), dout.stride(1), dk.stride(0),
                 dk.stride(1), dq_acc.stride(0), dq_acc.stride(1), total_q)
    _dkdv_kernel[(triton.cdiv(max_k, bn1), k.shape[1], batch)](
        *dkdv_args, BLOCK_M=bm1, BLOCK_N=bn1, ATOMIC_DQ=not deterministic, num_warps=w1,
        num_stages=s1, **meta)
    if deterministic:
        _dq_kernel[(triton.cdiv(max_q, bm2), hq, batch)](
            q, k, v, dout, lse, delta, dq, cu_q, cu_k, float(scale), float(softcap), left, right,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            dout.stride(0), dout.stride(1), dq.stride(0), dq.stride(1), total_q,
            BLOCK_M=bm2, BLOCK_N=bn2, num_warps=w2, num_stages=s2, **meta)
    else:
        dq = dq_acc.to(q.dtype)
    return dq, dk, dv
