"""One decode call (attention_with_kvcache) per method for Nsight Compute: warm-up first, then
the profiled call between cudaProfilerStart and cudaProfilerStop (run ncu with
--profile-from-start off), bf16, D=128, 32 query heads over 8 KV heads, one query.

    ncu --clock-control none --profile-from-start off --section SpeedOfLight \\
        python benchmarks/profile_decode.py --method cuda-sm90 --batch 1 --ctx 32768 [--paged]
"""

from __future__ import annotations

import argparse

import torch
from bench_decode import cuda, fused, make_cache, read_floor


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--method", default="cuda-sm90",
                    help="triton, cuda-sm90, cuda-sm80 or read (the read-only floor of "
                         "bench_decode.py)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--ctx", type=int, default=32768)
    ap.add_argument("--paged", action="store_true")
    ap.add_argument("--num-splits", type=int, default=None)
    args = ap.parse_args()
    if args.method == "triton":
        fn = fused("triton", args.num_splits)
    elif args.method == "read":
        fn = read_floor(splits=args.num_splits)
    else:
        fn = cuda(args.method, args.num_splits)
    inputs = make_cache(args.batch, args.ctx, args.paged, 64)
    for _ in range(3):
        fn(*inputs)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    fn(*inputs)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()
