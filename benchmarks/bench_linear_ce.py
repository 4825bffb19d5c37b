"""Benchmark: fused linear cross-entropy, forward + backward of the mean loss (grads for hidden and
weight), every fusedops backend next to PyTorch eager, torch.compile, Liger and Cut Cross-Entropy
(when installed). Prints a table; appends one JSON object per measured row to
benchmarks/results/linear_ce.jsonl (or <--out>/linear_ce.jsonl).

    python benchmarks/bench_linear_ce.py                  # Llama-3-8B LM head, bf16
    python benchmarks/bench_linear_ce.py --shapes llama3,gemma2,llama2 --out DIR
    python benchmarks/bench_linear_ce.py --shapes llama3,gemma2,llama2 --data peaked --no-accuracy
    python benchmarks/bench_linear_ce.py --shapes llama3,llama3-4k \
        --methods fusedops,fusedops-sm90,fusedops-sm90-fused,fusedops-sm90-fused-520
    python benchmarks/bench_linear_ce.py --shapes llama3 \
        --methods fusedops-sm90-fused-520,fusedops-sm90-fused2-520
    python benchmarks/bench_linear_ce.py --shapes llama3,gemma2,llama2 --loss none

"fusedops-sm90" runs the mean path's three GEMMs on our Hopper GEMMs (FUSEDOPS_LCE_GEMM=sm90),
"fusedops-sm90-fused" also the statistics in the logits GEMM's epilogue (sm90-fused; its partials
count in the 512 MiB budget, so Llama-3's 8192 tokens go in 5 chunks of 1664 instead of 4 of
2048), "-520" the same at a 520 MiB budget, where both routes take 4 chunks of 2048;
"fusedops-sm90-fused2" (-520) also drops the row kernel's dz pass (sm90-fused2: d_hidden and
d_weight compute dz from z in their operand path).

--data picks the logits: "dense" (random, std ~2, the default), "mild" (random, std ~0.5: every
probability near 1 / V) or "peaked" (as a trained model's: the target's logit ~10 above the rest,
where Cut Cross-Entropy's gradient filter skips most blocks); rows carry it as "data".
"-fullrows" variants of the lowmem methods force whole-row chunks however few rows fit.
"-filter" methods pass filter_eps=2^-12 (gradient filtering, Cut Cross-Entropy's threshold: dz
blocks below it are skipped in the d_hidden and d_weight products).
"fusedops-b<MiB>" (named in --methods only) runs the default backend at that memory budget.

--loss picks what is differentiated: "mean" (the default), "none" (reduction "none", per-token
losses summed with weight 1 / N: the statistics path's GEMMs, one in the forward and three in the
backward) or "lse" (return_lse: mean loss + 1e-4 mean(lse^2)); rows carry reduction and
return_lse. Liger, Cut Cross-Entropy and quack (`quack-kernels`: its chunked loss, 4096-token
chunks, the scaled-exp route where it applies; no softcap) run with the mean loss only.

"extra_mib" is peak memory above what was allocated before the step (inputs, weights) minus the
bytes of the gradients the step returns (d_hidden, d_weight), i.e. the method's scratch. "ms" is
the median of triton.testing.do_bench, "p20"/"p80" its 20th and 80th percentiles.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F
from common import (
    add_out_arg,
    append_rows,
    describe,
    env_set,
    peak_extra_mib,
    print_table,
    results_path,
    run_meta,
    time_ms,
)

SHAPES = {  # name: (N tokens, H, V, softcap)
    "llama3": (8192, 4096, 128256, None),
    "gemma2": (16384, 2304, 256000, 30.0),
    "llama2": (4096, 4096, 32000, None),
    "small": (2048, 1024, 32000, None),
    "llama3-4k": (4096, 4096, 128256, None),
}


DATA = {  # --data: name -> (scale of hidden, scale of weight * sqrt(H), target boost)
    "dense": (1.0, 2.0, 0.0),   # random logits of std ~2: softmax mass spread over many entries
    "mild": (0.5, 1.0, 0.0),    # random logits of std ~0.5: every probability near 1 / V
    "peaked": (0.5, 1.0, 10.0),  # as mild, the target's logit 10 above the rest (as a trained
    #                               model's: mean loss ~2 nats at V = 128256, ~1 at V = 32000)
}


def make_inputs(n: int, h: int, v: int, data: str):
    """hidden (n, h), weight (v, h) in bf16 (hidden requiring grad, weight too) and targets.
    peaked: hidden gets boost * w_t / |w_t|^2 added, which raises the target's logit by `boost`
    and moves every other logit by about boost / sqrt(h)."""
    xs, ws, boost = DATA[data]
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(n, h, device="cuda", generator=g) * xs
    w = (torch.randn(v, h, device="cuda", generator=g) * (ws / h**0.5)).bfloat16()
    t = torch.randint(0, v, (n,), device="cuda", generator=g)
    if boost:
        wt = w[t].float()
        x += boost * wt / wt.pow(2).sum(1, keepdim=True)
    return x.bfloat16().requires_grad_(), w.requires_grad_(), t


# --loss: what the step differentiates. "mean": the mean loss. "none": per-token losses
# (reduction "none") weighted by 1 / N and summed (the same gradients as the mean, through the
# per-token path). "lse": per-token losses and lse (return_lse), mean loss + 1e-4 * mean(lse^2)
# (a z-loss formed by the caller).
LOSSES = ("mean", "none", "lse")
Z_COEF = 1e-4


def finish(out, kind: str):
    """The scalar a step differentiates, from the loss function's output for --loss kind."""
    if kind == "mean":
        return out
    if kind == "none":
        return out.sum() / out.shape[0]
    loss, lse = out
    return loss.mean() + Z_COEF * lse.square().mean()


