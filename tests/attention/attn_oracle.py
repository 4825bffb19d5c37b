"""Oracle rule for attention tests: error against the float64 reference <= 2x the error of plain
PyTorch attention in the same dtype (scores and p @ v in that dtype, softmax in float32) + slack."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fusedops.attention import attention
from fusedops.attention.reference import visible

SLACK = {torch.float32: 2e-6, torch.float16: 1e-4, torch.bfloat16: 1e-4, torch.float64: 1e-12}


@dataclass
class Case:
    batch: int
    seq_q: int
    seq_k: int
    heads_q: int
    heads_kv: int
    head_dim: int
    dtype: torch.dtype
    device: str
    causal: bool = False
    window: tuple = (-1, -1)
    softcap: float | None = None
    varlen: bool = False
    seed: int = 0
    lens: tuple | None = None  # varlen: explicit (lens_q, lens_k) instead of the three below

    def kwargs(self):
        return dict(causal=self.causal, window_size=self.window, softcap=self.softcap)


def make_inputs(c: Case):
    g = torch.Generator().manual_seed(c.seed)
    if c.varlen:  # three sequences: full, a shorter one with Sq != Sk, and a tiny one
        lens_q = [c.seq_q, max(1, c.seq_q // 2), 1]
        lens_k = [c.seq_k, max(1, c.seq_k // 3 + 1), 5]
        if c.lens is not None:
            lens_q, lens_k = list(c.lens[0]), list(c.lens[1])
        tq, tk = sum(lens_q), sum(lens_k)
        q = torch.randn(tq, c.heads_q, c.head_dim, generator=g)
        k = torch.randn(tk, c.heads_kv, c.head_dim, generator=g)
        v = torch.randn(tk, c.heads_kv, c.head_dim, generator=g)
        cu_q = torch.tensor([0] + list(torch.tensor(lens_q).cumsum(0)), dtype=torch.int32)
        cu_k = torch.tensor([0] + list(torch.tensor(lens_k).cumsum(0)), dtype=torch.int32)
        extra = dict(cu_seqlens_q=cu_q.to(c.device), cu_seqlens_k=cu_k.to(c.device),
                     max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k))
    else:
        q = torch.randn(c.batch, c.seq_q, c.heads_q, c.head_dim, generator=g)
        k = torch.randn(c.batch, c.seq_k, c.heads_kv, c.head_dim, generator=g)
        v = torch.randn(c.batch, c.seq_k, c.heads_kv, c.head_dim, generator=g)
        extra = {}
    dout = torch.randn(q.shape, generator=g)
    dev = lambda t: t.to(c.device)  # noqa: E731
    return dict(q=dev(q), k=dev(k), v=dev(v), dout=dev(dout), extra=extra)


def eager_attention(q, k, v, *, causal, window_size, softcap, cu_seqlens_q=None,
                    cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None):
    """Materialised attention in the input dtype; returns (out, lse) in the API's layouts."""
    if cu_seqlens_q is None:
        outs, lses = [], []
        for b in range(q.shape[0]):
            o, lse = _eager_one(q[b], k[b], v[b], causal, window_size, softcap)
            outs.append(o)
            lses.append(lse)
        return torch.stack(outs), torch.stack(lses)
    outs, lses = [], []
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for b in range(len(cq) - 1):
        o, lse = _eager_one(q[cq[b]:cq[b + 1]], k[ck[b]:ck[b + 1]], v[ck[b]:ck[b + 1]], causal,
                            window_size, softcap)
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses, dim=1)


def _eager_one(q, k, v, causal, window, softcap):
    lq, hq, d = q.shape
    lk, hkv, _ = k.shape
    kh = k.repeat_interleave(hq // hkv, 1)
    vh = v.repeat_interleave(hq // hkv, 1)
    s = torch.einsum("qhd,khd->hqk", q, kh)  # in the input dtype
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    s = s.to(acc) / math.sqrt(d)
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    mask = visible(0, lq, lq, lk, causal, window[0], window[1], q.device)
    s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.softmax(s, -1).nan_to_num(0.0)  # rows that see nothing: 0
    out = torch.einsum("hqk,khd->qhd", p.to(q.dtype), vh)
    return out, lse


def run(fn, inp, case: Case, dtype):
    q, k, v = (inp[n].detach().to(dtype).requires_grad_() for n in ("q", "k", "v"))
    out, lse = fn(q, k, v, **case.kwargs(), **inp["extra"])
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), inp["dout"].to(out.dtype))
    return {"out": out.detach(), "lse": lse.detach(), "dq": dq, "dk": dk, "dv": dv}


def scaled_err(x, ref):
    """||x - ref|| / max(||ref||, sqrt(n)) over the finite entries of ref; inf if the -inf
    entries (lse of rows that see no key) differ. Inputs are O(1), so where a gradient is exactly
    zero (one key: softmax == 1, dQ == 0, the float64 reference holding only 1e-16 noise) this is
    an absolute per-element error instead of a division by noise."""
    x, ref = x.double(), ref.double()
    fin = torch.isfinite(ref)
    if not torch.equal(torch.isfinite(x), fin) or not torch.equal(x[~fin], ref[~fin]):
        return math.inf
    x, ref = x[fin], ref[fin]
    scale = max(ref.norm().item(), math.sqrt(max(1, ref.numel())))
    return (x - ref).norm().item() / scale


rel_err = scaled_err  # the name the tests use


def check(case: Case, backend: str, cache=None, **extra_kw):
    inp = make_inputs(case)
    key = tuple(vars(case).items())
    if cache is not None and key in cache:
        ref, eager = cache[key]
    else:
        ref = run(lambda *a, **k: attention(*a, **k, return_lse=True, backend="torch"), inp, case,
                  torch.float64)
        eager = run(eager_attention, inp, case, case.dtype)
        if cache is not None:
            cache[key] = (ref, eager)
    got = run(lambda *a, **k: attention(*a, **k, return_lse=True, backend=backend, **extra_kw),
              inp, case, case.dtype)
    table = {}
    for name in ref:
        assert got[name].shape == ref[name].shape, f"{name}: {got[name].shape}"
        e_got, e_eager = scaled_err(got[name], ref[name]), scaled_err(eager[name], ref[name])
        table[name] = (e_got, e_eager)
        assert e_got <= 2 * e_eager + SLACK[case.dtype], (
            f"{name}: error {e_got:.3e} > 2 x eager {e_eager:.3e} + {SLACK[case.dtype]:.0e} "
            "(errors relative to max(|ref|, sqrt(n)))")
    assert got["lse"].dtype == torch.float32
    return table
