"""Plain-PyTorch exact attention over packed sequences: the float64 oracle and the CPU path.

Op contract shared with the Triton backend (all tensors packed, "varlen" form):
  q (total_q, Hq, D), k and v (total_k, Hkv, D), int32 cu_seqlens_q / cu_seqlens_k (batch + 1).
  forward -> out (total_q, Hq, D) and lse (Hq, total_q) float32 (float64 for float64 inputs).
Within sequence b, with Lq and Lk its lengths and off = Lk - Lq (bottom-right alignment), query i
sees key j when j <= i + off + right (right = 0 when causal) and, for left >= 0,
j >= i + off - left. Scores are scale * q.k, then softcap * tanh(s / softcap) when softcap > 0.
A query that sees no key gets out = 0 and lse = -inf (zero gradients).
Works through query blocks so memory is O(block * Lk), never O(Lq * Lk).
"""

from __future__ import annotations

import torch

BLOCK_Q = 256


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def visible(i0: int, i1: int, lq: int, lk: int, causal: bool, left: int, right: int, device):
    """Boolean mask [i1 - i0, lk] of the keys each query row sees."""
    off = lk - lq
    i = torch.arange(i0, i1, device=device)[:, None]
    j = torch.arange(lk, device=device)[None, :]
    right = 0 if causal else right
    mask = torch.ones(i1 - i0, lk, dtype=torch.bool, device=device)
    if right >= 0:
        mask &= j <= i + off + right
    if left >= 0:
        mask &= j >= i + off - left
    return mask


def _scores(qb, kh, scale, softcap):
    """qb [Hq, m, D], kh [Hq, Lk, D] -> raw capped scores and tanh (for the backward)."""
    s = torch.matmul(qb, kh.transpose(1, 2)) * scale
    if softcap:
        t = torch.tanh(s / softcap)
        return t * softcap, t
    return s, None


def _seq_bounds(cu_q, cu_k):
    """[(q_start, q_end, k_start, k_end)] per sequence (one host synchronisation)."""
    cq, ck = cu_q.tolist(), cu_k.tolist()
    return [(cq[b], cq[b + 1], ck[b], ck[b + 1]) for b in range(len(cq) - 1)]


def attention_fwd(q, k, v, cu_q, cu_k, scale: float, causal: bool, left: int, right: int,
                  softcap: float):
    hq, hkv = q.shape[1], k.shape[1]
    group = hq // hkv
    cdt = compute_dtype(q.dtype)
    out = torch.zeros(q.shape, dtype=cdt, device=q.device)
    lse = torch.full((hq, q.shape[0]), float("-inf"), dtype=cdt, device=q.device)
    for q0, q1, k0, k1 in _seq_bounds(cu_q, cu_k):
        lq, lk = q1 - q0, k1 - k0
        if lq == 0 or lk == 0:
            continue
        kh = k[k0:k1].to(cdt).transpose(0, 1).repeat_interleave(group, 0)  # [Hq, Lk, D]
        vh = v[k0:k1].to(cdt).transpose(0, 1).repeat_interleave(group, 0)
        for i0 in range(0, lq, BLOCK_Q):
            i1 = min(i0 + BLOCK_Q, lq)
            qb = q[q0 + i0:q0 + i1].to(cdt).transpose(0, 1)  # [Hq, m, D]
            s, _ = _scores(qb, kh, scale, softcap)
            mask = visible(i0, i1, lq, lk, causal, left, right, q.device)
            s = s.masked_fill(~mask, float("-inf"))
            row_lse = torch.logsumexp(s, dim=-1)  # -inf where nothing is visible
            p = torch.exp(s - row_lse.masked_fill(row_lse == float("-inf"), 0.0)[..., None])
            out[q0 + i0:q0 + i1] = torch.matmul(p, vh).transpose(0, 1)
            lse[:, q0 + i0:q0 + i1] = row_lse
    return out.to(q.dtype), lse


def attention_bwd(q, k, v, out, lse, dout, cu_q, cu_k, scale: float, causal: bool, left: int,
                  right: int, softcap: float):
    hq, hkv = q.shape[1], k.shape[1]
    group = hq // hkv
    cdt = compute_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=cdt, device=q.device)
    dk = torch.zeros(k.shape, dtype=cdt, device=q.device)
    dv = torch.zeros(v.shape, dtype=cdt, device=q.device)
    delta = (dout.to(cdt) * out.to(cdt)).sum(-1).transpose(0, 1)  # [Hq, total_q]
    lse = lse.to(cdt)
    for q0, q1, k0, k1 in _seq_bounds(cu_q, cu_k):
        lq, lk = q1 - q0, k1 - k0
        if lq == 0 or lk == 0:
            continue
        kh = k[k0:k1].to(cdt).transpose(0, 1).repeat_interleave(group, 0)
        vh = v[k0:k1].to(cdt).transpose(0, 1).repeat_interleave(group, 0)
        dkh = torch.zeros_like(kh)
        dvh = torch.zeros_like(vh)
        for i0 in range(0, lq, BLOCK_Q):
            i1 = min(i0 + BLOCK_Q, lq)
            qb = q[q0 + i0:q0 + i1].to(cdt).transpose(0, 1)
            dob = dout[q0 + i0:q0 + i1].to(cdt).transpose(0, 1)
            s, t = _scores(qb, kh, scale, softcap)
            mask = visible(i0, i1, lq, lk, causal, left, right, q.device)
            row_lse = lse[:, q0 + i0:q0 + i1]
            safe = row_lse.masked_fill(row_lse == float("-inf"), float("inf"))
            p = torch.exp(s - safe[..., None]).masked_fill(~mask, 0.0)
            dvh += torch.matmul(p.transpose(1, 2), dob)
            dp = torch.matmul(dob, vh.transpose(1, 2))
            ds = p * (dp - delta[:, q0 + i0:q0 + i1, None])
            if softcap:
                ds = ds * (1.0 - t * t)
            dq[q0 + i0:q0 + i1] = (torch.matmul(ds, kh) * scale).transpose(0, 1)
            dkh += torch.matmul(ds.transpose(1, 2), qb) * scale
        # Heads of one GQA group share k and v: sum their gradients.
        dk[k0:k1] = dkh.view(hkv, group, lk, -1).sum(1).transpose(0, 1)
        dv[k0:k1] = dvh.view(hkv, group, lk, -1).sum(1).transpose(0, 1)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
