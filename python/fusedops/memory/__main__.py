"""python -m fusedops.memory: the peak memory of one training step of a random-init Llama model,
stock transformers (SDPA attention, lm_head + cross-entropy) against fusedops
(apply_fusedops: fusedops attention, the fused linear cross-entropy and SwiGLU), measured by
profile_step and estimated by plan, side by side.

    python -m fusedops.memory                          # GPU: llama-1b, 1 x 8192 tokens, bf16
    python -m fusedops.memory --model tiny --seq 256   # CPU: a tiny model, float32
    python -m fusedops.memory --checkpointing --out results/

Writes under --out (default ./memory_report): memory_report.json (both reports and plans),
memory.png (stacked bars) and, on CUDA, snapshot_stock.pickle / snapshot_fusedops.pickle
(open them at pytorch.org/memory_viz).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys

from fusedops._checks import cli_number, cli_positive_int

INSTALL_TRANSFORMERS = 'pip install "transformers>=4.56"'


_non_negative_int = cli_number(int, lambda v: v >= 0, "an integer >= 0")
_positive_float = cli_number(float, lambda v: 0 < v < float("inf"), "a positive number")


def _parser(gpu: bool) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m fusedops.memory",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None,
                    help="tiny | small | llama-1b | CONFIG.json (default: llama-1b on a GPU, "
                         "tiny on the CPU)")
    ap.add_argument("--seq", type=cli_positive_int, default=None,
                    help="tokens per sequence (default 8192 on a GPU, 256 on the CPU)")
    ap.add_argument("--batch", type=cli_positive_int, default=1)
    ap.add_argument("--dtype", default=None, choices=("bfloat16", "float16", "float32"),
                    help="default bfloat16 on a GPU, float32 on the CPU")
    ap.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    ap.add_argument("--checkpointing", action="store_true",
                    help="activation checkpointing (activation_checkpointing_enable)")
    ap.add_argument("--warmup", type=_non_negative_int, default=1,
                    help="unmeasured steps first, so the optimizer state exists (default 1)")
    ap.add_argument("--memory-budget", type=_positive_float, default=None,
                    help="the fused loss's memory_budget_mib (default: its own, 512 MiB)")
    ap.add_argument("--out", default="memory_report", help="folder for JSON, PNG, snapshots")
    return ap


def main(argv=None) -> int:
    import torch

    gpu = torch.cuda.is_available()
    args = _parser(gpu).parse_args(argv)
    device = torch.device(args.device or ("cuda" if gpu else "cpu"))
    on_gpu = device.type == "cuda"
    args.model = args.model or ("llama-1b" if on_gpu else "tiny")
    if args.seq is None:
        args.seq = 8192 if on_gpu else 256
    args.dtype = args.dtype or ("bfloat16" if on_gpu else "float32")
    try:
        import transformers  # noqa: F401
    except ImportError:
        print(f"python -m fusedops.memory needs transformers: {INSTALL_TRANSFORMERS}",
              file=sys.stderr)
        return 2
    try:
        from fusedops.integrations.transformers import apply_fusedops
    except ImportError as exc:
        apply_fusedops = None
        print(f"fusedops.integrations.transformers is not importable ({exc}): measuring the "
              "stock model only", file=sys.stderr)

    from fusedops.memory import plan, plot_reports, profile_step
    from fusedops.memory.configs import build_llama, model_config

    cfg = model_config(args.model)
    dtype = getattr(torch, args.dtype)
    os.makedirs(args.out, exist_ok=True)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg["vocab_size"], (args.batch, args.seq), generator=gen)
    batch = {"input_ids": ids.to(device), "labels": ids.to(device)}
    print(f"{args.model}: B={args.batch} S={args.seq} {args.dtype} on {device}"
          f"{' with activation checkpointing' if args.checkpointing else ''}; one AdamW step "
          f"after {args.warmup} warm-up step(s)")
    variants = [("stock", False)] + ([("fusedops", True)] if apply_fusedops else [])
    results = {}
    reports, plans = [], []
    for name, fused in variants:
        est = plan(cfg, batch=args.batch, seq=args.seq, dtype=args.dtype, mixed_precision=False,
                   activation_checkpointing=args.checkpointing, fused_loss=fused,
                   attention_impl="fusedops" if fused else "sdpa", device=device.type,
                   memory_budget_mib=args.memory_budget if fused else None,
                   fused_mlp=fused, label=f"{name} (planned)")
        model = build_llama(cfg, dtype=dtype, device=device, attn_implementation="sdpa")
        if args.checkpointing:
            # transformers >= 5.19 renames it (the old name warns, and goes in 6)
            enable = (getattr(model, "activation_checkpointing_enable", None)
                      or model.gradient_checkpointing_enable)
            enable()
        if fused:
            model = apply_fusedops(model, memory_budget_mib=args.memory_budget)
        try:
            report = profile_step(model, batch, warmup=args.warmup, label=name)
        except torch.cuda.OutOfMemoryError as exc:
            print(f"\n{name}: out of memory ({str(exc).splitlines()[0]})")
            print(est.table())
            results[name] = dict(oom=True, plan=est.to_dict())
            del model
            gc.collect()
            torch.cuda.empty_cache()
            continue
        print()
        print(report.table(plan=est))
        for note in report.notes:
            print(f"  note: {note}")
        budget = est.loss_budget()
        if budget is not None:
            print(f"  planner: the fused loss's chunk sets this peak; at memory_budget_mib="
                  f"{budget:g} or less the step peaks elsewhere (apply_fusedops(model, "
                  f"memory_budget_mib=...))")
        results[name] = dict(report=report.to_dict(), plan=est.to_dict())
        if report.snapshot is not None:
            path = report.save_snapshot(os.path.join(args.out, f"snapshot_{name}.pickle"))
            print(f"  snapshot: {path}")
        report.snapshot = None
        reports.append(report)
        plans.append(est)
        del model
        gc.collect()
        if on_gpu:
            torch.cuda.empty_cache()
    stock_plan = plan(cfg, batch=args.batch, seq=args.seq, dtype=args.dtype,
                      mixed_precision=False, activation_checkpointing=args.checkpointing,
                      fused_loss=False, device=device.type)
    switch = stock_plan.best_switch()
    if switch is not None:
        print(f"\nplanner, from the stock setting: the best single switch is {switch}")
    meta = dict(model=args.model, config=cfg, batch=args.batch, seq=args.seq, dtype=args.dtype,
                device=str(device), checkpointing=args.checkpointing, torch=torch.__version__,
                gpu=torch.cuda.get_device_name(device) if on_gpu else "cpu")
    with open(os.path.join(args.out, "memory_report.json"), "w") as f:
        json.dump(dict(meta=meta, results=results), f, indent=1)
    print(f"\nwrote {os.path.join(args.out, 'memory_report.json')}")
    if reports:
        try:
            png = plot_reports(os.path.join(args.out, "memory.png"), reports, plans=plans,
                               title=f"{args.model}, B={args.batch} S={args.seq} {args.dtype}")
            print(f"wrote {png}")
        except ImportError as exc:
            print(f"no plot: {exc}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
