"""Triton kernels for fused linear cross-entropy (same op contract as fusedops.linear_ce.reference).

Forward: logit tiles live only on chip; each program owns a block of tokens and a range of vocab
tiles, keeps an online log-sum-exp, the target logit and the logit sum in registers, and writes
per-(split, token) partials that a small kernel combines.

Backward, per vocab chunk of `chunk_v` columns:
  1. _dz_kernel recomputes the logit tiles and turns them into dz in registers, writing dz (in the
     input dtype, the rounding PyTorch eager also applies) for [N, chunk_v] only, and d_bias by
     float32 atomics;
  2. _dw_kernel: d_weight[chunk] = dz^T @ hidden, reduced over all tokens in float32 registers;
  3. _dx_kernel: d_hidden += dz @ weight[chunk], accumulated across chunks in float32. For bfloat16
     the float32 accumulator is stored split: its high 16 bits in the d_hidden output itself and
     its low 16 bits in a scratch buffer, so the extra memory is N*H*2 bytes, not N*H*4; the last
     chunk rounds to bfloat16 (round-to-nearest-even) in place.
Constraints: hidden (N, H) and weight (V, H) contiguous; float32 uses IEEE dots (no TF32).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fusedops._triton import LOG2E
from fusedops._triton import interpreting as _interpreting

# Bytes of dz one backward chunk may hold: 32 MiB keeps the Llama-3 shape (N=8192) under 1% of
# eager's extra memory together with the N*H*2 bytes of the split d_hidden accumulator.
DZ_CHUNK_BYTES = 32 << 20


def _blocks(dtype: torch.dtype):
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) for the GEMM-shaped kernels."""
    if _interpreting():
        return 16, 32, 16, 1, 1
    if dtype == torch.float32:
        return 64, 64, 32, 4, 3
    return 128, 128, 64, 8, 3


@triton.jit
def _cap(acc, softcap, SOFTCAP: tl.constexpr):
    """softcap * tanh(acc / softcap), tanh(a) = 1 - 2 / (e^{2a} + 1) on |acc| as the CUDA row
    kernel computes it: one exp2 and a fast division instead of libdevice's tanh; absolute error
    below 1e-6 * softcap (a bf16 logit carries ~4e-3 relative)."""
    if SOFTCAP:
        a = tl.minimum(tl.abs(acc) * (1.0 / softcap), 20.0)  # tanh(20) == 1 in float32
        t = 1.0 - tl.fdiv(2.0, tl.exp2(a * (2.0 * LOG2E)) + 1.0, ieee_rounding=False)
        acc = tl.where(acc < 0, -softcap * t, softcap * t)
    return acc


