"""Per-kernel GPU time of one attention forward + backward (torch.profiler), bf16.

    python benchmarks/profile_attention.py --backend cuda-sm80 --dims 64,128 --length 4096
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from fusedops.attention import attention


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="cuda-sm80")
    ap.add_argument("--dims", default="64,128")
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--causal", action="store_true")
    args = ap.parse_args()
    for d in map(int, args.dims.split(",")):
        b, h, n = 16384 // args.length, 2048 // d, args.length
        q, k, v, do = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16)
                       for _ in range(4))
        for t in (q, k, v):
            t.requires_grad_()

        def step(q=q, k=k, v=v, do=do):
            attention(q, k, v, causal=args.causal, backend=args.backend).backward(do)

        for _ in range(3):
            step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                step()
            torch.cuda.synchronize()
        flops = 4 * b * h * n * n * d / (2 if args.causal else 1)
        print(f"D={d} L={n} B={b} H={h} causal={args.causal} backend={args.backend}: "
              f"fwd flops {flops / 1e12:.2f} T, bwd {2.5 * flops / 1e12:.2f} T")
        for ev in sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:8]:
            ms = ev.device_time_total / 1e3 / ev.count
            print(f"  {ev.key[:70]:70} {ev.count:4d} x {ms:8.3f} ms")


if __name__ == "__main__":
    main()
