"""Vocab-parallel linear_cross_entropy (process_group / vocab_start / DTensor weights).

Two and four gloo processes on CPU against one process on the full weight: loss, lse and the
gradients of hidden, the weight shard and the bias shard for every option, uneven splits (a rank
with a one-row shard, shards out of rank order), a DTensor weight, and the misuse cases. Each
world size is one start of processes that runs every case (starting them is most of the cost:
CPU workers are forked from a forkserver that imported torch and fusedops once); the workers
write their results to a file that the tests below compare. GPU variants: NCCL with one GPU per
rank (needs >= 2 GPUs), and gloo with every rank's shard on the one GPU.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import os
import sys
import time
import traceback

import pytest
import torch

import lce_oracle as O
from fusedops.linear_ce import linear_cross_entropy

N_LEAD = (2, 9)  # 18 tokens
H = 16
V = 37  # uneven over 2 and 4 ranks
# Vocab chunks of the shard (the low-memory plan): a larger vocabulary and a budget of 8 KiB over
# the fixed part.
BIG_V = 6001
SMALL_BUDGET = (2 * 2**20 + 64 * 18 + 8192) / 2**20
IGNORE = -100

# name -> options; "split": None (torch.chunk sizes in rank order), "tiny" (one-row shards),
# "permuted" (rank order reversed, vocab_start given), "start" (chunk sizes, vocab_start given).
CASES = {
    "mean": dict(reduction="mean"),
    "sum_ignore": dict(reduction="sum", ignore=True),
    "none_ignore": dict(reduction="none", ignore=True),
    "mean_all_ignored": dict(reduction="mean", all_ignored=True),
    "label_smoothing": dict(reduction="mean", label_smoothing=0.1, ignore=True),
    "softcap": dict(reduction="sum", softcap=3.0),
    "z_loss": dict(reduction="mean", z_loss=1e-2, ignore=True),
    "bias": dict(reduction="mean", bias=True),
    "return_lse": dict(reduction="none", return_lse=True, bias=True, ignore=True),
    "everything": dict(reduction="mean", bias=True, label_smoothing=0.2, softcap=4.0,
                       z_loss=1e-3, ignore=True, return_lse=True),
    "tiny_shards": dict(reduction="sum", bias=True, split="tiny", label_smoothing=0.1),
    "permuted_start": dict(reduction="none", split="permuted", ignore=True, bias=True),
    "explicit_start": dict(reduction="mean", split="start", z_loss=1e-2),
    "empty_batch": dict(reduction="mean", empty=True),
    "vocab_chunks": dict(reduction="mean", V=BIG_V, budget=SMALL_BUDGET, bias=True,
                         label_smoothing=0.1, z_loss=1e-3, softcap=5.0, ignore=True),
    "vocab_chunks_none": dict(reduction="none", V=BIG_V, budget=SMALL_BUDGET, split="tiny"),
    # The small budget on rank 0 only: alone, its plan (one-token chunks) and the others' (one
    # chunk) would differ; the token chunks, one round of collectives each, must not.
    "budgets_differ": dict(reduction="mean", V=BIG_V, budget_rank0=SMALL_BUDGET,
                           bias=True, ignore=True, label_smoothing=0.1),
    # rank 0's one-row shard fits whole rows of 8 tokens in its budget and no vocab chunk (the
    # float32 d_hidden row needs more): the others' shards would not fit that budget, but need
    # only their own
    "narrow_small_budget": dict(reduction="sum", V=BIG_V, split="tiny", bias=True,
                                budget_rank0=(2 * 2**20 + 64 * 18 + 64) / 2**20),
    "recompute_mean": dict(reduction="mean", algo="recompute", bias=True, label_smoothing=0.1,
                           softcap=3.0, z_loss=1e-2, ignore=True),
    "recompute_tiny": dict(reduction="sum", algo="recompute", split="tiny"),
    "mixed_bf16": dict(reduction="mean", mixed=True, bias=True, ignore=True),
    # hidden without grad (every rank skips d_hidden's all-reduce), and a no_grad evaluation
    "frozen_hidden": dict(reduction="sum", bias=True, frozen=True, label_smoothing=0.1),
    "no_grad_eval": dict(reduction="mean", bias=True, no_grad=True, z_loss=1e-2),
}
# DTensor weight and bias (Shard(0) over a 1-D mesh) -> the case whose options they take: the
# statistics path (return_lse) and the mean loss's path
DTENSOR_CASES = {"dtensor": "everything", "dtensor_mean": "bias"}
DTYPES = {"float64": torch.float64, "float32": torch.float32}
MISUSE = ("group_type", "start_out_of_range", "overlap", "start_on_one_rank", "target_range",
          "mismatch_hidden", "bad_dtype_one_rank", "tokens_differ", "empty_shard",
          "start_type", "double_backward", "double_backward_lse", "dtensor_replicate",
          "module_form", "bias_group_differs", "target_one_rank", "check_targets_one_rank",
          "replicated_one_rank", "replicated_type_one_rank", "start_huge_one_rank",
          "mismatch_hidden_nan", "same_nan_hidden", "algo_env", "budget_env_one_rank",
          "reduction_one_rank", "algo_one_rank", "min_full_rows_one_rank",
          "ignore_index_int64_min")


def _sizes(split, world, v):
    if split == "tiny":
        return [1, v - 1] if world == 2 else [1, 20, v - 22, 1]
    return [c.numel() for c in torch.arange(v).chunk(world)]


def _layout(split, world, v=V):
    """(start, rows) of every rank."""
    sizes = _sizes(split, world, v)
    if split == "permuted":
        sizes = sizes[::-1]
        starts = [sum(sizes[r + 1:]) for r in range(world)]  # rank 0 holds the last rows
        return list(zip(starts, sizes, strict=True))
    starts = [sum(sizes[:r]) for r in range(world)]
    return list(zip(starts, sizes, strict=True))


def _full_inputs(opts, dtype, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    lead = (0, 9) if opts.get("empty") else N_LEAD
    v = opts.get("V", V)
    x = torch.randn(*lead, H, generator=g, dtype=torch.float64)
    w = torch.randn(v, H, generator=g, dtype=torch.float64) / 2
    b = torch.randn(v, generator=g, dtype=torch.float64) if opts.get("bias") else None
    t = torch.randint(0, v, lead, generator=g)
    if opts.get("ignore"):
        t[..., ::4] = IGNORE
    if opts.get("all_ignored"):
        t[:] = IGNORE
    g_loss = torch.randn(lead, generator=g, dtype=torch.float64) if opts["reduction"] == "none" \
        else torch.tensor(1.7, dtype=torch.float64)
    g_lse = torch.randn(lead, generator=g, dtype=torch.float64)
    conv = lambda a: None if a is None else a.to(device, dtype)
    if opts.get("mixed"):  # float32 weight and bias with bfloat16 hidden
        wconv = lambda a: None if a is None else a.to(device, torch.float32)
        return (x.to(device, torch.bfloat16), wconv(w), wconv(b), t.to(device), wconv(g_loss),
                wconv(g_lse))
    return conv(x), conv(w), conv(b), t.to(device), conv(g_loss), conv(g_lse)


def _kwargs(opts):
    return dict(ignore_index=IGNORE, reduction=opts["reduction"],
                label_smoothing=opts.get("label_smoothing", 0.0), softcap=opts.get("softcap"),
                z_loss=opts.get("z_loss", 0.0), return_lse=opts.get("return_lse", False),
                memory_budget_mib=opts.get("budget"))


def _run(x, w, b, t, g_loss, g_lse, opts, backend, **extra):
    """Loss, lse and the gradients of (x, w, b) for the upstream gradients g_loss, g_lse; the
    second of two backwards through a retained graph, checked equal to the first."""
    x = x.detach().requires_grad_(not opts.get("frozen") and not opts.get("no_grad"))
    w_leaf = w.detach().requires_grad_() if not extra.get("dtensor") else w
    extra.pop("dtensor", None)
    b = None if b is None else b.detach().requires_grad_()
    algo = os.environ.pop("FUSEDOPS_LCE_ALGO", None)
    if opts.get("algo"):
        os.environ["FUSEDOPS_LCE_ALGO"] = opts["algo"]
    try:
        if opts.get("no_grad"):
            with torch.no_grad():
                loss = linear_cross_entropy(x, w_leaf, t, b, backend=backend, **_kwargs(opts),
                                            **extra)
            return {"loss": loss.cpu(), "lse": None, "dx": None, "dw": None, "db": None,
                    "grad_fn": loss.grad_fn is not None}
        out = linear_cross_entropy(x, w_leaf, t, b, backend=backend, **{**_kwargs(opts), **extra})
    finally:
        os.environ.pop("FUSEDOPS_LCE_ALGO", None)
        if algo is not None:
            os.environ["FUSEDOPS_LCE_ALGO"] = algo
    loss, lse = out if opts.get("return_lse") else (out, None)
    total = (loss * g_loss).sum()
    if lse is not None:
        total = total + (lse * g_lse).sum()
    params = [p for p in (x, w_leaf, b) if p is not None and p.requires_grad]
    first = torch.autograd.grad(total, params, retain_graph=True)
    second = torch.autograd.grad(total, params)
    for a, c in zip(first, second, strict=True):
        a_l, c_l = (a.to_local(), c.to_local()) if hasattr(a, "to_local") else (a, c)
        assert torch.equal(a_l, c_l), "second backward differs from the first"
    grads = [g.to_local() if hasattr(g, "to_local") else g for g in first]
    if not x.requires_grad:
        grads = [None, *grads]
    res = {"loss": loss.detach().cpu(), "lse": None if lse is None else lse.detach().cpu(),
           "dx": None if grads[0] is None else grads[0].cpu(), "dw": grads[1].cpu(),
           "db": grads[2].cpu() if b is not None else None}
    return res


@contextlib.contextmanager
def _env(var: str, value: str, on: bool = True):
    """var=value in this process's environment while the block runs (when on)."""
    if on:
        os.environ[var] = value
    try:
        yield
    finally:
        os.environ.pop(var, None)