@triton.jit
def _logit_tile(X, W, B, rows, cols, row_mask, col_mask, H, softcap,
                HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr, IEEE: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    x_ptrs = X + rows.to(tl.int64)[:, None] * H + tl.arange(0, BLOCK_K)[None, :]
    w_ptrs = W + cols.to(tl.int64)[:, None] * H + tl.arange(0, BLOCK_K)[None, :]
    for k0 in range(0, H, BLOCK_K):
        k_mask = (k0 + tl.arange(0, BLOCK_K)) < H
        x = tl.load(x_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=col_mask[:, None] & k_mask[None, :], other=0.0)
        if IEEE:
            acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, tl.trans(w), acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(B + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    return _cap(acc, softcap, SOFTCAP)


@triton.jit
def _fwd_kernel(X, W, B, T, PART, N, V, H, softcap, tiles_per_split,
                HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr, IEEE: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_s = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < N
    tgt = tl.load(T + rows, mask=row_mask, other=-1).to(tl.int64)
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    s_i = tl.zeros((BLOCK_M,), tl.float32)
    zt = tl.zeros((BLOCK_M,), tl.float32)
    zs = tl.zeros((BLOCK_M,), tl.float32)
    for i in range(0, tiles_per_split):
        cols = (pid_s * tiles_per_split + i) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_mask = cols < V
        z = _logit_tile(X, W, B, rows, cols, row_mask, col_mask, H, softcap, HAS_BIAS, SOFTCAP,
                        IEEE, BLOCK_M, BLOCK_N, BLOCK_K)
        z = tl.where(col_mask[None, :], z, float("-inf"))
        # The first tile of every split has a valid column, so m_new is finite from then on.
        m_new = tl.maximum(m_i, tl.max(z, 1))
        s_i = s_i * tl.exp2((m_i - m_new) * LOG2E) + tl.sum(
            tl.exp2((z - m_new[:, None]) * LOG2E), 1)
        m_i = m_new
        zs += tl.sum(tl.where(col_mask[None, :], z, 0.0), 1)
        # A target past V (a vocab shard's relative target of a later shard) may equal a padding
        # column of the last tile, whose z is -inf: only real columns match.
        hit = (cols.to(tl.int64)[None, :] == tgt[:, None]) & col_mask[None, :]
        zt += tl.sum(tl.where(hit, z, 0.0), 1)
    base = PART + pid_s * 4 * N
    tl.store(base + rows, m_i, mask=row_mask)
    tl.store(base + N + rows, s_i, mask=row_mask)
    tl.store(base + 2 * N + rows, zt, mask=row_mask)
    tl.store(base + 3 * N + rows, zs, mask=row_mask)


@triton.jit
def _combine_kernel(PART, LSE, ZT, ZS, N, n_splits, BLOCK: tl.constexpr):
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = rows < N
    m = tl.full((BLOCK,), float("-inf"), tl.float32)
    for s in range(0, n_splits):
        m = tl.maximum(m, tl.load(PART + s * 4 * N + rows, mask=mask, other=0.0))
    tot = tl.zeros((BLOCK,), tl.float32)
    zt = tl.zeros((BLOCK,), tl.float32)
    zs = tl.zeros((BLOCK,), tl.float32)
    for s in range(0, n_splits):
        base = PART + s * 4 * N
        tot += tl.load(base + N + rows, mask=mask, other=1.0) * tl.exp(
            tl.load(base + rows, mask=mask, other=0.0) - m)
        zt += tl.load(base + 2 * N + rows, mask=mask, other=0.0)
        zs += tl.load(base + 3 * N + rows, mask=mask, other=0.0)
    tl.store(LSE + rows, m + tl.log(tot), mask=mask)
    tl.store(ZT + rows, zt, mask=mask)
    tl.store(ZS + rows, zs, mask=mask)


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def linear_ce_fwd(hidden, weight, bias, target, softcap: float):
    n_tokens, hidden_size = hidden.shape
    vocab_size = weight.shape[0]
    dev = hidden.device
    lse = torch.empty(n_tokens, dtype=torch.float32, device=dev)
    z_target = torch.empty_like(lse)
    z_sum = torch.empty_like(lse)
    if n_tokens == 0:
        return lse, z_target, z_sum
    bm, bn, bk, warps, stages = _blocks(hidden.dtype)
    m_blocks = triton.cdiv(n_tokens, bm)
    v_tiles = triton.cdiv(vocab_size, bn)
    # Enough (token block, vocab split) programs for two waves, each split >= 1 vocab tile.
    want_splits = max(1, min(v_tiles, triton.cdiv(2 * _num_sms(dev), m_blocks)))
    tiles_per_split = triton.cdiv(v_tiles, want_splits)
    n_splits = triton.cdiv(v_tiles, tiles_per_split)
    part = torch.empty((n_splits, 4, n_tokens), dtype=torch.float32, device=dev)
    _fwd_kernel[(m_blocks, n_splits)](
        hidden, weight, bias if bias is not None else hidden, target, part, n_tokens, vocab_size,
        hidden_size, float(softcap), tiles_per_split, HAS_BIAS=bias is not None,
        SOFTCAP=bool(softcap), IEEE=hidden.dtype == torch.float32, BLOCK_M=bm, BLOCK_N=bn,
        BLOCK_K=bk, num_warps=warps, num_stages=stages)
    block = 16 if _interpreting() else 256
    _combine_kernel[(triton.cdiv(n_tokens, block),)](part, lse, z_target, z_sum, n_tokens,
                                                    n_splits, BLOCK=block)
    return lse, z_target, z_sum


@triton.jit
def _dz_kernel(X, W, B, T, LSE, DLSE, DZT, DZS, DZ, DB, N, V, H, v0, chunk_cols, ld_dz, softcap,
               HAS_BIAS: tl.constexpr, NEED_DB: tl.constexpr, SOFTCAP: tl.constexpr,
               IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    local = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = v0 + local
    row_mask = rows < N
    col_mask = (local < chunk_cols) & (cols < V)
    z = _logit_tile(X, W, B, rows, cols, row_mask, col_mask, H, softcap, HAS_BIAS, SOFTCAP, IEEE,
                    BLOCK_M, BLOCK_N, BLOCK_K)
    lse = tl.load(LSE + rows, mask=row_mask, other=0.0)
    a = tl.load(DLSE + rows, mask=row_mask, other=0.0)
    b = tl.load(DZT + rows, mask=row_mask, other=0.0)
    c = tl.load(DZS + rows, mask=row_mask, other=0.0)
    tgt = tl.load(T + rows, mask=row_mask, other=-1).to(tl.int64)
    dz = a[:, None] * tl.exp(z - lse[:, None]) + c[:, None]
    dz += tl.where(cols.to(tl.int64)[None, :] == tgt[:, None], b[:, None], 0.0)
    if SOFTCAP:
        zc = z / softcap
        dz = dz * (1.0 - zc * zc)
    dz = tl.where(row_mask[:, None] & col_mask[None, :], dz, 0.0)
    if NEED_DB:
        tl.atomic_add(DB + cols, tl.sum(dz, 0), mask=col_mask)
    out = DZ + rows.to(tl.int64)[:, None] * ld_dz + local[None, :]
    tl.store(out, dz.to(DZ.dtype.element_ty), mask=row_mask[:, None] & (local < ld_dz)[None, :])


@triton.jit
def _dw_operands(DZ, X, n, i, j, N, H, ld_dz, i_mask, j_mask):
    n_mask = n < N
    a = tl.load(DZ + n.to(tl.int64)[:, None] * ld_dz + i[None, :],
                mask=n_mask[:, None] & i_mask[None, :], other=0.0)
    b = tl.load(X + n.to(tl.int64)[:, None] * H + j[None, :],
                mask=n_mask[:, None] & j_mask[None, :], other=0.0)
    return a, b


@triton.jit
def _dw_kernel(DZ, X, DW, N, V, H, v0, chunk_cols, ld_dz, IEEE: tl.constexpr,
               INNER: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr):
    # DW[v0 + i, j] = sum_n DZ[n, i] * X[n, j]; i over the chunk's columns, j over H.
    i = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    j = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    i_mask = (i < chunk_cols) & (v0 + i < V)
    j_mask = j < H
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if IEEE:  # float32: sum in two levels, see _dx_kernel
        for n_outer in range(0, N, BLOCK_K * INNER):
            part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for kk in range(0, INNER):
                n = n_outer + kk * BLOCK_K + tl.arange(0, BLOCK_K)
                a, b = _dw_operands(DZ, X, n, i, j, N, H, ld_dz, i_mask, j_mask)
                part = tl.dot(tl.trans(a), b, part, input_precision="ieee")
            acc += part
    else:
        for n0 in range(0, N, BLOCK_K):
            n = n0 + tl.arange(0, BLOCK_K)
            a, b = _dw_operands(DZ, X, n, i, j, N, H, ld_dz, i_mask, j_mask)
            acc = tl.dot(tl.trans(a), b, acc)
    out = DW + (v0 + i).to(tl.int64)[:, None] * H + j[None, :]
    tl.store(out, acc.to(DW.dtype.element_ty), mask=i_mask[:, None] & j_mask[None, :])


@triton.jit
def _dx_operands(DZ, W, rows, k, j, V, H, v0, chunk_cols, ld_dz, row_mask, j_mask):
    k_mask = (k < chunk_cols) & (v0 + k < V)
    a = tl.load(DZ + rows.to(tl.int64)[:, None] * ld_dz + k[None, :],
                mask=row_mask[:, None] & k_mask[None, :], other=0.0)
    b = tl.load(W + (v0 + k).to(tl.int64)[:, None] * H + j[None, :],
                mask=k_mask[:, None] & j_mask[None, :], other=0.0)
    return a, b


@triton.jit
def _dx_kernel(DZ, W, ACC, LO, OUT, N, V, H, v0, chunk_cols, ld_dz,
               FIRST: tl.constexpr, LAST: tl.constexpr, SPLIT_BF16: tl.constexpr,
               CAST_OUT: tl.constexpr, IEEE: tl.constexpr, INNER: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # d_hidden[n, j] += sum_i DZ[n, i] * W[v0 + i, j]
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    j = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    j_mask = j < H
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if IEEE:
        # float32 inputs: one long chain of float32 adds over K = V loses ~sqrt(V) ulps
        # (2e-5 relative at V = 128256, 40x eager's cuBLAS error); partial sums over
        # INNER * BLOCK_K columns, then added up, keep it at eager's level.
        for k_outer in range(0, chunk_cols, BLOCK_K * INNER):
            part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for kk in range(0, INNER):
                k = k_outer + kk * BLOCK_K + tl.arange(0, BLOCK_K)
                a, b = _dx_operands(DZ, W, rows, k, j, V, H, v0, chunk_cols, ld_dz, row_mask,
                                    j_mask)
                part = tl.dot(a, b, part, input_precision="ieee")
            acc += part
    else:
        for k0 in range(0, chunk_cols, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            a, b = _dx_operands(DZ, W, rows, k, j, V, H, v0, chunk_cols, ld_dz, row_mask, j_mask)
            acc = tl.dot(a, b, acc)
    offs = rows.to(tl.int64)[:, None] * H + j[None, :]
    mask = row_mask[:, None] & j_mask[None, :]
    if SPLIT_BF16:
        # ACC is d_hidden viewed as int16 (high halves), LO the low halves of the float32 sums.
        if not FIRST:
            hi = tl.load(ACC + offs, mask=mask, other=0).to(tl.int32)
            lo = tl.load(LO + offs, mask=mask, other=0).to(tl.int32) & 0xFFFF
            acc += ((hi << 16) | lo).to(tl.float32, bitcast=True)
        if LAST:
            tl.store(ACC + offs, acc.to(tl.bfloat16).to(tl.int16, bitcast=True), mask=mask)
        else:
            bits = acc.to(tl.int32, bitcast=True)
            tl.store(ACC + offs, (bits >> 16).to(tl.int16), mask=mask)
            tl.store(LO + offs, (bits & 0xFFFF).to(tl.int16), mask=mask)
    else:
        if not FIRST:
            acc += tl.load(ACC + offs, mask=mask, other=0.0)
        if LAST and CAST_OUT:
            tl.store(OUT + offs, acc.to(OUT.dtype.element_ty), mask=mask)
        else:
            tl.store(ACC + offs, acc, mask=mask)


def chunk_columns(n_tokens: int, vocab_size: int, elem_bytes: int, block: int,
                  budget_bytes: int = DZ_CHUNK_BYTES) -> int:
    """Vocab columns per backward chunk: dz [N, cols] within budget, a multiple of `block`."""
    cols = budget_bytes // max(1, n_tokens * elem_bytes)
    cols = max(block, cols // block * block)
    return min(cols, triton.cdiv(vocab_size, block) * block)


def linear_ce_bwd(hidden, weight, bias, target, lse, d_lse, d_zt, d_zsum, softcap: float,
                  need_dh: bool, need_dw: bool, need_db: bool):
    n_tokens, hidden_size = hidden.shape
    vocab_size = weight.shape[0]
    dev, dtype = hidden.device, hidden.dtype
    empty = hidden.new_empty(0)  # placeholder argument; returned gradients never alias it
    need_db = need_db and bias is not None
    d_hidden = torch.empty_like(hidden) if need_dh else hidden.new_empty(0)
    d_weight = torch.empty_like(weight) if need_dw else hidden.new_empty(0)
    d_bias32 = torch.zeros(vocab_size, dtype=torch.float32, device=dev) if need_db else None
    d_bias = lambda: d_bias32.to(dtype) if need_db else hidden.new_empty(0)  # noqa: E731
    if n_tokens == 0 or not (need_dh or need_dw or need_db):
        d_weight.zero_()
        return d_hidden, d_weight, d_bias()
    bm, bn, bk, warps, stages = _blocks(dtype)
    cols = chunk_columns(n_tokens, vocab_size, hidden.element_size(), bn)
    dz = torch.empty((n_tokens, cols), dtype=dtype, device=dev)
    split = dtype == torch.bfloat16
    if need_dh:
        if split:
            acc, lo = d_hidden.view(torch.int16), torch.empty_like(d_hidden, dtype=torch.int16)
        elif dtype == torch.float32:
            acc, lo = d_hidden, empty
        else:
            acc, lo = torch.empty_like(d_hidden, dtype=torch.float32), empty
    ieee = dtype == torch.float32
    for v0 in range(0, vocab_size, cols):
        n_cols = min(cols, vocab_size - v0)
        _dz_kernel[(triton.cdiv(n_tokens, bm), triton.cdiv(n_cols, bn))](
            hidden, weight, bias if bias is not None else hidden, target, lse, d_lse, d_zt, d_zsum,
            dz, d_bias32 if need_db else lse, n_tokens, vocab_size, hidden_size, v0, n_cols, cols,
            float(softcap), HAS_BIAS=bias is not None, NEED_DB=need_db, SOFTCAP=bool(softcap),
            IEEE=ieee, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages)
        if need_dw:
            _dw_kernel[(triton.cdiv(n_cols, bm), triton.cdiv(hidden_size, bn))](
                dz, hidden, d_weight, n_tokens, vocab_size, hidden_size, v0, n_cols, cols,
                IEEE=ieee, INNER=16, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps,
                num_stages=stages)
        if need_dh:
            _dx_kernel[(triton.cdiv(n_tokens, bm), triton.cdiv(hidden_size, bn))](
                dz, weight, acc, lo, d_hidden, n_tokens, vocab_size, hidden_size, v0, n_cols, cols,
                FIRST=v0 == 0, LAST=v0 + cols >= vocab_size, SPLIT_BF16=split,
                CAST_OUT=dtype == torch.float16, IEEE=ieee, INNER=16, BLOCK_M=bm, BLOCK_N=bn,
                BLOCK_K=bk,
                num_warps=warps, num_stages=stages)
    return d_hidden, d_weight, d_bias()


# ----------------------------------------------------------------------------------------------
# Row kernels of the fast path (fusedops.linear_ce.chunked): the logits chunk z is materialised by
# cuBLAS; one program per row streams it in BLOCK-column pieces. Modes as in chunked.py:
# 1 MERGE (online log-sum-exp of this vocab chunk folded into m, s; zt, zsum accumulated),
# 2 DZ (z -> dz in place from the final lse), 3 FULL_DZ (whole rows: lse, zt, zsum, then dz; the
# second read of the row mostly hits L2), 4 FULL (whole rows, statistics only), 5 DZ_GRADS (as 2,
# for given gradients of the statistics: dz = w softmax(z) + zt onehot(target) + zsum, with W, ZT,
# ZS read as d_lse, d_zt, d_zsum).
# Otherwise dz = w * ((1 + 2 zl lse) softmax(z) - (1 - eps) onehot(target) - eps / V), times the
# softcap derivative 1 - (z / softcap)^2; w is the token's weight in the loss (0 when ignored).

@triton.jit
def _row_logits(Z, B, cols, mask, softcap, HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr):
    z = tl.load(Z + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        z += tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
    return _cap(z, softcap, SOFTCAP)


@triton.jit
def _ce_rows_kernel(Z, B, T, W, LSE, M, S, ZT, ZS, n_cols, col0, vocab, eps, zl, softcap,
                    MODE: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr,
                    BLOCK: tl.constexpr):
    row = tl.program_id(0)
    z_row = Z + row.to(tl.int64) * n_cols
    t = tl.load(T + row).to(tl.int64) - col0
    t_in = (t >= 0) & (t < n_cols)
    if MODE != 2 and MODE != 5:
        m = tl.max(tl.full((BLOCK,), -float("inf"), tl.float32), axis=0)
        s_vec = tl.zeros((BLOCK,), dtype=tl.float32)
        zs_vec = tl.zeros((BLOCK,), dtype=tl.float32)
        for c0 in range(0, n_cols, BLOCK):
            cols = c0 + tl.arange(0, BLOCK)
            mask = cols < n_cols
            z = _row_logits(z_row, B, cols, mask, softcap, HAS_BIAS, SOFTCAP)
            m_new = tl.maximum(m, tl.max(tl.where(mask, z, -float("inf")), axis=0))
            s_vec = s_vec * tl.exp2((m - m_new) * LOG2E) + tl.where(
                mask, tl.exp2((z - m_new) * LOG2E), 0.0)
            zs_vec += tl.where(mask, z, 0.0)
            m = m_new
        s = tl.sum(s_vec, axis=0)
        zs = tl.sum(zs_vec, axis=0)
        t_safe = tl.where(t_in, t, 0)
        zt = tl.where(t_in, tl.sum(_row_logits(z_row, B, t_safe + tl.arange(0, 1),
                                               tl.full((1,), 1, tl.int1), softcap, HAS_BIAS,
                                               SOFTCAP), axis=0), 0.0)
        if MODE == 1:
            m_old = tl.load(M + row)
            m_tot = tl.maximum(m_old, m)
            s_tot = (tl.load(S + row) * tl.exp2((m_old - m_tot) * LOG2E)
                     + s * tl.exp2((m - m_tot) * LOG2E))
            tl.store(M + row, m_tot)
            tl.store(S + row, s_tot)
            tl.store(ZT + row, tl.load(ZT + row) + zt)
            tl.store(ZS + row, tl.load(ZS + row) + zs)
        else:
            lse = m + tl.log2(s) / LOG2E
            tl.store(LSE + row, lse)
            tl.store(ZT + row, zt)
            tl.store(ZS + row, zs)
    if MODE == 2 or MODE == 3 or MODE == 5:
        if MODE != 3:  # MODE 3 keeps its own lse in registers (re-reading the store would race)
            lse = tl.load(LSE + row)
        w = tl.load(W + row)
        if MODE == 5:  # the gradients of the statistics, given
            d_lse = w
            d_zt = tl.load(ZT + row)
            d_zs = tl.load(ZS + row)
        else:
            d_lse = w * (1.0 + 2.0 * zl * lse)
            d_zt = -w * (1.0 - eps)
            d_zs = -w * eps / vocab
        for c0 in range(0, n_cols, BLOCK):
            cols = c0 + tl.arange(0, BLOCK)
            mask = cols < n_cols
            z = _row_logits(z_row, B, cols, mask, softcap, HAS_BIAS, SOFTCAP)
            dz = d_lse * tl.exp2((z - lse) * LOG2E) + d_zs + tl.where(cols == t, d_zt, 0.0)
            if SOFTCAP:
                zc = z / softcap
                dz = dz * (1.0 - zc * zc)
            tl.store(z_row + cols, dz.to(Z.dtype.element_ty), mask=mask)


def ce_rows(z, bias, target, col0: int, vocab: int, w, lse, m, s, zt, zsum, eps: float,
            zl: float, softcap: float, mode: int):
    """Runs the row kernel on z (rows, cols), contiguous; per-token arrays float32."""
    rows, n_cols = z.shape
    if rows == 0:
        return
    block = 64 if _interpreting() else min(4096, triton.next_power_of_2(n_cols))
    _ce_rows_kernel[(rows,)](
        z, bias if bias is not None else z, target, w, lse, m, s, zt, zsum, n_cols, col0, vocab,
        float(eps), float(zl), float(softcap), MODE=mode, HAS_BIAS=bias is not None,
        SOFTCAP=bool(softcap), BLOCK=block, num_warps=1 if _interpreting() else 8)


@triton.jit
def _scale_kernel(X, G, n, BLOCK: tl.constexpr):
    g = tl.load(G).to(tl.float32)
    if g != 1.0:  # the usual loss.backward(): nothing to do, decided on the device
        step = tl.num_programs(0).to(tl.int64) * BLOCK
        for start in range(tl.program_id(0).to(tl.int64) * BLOCK, n, step):
            offs = start + tl.arange(0, BLOCK)
            mask = offs < n
            x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
            tl.store(X + offs, (x * g).to(X.dtype.element_ty), mask=mask)


def scale_if_not_one(x, g):
    """x *= g in place (x contiguous); g a one-element tensor read on the device."""
    n = x.numel()
    block = 64 if _interpreting() else 4096
    grid = min(triton.cdiv(n, block), 1056)
    _scale_kernel[(grid,)](x, g, n, BLOCK=block, num_warps=1 if _interpreting() else 8)


# ----------------------------------------------------------------------------------------------
# Gradient filtering (fusedops.linear_ce.filtered): which BLOCK x BLOCK blocks of a dz chunk hold
# an entry above the token's threshold, and the d_hidden / d_weight products over those blocks
# only. Each output tile loops over its list of kept blocks (built on the device, no host sync).

@triton.jit
def _mask_kernel(DZ, THR, MASK, rows, cols, ld_dz, n_kb, BLOCK: tl.constexpr):
    rb = tl.program_id(0)
    kb = tl.program_id(1)
    r = rb * BLOCK + tl.arange(0, BLOCK)
    c = kb * BLOCK + tl.arange(0, BLOCK)
    rm = r < rows
    m = rm[:, None] & (c < cols)[None, :]
    a = tl.load(DZ + r.to(tl.int64)[:, None] * ld_dz + c[None, :], mask=m, other=0.0)
    thr = tl.load(THR + r, mask=rm, other=0.0)
    af = a.to(tl.float32)
    big = ((tl.abs(af) > thr[:, None]) | (af != af)) & m  # a NaN counts as large
    keep = tl.max(big.to(tl.int32), axis=1)
    tl.store(MASK + rb * n_kb + kb, tl.max(keep, axis=0).to(tl.int8))


@triton.jit
def _sparse_kernel(DZ, B, OUT, IDX, CNT, n_out, n_red, H, ld_dz, n_list, ACCUM: tl.constexpr,
                   DW: tl.constexpr, BLOCK: tl.constexpr, BH: tl.constexpr, BK: tl.constexpr):
    # OUT[o, j] (+)= sum over the kept blocks kb of output block ot: A[o, kb] @ B[kb, j], where
    # A = DZ for d_hidden (o a token, the sum over vocab columns) and DZ^T for d_weight (o a vocab
    # column, the sum over tokens). IDX[ot, :CNT[ot]] lists the kept blocks.
    ot = tl.program_id(0)
    o = ot * BLOCK + tl.arange(0, BLOCK)
    j = tl.program_id(1) * BH + tl.arange(0, BH)
    om = o < n_out
    jm = j < H
    cnt = tl.load(CNT + ot)
    acc = tl.zeros((BLOCK, BH), dtype=tl.float32)
    SUB: tl.constexpr = BLOCK // BK
    for t in range(0, cnt * SUB):  # one flat loop over (kept block, BK step): one pipeline
        kb = tl.load(IDX + ot * n_list + t // SUB)
        k = kb * BLOCK + (t % SUB) * BK + tl.arange(0, BK)
        km = k < n_red
        if DW:
            a = tl.trans(tl.load(DZ + k.to(tl.int64)[:, None] * ld_dz + o[None, :],
                                 mask=km[:, None] & om[None, :], other=0.0))
        else:
            a = tl.load(DZ + o.to(tl.int64)[:, None] * ld_dz + k[None, :],
                        mask=om[:, None] & km[None, :], other=0.0)
        b = tl.load(B + k.to(tl.int64)[:, None] * H + j[None, :],
                    mask=km[:, None] & jm[None, :], other=0.0)
        acc = tl.dot(a, b, acc)
    offs = o.to(tl.int64)[:, None] * H + j[None, :]
    m = om[:, None] & jm[None, :]
    if ACCUM:  # a tile with no kept block keeps its values: neither read nor written
        m = m & (tl.zeros_like(o) + cnt > 0)[:, None]  # (a tensor: the interpreter's masks)
        acc += tl.load(OUT + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(OUT + offs, acc.to(OUT.dtype.element_ty), mask=m)


@triton.jit
def _zero_blocks_kernel(DZ, MASK, rows, cols, ld_dz, n_kb, BLOCK: tl.constexpr):
    rb = tl.program_id(0)
    kb = tl.program_id(1)
    if tl.load(MASK + rb * n_kb + kb) == 0:
        r = rb * BLOCK + tl.arange(0, BLOCK)
        c = kb * BLOCK + tl.arange(0, BLOCK)
        m = (r < rows)[:, None] & (c < cols)[None, :]
        zero = tl.zeros((BLOCK, BLOCK), dtype=DZ.dtype.element_ty)
        tl.store(DZ + r.to(tl.int64)[:, None] * ld_dz + c[None, :], zero, mask=m)


@triton.jit
def _lists_kernel(MASK, IDX, CNT, n_len, s_list, s_elem, NP: tl.constexpr):
    # List l: the positions e < n_len of the nonzero entries MASK[l * s_list + e * s_elem], in
    # increasing order, into IDX[l, :CNT[l]] (the rest of the row is left as it is), NP entries
    # at a time: a prefix sum gives each kept entry its slot.
    lst = tl.program_id(0)
    base = 0
    for s in range(0, n_len, NP):
        e = s + tl.arange(0, NP)
        em = e < n_len
        keep = (tl.load(MASK + lst * s_list + e * s_elem, mask=em, other=0) != 0) & em
        k = keep.to(tl.int32)
        pos = base + tl.cumsum(k, axis=0) - 1
        tl.store(IDX + lst.to(tl.int64) * n_len + pos, e, mask=keep)
        base += tl.sum(k, axis=0)
    tl.store(CNT + lst, base)


def kept_lists(mask, dim: int):
    """(idx, cnt): per row of mask (dim=1) or per column (dim=0), the kept blocks' indices in
    increasing order in idx[l, :cnt[l]] (int32; entries past cnt[l] are unspecified), and their
    count. One launch: the filtered chunks are many at small budgets, and their time is the
    host's launch time."""
    n_r, n_k = mask.shape
    n_lists, n_len = (n_r, n_k) if dim == 1 else (n_k, n_r)
    s_list, s_elem = (n_k, 1) if dim == 1 else (1, n_k)
    idx = torch.empty(n_lists, n_len, dtype=torch.int32, device=mask.device)
    cnt = torch.empty(n_lists, dtype=torch.int32, device=mask.device)
    if n_lists and n_len:
        np2 = min(triton.next_power_of_2(n_len), 1024)
        _lists_kernel[(n_lists,)](mask.contiguous(), idx, cnt, n_len, s_list, s_elem, NP=np2,
                                  num_warps=4)
    else:
        cnt.zero_()
    return idx, cnt


def filter_mask(dz, thr, block: int):
    """(blocks of rows, blocks of columns) int8 mask of dz's kept blocks (filtered.block_mask)."""
    rows, cols = dz.shape
    nr, nk = triton.cdiv(rows, block), triton.cdiv(cols, block)
    mask = torch.empty(nr, nk, dtype=torch.int8, device=dz.device)
    if nr and nk:
        _mask_kernel[(nr, nk)](dz, thr.float().contiguous(), mask, rows, cols, dz.stride(0), nk,
                               BLOCK=block, num_warps=8)
    return mask


def zero_blocks(dz, mask, block: int):
    """Zeroes the blocks of dz (rows, cols; unit column stride) whose mask entry is 0."""
    rows, cols = dz.shape
    nr, nk = mask.shape
    if nr and nk:
        _zero_blocks_kernel[(nr, nk)](dz, mask, rows, cols, dz.stride(0), nk, BLOCK=block,
                                      num_warps=8)


_SPARSE_TILE = dict(BH=128, BK=64, num_warps=8, num_stages=3)


def _sparse_product(dz, b, out, accumulate: bool, mask, block: int, dw: bool):
    rows, cols = dz.shape
    n_out, n_red = (cols, rows) if dw else (rows, cols)
    hidden = b.shape[1]
    if n_out == 0:
        return
    idx, cnt = kept_lists(mask, 0 if dw else 1)
    grid = (triton.cdiv(n_out, block), triton.cdiv(hidden, _SPARSE_TILE["BH"]))
    _sparse_kernel[grid](dz, b, out, idx, cnt, n_out, n_red, hidden, dz.stride(0), idx.shape[1],
                         ACCUM=accumulate, DW=dw, BLOCK=block, **_SPARSE_TILE)


def sparse_dh(dz, w_chunk, out, accumulate: bool, mask, block: int):
    """out (+)= dz @ w_chunk over mask's kept blocks; out (rows, H) contiguous; with accumulate,
    a row block without a kept block is left as it is."""
    _sparse_product(dz, w_chunk, out, accumulate, mask, block, dw=False)


def sparse_dw(dz, x, out, accumulate: bool, mask, block: int):
    """out (+)= dz^T @ x over mask's kept blocks; out (cols, H) contiguous; with accumulate, a
    tile without a kept block is left as it is."""
    _sparse_product(dz, x, out, accumulate, mask, block, dw=True)
