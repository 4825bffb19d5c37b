"""Plots attention benchmark rows: forward and backward TFLOP/s per method and shape.

    python benchmarks/plot_attention.py --run 753fb837 benchmarks/results/attention.png

Reads benchmarks/results/attention.jsonl (or --results); --run takes one run id or several
joined by commas (default: the file's last run).
"""

import argparse

import matplotlib
from common import add_plot_args, read_rows

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_plot_args(ap, "attention")
    args = ap.parse_args(argv)
    rows = read_rows(args.results, args.run)
    # A method timed in more than one of the runs is drawn once per run, labelled by its git sha.
    runs_of = {}
    for r in rows:
        runs_of.setdefault(r["method"], dict.fromkeys(()))[r["run"]] = None
    for r in rows:
        r["label"] = (f"{r['method']} ({r['git']})" if len(runs_of[r["method"]]) > 1
                      else r["method"])
    configs = list(dict.fromkeys((r["D"], r["L"], r["causal"]) for r in rows))
    methods = list(dict.fromkeys(r["label"] for r in rows))
    fig, axes = plt.subplots(2, 1, figsize=(14, 8))
    width = 0.8 / len(methods)
    for ax, key in zip(axes, ("fwd_tflops", "bwd_tflops"), strict=True):
        for i, m in enumerate(methods):
            xs, ys = [], []
            for j, c in enumerate(configs):
                hit = [r for r in rows if (r["D"], r["L"], r["causal"]) == c and r["label"] == m]
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
    fig.savefig(args.out, dpi=80)
    print(args.out)


if __name__ == "__main__":
    main()