def loss_options(kind: str) -> dict:
    """linear_cross_entropy's reduction and return_lse for --loss kind."""
    return dict(reduction="mean" if kind == "mean" else "none", return_lse=kind == "lse")


def eager_loss(x, w, t, softcap=None, kind="mean"):
    z = (x @ w.T).float()
    if softcap:
        z = softcap * torch.tanh(z / softcap)
    if kind == "mean":
        return F.cross_entropy(z, t)
    loss = F.cross_entropy(z, t, reduction="none")
    return finish(loss if kind == "none" else (loss, torch.logsumexp(z, -1)), kind)


LOWMEM_MIB = 64  # the low-memory setting reported as "-lowmem"
FILTER_EPS = 2.0**-12  # gradient filtering's threshold for the "-filter" methods (as CCE's)


def fused_fn(softcap, kind, backend=None, budget_mib=None, filter_eps=None):
    """fusedops.linear_cross_entropy as a step's loss for --loss kind."""
    from fusedops.linear_ce import linear_cross_entropy
    return lambda x, w, t: finish(linear_cross_entropy(
        x, w, t, softcap=softcap, backend=backend, check_targets=False,
        memory_budget_mib=budget_mib, filter_eps=filter_eps, **loss_options(kind)), kind)


def methods(softcap, kind="mean"):
    from fusedops import dispatch
    from fusedops.linear_ce import linear_cross_entropy

    opts = loss_options(kind)

    def fused(backend=None, budget=None):
        return fused_fn(softcap, kind, backend, budget)

    def recompute(x, w, t):  # the recompute algorithm: 4 fused GEMM kernels, no logits chunk
        with env_set("FUSEDOPS_LCE_ALGO", "recompute"):
            return finish(linear_cross_entropy(x, w, t, softcap=softcap, check_targets=False,
                                               **opts), kind)

    def with_env(inner, name, value):
        def run(x, w, t):
            with env_set(name, value):
                return inner(x, w, t)
        return run

    def with_gemm(mode, budget=None):  # FUSEDOPS_LCE_GEMM=<mode> for the forward (all the work)
        inner = fused(budget=budget)

        def run(x, w, t):
            calls, dz_calls = gemm_sm90.stats_calls, gemm_sm90.dz_calls
            with env_set("FUSEDOPS_LCE_GEMM", mode):
                out = inner(x, w, t)
            if mode.startswith("sm90-fused") and gemm_sm90.stats_calls == calls:
                raise RuntimeError("the statistics epilogue did not run (route not taken)")
            if mode == "sm90-fused2" and gemm_sm90.dz_calls == dz_calls:
                raise RuntimeError("the dz GEMMs did not run (route not taken)")
            return out
        return run

    out = {"fusedops": fused(), "fusedops-lowmem": fused(budget=LOWMEM_MIB),
           "fusedops-filter": fused_fn(softcap, kind, filter_eps=FILTER_EPS),
           "fusedops-lowmem-filter": fused_fn(softcap, kind, None, LOWMEM_MIB, FILTER_EPS)}
    from fusedops.linear_ce import gemm_sm90
    if gemm_sm90.supported(torch.device("cuda")) and kind == "mean":
        out["fusedops-sm90"] = with_gemm("sm90")
        if gemm_sm90.stats_op_available():
            out["fusedops-sm90-fused"] = with_gemm("sm90-fused")
            out["fusedops-sm90-fused-520"] = with_gemm("sm90-fused", 520)
            out["fusedops-520"] = fused(budget=520)
            if gemm_sm90.dz_op_available():
                out["fusedops-sm90-fused2"] = with_gemm("sm90-fused2")
                out["fusedops-sm90-fused2-520"] = with_gemm("sm90-fused2", 520)
    sig = dispatch.InputSig("linear_ce", "cuda", torch.cuda.current_device(), torch.bfloat16, 64)
    default = dispatch.select_name("linear_ce", "cuda", torch.cuda.current_device(), "bfloat16",
                                   64, None)
    for name in ("cuda-sm90", "cuda-sm80", "triton", "torch"):
        if name != default and dispatch.why_not(name, sig) is None:
            out[f"fusedops-{name}"] = fused(name)
            if name != "torch":
                out[f"fusedops-{name}-lowmem"] = fused(name, LOWMEM_MIB)
    for name in [k for k in out if k.endswith("-lowmem")]:
        # whole-row token chunks however few rows fit (three GEMMs)
        out[f"{name}-fullrows"] = with_env(out[name], "FUSEDOPS_LCE_MIN_FULL_ROWS", "1")
    out["fusedops-recompute"] = recompute
    out["torch_eager"] = lambda x, w, t: eager_loss(x, w, t, softcap, kind)
    compiled = torch.compile(eager_loss)
    out["torch_compile"] = lambda x, w, t: compiled(x, w, t, softcap, kind)
    if kind != "mean":  # Liger and Cut Cross-Entropy: the mean loss only here
        return out
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
        liger = LigerFusedLinearCrossEntropyLoss(softcap=softcap)
        out["liger"] = lambda x, w, t: liger(w, x, t)
    except Exception as exc:  # not installed
        print(f"liger: skipped ({type(exc).__name__}: {exc})", file=sys.stderr)
    try:
        from cut_cross_entropy import linear_cross_entropy as cce
        out["cce"] = lambda x, w, t: cce(x, w, t, softcap=softcap, impl="cce")
    except Exception as exc:
        print(f"cce: skipped ({type(exc).__name__}: {exc})", file=sys.stderr)
    if softcap is None:  # quack's fused loss has no softcap
        try:
            from quack.linear_cross_entropy import chunked_linear_cross_entropy as quack_lce
            out["quack"] = lambda x, w, t: quack_lce(x, w, t, chunk_size=4096)
            # 2048-token chunks: quack 0.6.5 rejects a chunk of as many rows as H has columns
            out["quack-c2048"] = lambda x, w, t: quack_lce(x, w, t, chunk_size=2048)
        except Exception as exc:
            print(f"quack: skipped ({type(exc).__name__}: {exc})", file=sys.stderr)
    return out


