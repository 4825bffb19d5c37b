"""Plots linear_ce benchmark rows: time and extra memory per method and shape, and the
extra-memory-vs-N curve when the runs have one.

    python benchmarks/plot_linear_ce.py --run f44e8a84,c3d1e595 benchmarks/results/linear_ce.png

Reads benchmarks/results/linear_ce.jsonl (or --results); --run takes one run id or several
joined by commas (default: the file's last run): the shape rows come from the first run that has
any (of one data mode), the curve from every run listed.
"""

import argparse

import matplotlib
from common import add_plot_args, read_rows

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_plot_args(ap, "linear_ce")
    args = ap.parse_args(argv)
    rows = read_rows(args.results, args.run)
    curve = [r for r in rows if r["shape"] == "curve"]
    rows = [r for r in rows if r["shape"] != "curve"]
    order = args.run.split(",") if args.run != "last" else []
    first = next((run for run in order if any(r["run"] == run for r in rows)), None)
    if first is not None:
        rows = [r for r in rows if r["run"] == first]
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    ncols = len(shapes) + (1 if curve else 0)
    fig, axes = plt.subplots(2, ncols, figsize=(5.5 * ncols, 7.5), squeeze=False)
    for col, shape in enumerate(shapes):
        rs = [r for r in rows if r["shape"] == shape]
        names = [r["method"].replace("fusedops-", "fo-") for r in rs]
        colors = ["tab:blue" if r["method"].startswith("fusedops") else "tab:gray" for r in rs]
        r0 = rs[0]
        title = f"{shape}: N={r0['N']} H={r0['H']} V={r0['V']}"
        ax = axes[0][col]
        ax.barh(names, [r["ms"] for r in rs], color=colors)
        ax.set_title(title)
        ax.set_xlabel("forward+backward, ms (lower is better)")
        ax.invert_yaxis()
        ax = axes[1][col]
        ax.barh(names, [max(r["extra_mib"], 0.1) for r in rs], color=colors)
        ax.set_xscale("log")
        ax.set_xlabel("extra peak memory, MiB (log)")
        ax.invert_yaxis()
    if curve:
        ax = axes[0][-1]
        for method in dict.fromkeys(r["method"] for r in curve):
            pts = sorted((r["N"], r["extra_mib"]) for r in curve if r["method"] == method)
            ax.plot([p[0] for p in pts], [max(p[1], 0.1) for p in pts], marker="o", label=method)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tokens N (H=4096, V=128256)")
        ax.set_ylabel("extra peak memory, MiB")
        ax.set_title("extra memory vs N")
        ax.legend(fontsize=8)
        axes[1][-1].axis("off")
    r0 = (rows or curve)[0]
    data = f", {r0['data']} logits" if r0.get("data") else ""
    fig.suptitle(f"fused linear cross-entropy, bf16{data}, {r0['gpu']}, torch {r0['torch']}, "
                 f"git {r0['git']}, {r0['date']}")
    fig.tight_layout()
    fig.savefig(args.out, dpi=90)
    print(args.out)


if __name__ == "__main__":
    main()
