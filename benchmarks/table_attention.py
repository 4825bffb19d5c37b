"""Prints the README's Hopper attention table (markdown) from benchmark rows.

    python benchmarks/table_attention.py --run 6b795a91

Reads benchmarks/results/attention.jsonl (or --results); --run takes one run id or several
joined by commas (default: the file's last run). Per (D, L, causal), each cell is the median
over the selected rows of a method (a row is already the median of its run's rounds): forward
and backward TFLOP/s of cuda-sm90, SDPA's cuDNN backend and FlashAttention-4 ("fa4"), the
deterministic backward, cuda-sm90 over the faster of cuDNN and FA4 ("best"), and the time of
forward + backward over FA4's ("step"). Missing methods print "-".
"""

import argparse
import statistics

from common import add_run_args, read_rows

FWD = ("cuda-sm90", "sdpa_cudnn", "fa4")
BWD = ("cuda-sm90", "cuda-sm90-deterministic", "sdpa_cudnn", "fa4")


def table(rows: list[dict]) -> list[str]:
    """The markdown lines of the table for `rows` (attention.jsonl rows)."""
    cells: dict = {}
    for r in rows:
        cells.setdefault((r["D"], r["L"], bool(r["causal"])), {}).setdefault(
            r["method"], []).append(r)

    def med(shape, method, field):
        hit = cells[shape].get(method)
        return statistics.median(r[field] for r in hit) if hit else None

    def num(x):
        return "-" if x is None else f"{x:.0f}"

    def share(ours, *others):
        best = max((x for x in others if x is not None), default=None)
        return "-" if ours is None or best is None else f"{ours / best:.0%}"

    out = ["| D | L | causal | fwd cuda-sm90 | fwd cuDNN | fwd FA4 | sm90 / best | bwd cuda-sm90 "
           "| bwd deterministic | bwd cuDNN | bwd FA4 | sm90 / best | step / FA4 |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for shape in sorted(cells):
        f = [med(shape, m, "fwd_tflops") for m in FWD]
        b = [med(shape, m, "bwd_tflops") for m in BWD]
        times = [med(shape, m, k) for m in ("cuda-sm90", "fa4") for k in ("fwd_ms", "bwd_ms")]
        step = ("-" if None in times
                else f"{(times[0] + times[1]) / (times[2] + times[3]):.2f}x")
        d, seq, causal = shape
        out.append(f"| {d} | {seq} | {'yes' if causal else 'no'} | **{num(f[0])}** | {num(f[1])} "
                   f"| {num(f[2])} | {share(f[0], f[1], f[2])} | **{num(b[0])}** | {num(b[1])} "
                   f"| {num(b[2])} | {num(b[3])} | {share(b[0], b[2], b[3])} | {step} |")
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_args(ap, "attention")
    args = ap.parse_args(argv)
    print("\n".join(table(read_rows(args.results, args.run))))


if __name__ == "__main__":
    main()