def _misuse(name, rank, world, group, device):
    """Runs one misuse case on every rank; returns the exception (type name, message)."""
    import torch.distributed as dist

    opts = dict(reduction="mean", bias=True)
    x, w, b, t, _, _ = _full_inputs(opts, torch.float64, device)
    start, rows = _layout(None, world)[rank]
    ws, bs = w[start:start + rows], b[start:start + rows]
    kw = dict(process_group=group, backend="torch")
    try:
        if name == "group_type":
            linear_cross_entropy(x, ws, t, bs, process_group="tp", backend="torch")
        elif name == "start_out_of_range":
            linear_cross_entropy(x, ws, t, bs, vocab_start=start if rank == 0 else V + 5, **kw)
        elif name == "overlap":
            linear_cross_entropy(x, ws, t, bs, vocab_start=0, **kw)
        elif name == "start_on_one_rank":
            linear_cross_entropy(x, ws, t, bs, vocab_start=start if rank == 0 else None, **kw)
        elif name == "target_range":
            t = t.clone()
            t[0, 3] = V
            linear_cross_entropy(x, ws, t, bs, **kw)
        elif name == "mismatch_hidden":
            x = x.clone()
            if rank == 1:
                x[1, 2, 3] += 1e-3
            linear_cross_entropy(x, ws, t, bs, check_replicated=True, **kw)
        elif name == "target_one_rank":  # rank 1 alone has a bad target: no rank may wait
            t = t.clone()
            if rank == 1:
                t[0, 3] = V
            linear_cross_entropy(x, ws, t, bs, **kw)
        elif name == "check_targets_one_rank":
            linear_cross_entropy(x, ws, t, bs, check_targets=rank == 0, **kw)
        elif name == "replicated_one_rank":
            linear_cross_entropy(x, ws, t, bs, check_replicated=rank == 0, **kw)
        elif name == "replicated_type_one_rank":
            linear_cross_entropy(x, ws, t, bs, check_replicated="yes" if rank == 1 else False,
                                 **kw)
        elif name == "start_huge_one_rank":
            linear_cross_entropy(x, ws, t, bs, vocab_start=start if rank == 0 else 2**70, **kw)
        elif name in ("mismatch_hidden_nan", "same_nan_hidden"):
            # NaN and inf compare equal to themselves and unequal to anything else
            x = x.clone()
            x[0, 0, 0], x[1, 0, 1] = float("nan"), float("inf")
            if rank == 1 and name == "mismatch_hidden_nan":
                x[1, 2, 3] += 1e-3
            linear_cross_entropy(x, ws, t, bs, check_replicated=True, **kw)
        elif name == "budget_env_one_rank":
            with _env("FUSEDOPS_LCE_MEMORY_MIB", "abc", rank == 1):
                linear_cross_entropy(x, ws, t, bs, **kw)
        elif name == "reduction_one_rank":  # per-chunk collectives on one, per-call on the other
            linear_cross_entropy(x, ws, t, bs, reduction="none" if rank == 0 else "sum", **kw)
        elif name == "algo_one_rank":
            with _env("FUSEDOPS_LCE_ALGO", "recompute", rank == 1):
                linear_cross_entropy(x, ws, t, bs, **kw)
        elif name == "min_full_rows_one_rank":  # each rank's own plan differs: still one sweep
            budget = (2 * 2**20 + 64 * 18 + 6 * rows * 8) / 2**20  # whole rows of 6 tokens
            with _env("FUSEDOPS_LCE_MIN_FULL_ROWS", "1", rank == 0):
                got = linear_cross_entropy(x, ws, t, bs, memory_budget_mib=budget, **kw)
            want = linear_cross_entropy(x, w, t, b, backend="torch")
            assert _rel(got, want) <= 1e-12, (got, want)
        elif name == "ignore_index_int64_min":  # no shifted sentinel (it would overflow)
            lowest = -2**63
            t = torch.where(torch.arange(t.numel()).view(t.shape) % 3 == 0, lowest, t)
            got = linear_cross_entropy(x, ws, t, bs, ignore_index=lowest, **kw)
            want = linear_cross_entropy(x, w, t, b, ignore_index=lowest, backend="torch")
            assert _rel(got, want) <= 1e-12, (got, want)
        elif name == "algo_env":
            with _env("FUSEDOPS_LCE_ALGO", "bogus"):
                linear_cross_entropy(x, ws, t, bs, **kw)
        elif name == "bad_dtype_one_rank":
            linear_cross_entropy(x, ws.float() if rank == 1 else ws, t, bs, **kw)
        elif name == "tokens_differ":
            n = 18 if rank == 0 else 17
            linear_cross_entropy(x.reshape(-1, H)[:n], ws, t.reshape(-1)[:n], bs, **kw)
        elif name == "empty_shard":
            linear_cross_entropy(x, ws[:0] if rank == 1 else ws, t, None, **kw)
        elif name == "start_type":
            linear_cross_entropy(x, ws, t, bs, vocab_start=float(start), **kw)
        elif name == "double_backward":
            xr = x.detach().requires_grad_()
            loss = linear_cross_entropy(xr, ws, t, bs, reduction="sum", **kw)
            (gx,) = torch.autograd.grad(loss, xr, create_graph=True)
            gx.sum().backward()
        elif name == "double_backward_lse":
            xr = x.detach().requires_grad_()
            loss, lse = linear_cross_entropy(xr, ws, t, bs, reduction="none", return_lse=True,
                                             **kw)
            (gx,) = torch.autograd.grad(loss.sum() + lse.sum(), xr, create_graph=True)
            gx.sum().backward()
        elif name == "module_form":  # the module passes process_group on; a bad one raises
            # when the module is built, before any forward
            from fusedops.linear_ce import LinearCrossEntropyLoss

            mod = LinearCrossEntropyLoss(process_group=group, backend="torch")
            ref = linear_cross_entropy(x, ws, t, bs, **kw)
            assert torch.equal(mod(x, ws, t, bs), ref)
            LinearCrossEntropyLoss(process_group=object())
        elif name == "bias_group_differs":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.tensor import Shard, distribute_tensor

            mesh = init_device_mesh(device.split(":")[0], (world,))
            bd = distribute_tensor(b, mesh, [Shard(0)])
            other = dist.new_group(list(range(world)))
            linear_cross_entropy(x, ws, t, bd, process_group=other, backend="torch")
        elif name == "dtensor_replicate":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.tensor import Replicate, distribute_tensor

            mesh = init_device_mesh(device.split(":")[0], (world,))
            wd = distribute_tensor(w, mesh, [Replicate()])
            linear_cross_entropy(x, wd, t, backend="torch")
        else:
            raise AssertionError(name)
        err = None
    except Exception as e:  # noqa: BLE001  (the test checks the type and message)
        err = (type(e).__name__, str(e))
    # Every rank must still be in step: a rank left waiting in a collective would hang here.
    flag = torch.ones(1, device=device if dist.get_backend(group) == "nccl" else "cpu")
    dist.all_reduce(flag, group=group)
    assert int(flag.item()) == world
    return err


