"""Plain-PyTorch linear cross-entropy: the float64 oracle in tests and the CPU path.

Implements the same op contract as the Triton and CUDA backends:

* forward  (hidden[N,H], weight[V,H], bias[V]?, target[N], softcap) -> per-token
  lse, z_target (the target's logit, 0 when the target is outside [0, V)) and z_sum (sum of all V
  logits), where z = softcap * tanh((hidden @ weight.T + bias) / softcap) or the plain logits.
* backward (..., lse, d_lse, d_zt, d_zsum) -> d_hidden, d_weight, d_bias, from
  dz[i, j] = d_lse[i] * softmax(z)[i, j] + d_zt[i] * [j == target[i]] + d_zsum[i], times the
  softcap derivative 1 - (z / softcap)^2.

Tokens and vocabulary are processed in chunks of at most `chunk_elems` logits, so the full
[N, V] logits tensor never exists. Arithmetic runs in float32 (float64 for float64 inputs).
"""

from __future__ import annotations

import torch

# 2^23 float32 logits per chunk (32 MiB): large enough for cuBLAS to run near peak on the GPU,
# small next to the 4 GiB of float32 logits at the Llama-3 shape.
DEFAULT_CHUNK_ELEMS = 1 << 23


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _chunks(n_tokens: int, vocab_size: int, chunk_elems: int) -> tuple[int, int]:
    block_v = max(1, min(vocab_size, 8192, chunk_elems))
    block_n = max(1, min(max(n_tokens, 1), chunk_elems // block_v))
    return block_n, block_v


def _logits(h, w, b, softcap: float, cdt):
    z = h.to(cdt) @ w.to(cdt).T
    if b is not None:
        z = z + b.to(cdt)
    if softcap:
        z = torch.tanh(z / softcap) * softcap
    return z


def linear_ce_fwd(hidden, weight, bias, target, softcap: float,
                  chunk_elems: int = DEFAULT_CHUNK_ELEMS):
    n_tokens, vocab_size = hidden.shape[0], weight.shape[0]
    cdt = compute_dtype(hidden.dtype)
    lse = torch.empty(n_tokens, dtype=cdt, device=hidden.device)
    z_target = torch.zeros(n_tokens, dtype=cdt, device=hidden.device)
    z_sum = torch.zeros(n_tokens, dtype=cdt, device=hidden.device)
    block_n, block_v = _chunks(n_tokens, vocab_size, chunk_elems)
    tgt = target.long()
    for n0 in range(0, n_tokens, block_n):
        n1 = min(n0 + block_n, n_tokens)
        h = hidden[n0:n1]
        t = tgt[n0:n1]
        parts = []
        for v0 in range(0, vocab_size, block_v):
            v1 = min(v0 + block_v, vocab_size)
            z = _logits(h, weight[v0:v1], None if bias is None else bias[v0:v1], softcap, cdt)
            parts.append(torch.logsumexp(z, dim=1))
            z_sum[n0:n1] += z.sum(dim=1)
            inside = (t >= v0) & (t < v1)
            col = torch.where(inside, t - v0, 0)
            z_target[n0:n1] += torch.where(inside, z.gather(1, col[:, None])[:, 0], 0.0)
        lse[n0:n1] = torch.logsumexp(torch.stack(parts, dim=0), dim=0)
    return lse, z_target, z_sum


def linear_ce_bwd(hidden, weight, bias, target, lse, d_lse, d_zt, d_zsum, softcap: float,
                  need_dh: bool, need_dw: bool, need_db: bool,
                  chunk_elems: int = DEFAULT_CHUNK_ELEMS):
    n_tokens, vocab_size = hidden.shape[0], weight.shape[0]
    cdt = compute_dtype(hidden.dtype)
    dev = hidden.device
    d_hidden = torch.zeros(hidden.shape, dtype=cdt, device=dev) if need_dh else None
    d_bias = torch.zeros(vocab_size, dtype=cdt, device=dev) if (need_db and bias is not None) \
        else None
    d_weight = torch.empty(weight.shape, dtype=weight.dtype, device=dev) if need_dw else None
    block_n, block_v = _chunks(n_tokens, vocab_size, chunk_elems)
    tgt = target.long()
    lse_c, a_c, b_c, c_c = (x.to(cdt) for x in (lse, d_lse, d_zt, d_zsum))
    for v0 in range(0, vocab_size, block_v):
        v1 = min(v0 + block_v, vocab_size)
        w = weight[v0:v1]
        dw_acc = torch.zeros(w.shape, dtype=cdt, device=dev) if need_dw else None
        for n0 in range(0, n_tokens, block_n):
            n1 = min(n0 + block_n, n_tokens)
            h = hidden[n0:n1]
            z = _logits(h, w, None if bias is None else bias[v0:v1], softcap, cdt)
            dz = torch.exp(z - lse_c[n0:n1, None]) * a_c[n0:n1, None] + c_c[n0:n1, None]
            t = tgt[n0:n1]
            inside = (t >= v0) & (t < v1)
            col = torch.where(inside, t - v0, 0)[:, None]
            dz.scatter_add_(1, col, torch.where(inside, b_c[n0:n1], 0.0)[:, None])
            if softcap:
                dz = dz * (1.0 - (z / softcap) ** 2)
            if need_dh:
                d_hidden[n0:n1] += dz @ w.to(cdt)
            if need_dw:
                dw_acc += dz.T @ h.to(cdt)
            if d_bias is not None:
                d_bias[v0:v1] += dz.sum(dim=0)
        if need_dw:
            d_weight[v0:v1] = dw_acc.to(weight.dtype)
    # Gradients not asked for are distinct empty tensors (op outputs must not alias).
    return (
        d_hidden.to(hidden.dtype) if need_dh else hidden.new_empty(0),
        d_weight if need_dw else hidden.new_empty(0),
        d_bias.to(bias.dtype) if d_bias is not None else hidden.new_empty(0),
    )
