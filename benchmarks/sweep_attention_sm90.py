"""Forward launch variants of the Hopper attention kernels against their default, on the GPU.

The sm90 launcher reads its FUSEDOPS_ATTN_SM90_* overrides at every call (docs/attention_sm90.md,
"Switches"); this script times the cuda-sm90 forward under each variant's overrides, the variants
of a shape in interleaved rounds (the median of each), bf16, B*L = 16384, H*D = 2048. The
measured tables of csrc/attention/attention_config_sm90.h (schedule, tiles, persistence,
multicast) are chosen from such sweeps. Prints one line per shape and appends one row per
(shape, variant) to benchmarks/results/attention_sweep.jsonl (or <--out>/attention_sweep.jsonl),
method "cuda-sm90" with the variant's name ("launch") and overrides ("env").

    python benchmarks/sweep_attention_sm90.py --dims 64 --lengths 1024,4096,16384 --rounds 7
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import add_out_arg, append_rows, env_vars, run_meta, time_ms  # noqa: E402

# name -> overrides, per head dim ("default": none, the measured tables)
VARIANTS = {
    64: {"default": {}, "overlap": {"FUSEDOPS_ATTN_SM90_SCHEDULE": "overlap"},
         "pingpong": {"FUSEDOPS_ATTN_SM90_SCHEDULE": "pingpong"},
         "m128": {"FUSEDOPS_ATTN_SM90_TILE": "m128"},
         "nonpersistent": {"FUSEDOPS_ATTN_SM90_PERSISTENT": "0"},
         "poly": {"FUSEDOPS_ATTN_SM90_EXP2": "poly"}},
    128: {"default": {}, "overlap": {"FUSEDOPS_ATTN_SM90_SCHEDULE": "overlap"},
          "pingpong": {"FUSEDOPS_ATTN_SM90_SCHEDULE": "pingpong"},
          "multicast-off": {"FUSEDOPS_ATTN_SM90_MULTICAST": "0"},
          "multicast-on": {"FUSEDOPS_ATTN_SM90_MULTICAST": "1"},
          "overlap-mc0": {"FUSEDOPS_ATTN_SM90_SCHEDULE": "overlap",
                          "FUSEDOPS_ATTN_SM90_MULTICAST": "0"},
          "pingpong-mc1": {"FUSEDOPS_ATTN_SM90_SCHEDULE": "pingpong",
                           "FUSEDOPS_ATTN_SM90_MULTICAST": "1"},
          "nonpersistent": {"FUSEDOPS_ATTN_SM90_PERSISTENT": "0"},
          "bn176": {"FUSEDOPS_ATTN_SM90_BLOCK_N": "176"},
          "poly": {"FUSEDOPS_ATTN_SM90_EXP2": "poly"}},
}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dims", default="64,128")
    ap.add_argument("--lengths", default="1024,4096,16384")
    ap.add_argument("--causal", default="0,1", help="0, 1 or both (0,1)")
    ap.add_argument("--variants", default="", help="comma list of variant names; default all")
    ap.add_argument("--keys", choices=("randn", "settle", "scaled"), default="randn",
                    help="settle: keys after each sequence's first 128 scaled by 2.5, so that "
                         "the scores settle a few log2 units above the first key tile's maximum; "
                         "scaled: every key scaled by 2.5 (the same magnitudes, no settling)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--rep-ms", type=int, default=40)
    add_out_arg(ap)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU (compute capability 9.0)")
    from fusedops.attention import attention

    meta = run_meta()
    wanted = set(filter(None, args.variants.split(",")))
    for d in map(int, args.dims.split(",")):
        variants = {n: e for n, e in VARIANTS[d].items() if not wanted or n in wanted}
        for length in map(int, args.lengths.split(",")):
            for causal in (c == "1" for c in args.causal.split(",")):
                b, h = 16384 // length, 2048 // d
                g = torch.Generator(device="cuda").manual_seed(0)
                q, k, v = (torch.randn(b, length, h, d, device="cuda", generator=g,
                                       dtype=torch.bfloat16) for _ in range(3))
                if args.keys != "randn":
                    k[:, 128 if args.keys == "settle" else 0:] *= 2.5
                flops = 4 * b * h * length * length * d / (2 if causal else 1)

                def fwd(q=q, k=k, v=v, causal=causal):
                    return attention(q, k, v, causal=causal, backend="cuda-sm90")

                ms = {n: [] for n in variants}
                with torch.no_grad():
                    for _ in range(max(1, args.rounds)):
                        for name, env in variants.items():
                            with env_vars(env):
                                ms[name].append(time_ms(fwd, args.rep_ms))
                rows = []
                for name, env in variants.items():
                    med = statistics.median(ms[name])
                    rows.append(dict(op="attention_sweep", method="cuda-sm90", launch=name,
                                     env=env, B=b, H=h, L=length, D=d, causal=causal,
                                     dtype="bfloat16", keys=args.keys, fwd_ms=round(med, 4),
                                     fwd_tflops=round(flops / med / 1e9, 1),
                                     rounds=args.rounds, **meta))
                append_rows("attention_sweep", rows, args.out)
                print(f"D={d} L={length} causal={int(causal)} keys={args.keys} " + " ".join(
                    f"{r['launch']}={r['fwd_tflops']:.0f}" for r in rows), flush=True)


if __name__ == "__main__":
    main()
