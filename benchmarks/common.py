"""What the benchmark scripts share: run metadata, timing and memory measurement, the per-op
results files (benchmarks/results/<op>.jsonl, one JSON object per line, appended) and the table.

Torch and Triton are imported only inside the functions that need them, so the plot scripts can
read results without either.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import json
import os
import subprocess
import uuid

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


@contextlib.contextmanager
def env_vars(values: dict):
    """The environment variables of `values` set inside the block, each restored (or removed)
    after: the switches that fusedops reads at each call."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, old in saved.items():
            if old is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = old


def env_set(name: str, value: str):
    """env_vars of one variable."""
    return env_vars({name: value})


def git_sha() -> str:
    """Short sha of the checkout; FUSEDOPS_GIT overrides it (the GPU machine's copy of the tree
    has no .git, so the device scripts pass the sha in)."""
    env = os.environ.get("FUSEDOPS_GIT")
    if env:
        return env
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True,
                                       cwd=os.path.dirname(os.path.abspath(__file__)),
                                       stderr=subprocess.DEVNULL).strip()
    except Exception:
        return "unknown"


@functools.cache
def _meta() -> tuple:
    import torch
    try:
        import triton
        triton_version = triton.__version__
    except Exception:  # not installed
        triton_version = None
    stamp = datetime.datetime.now(datetime.timezone.utc)
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    meta = dict(gpu=gpu, torch=torch.__version__, triton=triton_version, git=git_sha(),
                run=uuid.uuid4().hex[:8], date=f"{stamp:%Y-%m-%d}", time=f"{stamp:%H:%M:%S}")
    variant = os.environ.get("FUSEDOPS_BENCH_VARIANT")
    if variant:
        meta["variant"] = variant
    return tuple(meta.items())


def run_meta() -> dict:
    """gpu, torch, triton, git, run (a new 8-hex id), date and time (UTC) of this process's run,
    fixed at the first call so that every row of the run carries the same values. With
    FUSEDOPS_BENCH_VARIANT set (what a variant build changed, e.g. its sed script), also
    "variant"."""
    return dict(_meta())


def describe(meta: dict | None = None) -> str:
    """One line naming the run: GPU, versions, git sha, run id."""
    m = meta or run_meta()
    return (f"{m['gpu']}, torch {m['torch']}, triton {m['triton']}, git {m['git']}, "
            f"run {m['run']}")


def add_out_arg(parser) -> None:
    """The --out option every bench script takes (the device scripts pass --out $OUT)."""
    parser.add_argument("--out", default=RESULTS_DIR,
                        help="folder of the <op>.jsonl results files (default benchmarks/results)")


def results_path(op: str, out_dir: str | None = None) -> str:
    """<out_dir>/<op>.jsonl, out_dir defaulting to benchmarks/results/."""
    return os.path.join(out_dir or RESULTS_DIR, f"{op}.jsonl")


def append_rows(op: str, rows, out_dir: str | None = None) -> str:
    """Appends rows (dicts whose "op" is op) as JSON lines to <out_dir>/<op>.jsonl, creating the
    folder and file when needed; returns the path. Scripts call it once per measured row, so a
    run that fails halfway keeps what it measured."""
    rows = list(rows)
    for r in rows:
        if r.get("op") != op:
            raise ValueError(f"row of op {r.get('op')!r} appended to {op}.jsonl")
    path = results_path(op, out_dir)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "a") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return path


def read_rows(path: str, run: str | None = "last") -> list[dict]:
    """The rows of a results file, in file order: those of run `run` (an id, or several joined
    by commas), of the file's last run by default, or all of them for run=None. Raises
    ValueError when no row matches."""
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    if run == "last" and rows:
        run = rows[-1].get("run")
    if run is not None:
        runs = set(run.split(","))
        rows = [r for r in rows if r.get("run") in runs]
    if not rows:
        raise ValueError(f"no rows{f' with run {run}' if run else ''} in {path}")
    return rows