def _worker(rank, world, init_file, out_dir, backend_name, device_kind, dtypes, backend):
    import torch.distributed as dist

    torch.set_num_threads(1)
    if device_kind == "cuda-per-rank":
        torch.cuda.set_device(rank)
        device = f"cuda:{rank}"
    elif device_kind == "cuda-shared":
        device = "cuda:0"
    else:
        device = "cpu"
    # A collective left waiting (a rank that failed) raises after this instead of hanging.
    dist.init_process_group(backend_name, init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=COLLECTIVE_S))
    results = {}
    try:
        group = dist.group.WORLD
        for dname in dtypes:
            dtype = DTYPES[dname] if dname in DTYPES else getattr(torch, dname)
            for case, opts in CASES.items():
                x, w, b, t, g_loss, g_lse = _full_inputs(opts, dtype, device)
                split = opts.get("split")
                start, rows = _layout(split, world, opts.get("V", V))[rank]
                kw = dict(process_group=group)
                if split in ("permuted", "start"):
                    kw["vocab_start"] = start
                if rank == 0 and "budget_rank0" in opts:
                    kw["memory_budget_mib"] = opts["budget_rank0"]
                ws = w[start:start + rows]
                bs = None if b is None else b[start:start + rows]
                res = _run(x, ws, bs, t, g_loss, g_lse, opts, backend, **kw)
                res["span"] = (start, rows)
                results[(dname, case)] = res
            if device_kind == "cpu" or device_kind == "cuda-per-rank":
                # DTensor weight and bias, Shard(0) over a 1-D mesh (torch.chunk sizes).
                from torch.distributed.device_mesh import init_device_mesh
                from torch.distributed.tensor import Shard, distribute_tensor

                mesh = init_device_mesh("cpu" if device_kind == "cpu" else "cuda", (world,))
                for case, base in DTENSOR_CASES.items():
                    opts = CASES[base]
                    x, w, b, t, g_loss, g_lse = _full_inputs(opts, dtype, device)
                    wd = distribute_tensor(w, mesh, [Shard(0)]).requires_grad_()
                    bd = distribute_tensor(b, mesh, [Shard(0)])
                    res = _run(x, wd, bd, t, g_loss, g_lse, opts, backend, dtensor=True)
                    res["span"] = _layout(None, world)[rank]
                    results[(dname, case)] = res
        if world == 2 and device_kind == "cpu":
            for name in MISUSE:
                results[("misuse", name)] = _misuse(name, rank, world, group, device)
        results["ok"] = True
    except Exception:  # noqa: BLE001
        results["error"] = traceback.format_exc()
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    _leave(results.get("ok", False))


