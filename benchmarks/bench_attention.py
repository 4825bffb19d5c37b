"""Benchmark: exact attention forward and backward, fusedops backends next to PyTorch SDPA's flash,
cuDNN and memory-efficient backends and FlexAttention, one run. bf16, B*L = 16384, H*D = 2048.
Appends one JSON object per measured row to benchmarks/results/attention.jsonl (or
<--out>/attention.jsonl) and prints a table.

    python benchmarks/bench_attention.py [--lengths 1024,4096,16384] [--dims 64,128]

FLOPs: forward 4*B*H*L*L*D (half when causal), backward 2.5x the forward. Times are medians of
triton.testing.do_bench (the rows of 2026-11-29 hold its mean); backward time is
(forward+backward) - forward. peak_mib is peak memory above the inputs during forward+backward.
With --rounds N (rows with a "rounds" field) every shape times its methods N times in turn, one
after another, and each row holds the median of its N times: the GPU's clock drifts over a run
(the same kernel timed 5-10% apart in runs minutes apart), and interleaving exposes every method
to the same drift.

Methods with a suffix run the fusedops backend under an environment override (METHOD_ENV):
-atomic-dq / -deterministic the dQ modes (-deterministic-ascending with the deterministic mode's
linear order of key blocks forced), -bwd80 the sm90 forward with the sm80 backward, -bwd-regs
the sm90 backward storing dK/dV from registers, -bwd-immediate its dK/dV store waited for before
the next key block, -bwd-nonpersistent its one-CTA-per-key-block launch, -bwd-lagged /
-bwd-lockstep its dQ products a step behind or not, -bwd-overlap its overlapped schedule,
-bm64 / -bm80 its query steps at D=128, -masked-steps every key step of its backward on the masked
path (a probe),
-static / -dynamic the sm90 forward's tile order, -nonpersistent its one-CTA-per-tile launch,
-m128 / -m192 its 128- or 192-query tiles at D=64, -overlap / -pingpong its consumers'
schedule, -bn176 its 176-key tiles at D=128, -mc / -nomc its K/V multicast in clusters of two
forced on (where the launch allows it) or off, -qstart / -qend its q-blocks counted from each
sequence's start or end.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
import torch.nn.functional as F
from common import (
    add_out_arg,
    append_rows,
    describe,
    env_vars,
    peak_extra_mib,
    print_table,
    results_path,
    run_meta,
    time_ms,
)

from fusedops.attention.ops import dq_mode


def sdpa(kind):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    backend = {"sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION,
               "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION}[kind]

    def fn(q, k, v, causal):
        with sdpa_kernel(backend):
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                 v.transpose(1, 2), is_causal=causal)
        return out.transpose(1, 2)
    return fn


def flex():
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    compiled = torch.compile(flex_attention)
    masks = {}

    def fn(q, k, v, causal):
        bm = None
        if causal:
            key = q.shape[1]
            if key not in masks:
                masks[key] = create_block_mask(lambda b, h, i, j: j <= i, None, None, key, key)
            bm = masks[key]
        return compiled(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                        block_mask=bm).transpose(1, 2)
    return fn


def fa4():
    """FlashAttention-4 (flash-attn-4, CuTe DSL; its sm_90 kernels on Hopper), (B, S, H, D)."""
    from flash_attn.cute import flash_attn_func
    return lambda q, k, v, causal: flash_attn_func(q, k, v, causal=causal)[0]


def fused(backend):
    from fusedops.attention import attention
    return lambda q, k, v, causal: attention(q, k, v, causal=causal, backend=backend)


def measure(fn, q, k, v, do, causal, rep_ms):
    """(forward ms, forward+backward ms, peak MiB above the inputs)."""
    def step():
        fn(q, k, v, causal).backward(do)

    peak = peak_extra_mib(step, (q, k, v))  # after one warm-up step (compilation)
    with torch.no_grad():
        fwd = time_ms(lambda: fn(q, k, v, causal), rep_ms)
    tot = time_ms(step, rep_ms, grad_to_none=[q, k, v])
    return fwd, tot, peak


# Environment overrides of the suffixed methods (read by the kernels' launchers at each call).
METHOD_ENV = {
    "-atomic-dq": {"FUSEDOPS_ATTN_DQ": "atomic"},
    "-deterministic-after": {"FUSEDOPS_ATTN_DQ": "separate",
                             "FUSEDOPS_ATTN_SM90_BWD_CONVERT": "after"},
    "-after": {"FUSEDOPS_ATTN_SM90_BWD_CONVERT": "after"},
    "-deterministic": {"FUSEDOPS_ATTN_DQ": "separate"},
    "-deterministic-ascending": {"FUSEDOPS_ATTN_DQ": "separate",
                                 "FUSEDOPS_ATTN_SM90_BWD_DQ_ORDER": "ascending"},
    "-bwd80": {"FUSEDOPS_ATTN_SM90_BWD": "sm80"},
    "-bwd-nonpersistent": {"FUSEDOPS_ATTN_SM90_BWD_PERSISTENT": "0"},  # before -nonpersistent
    "-bwd-regs": {"FUSEDOPS_ATTN_SM90_BWD_EPILOGUE": "regs"},
    "-bwd-immediate": {"FUSEDOPS_ATTN_SM90_BWD_EPILOGUE": "immediate"},
    "-bwd-lagged": {"FUSEDOPS_ATTN_SM90_BWD_SCHEDULE": "lagged"},
    "-bwd-lockstep": {"FUSEDOPS_ATTN_SM90_BWD_SCHEDULE": "lockstep"},
    "-bwd-overlap": {"FUSEDOPS_ATTN_SM90_BWD_SCHEDULE": "overlap"},  # before -overlap
    "-bm64": {"FUSEDOPS_ATTN_SM90_BWD_BM": "64"},
    "-masked-steps": {"FUSEDOPS_ATTN_SM90_BWD_DET_PROBE": "4"},
    "-bm80": {"FUSEDOPS_ATTN_SM90_BWD_BM": "80"},
    "-qstart": {"FUSEDOPS_ATTN_SM90_QALIGN": "start"},
    "-qend": {"FUSEDOPS_ATTN_SM90_QALIGN": "end"},
    "-static": {"FUSEDOPS_ATTN_SM90_TILES": "static"},
    "-dynamic": {"FUSEDOPS_ATTN_SM90_TILES": "dynamic"},
    "-nonpersistent": {"FUSEDOPS_ATTN_SM90_PERSISTENT": "0"},
    "-m128": {"FUSEDOPS_ATTN_SM90_TILE": "m128"},
    "-m192": {"FUSEDOPS_ATTN_SM90_TILE": "m192"},
    "-overlap": {"FUSEDOPS_ATTN_SM90_SCHEDULE": "overlap"},
    "-pingpong": {"FUSEDOPS_ATTN_SM90_SCHEDULE": "pingpong"},
    "-bn176": {"FUSEDOPS_ATTN_SM90_BLOCK_N": "176"},
    "-mc": {"FUSEDOPS_ATTN_SM90_MULTICAST": "1"},
    "-nomc": {"FUSEDOPS_ATTN_SM90_MULTICAST": "0"},
}


def split_method(name):
    """(backend, environment) of a method name: the fusedops backend or anchor name before a
    METHOD_ENV suffix, and that suffix's overrides."""
    for suffix, env in METHOD_ENV.items():
        if name.endswith(suffix):
            return name[: -len(suffix)], env
    return name, {}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="1024,4096,16384")
    ap.add_argument("--dims", default="64,128")
    ap.add_argument("--methods", default="cuda-sm90,cuda-sm90-bwd80,cuda-sm90-deterministic,"
                                          "cuda-sm80,triton,"
                                          "torch,sdpa_flash,sdpa_cudnn,sdpa_efficient,flex,fa4")
    ap.add_argument("--flex-lengths", default="4096", help="FlexAttention compiles per shape")
    ap.add_argument("--torch-max-length", type=int, default=1024)
    ap.add_argument("--rep-ms", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=1,
                    help="time each shape's methods this many times in turn; rows: medians")
    add_out_arg(ap)
    args = ap.parse_args()
    meta = run_meta()
    path = results_path("attention", args.out)
    makers = {"cuda-sm90": lambda: fused("cuda-sm90"), "cuda-sm80": lambda: fused("cuda-sm80"),
              "triton": lambda: fused("triton"), "torch": lambda: fused("torch"),
              "sdpa_flash": lambda: sdpa("sdpa_flash"), "sdpa_cudnn": lambda: sdpa("sdpa_cudnn"),
              "sdpa_efficient": lambda: sdpa("sdpa_efficient"), "flex": flex, "fa4": fa4}
    fns = {}
    for m in args.methods.split(","):
        backend, _ = split_method(m)
        if backend not in makers:
            ap.error(f"unknown method {m!r}")
        try:
            fns[m] = makers[backend]()
        except ImportError as exc:  # an anchor library that is not installed here
            print(f"{m}: skipped ({exc})", file=sys.stderr)
    rows = []
    for d in map(int, args.dims.split(",")):
        for length in map(int, args.lengths.split(",")):
            for causal in (False, True):
                b, h = 16384 // length, 2048 // d
                g = torch.Generator(device="cuda").manual_seed(0)
                q, k, v, do = (torch.randn(b, length, h, d, device="cuda", generator=g,
                                           dtype=torch.bfloat16) for _ in range(4))
                for t in (q, k, v):
                    t.requires_grad_()
                flops = 4 * b * h * length * length * d / (2 if causal else 1)
                times = {}  # method -> [(fwd, tot, peak)], one per round
                for _ in range(max(1, args.rounds)):
                    for name, fn in fns.items():
                        if name == "flex" and str(length) not in args.flex_lengths.split(","):
                            continue
                        if name == "torch" and length > args.torch_max_length:
                            continue
                        if name in times and times[name] is None:
                            continue  # failed in an earlier round
                        _, env = split_method(name)
                        try:
                            with env_vars(env):
                                times.setdefault(name, []).append(
                                    measure(fn, q, k, v, do, causal, args.rep_ms))
                        except Exception as exc:
                            print(f"{name} D={d} L={length} causal={causal}: "
                                  f"{type(exc).__name__}: {str(exc)[:200]}", file=sys.stderr)
                            times[name] = None
                for name, runs in times.items():
                    if not runs:
                        continue
                    backend, env = split_method(name)
                    with env_vars(env):  # dq_mode reads FUSEDOPS_ATTN_DQ
                        dq = (dq_mode(backend, d)
                              if backend in ("cuda-sm90", "cuda-sm80", "triton") else None)
                    fwd = statistics.median(r[0] for r in runs)
                    bwd = statistics.median(r[1] - r[0] for r in runs)
                    peak = runs[0][2]
                    row = dict(op="attention", method=name, B=b, H=h, L=length, D=d,
                               causal=causal, dtype="bfloat16", dq_mode=dq,
                               fwd_ms=round(fwd, 4),
                               bwd_ms=round(bwd, 4), fwd_tflops=round(flops / fwd / 1e9, 1),
                               bwd_tflops=round(2.5 * flops / bwd / 1e9, 1),
                               peak_mib=round(peak, 1), **meta)
                    if args.rounds > 1:
                        row["rounds"] = args.rounds
                    rows.append(row)
                    append_rows("attention", [row], args.out)
                del q, k, v, do
                torch.cuda.empty_cache()
    print_table(rows, [("D", "D", "d"), ("L", "L", "d"), ("causal", "causal", ""),
                       ("method", "method", ""), ("fwd TF/s", "fwd_tflops", ".1f"),
                       ("bwd TF/s", "bwd_tflops", ".1f"), ("peak MiB", "peak_mib", ".1f")],
                title=f"\n{describe(meta)} -> {path}")


if __name__ == "__main__":
    main()