def rel_err(a, ref, rows=4096):
    """||a - ref|| / ||ref|| in float64, a few thousand rows at a time."""
    num = den = 0.0
    for i in range(0, a.shape[0], rows):
        r = ref[i:i + rows]
        num += float((a[i:i + rows].double() - r).pow(2).sum())
        den += float(r.pow(2).sum())
    return (num / den) ** 0.5 if den else float("nan")


def reference_grads(x, w, t, softcap, kind="mean"):
    """float64 gradients of the step's loss (the torch backend in float64, the tests' oracle)."""
    from fusedops.linear_ce import linear_cross_entropy
    x64 = x.detach().double().requires_grad_()
    w64 = w.detach().double().requires_grad_()
    finish(linear_cross_entropy(x64, w64, t, softcap=softcap, backend="torch",
                                check_targets=False, **loss_options(kind)), kind).backward()
    return x64.grad, w64.grad


def grad_errors(fn, x, w, t, ref):
    x.grad = w.grad = None
    fn(x, w, t).backward()
    errs = rel_err(x.grad, ref[0]), rel_err(w.grad, ref[1])
    x.grad = w.grad = None
    return errs


def measure(fn, x, w, t, reps: int):
    def step():
        x.grad = None
        w.grad = None
        fn(x, w, t).backward()

    # one warm-up step first (compilation, autotuning, caches)
    extra = peak_extra_mib(step, (x, w), minus_grads=True)
    loss = float(fn(x, w, t))
    ms, p20, p80 = time_ms(step, reps, quantiles=(0.5, 0.2, 0.8), grad_to_none=[x, w])
    return ms, p20, p80, extra, loss


def measure_memory(fn, x, w, t):
    """Extra peak MiB of one step (after a warm-up step), as in measure()."""
    extra = peak_extra_mib(lambda: fn(x, w, t).backward(), (x, w), minus_grads=True)
    x.grad = w.grad = None
    return extra