def _leave(ok: bool) -> None:
    """Ends a worker: the ranks meet (when none failed), whatever may hold gloo work (DTensors,
    device meshes, autograd graphs of collectives) is dropped while the group lives, the group
    is destroyed, and the process leaves by os._exit: gloo's threads torn down at interpreter
    exit have aborted a worker after its results were written ("terminate called without an
    active exception", on a loaded 2-core machine). The results file is what the tests read."""
    import torch.distributed as dist

    try:
        if ok:
            dist.barrier()
        gc.collect()
        dist.destroy_process_group()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


COLLECTIVE_S = 60  # the workers' collective timeout


def _start_method(device_kind: str) -> str:
    """CPU workers: forkserver; the server imports torch, fusedops and this module once and
    forks the workers from there (a spawned worker imports them itself: about 7 s of CPU each).
    GPU workers are spawned: an import that asks whether CUDA is available initialises the
    driver, which forked children cannot use."""
    import multiprocessing

    if device_kind != "cpu" or "forkserver" not in multiprocessing.get_all_start_methods():
        return "spawn"
    multiprocessing.set_forkserver_preload(["torch", "torch.distributed", "fusedops.linear_ce",
                                            __name__])
    return "forkserver"


def _read_results(tmp_dir, world):
    out = {}
    for r in range(world):
        path = os.path.join(tmp_dir, f"rank{r}.pt")
        if os.path.exists(path):
            out[r] = torch.load(path, weights_only=False)
    return out


