"""Gradient filtering's accuracy (filter_eps): relative errors of d_hidden and d_weight against
float64 exact gradients, on bench_linear_ce.py's data recipes with N cut down, on the CPU.

    python benchmarks/filter_accuracy.py --shapes llama3,gemma2,llama2 --tokens 512

Per shape and data mode, the mean loss's gradients and their Frobenius-norm relative errors, and
"kept": the share of 128 x 128 blocks of dz the filter keeps (methods with the filter):
- "eager bf16": plain PyTorch in bfloat16 (bf16 operands, float32 accumulation, each GEMM's
  result rounded to bf16 as cuBLAS does, softmax in float32), the yardstick of the oracle rule;
- "filter, float64": fusedops' filter alone (torch backend in float64, filter_eps on), i.e. the
  approximation itself without rounding;
- "eager bf16 + filter": the eager bf16 computation with the filter's blocks dropped (the mask of
  128 x 128 blocks of the float32 dz), what a filtered bf16 run computes up to its own rounding.
Rows go to benchmarks/results/linear_ce_filter.jsonl (op "linear_ce_filter").
"""

from __future__ import annotations

import argparse
import sys

import torch
from common import add_out_arg, append_rows, print_table, run_meta

from fusedops.linear_ce import filtered, linear_cross_entropy

SHAPES = {"llama3": (4096, 128256, None), "gemma2": (2304, 256000, 30.0),
          "llama2": (4096, 32000, None)}  # name: (H, V, softcap), as bench_linear_ce.py
DATA = {"dense": (1.0, 2.0, 0.0), "peaked": (0.5, 1.0, 10.0)}  # as bench_linear_ce.DATA


def make_inputs(n, h, v, data, seed=0):
    xs, ws, boost = DATA[data]
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, generator=g) * xs
    w = (torch.randn(v, h, generator=g) * (ws / h**0.5)).bfloat16()
    t = torch.randint(0, v, (n,), generator=g)
    if boost:
        wt = w[t].float()
        x += boost * wt / wt.pow(2).sum(1, keepdim=True)
    return x.bfloat16(), w, t


def exact(x, w, t, softcap, eps=None):
    xx = x.double().requires_grad_()
    ww = w.double().requires_grad_()
    loss = linear_cross_entropy(xx, ww, t, softcap=softcap, backend="torch", filter_eps=eps)
    dh, dw = torch.autograd.grad(loss, [xx, ww])
    return float(loss.detach()), dh.float(), dw.float()  # float32 copies: the errors are ~1e-3


def eager_dz(x, w, t, softcap):
    """The mean loss's float32 dz of bf16 eager (logits rounded to bf16, softmax in float32)."""
    z = (x.float() @ w.float().T).bfloat16().float()
    if softcap:
        z = softcap * torch.tanh(z / softcap)
    n = len(t)
    dz = torch.softmax(z, 1)
    dz[torch.arange(n), t] -= 1.0
    if softcap:
        dz *= 1.0 - (z / softcap) ** 2
    return dz / n


def filter_mask(dz, eps):
    return filtered.block_mask(dz, torch.full((dz.shape[0],), eps / dz.shape[0]))


def eager_bf16(x, w, t, softcap, eps=None):
    """bf16 eager's gradients (float32 GEMMs of bf16 values, results rounded to bf16), with the
    filter's blocks of dz dropped when eps is given."""
    xf, wf = x.float(), w.float()
    dz = eager_dz(x, w, t, softcap)
    if eps is not None:
        filtered.zero_dropped_(dz, filter_mask(dz, eps))
    dz = dz.bfloat16().float()
    return (dz @ wf).bfloat16(), (dz.T @ xf).bfloat16()


def rel(a, ref):
    return float((a.float() - ref).norm() / ref.norm())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="llama3,gemma2,llama2")
    ap.add_argument("--data", default="peaked,dense")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--eps", type=float, default=2.0**-12)
    add_out_arg(ap)
    args = ap.parse_args()
    meta = run_meta()
    rows = []
    for shape in args.shapes.split(","):
        h, v, softcap = SHAPES[shape]
        for data in args.data.split(","):
            x, w, t = make_inputs(args.tokens, h, v, data)
            loss, dh, dw = exact(x, w, t, softcap)
            kept = float(filter_mask(eager_dz(x, w, t, softcap), args.eps).float().mean())
            runs = (("eager_bf16", eager_bf16, None), ("filter_float64", exact, args.eps),
                    ("eager_bf16_filter", eager_bf16, args.eps))
            for method, fn, eps in runs:  # one method's gradients alive at a time (GiBs each)
                a, b = fn(x, w, t, softcap, eps)[-2:]
                rows.append(dict(op="linear_ce_filter", method=method, shape=shape,
                                 N=args.tokens, H=h, V=v, softcap=softcap, data=data,
                                 filter_eps=args.eps, kept=None if eps is None else kept,
                                 loss=round(loss, 4),
                                 err_dh=rel(a, dh), err_dw=rel(b, dw), **meta))
                del a, b
            del dh, dw
            append_rows("linear_ce_filter", rows[-3:], args.out)
            print(f"{shape} {data}: done", file=sys.stderr, flush=True)
    print_table(rows, [("shape", "shape", ""), ("data", "data", ""), ("loss", "loss", ".3f"),
                       ("method", "method", ""), ("kept", "kept", ".3f"),
                       ("err_dh", "err_dh", ".2e"), ("err_dw", "err_dw", ".2e")])


if __name__ == "__main__":
    main()