def profile(fn, x, w, t, label, path):
    """Per-kernel GPU time of one forward+backward step (CUDA events via torch.profiler)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    def step():
        x.grad = w.grad = None
        fn(x, w, t).backward()

    step()
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=12,
                                      max_name_column_width=60)
    with open(path, "a") as f:
        f.write(f"== {label}\n{table}\n")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="llama3")
    ap.add_argument("--methods", default="", help="comma list; default all")
    add_out_arg(ap)
    ap.add_argument("--rep-ms", type=int, default=300)
    ap.add_argument("--profile", action="store_true",
                    help="also write per-kernel times of each method (but eager and the torch "
                         "backend) to profile.txt")
    ap.add_argument("--no-accuracy", action="store_true",
                    help="skip the float64 gradient errors (err_dh, err_dw)")
    ap.add_argument("--data", default="dense", choices=list(DATA),
                    help="logits of the inputs: dense (random, std ~2; the default), mild "
                         "(random, std ~0.5), peaked (as a trained model's, the target ~10 above "
                         "the rest)")
    ap.add_argument("--loss", default="mean", choices=LOSSES,
                    help="mean (the default), none (per-token losses, weighted sum) or lse "
                         "(per-token losses and lse: mean loss + 1e-4 mean(lse^2))")
    ap.add_argument("--curve", default="",
                    help="comma list of N: extra memory vs N at H=4096, V=128256 (no timing)")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    meta = run_meta()
    path = results_path("linear_ce", args.out)
    rows = []
    for shape in args.shapes.split(","):
        n, h, v, softcap = SHAPES[shape]
        x, w, t = make_inputs(n, h, v, args.data)
        ref = None if args.no_accuracy else reference_grads(x, w, t, softcap, args.loss)
        wanted = args.methods.split(",") if args.methods else []
        table = methods(softcap, args.loss)
        for name in wanted:  # fusedops-b<MiB>: the default backend at that memory budget
            if name.startswith("fusedops-b") and name[10:].isdigit():
                table[name] = fused_fn(softcap, args.loss, None, int(name[10:]))
        for name, fn in table.items():
            if args.methods and name not in wanted:
                continue
            rep = args.rep_ms if name not in ("fusedops-torch", "fusedops-recompute") else 100
            t0 = time.time()
            try:
                ms, p20, p80, extra, loss = measure(fn, x, w, t, rep)
                errs = (None, None) if ref is None else grad_errors(fn, x, w, t, ref)
            except Exception as exc:
                print(f"{shape} {name}: failed: {type(exc).__name__}: {exc}", file=sys.stderr)
                continue
            row = dict(op="linear_ce", method=name, shape=shape, N=n, H=h, V=v, softcap=softcap,
                       dtype="bfloat16", data=args.data, **loss_options(args.loss),
                       ms=round(ms, 3), p20=round(p20, 3),
                       p80=round(p80, 3),
                       tflops=round(6 * n * h * v / ms / 1e9, 1), extra_mib=round(extra, 1),
                       loss=round(loss, 6), err_dh=errs[0], err_dw=errs[1], **meta)
            rows.append(row)
            if args.profile and name not in ("fusedops-torch", "torch_eager"):
                profile(fn, x, w, t, f"{shape} {name}", os.path.join(args.out, "profile.txt"))
            append_rows("linear_ce", [row], args.out)
            print(f"  {shape} {name}: {ms:.2f} ms ({time.time() - t0:.0f} s)", file=sys.stderr)
            torch.cuda.empty_cache()
        del x, w, t, ref
        torch.cuda.empty_cache()
    for n in [int(c) for c in args.curve.split(",") if c]:
        h, v = 4096, 128256
        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(n, h, device="cuda", generator=g).bfloat16().requires_grad_()
        w = (torch.randn(v, h, device="cuda", generator=g) * (2.0 / h**0.5)).bfloat16()
        w.requires_grad_()
        t = torch.randint(0, v, (n,), device="cuda", generator=g)
        for name, fn in methods(None).items():
            if name not in ("fusedops", "fusedops-lowmem", "torch_eager", "liger", "cce"):
                continue
            try:
                extra = measure_memory(fn, x, w, t)
            except Exception as exc:
                print(f"curve N={n} {name}: failed: {type(exc).__name__}: {exc}", file=sys.stderr)
                continue
            row = dict(op="linear_ce", method=name, shape="curve", N=n, H=h, V=v, softcap=None,
                       dtype="bfloat16", extra_mib=round(extra, 1), **meta)
            rows.append(row)
            append_rows("linear_ce", [row], args.out)
            torch.cuda.empty_cache()
        del x, w, t
        torch.cuda.empty_cache()
    print_table(rows, [("shape", "shape", ""), ("N", "N", "d"), ("method", "method", ""),
                       ("ms", "ms", ".2f"), ("TFLOP/s", "tflops", ".1f"),
                       ("extra MiB", "extra_mib", ".1f"), ("err_dh", "err_dh", ".2e"),
                       ("err_dw", "err_dw", ".2e")],
                title=f"\n{describe(meta)} -> {path}")
    return path


if __name__ == "__main__":
    main()