def _spawn(tmp_dir, world, backend_name="gloo", device_kind="cpu",
           dtypes=("float64", "float32"), backend="torch", timeout=150):
    import torch.multiprocessing as mp

    ctx = mp.start_processes(_worker, args=(world, os.path.join(tmp_dir, "init"), tmp_dir,
                                            backend_name, device_kind, dtypes, backend),
                             nprocs=world, join=False, start_method=_start_method(device_kind))
    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            errors = "".join(f"\nrank {r}:\n{res['error']}"
                             for r, res in _read_results(tmp_dir, world).items()
                             if "error" in res)
            pytest.fail(f"the {world} workers did not finish in {timeout} s{errors}")
    found = _read_results(tmp_dir, world)
    missing = [r for r in range(world) if r not in found]
    assert not missing, f"rank(s) {missing} exited without writing results"
    for r, res in found.items():
        assert "error" not in res, f"rank {r}:\n{res['error']}"
    return [found[r] for r in range(world)]


def _rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp(min=1e-300)) if b.norm() > 0 \
        else float((a - b).norm())


def _tol(dname, device="cpu", case=None):
    if CASES.get(case, {}).get("mixed"):
        return 1e-2
    if device != "cpu":  # GPU kernels: other GEMM orders, TF32 in Triton's float32 dots
        return {"float32": 2e-3, "bfloat16": 3e-2}[dname]
    return {"float64": 1e-12, "float32": 2e-6}[dname]


