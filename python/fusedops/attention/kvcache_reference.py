"""Plain-PyTorch attention over a KV cache: the float64 oracle of attention_decode and its CPU path.

Op contract shared with the Triton backend (the cache is already appended to):
  q (B, Sq, Hq, D); k_cache and v_cache (B, S_max, Hkv, D), or paged (num_pages, page_size, Hkv, D)
  with an int32 page_table (B, max_pages) whose row b maps logical key p of sequence b to
  page_table[b, p // page_size], slot p % page_size; seqlens_k int32 (B,) the number of keys of
  each sequence. Returns out (B, Sq, Hq, D) in q's dtype and lse (B, Hq, Sq) float32 (float64 for
  float64 inputs). Query i of sequence b sits at position i + off, off = seqlens_k[b] - Sq
  (bottom-right alignment), and sees key j < seqlens_k[b] when j <= i + off + right (right = 0
  when causal) and, for left >= 0, j >= i + off - left. Scores are scale * q.k, then
  softcap * tanh(s / softcap) when softcap > 0. A query that sees no key gets out = 0, lse = -inf.

Everything is masked on the device over the cache's full capacity, in key chunks merged by their
log-sum-exp (exact), so there is no host synchronisation and memory is O(chunk), not O(S_max).
Page table entries of pages past a sequence's length are never read for keys that are used (they
are clamped into range before the gather and masked out).
"""

from __future__ import annotations

import torch

CHUNK_K = 2048  # keys per chunk: (B, Hq, Sq, CHUNK_K) scores at a time


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def capacity(k_cache: torch.Tensor, page_table: torch.Tensor | None) -> int:
    """How many keys a sequence can hold: S_max, or max_pages * page_size."""
    if page_table is None:
        return k_cache.shape[1]
    return page_table.shape[1] * k_cache.shape[1]


def gather_keys(cache, page_table, batch: int, j0: int, j1: int):
    """Logical keys [j0, j1) of every sequence: (B, j1 - j0, Hkv, D)."""
    if page_table is None:
        return cache[:batch, j0:j1]
    page_size = cache.shape[1]
    j = torch.arange(j0, j1, device=cache.device)
    pages = page_table[:, j // page_size].long().clamp_(0, cache.shape[0] - 1)  # (B, n)
    return cache[pages, (j % page_size)[None, :].expand_as(pages)]


def decode_fwd(q, k_cache, v_cache, seqlens_k, page_table, scale: float, causal: bool,
               left: int, right: int, softcap: float):
    batch, sq, hq, head_dim = q.shape
    hkv = k_cache.shape[2]
    group = hq // hkv
    cdt = compute_dtype(q.dtype)
    cap = capacity(k_cache, page_table)
    qg = q.to(cdt).view(batch, sq, hkv, group, head_dim)
    out = torch.zeros(batch, sq, hkv, group, head_dim, dtype=cdt, device=q.device)
    lse = torch.full((batch, hkv, group, sq), float("-inf"), dtype=cdt, device=q.device)
    lens = seqlens_k.to(torch.long).view(batch, 1, 1)
    i = torch.arange(sq, device=q.device).view(1, sq, 1)
    pos = i + lens - sq  # (B, Sq, 1): each query's position among the keys
    right = 0 if causal else right
    for j0 in range(0, cap, CHUNK_K):
        j1 = min(cap, j0 + CHUNK_K)
        kc = gather_keys(k_cache, page_table, batch, j0, j1).to(cdt)  # (B, n, Hkv, D)
        vc = gather_keys(v_cache, page_table, batch, j0, j1).to(cdt)
        s = torch.einsum("bqhgd,bkhd->bhgqk", qg, kc) * scale
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        j = torch.arange(j0, j1, device=q.device).view(1, 1, -1)
        mask = j < lens  # (B, Sq, n)
        if right >= 0:
            mask = mask & (j <= pos + right)
        if left >= 0:
            mask = mask & (j >= pos - left)
        s = s.masked_fill(~mask[:, None, None], float("-inf"))
        lse_c = torch.logsumexp(s, dim=-1)  # (B, Hkv, G, Sq), -inf where nothing is visible
        p = torch.exp(s - lse_c.masked_fill(lse_c == float("-inf"), 0.0)[..., None])
        out_c = torch.einsum("bhgqk,bkhd->bqhgd", p, vc)  # normalised within the chunk
        new = torch.logaddexp(lse, lse_c)
        safe = new.masked_fill(new == float("-inf"), 0.0)
        w_old = torch.exp(lse - safe).permute(0, 3, 1, 2)[..., None]  # (B, Sq, Hkv, G, 1)
        w_new = torch.exp(lse_c - safe).permute(0, 3, 1, 2)[..., None]
        out = out * w_old + out_c * w_new
        lse = new
    return (out.view(batch, sq, hq, head_dim).to(q.dtype),
            lse.view(batch, hq, sq))
