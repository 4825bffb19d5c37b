"""Where a training step's time goes: one AdamW step of the bench_train_step.py model per method,
with fusedops' attention, loss and MLP switched on separately, and the heaviest CUDA kernels.

    python benchmarks/profile_train_step.py [--model llama-1b] [--seq 8192] [--kernels 14]

Methods: sdpa (stock), liger (its fused linear cross-entropy only), fusedops (all three),
fusedops-attention (attention only, stock loss), fusedops-loss (loss only, sdpa attention),
fusedops-mlp (fusedops.swiglu only).
Prints the median ms per step and the peak allocated memory of each and, for `--profile`
methods, the CUDA kernels by total time over two steps (torch.profiler).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from bench_train_step import build

from fusedops.memory import default_step


def make(method, args):
    if method.startswith("fusedops-"):
        from fusedops.integrations.transformers import apply_fusedops
        cfg, model = build("sdpa", args, torch.device("cuda"), torch.bfloat16)
        part = method.split("-", 1)[1]
        apply_fusedops(model, attention=part == "attention", linear_ce=part == "loss",
                       mlp=part == "mlp")
        return cfg, model
    return build(method, args, torch.device("cuda"), torch.bfloat16)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-1b")
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--methods", default="sdpa,liger,fusedops,fusedops-attention,fusedops-loss")
    ap.add_argument("--profile", default="sdpa,fusedops")
    ap.add_argument("--kernels", type=int, default=14)
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    args.batch, args.dtype, args.liger_all = 1, "bfloat16", False
    for method in args.methods.split(","):
        cfg, model = make(method, args)
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, cfg["vocab_size"], (1, args.seq), generator=g).cuda()
        batch = {"input_ids": ids, "labels": ids}
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
        for _ in range(2):
            default_step(model, batch, opt)
        torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(args.steps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            default_step(model, batch, opt)
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) * 1e3)
        peak = torch.cuda.max_memory_allocated() / 2**30
        print(f"{method:20} {statistics.median(times):8.1f} ms per step, peak {peak:.3f} GiB",
              flush=True)
        if method in args.profile.split(","):
            from torch.profiler import ProfilerActivity, profile
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(2):
                    default_step(model, batch, opt)
                torch.cuda.synchronize()
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.kernels,
                                            max_name_column_width=70), flush=True)
        del model, opt
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
