"""Sweep the Triton attention backward's tile configs (dK/dV kernel, then dQ kernel) on the GPU.

Each candidate's gradients are compared with the current default config's (relative difference
below 1e-2, else the candidate is marked wrong); the backward is timed alone (median of do_bench
on autograd.grad of a kept forward; the rows of 2026-11-29 hold its mean). Prints the best
configs per (D, L, causal) and appends one row per candidate to
benchmarks/results/attention_tune.jsonl (or <--out>/attention_tune.jsonl). The D<=64 backward
configs in fusedops.attention.triton._configs come from its sweep of 2026-11-29 (those rows).

    python benchmarks/tune_attention.py --dims 64 --lengths 4096
"""

from __future__ import annotations

import argparse
import itertools
import sys

import torch
from common import add_out_arg, append_rows, results_path, run_meta, time_ms

DKDV = [(bm, bn, w, s) for bm, bn, w, s in itertools.product((32, 64, 128), (64, 128), (4, 8),
                                                              (2, 3, 4))]
DQ = [(bm, bn, w, s) for bm, bn, w, s in itertools.product((64, 128), (32, 64, 128), (4, 8),
                                                           (2, 3, 4))]


def tune_shape(d, length, causal, rep_ms, out_dir):
    """Sweeps dK/dV configs, then dQ configs with the best dK/dV; returns the sorted good rows."""
    from fusedops.attention import attention
    from fusedops.attention import triton as ka  # its _configs is swapped per candidate

    default_configs = ka._configs

    def use(dkdv=None, dq=None):
        def configs(head_dim, dtype, causal_=False):
            fwd, d1, d2 = default_configs(head_dim, dtype, causal_)
            return fwd, dkdv or d1, dq or d2
        ka._configs = configs

    b, h = 16384 // length, 2048 // d
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(b, length, h, d, device="cuda", generator=g, dtype=torch.bfloat16)
                   for _ in range(4))
    for t in (q, k, v):
        t.requires_grad_()
    flops = 2.5 * 4 * b * h * length * length * d / (2 if causal else 1)

    def grads():
        out = attention(q, k, v, causal=causal, backend="triton")
        return out, torch.autograd.grad(out, (q, k, v), do, retain_graph=True)

    use()
    ref = grads()[1]

    def trial(kind, cfg):
        try:
            out, got = grads()
            err = max(float((a.float() - r.float()).norm() / r.float().norm())
                      for a, r in zip(got, ref, strict=True))
            ms = time_ms(lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True),
                         rep_ms)
        except Exception as exc:  # a config that does not compile or fit
            print(f"  {kind} {cfg}: failed ({type(exc).__name__})", file=sys.stderr, flush=True)
            return None
        row = dict(op="attention_tune", method="triton", kernel=kind, config=cfg, B=b, H=h,
                   L=length, D=d, causal=causal, dtype="bfloat16", bwd_ms=round(ms, 4),
                   bwd_tflops=round(flops / ms / 1e9, 1), max_rel_diff=err, ok=err < 1e-2,
                   **run_meta())
        append_rows("attention_tune", [row], out_dir)
        print(f"  {kind} {cfg}: {row['bwd_tflops']} TFLOP/s ok={row['ok']}", file=sys.stderr,
              flush=True)
        return row

    try:
        use()
        base = trial("default", None)
        rows = []
        for cfg in DKDV:
            use(dkdv=cfg)
            rows.append(trial("dkdv", {"dkdv": cfg, "dq": None}))
        good = [r for r in rows if r and r["ok"]]
        best = min(good, key=lambda r: r["bwd_ms"])["config"]["dkdv"] if good else None
        for cfg in DQ:
            use(dkdv=best, dq=cfg)
            rows.append(trial("dq", {"dkdv": best, "dq": cfg}))
    finally:
        ka._configs = default_configs
    return base, sorted((r for r in rows if r and r["ok"]), key=lambda r: r["bwd_ms"])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dims", default="64")
    ap.add_argument("--lengths", default="4096")
    ap.add_argument("--rep-ms", type=int, default=40)
    add_out_arg(ap)
    args = ap.parse_args()
    for d in map(int, args.dims.split(",")):
        for length in map(int, args.lengths.split(",")):
            for causal in (False, True):
                base, good = tune_shape(d, length, causal, args.rep_ms, args.out)
                print(f"D={d} L={length} causal={causal}: default "
                      f"{base['bwd_tflops'] if base else '-'} TFLOP/s; best:")
                for r in good[:5]:
                    print(f"  {r['config']} {r['bwd_tflops']} TFLOP/s "
                          f"(diff {r['max_rel_diff']:.1e})")
    print(f"run {run_meta()['run']} -> {results_path('attention_tune', args.out)}")


if __name__ == "__main__":
    main()
