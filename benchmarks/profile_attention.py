"""Per-kernel GPU time of one attention forward + backward (torch.profiler), bf16.

    python benchmarks/profile_attention.py --backend cuda-sm80 --dims 64,128 --length 4096

With --ncu, one step (after warm-up) runs between cudaProfilerStart/Stop and nothing is timed
here: run it under `ncu --profile-from-start off` (benchmarks/ncu_attention.sh). For comparison,
--backend sdpa_flash (PyTorch's SDPA with FlashAttention-2), sdpa_cudnn (its cuDNN backend) or
fa4 (FlashAttention-4, when flash-attn-4 is installed).
"""

from __future__ import annotations

import argparse

import torch
from bench_attention import fa4, fused, sdpa
from torch.profiler import ProfilerActivity, profile


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="cuda-sm80")
    ap.add_argument("--dims", default="64,128")
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--ncu", action="store_true", help="mark one step for ncu; no timing")
    args = ap.parse_args()
    if args.backend in ("sdpa_flash", "sdpa_cudnn"):
        run_attention = sdpa(args.backend)
    elif args.backend == "fa4":
        run_attention = fa4()
    else:
        run_attention = fused(args.backend)
    for d in map(int, args.dims.split(",")):
        b, h, n = 16384 // args.length, 2048 // d, args.length
        q, k, v, do = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16)
                       for _ in range(4))
        for t in (q, k, v):
            t.requires_grad_()

        def step(q=q, k=k, v=v, do=do):
            run_attention(q, k, v, args.causal).backward(do)

        for _ in range(3):
            step()
        torch.cuda.synchronize()
        if args.ncu:
            torch.cuda.cudart().cudaProfilerStart()
            step()
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaProfilerStop()
            continue
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
