"""Benchmark: the Hopper GEMMs of the linear cross-entropy (torch.ops.fusedops.lce_gemm_sm90)
against cuBLAS (torch.mm / Tensor.addmm_) at the linear cross-entropy's products per token
chunk: logits z = X W^T (layout 1), d_hidden = dz W (layout 2), d_weight += dz^T X (layout 3,
accumulated as in every chunk but the first; "d_weight_first" overwrites), and "logits_stats", the
logits GEMM with the cross-entropy statistics in its epilogue plus the combine kernel
(lce_logits_ce_stats_sm90; its cuBLAS row is torch.mm alone, so the difference to "logits" is
the epilogue's cost). Prints a table;
appends one JSON object per measured row to benchmarks/results/lce_gemm.jsonl (or
<--out>/lce_gemm.jsonl).

    python benchmarks/bench_gemm_sm90.py                    # Llama-3 and Gemma-2, rows 2048, 4096
    python benchmarks/bench_gemm_sm90.py --shapes llama3-2048 --gemms logits --out DIR
    python benchmarks/bench_gemm_sm90.py --sanitize         # tiny cases of every instantiation
    python benchmarks/bench_gemm_sm90.py --sanitize-run     # those under compute-sanitizer
                                                            # memcheck, racecheck, synccheck

"ms" is the median of triton.testing.do_bench (L2 cleared before each call), "p20"/"p80" its
20th and 80th percentiles, "tflops" 2 M N K / ms, "rel_diff" max |ours - cuBLAS| / max |cuBLAS|
on the same inputs (both round once to bf16: expect ~1e-2 at most).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import torch
from common import (
    add_out_arg,
    append_rows,
    describe,
    find_sanitizer,
    print_table,
    run_meta,
    sanitizer_verdict,
    time_ms,
)

SHAPES = {  # name: (rows per token chunk, H, V)
    "llama3-2048": (2048, 4096, 128256),
    "llama3-4096": (4096, 4096, 128256),
    "gemma2-2048": (2048, 2304, 256000),
    "gemma2-4096": (4096, 2304, 256000),
}
GEMMS = ("logits", "d_hidden", "d_weight", "d_weight_first", "logits_stats")


def _gemm_sm90():
    from fusedops.linear_ce import gemm_sm90
    return gemm_sm90


def problems(rows, h, v, dtype, which):
    """name -> (layout, accumulate, M, N, K, ours(), cublas(), out tensor, reset()) for the
    products of one token chunk; each closure writes its output in place."""
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(rows, h, generator=g, device="cuda").to(dtype)
    w = (torch.randn(v, h, generator=g, device="cuda") * 0.02).to(dtype)
    dz = (torch.randn(rows, v, generator=g, device="cuda") * 1e-3).to(dtype)
    gemm = _gemm_sm90().gemm
    out = {}
    if "logits" in which:
        z = torch.empty(rows, v, device="cuda", dtype=dtype)
        out["logits"] = (1, False, rows, v, h, lambda: gemm(x, w, z, 1),
                         lambda: torch.mm(x, w.T, out=z), z, None)
    if "logits_stats" in which:
        zs = torch.empty(rows, v, device="cuda", dtype=dtype)
        sm90 = _gemm_sm90()
        t = torch.randint(0, v, (rows,), generator=g, device="cuda")
        part = torch.empty(rows, sm90.stats_tiles(v), 4, device="cuda")
        lse, zt, zsum = (torch.empty(rows, device="cuda") for _ in range(3))
        out["logits_stats"] = (
            1, False, rows, v, h,
            lambda: sm90.logits_ce_stats(x, w, zs, None, t, 0.0, part, lse, zt, zsum),
            lambda: torch.mm(x, w.T, out=zs), zs, None)
    if "d_hidden" in which:
        dh = torch.empty(rows, h, device="cuda", dtype=dtype)
        out["d_hidden"] = (2, False, rows, h, v, lambda: gemm(dz, w, dh, 2),
                           lambda: torch.mm(dz, w, out=dh), dh, None)
    if "d_weight" in which or "d_weight_first" in which:
        dw = torch.empty(v, h, device="cuda", dtype=dtype)
        dw0 = (torch.randn(v, h, generator=g, device="cuda") * 1e-2).to(dtype)

        def reset():
            dw.copy_(dw0)

        if "d_weight" in which:
            out["d_weight"] = (3, True, v, h, rows, lambda: gemm(dz, x, dw, 3, True),
                               lambda: dw.addmm_(dz.T, x), dw, reset)
        if "d_weight_first" in which:
            out["d_weight_first"] = (3, False, v, h, rows, lambda: gemm(dz, x, dw, 3, False),
                                     lambda: torch.mm(dz.T, x, out=dw), dw, reset)
    return out


def rel_diff(ours, cublas, res, reset):
    """Runs both once on the same inputs (and the same old C) and compares their outputs."""
    if reset:
        reset()
    ours()
    a = res.clone()
    if reset:
        reset()
    cublas()
    b = res.float()
    return float((a.float() - b).abs().max() / b.abs().max().clamp(min=1e-30))


def bench(args):
    meta = run_meta()
    dtype = getattr(torch, args.dtype)
    rows_out = []
    which = [x for x in args.gemms.split(",") if x]
    for shape in [s for s in args.shapes.split(",") if s]:
        rows, h, v = SHAPES[shape]
        probs = problems(rows, h, v, dtype, which)
        for name in which:
            layout, acc, m, n, k, ours, cublas, res, reset = probs[name]
            diff = rel_diff(ours, cublas, res, reset)
            for method, fn in (("fusedops-sm90", ours), ("cublas", cublas)):
                if reset:
                    reset()
                t0 = time.time()
                p50, p20, p80 = time_ms(fn, args.rep_ms, quantiles=(0.5, 0.2, 0.8))
                row = dict(op="lce_gemm", method=method, gemm=name, shape=shape, rows=rows, H=h,
                           V=v, M=m, N=n, K=k, layout=layout, accumulate=acc,
                           dtype=args.dtype, ms=round(p50, 4), p20=round(p20, 4),
                           p80=round(p80, 4), tflops=round(2 * m * n * k / p50 / 1e9, 1),
                           rel_diff=diff, **meta)
                rows_out.append(row)
                path = append_rows("lce_gemm", [row], args.out)
                print(f"  {shape} {name} {method}: {p50:.3f} ms ({time.time() - t0:.0f} s)",
                      file=sys.stderr)
        del probs
        torch.cuda.empty_cache()
    print_table(rows_out, [("shape", "shape", ""), ("gemm", "gemm", ""), ("M", "M", "d"),
                           ("N", "N", "d"), ("K", "K", "d"), ("method", "method", ""),
                           ("ms", "ms", ".3f"), ("TFLOP/s", "tflops", ".1f"),
                           ("rel_diff", "rel_diff", ".1e")],
                title=f"\n{describe(meta)} -> {path}")
    by = {(r["shape"], r["gemm"], r["method"]): r for r in rows_out}
    for shape in dict.fromkeys(r["shape"] for r in rows_out):
        ratios = []
        for g in which:
            if (shape, g, "cublas") in by:
                speedup = by[(shape, g, "cublas")]["ms"] / by[(shape, g, "fusedops-sm90")]["ms"]
                ratios.append(f"{g} {speedup:.2f}x")
        print(f"{shape}: cuBLAS time / ours: {', '.join(ratios)}")


SANITIZE_CASES = [  # (layout, accumulate, M, N, K, k-splits): ragged edges, several tiles per CTA
    (1, False, 133, 520, 136, 1), (2, False, 133, 520, 136, 1), (3, False, 136, 520, 133, 1),
    (3, True, 136, 520, 133, 1), (1, False, 1, 8, 8, 1), (3, True, 8, 8, 1, 1),
    (1, False, 133, 522, 101, 1), (3, True, 134, 522, 133, 1),  # padded rows, odd inner sizes
    (2, False, 133, 522, 1100, 3),  # split-K and its reduction, with a ragged last 4 columns
]


def _padded(x):
    """x as a view into rows padded to a multiple of 8 elements (TMA's row-stride rule)."""
    buf = torch.zeros(x.shape[0], (x.shape[1] + 7) // 8 * 8, device=x.device, dtype=x.dtype)
    buf[:, :x.shape[1]] = x
    return buf[:, :x.shape[1]]


def sanitize_cases():
    """Each instantiation (bf16/fp16 x layouts 1, 2, 3, + accumulate, + layout 2's split-K and
    its reduction) once on small ragged shapes, checked loosely against torch (the tests check
    tightly)."""
    gemm = _gemm_sm90().gemm
    for dtype in (torch.bfloat16, torch.float16):
        for layout, acc, m, n, k, splits in SANITIZE_CASES:
            os.environ["FUSEDOPS_LCE_GEMM_SPLITK"] = str(splits)
            g = torch.Generator(device="cuda").manual_seed(1)
            a = torch.randn((k, m) if layout == 3 else (m, k), generator=g, device="cuda")
            b = torch.randn((n, k) if layout == 1 else (k, n), generator=g, device="cuda")
            out = torch.randn(m, n, generator=g, device="cuda")
            a, b, out = _padded(a.to(dtype)), _padded(b.to(dtype)), _padded(out.to(dtype))
            af, bf = a.float(), b.float()
            ref = af @ bf.T if layout == 1 else (af @ bf if layout == 2 else af.T @ bf)
            if acc:
                ref = ref + out.float()
            gemm(a, b, out, layout, acc)
            err = float((out.float() - ref).abs().max())
            if not err <= 0.05 * float(ref.abs().max()) + 1e-2:
                raise SystemExit(f"sanitize case {layout, acc, m, n, k} {dtype}: error {err}")
    os.environ.pop("FUSEDOPS_LCE_GEMM_SPLITK")
    sanitize_stats_cases()
    sanitize_dz_cases()
    torch.cuda.synchronize()
    print("sanitize cases ran")


STATS_SANITIZE_CASES = [  # (M, V, K, bias, softcap, padded z): ragged, several tiles per CTA
    (133, 520, 136, True, 5.0, False), (1, 8, 8, False, 0.0, False),
    (300, 1000, 72, True, 0.0, True), (130, 523, 64, True, 30.0, True),
]


def sanitize_stats_cases():
    """The statistics epilogue (bf16/fp16) and its combine kernel on small ragged shapes, lse
    checked loosely against torch (tests/linear_ce/test_lce_fused_sm90.py checks tightly)."""
    sm90 = _gemm_sm90()
    if not sm90.stats_op_available():
        print("stats sanitize cases skipped: no lce_logits_ce_stats_sm90 op")
        return
    for dtype in (torch.bfloat16, torch.float16):
        for m, v, k, bias, cap, padded in STATS_SANITIZE_CASES:
            g = torch.Generator(device="cuda").manual_seed(2)
            x = torch.randn(m, k, generator=g, device="cuda").to(dtype)
            w = (torch.randn(v, k, generator=g, device="cuda") / 4).to(dtype)
            b = torch.randn(v, generator=g, device="cuda") if bias else None
            t = torch.randint(0, v, (m,), generator=g, device="cuda")
            t[::3] = -100
            z = torch.empty(m, v, device="cuda", dtype=dtype)
            if padded:
                z = _padded(z)
            part = torch.empty(m, sm90.stats_tiles(v), 4, device="cuda")
            lse, zt, zsum = (torch.empty(m, device="cuda") for _ in range(3))
            sm90.logits_ce_stats(x, w, z, b, t, cap, part, lse, zt, zsum)
            logits = z.float() + (b if bias else 0.0)
            if cap:
                logits = cap * torch.tanh(logits / cap)
            err = float((lse - torch.logsumexp(logits, 1)).abs().max())
            if not err <= 1e-3:
                raise SystemExit(f"stats sanitize case {m, v, k, bias, cap} {dtype}: lse error "
                                 f"{err}")


DZ_SANITIZE_CASES = [  # (layout, accumulate, tokens, V, H, bias, softcap, split-K, padded z)
    (2, False, 133, 520, 136, True, 5.0, 1, True), (2, False, 130, 1024, 72, False, 0.0, 2, False),
    (3, False, 133, 520, 136, True, 5.0, 1, True), (3, True, 1, 8, 8, True, 0.0, 1, False),
]


def sanitize_dz_cases():
    """The dz-prologue GEMMs (bf16/fp16 x layout 2, its split-K, layout 3, accumulating, d_bias)
    on small ragged shapes, checked loosely against torch (tests/linear_ce/test_lce_dz_sm90.py
    checks tightly)."""
    sm90 = _gemm_sm90()
    if not sm90.dz_op_available():
        print("dz sanitize cases skipped: no lce_dz_gemm_sm90 op")
        return
    for dtype in (torch.bfloat16, torch.float16):
        for layout, acc, n, v, h, bias, cap, splits, padded in DZ_SANITIZE_CASES:
            os.environ["FUSEDOPS_LCE_GEMM_SPLITK"] = str(splits)
            g = torch.Generator(device="cuda").manual_seed(3)
            z = (torch.randn(n, v, generator=g, device="cuda") * 2).to(dtype)
            if padded:
                z = _padded(z)
            b = torch.randn(v, generator=g, device="cuda") * 0.3 if bias else None
            t = torch.randint(0, v, (n,), generator=g, device="cuda")
            t[::3] = -100
            logits = z.float() + (b if bias else 0.0)
            if cap:
                logits = cap * torch.tanh(logits / cap)
            lse = torch.logsumexp(logits, 1)
            w = torch.where(t == -100, 0.0, 1.0 / n)
            bm = torch.randn(v if layout == 2 else n, h, generator=g, device="cuda").to(dtype)
            out = torch.randn(n if layout == 2 else v, h, generator=g, device="cuda").to(dtype)
            old = out.float()
            dbias = torch.empty(v, device="cuda") if layout == 3 else None
            sm90.dz_gemm(z, bm, out, layout, acc, b, lse, w, t, 0.1, 1e-3, cap, dbias)
            p = torch.softmax(logits, 1)
            onehot = torch.zeros_like(p)
            inside = t >= 0
            onehot[inside] = torch.nn.functional.one_hot(t[inside], v).float()
            dz = w[:, None] * (p * (1 + 2e-3 * lse[:, None]) - 0.1 / v - 0.9 * onehot)
            if cap:
                dz = dz * (1 - (logits / cap) ** 2)
            ref = dz @ bm.float() if layout == 2 else dz.T @ bm.float()
            if acc:
                ref = ref + old
            err = float((out.float() - ref).abs().max())
            if not err <= 0.05 * float(ref.abs().max()) + 1e-2:
                raise SystemExit(f"dz sanitize case {layout, acc, n, v, h} {dtype}: error {err}")
    os.environ.pop("FUSEDOPS_LCE_GEMM_SPLITK")


def sanitize_run():
    exe = find_sanitizer()
    if exe is None:
        print("FAIL sanitize: compute-sanitizer not found (PATH, $CUDA_HOME/bin, /usr/local/cuda)")
        return 1
    bad = 0
    for tool in ("memcheck", "racecheck", "synccheck"):
        env = dict(os.environ, PYTORCH_NO_CUDA_MEMORY_CACHING="1")
        t0 = time.time()
        proc = subprocess.run([exe, "--tool", tool, "--error-exitcode", "3", sys.executable,
                               os.path.abspath(__file__), "--sanitize"],
                              env=env, capture_output=True, text=True, timeout=600)
        text = proc.stdout + proc.stderr
        bad += not sanitizer_verdict(tool, proc.returncode, text, time.time() - t0)
    return bad


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--gemms", default=",".join(GEMMS), help=f"comma list of {', '.join(GEMMS)}")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--rep-ms", type=int, default=100)
    ap.add_argument("--sanitize", action="store_true", help="only the tiny sanitizer cases")
    ap.add_argument("--sanitize-run", action="store_true",
                    help="run --sanitize under compute-sanitizer memcheck, racecheck, synccheck")
    add_out_arg(ap)
    args = ap.parse_args()
    if args.sanitize:
        sanitize_cases()
        return 0
    if args.sanitize_run:
        return 1 if sanitize_run() else 0
    if not _gemm_sm90().supported(torch.device("cuda")):
        print("lce_gemm_sm90 needs a compute capability 9.0 GPU and fusedops._C built for 9.0a")
        return 1
    bench(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
