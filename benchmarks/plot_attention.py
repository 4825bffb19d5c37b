"""Plots attention benchmark runs (JSON lines): forward and backward TFLOP/s per method.

    python benchmarks/plot_attention.py out.png run1.jsonl [run2.jsonl ...]
"""

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(out, *paths):
    rows = [json.loads(line) for p in paths for line in open(p)]
    configs = list(dict.fromkeys((r["D"], r["L"], r["causal"]) for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    fig, axes = plt.subplots(2, 1, figsize=(14, 8))
    width = 0.8 / len(methods)
    for ax, key in zip(axes, ("fwd_tflops", "bwd_tflops"), strict=True):
        for i, m in enumerate(methods):
            xs, ys = [], []
            for j, c in enumerate(configs):
                hit = [r for r in rows if (r["D"], r["L"], r["causal"]) == c and r["method"] == m]
                if hit:
                    xs.append(j + i * width)
                    ys.append(hit[0][key])
            ax.bar(xs, ys, width, label=m)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(configs))])
        ax.set_xticklabels([f"D{d} L{n}{' causal' if c else ''}" for d, n, c in configs],
                           rotation=30, ha="right", fontsize=8)
        ax.set_ylabel(f"{key.split('_')[0]} TFLOP/s")
    axes[0].legend(ncol=4, fontsize=8)
    r0 = rows[0]
    fig.suptitle(f"attention, bf16, B*L=16384, H*D=2048, {r0['gpu']}, torch {r0['torch']}, "
                 f"{r0['date']}")
    fig.tight_layout()
    fig.savefig(out, dpi=80)
    print(out)


if __name__ == "__main__":
    main(*sys.argv[1:])