def add_plot_args(parser, op: str) -> None:
    """The options of the plot scripts: the PNG to write, --run, --results."""
    parser.add_argument("out", help="the PNG to write")
    add_run_args(parser, op)


def add_run_args(parser, op: str) -> None:
    """--run and --results: which rows of benchmarks/results/<op>.jsonl a script reads."""
    parser.add_argument("--run", default="last",
                        help="run id(s), comma-separated (default: the file's last run)")
    parser.add_argument("--results", default=results_path(op),
                        help=f"results file (default benchmarks/results/{op}.jsonl)")


def time_ms(fn, rep_ms: int = 100, *, warmup_ms: int = 25, grad_to_none=None, quantiles=None):
    """Median time of fn() in ms by triton.testing.do_bench (CUDA events, L2 cleared before each
    call, warm-up calls first, rep_ms of measured calls); with quantiles (e.g. (0.5, 0.2, 0.8))
    the list of those quantiles instead. grad_to_none: tensors whose .grad is dropped before
    each call."""
    import triton.testing
    return triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, grad_to_none=grad_to_none,
                                   quantiles=list(quantiles) if quantiles else [0.5])


def peak_extra_mib(step, grads_of=(), *, minus_grads: bool = False, warmup: int = 1) -> float:
    """Peak CUDA memory of one call of step() above what was allocated before it, in MiB, after
    `warmup` calls (compilation, autotuning, caches). The .grad of each tensor in grads_of is
    dropped before the warm-up and before the measured call; with minus_grads the bytes of the
    gradients the call leaves there are not counted (the method's scratch only)."""
    import torch

    def drop_grads():
        for t in grads_of:
            t.grad = None

    drop_grads()
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    drop_grads()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before
    if minus_grads:
        extra -= sum(t.grad.numel() * t.grad.element_size() for t in grads_of
                     if t.grad is not None)
    return extra / 2**20


def print_table(rows, columns, title: str | None = None) -> None:
    """Prints rows as a table. columns: (header, key, format spec) triples, e.g. ("ms", "ms",
    ".2f"); an empty spec prints str(value). Numbers are right-aligned, text left; "-" where a
    row has no value."""
    def cell(row, key, spec):
        v = row.get(key)
        if v is None:
            return "-"
        return format(v, spec) if spec else str(v)

    cells = [[cell(r, key, spec) for _, key, spec in columns] for r in rows]
    widths = [max([len(h)] + [len(c[i]) for c in cells]) for i, (h, _, _) in enumerate(columns)]
    right = [bool(spec) for _, _, spec in columns]
    if title:
        print(title)
    print(" ".join(h.rjust(w) if r else h.ljust(w)
                   for (h, _, _), w, r in zip(columns, widths, right, strict=True)))
    for c in cells:
        print(" ".join(v.rjust(w) if r else v.ljust(w)
                       for v, w, r in zip(c, widths, right, strict=True)))


def find_sanitizer() -> str | None:
    """compute-sanitizer from PATH, $CUDA_HOME/bin or /usr/local/cuda/bin; None when absent."""
    import shutil

    exe = shutil.which("compute-sanitizer")
    for root in (os.environ.get("CUDA_HOME", ""), "/usr/local/cuda"):
        cand = os.path.join(root, "bin", "compute-sanitizer")
        if exe is None and root and os.path.exists(cand):
            exe = cand
    return exe


def sanitizer_verdict(tool: str, returncode: int, text: str, seconds: float) -> bool:
    """Prints a PASS/FAIL line for one compute-sanitizer run of a script whose cases end by
    printing "sanitize cases ran" (the error summary of the tool, and the output's tail on
    failure); True when it passed."""
    ok = returncode == 0 and "sanitize cases ran" in text
    summary = [ln for ln in text.splitlines() if "ERROR SUMMARY" in ln or "RACECHECK" in ln]
    print(f"{'PASS' if ok else 'FAIL'} sanitize {tool:<9} rc={returncode} {seconds:.0f}s "
          f"{' | '.join(summary[-2:])}")
    if not ok:
        print("\n".join(text.splitlines()[-25:]))
    return ok