def _reference(dname, case, device="cpu", backend="torch"):
    """One process on the full weight. For GPU ranks: the float64 torch oracle of the same
    rounded inputs (a GPU reference would mix in its own path's rounding, e.g. TF32 dots in
    Triton's float32 recompute kernels for return_lse)."""
    opts = CASES[DTENSOR_CASES.get(case, case)]
    dtype = DTYPES[dname] if dname in DTYPES else getattr(torch, dname)
    if device != "cpu":
        up = lambda a: None if a is None else a.double()  # noqa: E731
        x, w, b, t, g_loss, g_lse = _full_inputs(opts, dtype, "cpu")
        return _run(up(x), up(w), up(b), t, up(g_loss), up(g_lse), opts, "torch")
    x, w, b, t, g_loss, g_lse = _full_inputs(opts, dtype, device)
    return _run(x, w, b, t, g_loss, g_lse, opts, backend)


def _compare(per_rank, dname, case, device="cpu", backend="torch"):
    ref = _reference(dname, case, device, backend)
    tol = _tol(dname, device, case)
    for r, res in enumerate(per_rank):
        got = res[(dname, case)]
        start, rows = got["span"]
        assert _rel(got["loss"], ref["loss"]) <= tol, (r, "loss")
        if ref["lse"] is not None:
            assert _rel(got["lse"], ref["lse"]) <= tol, (r, "lse")
        if ref["dw"] is None:  # evaluated under no_grad: no graph
            assert got["dw"] is None and not got["grad_fn"] and not ref["grad_fn"], r
            continue
        if ref["dx"] is None:
            assert got["dx"] is None, (r, "d_hidden of a hidden without grad")
        else:
            assert _rel(got["dx"], ref["dx"]) <= tol, (r, "d_hidden")
        assert got["dw"].shape == (rows, H)
        assert _rel(got["dw"], ref["dw"][start:start + rows]) <= tol, (r, "d_weight")
        if ref["db"] is not None:
            assert _rel(got["db"], ref["db"][start:start + rows]) <= tol, (r, "d_bias")
    spans = sorted(res[(dname, case)]["span"] for res in per_rank)
    assert spans[0][0] == 0 and sum(s[1] for s in spans) == opts_v(case)


def opts_v(case):
    return CASES[DTENSOR_CASES.get(case, case)].get("V", V)


def _gloo_ok():
    return torch.distributed.is_available() and torch.distributed.is_gloo_available()


@pytest.fixture(scope="module", params=[2, 4], ids=["world2", "world4"])
def gloo_results(request, tmp_path_factory):
    if not _gloo_ok():
        pytest.skip("torch.distributed with gloo is not available")
    world = request.param
    per_rank = _spawn(str(tmp_path_factory.mktemp(f"vp{world}")), world)
    if world == 2:
        _MISUSE_CACHE["res"] = per_rank
    return world, per_rank


@pytest.mark.parametrize("dname", list(DTYPES))
@pytest.mark.parametrize("case", list(CASES) + list(DTENSOR_CASES))
def test_gloo_matches_one_process(gloo_results, dname, case):
    _, per_rank = gloo_results
    _compare(per_rank, dname, case)


_MISUSE_EXPECT = {
    # case: (exception type, a piece of the message on every rank, or per rank)
    "group_type": ("TypeError", "process_group must be a torch.distributed.ProcessGroup"),
    "start_out_of_range": ("ValueError", "outside [0, 37)"),
    "overlap": ("ValueError", "do not tile [0, 37)"),
    "start_on_one_rank": ("ValueError", "whether vocab_start is given differs"),
    "target_range": ("TargetOutOfRangeError",  # a ValueError naming the index in t's shape
                     "target[0, 3] = 37 is outside [0, 37)"),
    "mismatch_hidden": ("ValueError", "hidden or target differs across the ranks"),
    "bad_dtype_one_rank": ("TypeError", ["rank(s) [1]", "weight dtype torch.float32"]),
    "tokens_differ": ("ValueError", "the number of tokens differs"),
    "empty_shard": ("ValueError", ["rank(s) [1]", "weight shard on rank 1 has 0 rows"]),
    "start_type": ("TypeError", "vocab_start must be an int"),
    "double_backward": ("RuntimeError", "double backward"),
    "double_backward_lse": ("RuntimeError", "double backward"),
    "module_form": ("TypeError", "process_group must be a torch.distributed.ProcessGroup"),
    "dtensor_replicate": ("ValueError", "needs Shard(0) on one mesh dimension"),
    "bias_group_differs": ("ValueError", "bias is a DTensor sharded over another process group"),
    "target_one_rank": ("TargetOutOfRangeError", ["rank(s) [1] of process_group have targets "
                                                  "outside [0, 37)",
                                                  "target[0, 3] = 37 is outside [0, 37)"]),
    "check_targets_one_rank": ("ValueError", "whether targets are checked differs"),
    "replicated_one_rank": ("ValueError", "check_replicated differs"),
    "replicated_type_one_rank": ("TypeError", ["rank(s) [1]", "check_replicated must be a bool"]),
    "start_huge_one_rank": ("ValueError", ["rank(s) [1]", "vocab_start must be in [0, V)"]),
    "mismatch_hidden_nan": ("ValueError", "hidden or target differs across the ranks"),
    "same_nan_hidden": None,  # no error: the same hidden on every rank
    "algo_env": ("ValueError", "FUSEDOPS_LCE_ALGO must be 'auto' or 'recompute'"),
    "budget_env_one_rank": ("ValueError", ["rank(s) [1]",
                                           "FUSEDOPS_LCE_MEMORY_MIB must be a positive number"]),
    "reduction_one_rank": ("ValueError", "reduction, return_lse or FUSEDOPS_LCE_ALGO differs"),
    "algo_one_rank": ("ValueError", "reduction, return_lse or FUSEDOPS_LCE_ALGO differs"),
    "min_full_rows_one_rank": None,
    "ignore_index_int64_min": None,
}


