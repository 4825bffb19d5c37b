"""Benchmark: one training step (forward, backward, AdamW step) of a whole Llama-style model,
stock transformers against Liger and fusedops. Prints a table and the planner's estimate of
each method's peak; appends one JSON object per method to benchmarks/results/train_step.jsonl
(or <--out>/train_step.jsonl).

    python benchmarks/bench_train_step.py                    # Llama-3.2-1B shape, 1 x 8192, bf16
    python benchmarks/bench_train_step.py --model tiny       # CPU, seconds: checks the script
    python benchmarks/bench_train_step.py --methods sdpa,fusedops --seq 4096 --out DIR

Methods, each in a freshly initialised model (random init from the config in
fusedops.memory.configs, same seed; bf16 parameters on a GPU, torch.optim.AdamW) and, on a GPU,
in a fresh process, so that no allocator cache, cuBLAS workspace or Liger's module patches carry
over (on the CPU they share one process unless --separate: the tracker measures each model's own
tensors):
  eager     stock transformers, attn_implementation="eager"
  sdpa      stock transformers, attn_implementation="sdpa"
  liger     sdpa + liger_kernel's apply_liger_kernel_to_llama(fused_linear_cross_entropy=True)
            with its other kernels off (rope, rms_norm, swiglu; --liger-all turns them on), so
            that it differs from sdpa by the loss alone; skipped when liger_kernel is missing
  liger-all the same with Liger's rope, rms_norm and swiglu kernels on too
  fusedops  fusedops.integrations.transformers.apply_fusedops(), its defaults: attention, fused
            loss and the swiglu MLP
  fusedops-loss  apply_fusedops(attention=False, mlp=False): SDPA attention, fused loss
  fusedops@N, fusedops-loss@N  the same with apply_fusedops(memory_budget_mib=N)

Each method runs --warmup steps, then --steps timed steps: "ms" is their median (CUDA
synchronised around each step; time.perf_counter), "peak_gib" torch.cuda.max_memory_allocated
over the timed steps after a reset (on the CPU: the peak of fusedops.memory's tracker), and
"loss_head_gib" the logits/loss scratch at the peak of one more step measured by
fusedops.memory.profile_step (what the LM head and the loss hold). Out of memory is caught and
recorded as a row with "oom": true.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from common import add_out_arg, append_rows, describe, print_table, results_path, run_meta

METHODS = ("eager", "sdpa", "liger", "liger-all", "fusedops", "fusedops-loss")
DEFAULT_METHODS = ("eager", "sdpa", "liger", "fusedops")
GIB = float(1 << 30)


class Skip(Exception):
    pass


def parse_method(method: str) -> tuple[str, float | None]:
    """("fusedops-loss", 128.0) from "fusedops-loss@128"; the budget is None without "@"."""
    base, _, budget = method.partition("@")
    if base not in METHODS or (budget and not base.startswith("fusedops")):
        sys.exit(f"unknown method {method!r}; methods: {', '.join(METHODS)}, and fusedops@N, "
                 "fusedops-loss@N (N: the fused loss's memory budget in MiB)")
    try:
        return base, float(budget) if budget else None
    except ValueError:
        sys.exit(f"method {method!r}: the budget after '@' must be a number of MiB")


def build(method: str, args, device, dtype):
    from fusedops.memory.configs import build_llama, model_config

    method, budget = parse_method(method)

    cfg = model_config(args.model)
    model = build_llama(cfg, dtype=dtype, device=device,
                        attn_implementation="eager" if method == "eager" else "sdpa")
    if method in ("liger", "liger-all"):
        try:
            from liger_kernel.transformers import apply_liger_kernel_to_llama
        except ImportError as exc:
            raise Skip(f"liger_kernel is not importable ({exc}): pip install liger-kernel") from exc
        every = args.liger_all or method == "liger-all"
        apply_liger_kernel_to_llama(rope=every, rms_norm=every, swiglu=every, cross_entropy=False,
                                    fused_linear_cross_entropy=True, model=model)
    elif method.startswith("fusedops"):
        try:
            from fusedops.integrations.transformers import apply_fusedops
        except ImportError as exc:
            raise Skip(f"fusedops.integrations.transformers is not importable ({exc})") from exc
        full = method == "fusedops"
        model = apply_fusedops(model, attention=full, mlp=full, memory_budget_mib=budget)
    return cfg, model


def planned(method: str, cfg, args, device_type: str):
    from fusedops.memory import plan

    base, budget = parse_method(method)
    impl = {"eager": "eager", "sdpa": "sdpa", "liger": "sdpa", "liger-all": "sdpa",
            "fusedops": "fusedops", "fusedops-loss": "sdpa"}[base]
    # Liger's swiglu keeps gate and up and computes the gradients in their place, as fused_mlp
    # models (its rope and rms_norm kernels are not modelled)
    return plan(cfg, batch=args.batch, seq=args.seq, dtype=args.dtype, mixed_precision=False,
                fused_loss=base != "eager" and base != "sdpa", attention_impl=impl,
                device=device_type, memory_budget_mib=budget,
                fused_mlp=base in ("fusedops", "liger-all"), label=method)


def run_one(method: str, args) -> dict:
    """One method in this process: the row (without run metadata)."""
    import torch

    from fusedops.memory import default_step, profile_step

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = getattr(torch, args.dtype)
    cuda = device.type == "cuda"
    row = dict(op="train_step", method=method, model=args.model, B=args.batch, S=args.seq,
               dtype=args.dtype, device=device.type, oom=False)
    budget = parse_method(method)[1]
    if budget is not None:
        row["memory_budget_mib"] = budget
    try:
        cfg, model = build(method, args, device, dtype)
    except Skip as exc:
        row.update(skipped=str(exc))
        return row
    row["params"] = sum(p.numel() for p in model.parameters())
    est = planned(method, cfg, args, device.type)
    row.update(planned_gib=round(est.peak_bytes / GIB, 3), planned_phase=est.peak_phase)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg["vocab_size"], (args.batch, args.seq), generator=g).to(device)
    batch = {"input_ids": ids, "labels": ids}
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)

    def sync():
        if cuda:
            torch.cuda.synchronize(device)

    try:
        for _ in range(args.warmup):
            default_step(model, batch, opt)
        sync()
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        times = []
        for _ in range(args.steps):
            sync()
            t0 = time.perf_counter()
            default_step(model, batch, opt)
            sync()
            times.append(time.perf_counter() - t0)
        peak = torch.cuda.max_memory_allocated(device) if cuda else None
        report = None
        if not args.no_breakdown or not cuda:
            report = profile_step(model, batch, opt, warmup=0, label=method)
            if not cuda:
                peak = report.peak_bytes
    except torch.cuda.OutOfMemoryError as exc:
        row.update(oom=True, error=str(exc).splitlines()[0][:200])
        return row
    ms = statistics.median(times) * 1e3
    row.update(ms=round(ms, 2), tokens_per_s=round(args.batch * args.seq / (ms / 1e3), 1),
               peak_gib=round(peak / GIB, 3),
               plan_err=round((est.peak_bytes - peak) / peak, 4))
    if report is not None:
        row.update(loss_head_gib=round(report.logits_loss / GIB, 3),
                   loss_head_share=round(report.logits_loss / report.peak_bytes, 4),
                   breakdown_gib={k: round(v / GIB, 3) for k, v in report.categories().items()},
                   peak_phase=report.peak_phase)
    return row


def run_child(method: str, args) -> dict | None:
    cmd = [sys.executable, os.path.abspath(__file__), *sys.argv[1:], "--child", method,
           "--model", args.model, "--seq", str(args.seq), "--dtype", args.dtype]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode:
        sys.stderr.write(out.stderr[-3000:])
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("ROW ")]
    if not lines:
        print(f"{method}: failed (exit {out.returncode})", file=sys.stderr)
        return None
    return json.loads(lines[-1][4:])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None,
                    help="llama-1b (default on a GPU) | small | tiny (default on the CPU) | "
                         "CONFIG.json")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=None, help="default 8192 (GPU), 128 (CPU)")
    ap.add_argument("--dtype", default=None, help="default bfloat16 (GPU), float32 (CPU)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--methods", default=",".join(DEFAULT_METHODS),
                    help="comma list of eager, sdpa, liger, liger-all, fusedops, fusedops-loss, "
                         "fusedops@N, fusedops-loss@N (N: loss budget, MiB)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--no-breakdown", action="store_true",
                    help="skip the profile_step breakdown (loss_head_gib) on CUDA")
    ap.add_argument("--liger-all", action="store_true",
                    help="also Liger's rope, rms_norm and swiglu kernels")
    ap.add_argument("--separate", action="store_true",
                    help="one process per method on the CPU too (always so on a GPU)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    add_out_arg(ap)
    args = ap.parse_args()
    import torch

    gpu = (args.device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda")
    args.model = args.model or ("llama-1b" if gpu else "tiny")
    args.seq = args.seq or (8192 if gpu else 128)
    args.dtype = args.dtype or ("bfloat16" if gpu else "float32")
    if args.child:  # one method, in its own process
        print("ROW " + json.dumps(run_one(args.child, args)), flush=True)
        return None
    try:
        import transformers  # noqa: F401
    except ImportError:
        print('bench_train_step.py needs transformers: pip install "transformers>=4.56"',
              file=sys.stderr)
        sys.exit(2)
    meta = run_meta()
    rows = []
    for method in args.methods.split(","):
        parse_method(method)
        t0 = time.time()
        if gpu or args.separate:
            row = run_child(method, args)
            if row is None:
                continue
        else:
            row = run_one(method, args)
        if "skipped" in row:
            print(f"{method}: skipped: {row['skipped']}", file=sys.stderr)
            continue
        row.update(meta)
        rows.append(row)
        append_rows("train_step", [row], args.out)
        what = "out of memory" if row["oom"] else f"{row['ms']:.1f} ms"
        print(f"  {method}: {what} ({time.time() - t0:.0f} s)", file=sys.stderr)
    print_table(rows, [("method", "method", ""), ("params", "params", ",d"), ("B", "B", "d"),
                       ("S", "S", "d"), ("ms", "ms", ".1f"), ("tokens/s", "tokens_per_s", ",.0f"),
                       ("peak GiB", "peak_gib", ".3f"), ("loss+head GiB", "loss_head_gib", ".3f"),
                       ("planned GiB", "planned_gib", ".3f"), ("plan err", "plan_err", "+.1%"),
                       ("oom", "oom", "")],
                title=f"\ntrain_step {args.model} {args.dtype}: {describe(meta)} -> "
                      f"{results_path('train_step', args.out)}")
    print("\nplanner estimate per method (peak, the moment it predicts, error against the "
          "measured peak):")
    for r in rows:
        err = "" if r.get("plan_err") is None else f", {r['plan_err']:+.1%} against measured"
        print(f"  {r['method']:18} {r['planned_gib']:8.3f} GiB during {r['planned_phase']}{err}")
    return rows


if __name__ == "__main__":
    main()
