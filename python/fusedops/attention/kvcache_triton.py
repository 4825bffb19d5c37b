"""Triton split-KV (flash-decoding) kernels for attention over a KV cache, contiguous or paged.

Same op contract as fusedops.attention.kvcache_reference. One program per (split, KV head,
sequence): its query tile is the whole GQA group of that KV head for all Sq queries (row
r = query (r // G), head kvh * G + r % G), so each key block is loaded once for the group. A
sequence's visible keys [lo, L) (lo > 0 only with a left window) are cut into num_splits parts of
whole key blocks, computed in the kernel from the length on the device; a split with no keys
writes lse = -inf. Each split writes its normalised partial output and lse (float32); the combine
kernel weights the splits by exp(lse_s - lse) (rows that saw nothing: zeros, lse -inf). With
one split the partial kernel writes the output directly. Groups of more than MAX_BLOCK_M rows
(G * Sq: many query heads per KV head, or long speculative steps) are cut into blocks of rows,
each its own program (the KV head's keys are then read once per block).

Paged caches: each key's page is read from the page table (any page size, keys of one block may
span pages); page numbers are clamped into [0, num_pages) and lengths to the capacity, so bad
values cannot fault (the Python API checks them on request). No host synchronisation: the grid is
sized from static shapes, so a decode step can be captured in a CUDA graph.
Constraints: head dim <= 256 (padded to a power of two with masks); last dimension contiguous;
64-bit offsets into the cache.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from fusedops._triton import INTERPRET, LOG2E, scores_log2
from fusedops.attention.kvcache import num_splits_heuristic, sm_count


@triton.jit
def _row_offsets(rows, b, kvh, GROUP: tl.constexpr, stride_b, stride_s, stride_h):
    """Offsets of tile rows (query r // G, head kvh * G + r % G) in a (B, Sq, Hq, D) tensor."""
    qi = rows // GROUP
    h = kvh * GROUP + rows % GROUP
    return b.to(tl.int64) * stride_b + qi.to(tl.int64) * stride_s + h.to(tl.int64) * stride_h


@triton.jit
def _kv_offsets(start_n, cols, keep, b, PT, stride_pt, page_size, num_pages, stride_kb,
                stride_ks, stride_vb, stride_vs, PAGED: tl.constexpr, PAGE_BLOCK: tl.constexpr):
    """Offsets of the K and V rows of logical keys `cols` (= start_n + 0..BLOCK_N-1) of sequence
    b in the caches. Paged: each key's page from the table (one read serves K and V), or with
    PAGE_BLOCK (the page size a multiple of BLOCK_N, so that the block lies in one page) one
    scalar read for the block; page numbers clamped into [0, num_pages)."""
    if PAGED:
        if PAGE_BLOCK:
            page = tl.load(PT + b.to(tl.int64) * stride_pt + start_n // page_size)
            slot = (start_n % page_size + cols - start_n).to(tl.int64)
        else:
            page = tl.load(PT + b.to(tl.int64) * stride_pt + cols // page_size, mask=keep,
                           other=0)
            slot = (cols % page_size).to(tl.int64)
        page = tl.minimum(tl.maximum(page, 0), num_pages - 1).to(tl.int64)
        return page * stride_kb + slot * stride_ks, page * stride_vb + slot * stride_vs
    else:
        c = cols.to(tl.int64)
        b64 = b.to(tl.int64)
        return b64 * stride_kb + c * stride_ks, b64 * stride_vb + c * stride_vs


@triton.jit
def _partial_kernel(Q, K, V, SEQLENS, PT, OUT, LSE, OUT_P, LSE_P,
                    sm_scale, softcap, left, right, sq, n_mb, capacity, page_size, num_pages,
                    stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh,
                    stride_vb, stride_vs, stride_vh, stride_ob, stride_os, stride_oh, stride_pt,
                    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_LEFT: tl.constexpr,
                    HAS_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr, IEEE: tl.constexpr,
                    PAGED: tl.constexpr, PAGE_BLOCK: tl.constexpr, FINAL: tl.constexpr,
                    GDC_WAIT: tl.constexpr, GDC_LAUNCH: tl.constexpr):
    # GDC_WAIT: launched as a programmatic dependent of the kernel before it, so nothing that
    # kernel may write (q, the caches, the lengths) is read before its grid has completed.
    if GDC_WAIT:
        tl.extra.cuda.gdc_wait()
    # torch.compile's traced launch passes Python floats as float64 scalars: the softmax's
    # loop-carried statistics stay float32 only if the scalars are cast here.
    sm_scale = tl.cast(sm_scale, tl.float32)
    softcap = tl.cast(softcap, tl.float32)
    split = tl.program_id(0)
    kvh = tl.program_id(1) // n_mb
    mb = tl.program_id(1) % n_mb
    b = tl.program_id(2)
    n_splits = tl.num_programs(0)
    n_kv = tl.num_programs(1) // n_mb
    batch = tl.num_programs(2)
    m = GROUP * sq
    rows = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < m
    qi = rows // GROUP
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    q = tl.load(Q + _row_offsets(rows, b, kvh, GROUP, stride_qb, stride_qs, stride_qh)[:, None]
                + offs_d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    lk = tl.minimum(tl.load(SEQLENS + b), capacity)
    off = lk - sq  # query i sits at position i + off
    lo = 0
    if HAS_LEFT:
        lo = tl.maximum(0, off - left)
        lo = (lo // BLOCK_N) * BLOCK_N
    span = tl.maximum(lk - lo, 0)
    chunk = tl.cdiv(tl.cdiv(span, n_splits), BLOCK_N) * BLOCK_N
    s_lo = lo + split * chunk
    s_hi = tl.minimum(lk, s_lo + chunk)
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in range(s_lo, s_hi, BLOCK_N):
        cols = start_n + offs_n
        keep = cols < s_hi
        koff, voff = _kv_offsets(start_n, cols, keep, b, PT, stride_pt, page_size, num_pages,
                                 stride_kb, stride_ks, stride_vb, stride_vs, PAGED, PAGE_BLOCK)
        k = tl.load(K + koff[:, None] + kvh.to(tl.int64) * stride_kh + offs_d[None, :],
                    mask=keep[:, None] & d_ok[None, :], other=0.0)
        s = scores_log2(q, k, sm_scale, softcap, SOFTCAP, IEEE)  # log2 units from here on
        valid = row_ok[:, None] & keep[None, :]
        if HAS_RIGHT:
            valid &= cols[None, :] <= qi[:, None] + off + right
        if HAS_LEFT:
            valid &= cols[None, :] >= qi[:, None] + off - left
        s = tl.where(valid, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw nothing yet
        p = tl.exp2(s - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        v = tl.load(V + voff[:, None] + kvh.to(tl.int64) * stride_vh + offs_d[None, :],
                    mask=keep[:, None] & d_ok[None, :], other=0.0)
        if IEEE:
            acc = tl.dot(p.to(v.dtype), v, acc, input_precision="ieee")
        else:
            acc = tl.dot(p.to(v.dtype), v, acc)
        m_i = m_new
    # GDC_LAUNCH: the combine kernel (a programmatic dependent) may start launching once every
    # program is here; it waits for this grid's completion before reading the partials.
    if GDC_LAUNCH:
        tl.extra.cuda.gdc_launch_dependents()
    seen = l_i > 0.0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) / LOG2E, float("-inf"))
    if FINAL:
        o_ptrs = OUT + _row_offsets(rows, b, kvh, GROUP, stride_ob, stride_os, stride_oh)
        tl.store(o_ptrs[:, None] + offs_d[None, :], out.to(OUT.dtype.element_ty),
                 mask=row_ok[:, None] & d_ok[None, :])
        h = kvh * GROUP + rows % GROUP
        tl.store(LSE + (b.to(tl.int64) * n_kv * GROUP + h) * sq + qi, lse, mask=row_ok)
    else:
        base = ((split.to(tl.int64) * batch + b) * n_kv + kvh) * m + rows
        tl.store(OUT_P + base[:, None] * HEAD_DIM + offs_d[None, :], out,
                 mask=row_ok[:, None] & d_ok[None, :])
        tl.store(LSE_P + base, lse, mask=row_ok)


@triton.jit
def _combine_kernel(OUT_P, LSE_P, OUT, LSE, n_splits, sq, n_mb, stride_ob, stride_os,
                    stride_oh, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_MC: tl.constexpr, BLOCK_S: tl.constexpr,
                    BLOCK_DC: tl.constexpr, GDC_WAIT: tl.constexpr):
    # One program per (rows of a KV head's group, sequence, BLOCK_DC columns of the head dim);
    # BLOCK_MC covers the real rows of its BLOCK_M. The splits are read BLOCK_S at a time as
    # one [splits, rows, columns] tile together with their lse, merged by a running maximum
    # (one pass), so a call costs one dependent memory round trip per BLOCK_S splits.
    if GDC_WAIT:  # a programmatic dependent of the partial kernel: wait for its grid
        tl.extra.cuda.gdc_wait()
    kvh = tl.program_id(0) // n_mb
    mb = tl.program_id(0) % n_mb
    b = tl.program_id(1)
    dc = tl.program_id(2)
    n_kv = tl.num_programs(0) // n_mb
    batch = tl.num_programs(1)
    m = GROUP * sq
    rows = mb * BLOCK_M + tl.arange(0, BLOCK_MC)
    row_ok = rows < m
    offs_d = dc * BLOCK_DC + tl.arange(0, BLOCK_DC)
    d_ok = offs_d < HEAD_DIM
    m_i = tl.full((BLOCK_MC,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_MC,), tl.float32)
    acc = tl.zeros((BLOCK_MC, BLOCK_DC), tl.float32)
    for s0 in range(0, n_splits, BLOCK_S):
        offs_s = s0 + tl.arange(0, BLOCK_S)
        base = ((offs_s[:, None] * batch + b).to(tl.int64) * n_kv + kvh) * m + rows[None, :]
        ok = (offs_s[:, None] < n_splits) & row_ok[None, :]
        lse_s = tl.load(LSE_P + base, mask=ok, other=float("-inf"))
        o = tl.load(OUT_P + base[:, :, None] * HEAD_DIM + offs_d[None, None, :],
                    mask=ok[:, :, None] & d_ok[None, None, :], other=0.0)
        m_new = tl.maximum(m_i, tl.max(lse_s, 0))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows no split saw so far
        alpha = tl.exp(m_i - m_use)
        w = tl.exp(lse_s - m_use[None, :])
        l_i = l_i * alpha + tl.sum(w, 0)
        acc = acc * alpha[:, None] + tl.sum(o * w[:, :, None], 0)
        m_i = m_new
    seen = l_i > 0.0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    o_ptrs = OUT + _row_offsets(rows, b, kvh, GROUP, stride_ob, stride_os, stride_oh)
    tl.store(o_ptrs[:, None] + offs_d[None, :], out.to(OUT.dtype.element_ty),
             mask=row_ok[:, None] & d_ok[None, :])
    if dc == 0:
        lse = tl.where(seen, m_i + tl.log(tl.where(seen, l_i, 1.0)), float("-inf"))
        qi = rows // GROUP
        h = kvh * GROUP + rows % GROUP
        tl.store(LSE + (b.to(tl.int64) * n_kv * GROUP + h) * sq + qi, lse, mask=row_ok)


# Rows of one program's query tile: 64 rows x 128 columns of float32 accumulator is 64
# registers a thread at 4 warps. 16 under the interpreter, so that the CPU tests cut groups.
MAX_BLOCK_M = 16 if INTERPRET else 64


def _config(head_dim: int, dtype: torch.dtype, paged: bool, programs: int, sms: int):
    """(BLOCK_N, warps, stages) for `programs` (split, KV head, row block, sequence) programs
    before splitting. From the H200 sweeps (benchmarks/results/attention_decode.jsonl, rows with
    config; bf16, D=128, page 64): 64-key blocks and 4 warps, with 2 stages once the programs
    fill the GPU (batch 64: 1.00-1.03 of the copy bandwidth, against 0.87-0.89 with 3 stages)
    and 3 when a sequence's few programs each stream a long split (batch 1, 32k keys,
    contiguous: 0.78-0.81 against 0.70-0.73; paged: no difference); 128-key blocks with 8 warps
    on paged caches whose programs fill the GPU (batch 64: 0.96-0.98, against 0.76-0.77 with 64
    keys); 32 keys above D=128 or in float32, whose tiles are larger."""
    if INTERPRET:
        return 16, 1, 1
    if head_dim > 128 or dtype == torch.float32:
        return 32, 4, 2
    if programs >= sms:
        return (128, 8, 2) if paged else (64, 4, 2)
    return 64, 4, (3 if 4 * programs <= sms else 2)


def _per_sm(stages: int, paged: bool) -> int:
    """Programs of the partial kernel that one SM holds at once, for the split heuristic: 4 with
    two stages, 2 with three (the waves that the H200 sweeps' timings show: 512 and 264 programs
    at 132 SMs; registers and shared memory bound them). Paged caches count 4 either way: at
    batch 1 their page-table reads want the programs of 64 splits in flight (H200, 8k / 32k /
    128k keys: 64 splits 0.51 / 0.81 / 0.97 of the copy bandwidth, 33 splits 0.47 / 0.74 /
    0.87)."""
    return 4 if stages == 2 or paged else 2


def _launch_pdl_supported() -> bool:
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    return "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {})


_PDL_OPTION = not INTERPRET and _launch_pdl_supported()


def _pdl_mode(device: torch.device) -> int:
    """Programmatic dependent launch (compute capability 9.0 and later): 1 (the default) launches
    the combine kernel as a dependent of the partial kernel, so that its launch overlaps the
    partial kernel's last programs; 2 also launches the partial kernel as a dependent of the
    kernel before it on the stream (for measurement: that gains only where the kernel before
    releases its dependents early); 0 neither. FUSEDOPS_ATTN_DECODE_PDL, read at each call.
    Off under the interpreter, under torch.compile (its traced launch takes no launch_pdl),
    where Triton has no launch_pdl option, and below compute capability 9.0."""
    mode = os.environ.get("FUSEDOPS_ATTN_DECODE_PDL", "1")
    if mode not in ("0", "1", "2"):
        raise ValueError(f"FUSEDOPS_ATTN_DECODE_PDL={mode!r}: expected 0, 1 or 2")
    if (mode == "0" or not _PDL_OPTION or torch.compiler.is_compiling()
            or torch.cuda.get_device_capability(device)[0] < 9):
        return 0
    return int(mode)


def decode_fwd(q, k_cache, v_cache, seqlens_k, page_table, scale: float, causal: bool,
               left: int, right: int, softcap: float, num_splits: int | None = None):
    batch, sq, hq, head_dim = q.shape
    hkv = k_cache.shape[2]
    group = hq // hkv
    paged = page_table is not None
    cap = page_table.shape[1] * k_cache.shape[1] if paged else k_cache.shape[1]
    m = group * sq
    block_m = max(16, min(MAX_BLOCK_M, triton.next_power_of_2(m)))
    n_mb = triton.cdiv(m, block_m)
    sms = sm_count(q.device)
    block_n, warps, stages = _config(head_dim, q.dtype, paged, batch * hkv * n_mb, sms)
    if num_splits is None:
        num_splits = num_splits_heuristic(batch, hkv * n_mb, cap, sms, block_n,
                                          per_sm=_per_sm(stages, paged))
    out = torch.empty_like(q) if q.is_contiguous() else torch.empty(
        q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((batch, hq, sq), dtype=torch.float32, device=q.device)
    right = 0 if causal else right
    final = num_splits == 1
    if final:
        out_p = lse_p = lse  # unused
    else:
        out_p = torch.empty((num_splits, batch, hkv, m, head_dim), dtype=torch.float32,
                            device=q.device)
        lse_p = torch.empty((num_splits, batch, hkv, m), dtype=torch.float32, device=q.device)
    pt = page_table if paged else seqlens_k  # a placeholder pointer when contiguous
    pdl = _pdl_mode(q.device)
    pdl_partial = dict(launch_pdl=True) if pdl == 2 else {}
    block_d = max(16, triton.next_power_of_2(head_dim))
    meta = dict(GROUP=group, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=block_m)
    _partial_kernel[(num_splits, hkv * n_mb, batch)](
        q, k_cache, v_cache, seqlens_k, pt, out, lse, out_p, lse_p, float(scale), float(softcap),
        max(left, 0), max(right, 0), sq, n_mb, cap, k_cache.shape[1], k_cache.shape[0],
        q.stride(0), q.stride(1), q.stride(2), k_cache.stride(0), k_cache.stride(1),
        k_cache.stride(2), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        out.stride(0), out.stride(1), out.stride(2), pt.stride(0),
        BLOCK_N=block_n, HAS_LEFT=left >= 0, HAS_RIGHT=right >= 0, SOFTCAP=bool(softcap),
        IEEE=q.dtype == torch.float32, PAGED=paged,
        PAGE_BLOCK=paged and k_cache.shape[1] % block_n == 0, FINAL=final, GDC_WAIT=pdl == 2,
        GDC_LAUNCH=pdl > 0 and not final, num_warps=warps, num_stages=stages, **pdl_partial,
        **meta)
    if not final:
        block_dc = min(block_d, 32)
        block_mc = min(block_m, max(2, triton.next_power_of_2(m)))
        # about 8192 partial-output elements a load (64 a thread at 4 warps): one pass over up
        # to 64 splits of a 4-row group (batch 1, 4:1 GQA)
        block_s = max(1, min(triton.next_power_of_2(num_splits), 8192 // (block_mc * block_dc)))
        _combine_kernel[(hkv * n_mb, batch, block_d // block_dc)](
            out_p, lse_p, out, lse, num_splits, sq, n_mb, out.stride(0), out.stride(1),
            out.stride(2), GROUP=group, HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_MC=block_mc,
            BLOCK_S=block_s, BLOCK_DC=block_dc, GDC_WAIT=pdl > 0,
            num_warps=1 if INTERPRET else 4, **(dict(launch_pdl=True) if pdl else {}))
    return out, lse