@pytest.mark.parametrize("name", MISUSE)
def test_misuse_raises_on_every_rank(tmp_path_factory, name, request):
    if not _gloo_ok():
        pytest.skip("torch.distributed with gloo is not available")
    per_rank = _misuse_results(tmp_path_factory)
    if _MISUSE_EXPECT[name] is None:
        assert all(res[("misuse", name)] is None for res in per_rank), per_rank
        return
    kind, msg = _MISUSE_EXPECT[name]
    for r, res in enumerate(per_rank):
        err = res[("misuse", name)]
        assert err is not None, f"rank {r} raised nothing"
        want = msg[r] if isinstance(msg, list) else msg
        want_kind = kind if not isinstance(msg, list) or r == 1 else "ValueError"
        assert err[0] == want_kind and want in err[1], (r, err)


_MISUSE_CACHE: dict = {}


def _misuse_results(tmp_path_factory):
    # The misuse cases run in the world-2 spawn of gloo_results when that ran first; this
    # spawns it otherwise (a test run selecting only the misuse tests).
    if "res" not in _MISUSE_CACHE:
        _MISUSE_CACHE["res"] = _spawn(str(tmp_path_factory.mktemp("vp_misuse")), 2)
    return _MISUSE_CACHE["res"]


@pytest.fixture
def one_rank_group(tmp_path):
    """A gloo group of one process, this one (no spawn needed)."""
    import torch.distributed as dist

    if not _gloo_ok():
        pytest.skip("torch.distributed with gloo is not available")
    if dist.is_initialized():
        pytest.skip("a default process group already exists in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init1'}", rank=0,
                            world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("case", ["everything", "label_smoothing"])
def test_single_process_group_equals_plain_op(one_rank_group, case):
    """A group of one: the same as the op without process_group (the statistics path with
    return_lse, and the mean/sum path)."""
    opts = CASES[case]
    x, w, b, t, g_loss, g_lse = _full_inputs(opts, torch.float64)
    got = _run(x, w, b, t, g_loss, g_lse, opts, "torch", process_group=one_rank_group)
    ref = _run(x, w, b, t, g_loss, g_lse, opts, "torch")
    for k in ("loss", "lse", "dx", "dw", "db"):
        if ref[k] is not None:
            assert _rel(got[k], ref[k]) <= 1e-13, k


@pytest.mark.parametrize("reduction,per_chunk", [("mean", 3), ("sum", 3), ("none", 4)])
def test_gemms_per_token_chunk(one_rank_group, monkeypatch, reduction, per_chunk):
    """The mean and sum losses of a shard take three GEMMs per token chunk (logits, d_hidden,
    d_weight: the gradients formed in the forward from the combined statistics), as on one
    device; reduction "none" recomputes the logits in the backward (four)."""
    from fusedops.linear_ce import chunked

    calls = []
    mm = chunked._mm
    monkeypatch.setattr(chunked, "_mm", lambda *a: (calls.append(a[0].shape), mm(*a))[1])
    x, w, b, t, _, _ = _full_inputs(dict(reduction=reduction, V=BIG_V), torch.float32)
    budget = (2 * 2**20 + 64 * 18 + 18 * BIG_V * 4 // 2) / 2**20  # whole rows of 9 tokens
    monkeypatch.setenv("FUSEDOPS_LCE_MIN_FULL_ROWS", "9")  # (not vocab chunks)
    xr = x.detach().requires_grad_()
    wr = w.detach().requires_grad_()
    loss = linear_cross_entropy(xr, wr, t, process_group=one_rank_group, backend="torch",
                                reduction=reduction, memory_budget_mib=budget)
    loss.sum().backward()
    assert len(calls) == 2 * per_chunk, calls  # 18 tokens in two chunks
    ref_x, ref_w = x.detach().requires_grad_(), w.detach().requires_grad_()
    linear_cross_entropy(ref_x, ref_w, t, backend="torch", reduction=reduction).sum().backward()
    assert _rel(xr.grad, ref_x.grad) <= 1e-5 and _rel(wr.grad, ref_w.grad) <= 1e-5


# ----------------------------------------------------------------------------------------------
# GPUs: NCCL with one GPU per rank; gloo with every rank's shard on the one GPU.

def _gpu_dtypes():
    return ("float32", "bfloat16")


@pytest.mark.gpu
def test_nccl_two_gpus(tmp_path):
    if torch.cuda.device_count() < 2 or not torch.distributed.is_nccl_available():
        pytest.skip("needs >= 2 CUDA GPUs and NCCL")
    per_rank = _spawn(str(tmp_path), 2, "nccl", "cuda-per-rank", _gpu_dtypes(), None,
                      timeout=300)
    for dname in _gpu_dtypes():
        for case in [*CASES, *DTENSOR_CASES]:
            _compare(per_rank, dname, case, "cuda:0", None)


@pytest.mark.gpu
def test_gloo_shards_on_one_gpu(tmp_path):
    """Both ranks' CUDA shards on the one GPU, statistics combined by gloo (through the CPU)."""
    if not _gloo_ok():
        pytest.skip("torch.distributed with gloo is not available")
    per_rank = _spawn(str(tmp_path), 2, "gloo", "cuda-shared", _gpu_dtypes(), None, timeout=300)
    for dname in _gpu_dtypes():
        for case in CASES:
            _compare(per_rank, dname, case, "cuda:0", None)


@pytest.mark.parametrize("backend,device", O.backend_params(O.available_backends()))
@pytest.mark.parametrize("op", ["stats", "recompute"])
def test_statistics_of_targets_outside_the_shard(backend, device, op):
    """The statistics ops (the chunked path's and the recompute kernels') on shard-relative
    targets: those of other shards (negative, or at and past V, including the padding columns of
    the last vocab tile) have a target logit of 0 and leave lse and the logit sum as they are."""
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    g = torch.Generator().manual_seed(11)
    n, h, v = 48, 32, 77
    x = torch.randn(n, h, generator=g).to(device, dtype)
    w = (torch.randn(v, h, generator=g) * 0.5).to(device, dtype)
    b = torch.randn(v, generator=g).to(device, dtype)
    t = torch.randint(0, v, (n,), generator=g)
    t[1::2] = torch.cat([torch.arange(v, v + 16), -torch.arange(1, 9)])  # v itself included
    t = t.to(device)
    if op == "stats":  # 2 chunks of whole rows
        budget = (2 << 20) + 64 * n + 24 * v * x.element_size()
        lse, zt, zs, _ = torch.ops.fusedops.linear_ce_stats(x, w, b, t, -100, 0.0, budget, False,
                                                            True, False, backend)
    else:
        lse, zt, zs = torch.ops.fusedops.linear_ce_fwd(x, w, b, t, -100, 0.0, False, backend)
    z = (x.double() @ w.double().T + b.double()).cpu()
    t_cpu = t.cpu()
    hit = (t_cpu >= 0) & (t_cpu < v)
    want_zt = torch.where(hit, z.gather(1, t_cpu.clamp(0, v - 1)[:, None])[:, 0], 0.0)
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(zt.double().cpu(), want_zt, rtol=tol, atol=tol)
    torch.testing.assert_close(lse.double().cpu(), torch.logsumexp(z, 1), rtol=tol, atol=tol)
    torch.testing.assert_close(zs.double().cpu(), z.sum(1), rtol=tol, atol=tol * v)


def test_nccl_group_needs_cuda_tensors():
    """A CPU hidden with an NCCL group is refused by name (the rank raises after the layout
    all-gather, like the other local checks, so no rank is left waiting)."""
    from fusedops.linear_ce.parallel import check_group_device

    with pytest.raises(ValueError, match="hidden is on cpu, but process_group's backend is NCCL"):
        check_group_device("nccl", torch.randn(2, 3))
    check_group_device("gloo", torch.randn(2, 3))
