"""Benchmark: vocab-parallel linear cross-entropy (tensor parallelism) against one GPU.

The LM head's weight is split by rows over --world GPUs (NCCL, one process per GPU, spawned
here); every rank holds the same hidden states and targets. Per rank: time of forward + backward
of the mean loss (grads for hidden and the weight shard) and the peak memory above the inputs
and the gradients, next to the same op on one GPU with the whole weight (measured on every rank,
one after another). Checks the loss and gradients against the one-GPU op. Prints a table; rank 0
appends one JSON row per method to benchmarks/results/linear_ce_tp.jsonl (or <--out>).

    python benchmarks/bench_linear_ce_tp.py                  # Llama-3-8B LM head, bf16, 2 GPUs
    python benchmarks/bench_linear_ce_tp.py --world 4 --shapes llama3,gemma2
    python benchmarks/bench_linear_ce_tp.py --simulate       # one GPU: one rank's shard of 2
    python benchmarks/bench_linear_ce_tp.py --dry            # 2 gloo processes on CPU, tiny shape

"ms" is the median of triton.testing.do_bench on each rank (the collectives make the ranks wait
for each other), reported as the slowest rank; "extra_mib" is per rank, reported as the largest.

--simulate (one GPU, one process): what one of --world ranks computes, without the other ranks.
The vocab-parallel op runs on rank 0's shard (V / world rows) over a one-process NCCL group
(its all-reduces are local copies), next to the one-GPU op on the whole weight; rows carry
simulated=true. Its times leave out the real communication: per token 16 bytes of statistics
and H values of d_hidden (64 MiB at the Llama-3 shape in bf16), both in the forward of the mean
loss timed here.
The loss of a shard alone is not the full loss, so the check of the split (loss and gradients
against one GPU) is a third row: the vocab-parallel op with the whole weight over that group
(the same code path, a shard of V rows). tests/linear_ce/test_vocab_parallel.py checks two
ranks' shards on one GPU against one GPU (test_gloo_shards_on_one_gpu).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import add_out_arg, append_rows, describe, peak_extra_mib, print_table, run_meta  # noqa: E402
from common import time_ms as _time_ms  # noqa: E402

SHAPES = {  # name: (N tokens, H, V, softcap)
    "llama3": (8192, 4096, 128256, None),
    "gemma2": (16384, 2304, 256000, 30.0),
    "tiny": (64, 32, 1000, None),
}


def _inputs(shape: str, device, dtype):
    """(N, H, V, softcap, hidden, full weight, target) of a named shape, seeded: every rank and
    the one-GPU reference draw the same."""
    n, h, v, softcap = SHAPES[shape]
    g = torch.Generator(device=device).manual_seed(0)
    x = (torch.randn(n, h, generator=g, device=device) * 0.5).to(dtype)
    w = (torch.randn(v, h, generator=g, device=device) * 0.02).to(dtype)
    t = torch.randint(0, v, (n,), generator=g, device=device)
    return n, h, v, softcap, x, w, t


def _rel(a, b):
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def _worker(rank, world, init_file, args):
    import torch.distributed as dist

    from fusedops.linear_ce import linear_cross_entropy

    dry = args.dry
    device = torch.device("cpu") if dry else torch.device("cuda", rank)
    if not dry:
        torch.cuda.set_device(device)
    dist.init_process_group("gloo" if dry else "nccl", init_method=f"file://{init_file}",
                            rank=rank, world_size=world)
    dtype = torch.float32 if dry else torch.bfloat16
    rows = []
    try:
        for shape in args.shapes.split(","):
            n, h, v, softcap, x, w, t = _inputs(shape, device, dtype)
            start = sum(c.numel() for c in torch.arange(v).chunk(world)[:rank])
            size = torch.arange(v).chunk(world)[rank].numel()
            w_shard = w[start:start + size].clone()
            kw = dict(softcap=softcap, check_targets=False)

            def one_gpu(x=x, w=w, t=t, kw=kw):
                return linear_cross_entropy(x, w, t, **kw)

            def tp(x=x, w=w_shard, t=t, kw=kw):
                return linear_cross_entropy(x, w, t, process_group=dist.group.WORLD, **kw)

            results = {}
            for name, fn, wt in (("one GPU", one_gpu, w), (f"vocab-parallel x{world}", tp,
                                                           w_shard)):
                xl = x.detach().requires_grad_()
                wl = wt.detach().requires_grad_()
                loss = fn(xl, wl)
                loss.backward()
                results[name] = (float(loss.detach()), xl.grad, wl.grad)

                def step(xl=xl, wl=wl, fn=fn):
                    xl.grad = None
                    wl.grad = None
                    fn(xl, wl).backward()

                dist.barrier()
                if dry:
                    extra = float("nan")
                    t0 = time.perf_counter()
                    for _ in range(3):
                        step()
                    ms = (time.perf_counter() - t0) / 3 * 1e3
                else:
                    extra = peak_extra_mib(step, (xl, wl), minus_grads=True)
                    dist.barrier()
                    ms = _time_ms(step, args.reps, grad_to_none=[xl, wl])
                both = torch.tensor([ms, extra], dtype=torch.float64, device=device)
                dist.all_reduce(both, op=dist.ReduceOp.MAX)
                results[name] += (float(both[0]), float(both[1]))
            ref_loss, ref_dx, ref_dw = results["one GPU"][:3]
            tp_name = f"vocab-parallel x{world}"
            tp_loss, tp_dx, tp_dw = results[tp_name][:3]
            errs = torch.tensor([abs(tp_loss - ref_loss) / abs(ref_loss), _rel(tp_dx, ref_dx),
                                 _rel(tp_dw, ref_dw[start:start + size])],
                                dtype=torch.float64, device=device)
            dist.all_reduce(errs, op=dist.ReduceOp.MAX)
            for name, res in results.items():
                row = dict(op="linear_ce_tp", shape=shape, n=n, h=h, v=v, world=world,
                           method=name, ms=round(res[3], 3), extra_mib=round(res[4], 1),
                           dtype=str(dtype).removeprefix("torch."), **run_meta())
                if name == tp_name:
                    row.update(err_loss=float(errs[0]), err_dh=float(errs[1]),
                               err_dw=float(errs[2]))
                rows.append(row)
        if rank == 0:
            print_table(rows, [("shape", "shape", ""), ("method", "method", ""),
                               ("ms", "ms", ".2f"), ("extra MiB", "extra_mib", ".1f"),
                               ("err_loss", "err_loss", ".1e"), ("err_dh", "err_dh", ".1e"),
                               ("err_dw", "err_dw", ".1e")], title=describe())
            if not dry:
                print("results:", append_rows("linear_ce_tp", rows, args.out))
    finally:
        dist.destroy_process_group()


def _measure(fn, x, w, reps, dry=False):
    """(loss, d_hidden, d_weight, ms, extra MiB) of forward + backward of fn(x, w)."""
    xl = x.detach().requires_grad_()
    wl = w.detach().requires_grad_()
    loss = fn(xl, wl)
    loss.backward()
    out = (float(loss.detach()), xl.grad, wl.grad)

    def step():
        xl.grad = None
        wl.grad = None
        fn(xl, wl).backward()

    if dry:
        t0 = time.perf_counter()
        for _ in range(3):
            step()
        return (*out, (time.perf_counter() - t0) / 3 * 1e3, float("nan"))
    extra = peak_extra_mib(step, (xl, wl), minus_grads=True)
    ms = _time_ms(step, reps, grad_to_none=[xl, wl])
    return (*out, ms, extra)


def simulate(args):
    """One GPU: rank 0's shard of --world through a one-process group, and the one-GPU op."""
    import torch.distributed as dist

    from fusedops.linear_ce import linear_cross_entropy

    dry = args.dry
    device = torch.device("cpu") if dry else torch.device("cuda", 0)
    if not dry:
        torch.cuda.set_device(device)
    dtype = torch.float32 if dry else torch.bfloat16
    with tempfile.TemporaryDirectory() as tmp:
        backend = "nccl" if dist.is_nccl_available() and not dry else "gloo"
        dist.init_process_group(backend, init_method=f"file://{os.path.join(tmp, 'init')}",
                                rank=0, world_size=1)
        try:
            rows = []
            world = args.world
            for shape in args.shapes.split(","):
                n, h, v, softcap, x, w, t = _inputs(shape, device, dtype)
                shard = w[:torch.arange(v).chunk(world)[0].numel()].clone()
                kw = dict(softcap=softcap, check_targets=False)
                group = dist.group.WORLD

                def one_gpu(x, w, t=t, kw=kw):
                    return linear_cross_entropy(x, w, t, **kw)

                def parallel(x, w, t=t, kw=kw, group=group):
                    return linear_cross_entropy(x, w, t, process_group=group, **kw)

                ref = _measure(one_gpu, x, w, args.reps, dry)
                methods = ((f"vocab-parallel x{world}: rank 0's shard ({shard.shape[0]} rows)",
                            parallel, shard), ("vocab-parallel x1: the whole weight", parallel, w))
                for name, res in (("one GPU", ref),
                                  *((m, _measure(fn, x, wt, args.reps, dry))
                                    for m, fn, wt in methods)):
                    row = dict(op="linear_ce_tp", shape=shape, n=n, h=h, v=v, world=world,
                               method=name, ms=round(res[3], 3), extra_mib=round(res[4], 1),
                               dtype=str(dtype).removeprefix("torch."), simulated=True,
                               **run_meta())
                    if name.startswith("vocab-parallel x1"):
                        row.update(err_loss=abs(res[0] - ref[0]) / abs(ref[0]),
                                   err_dh=_rel(res[1], ref[1]), err_dw=_rel(res[2], ref[2]))
                    rows.append(row)
                del x, w, shard
                if not dry:
                    torch.cuda.empty_cache()
            print_table(rows, [("shape", "shape", ""), ("method", "method", ""),
                               ("ms", "ms", ".2f"), ("extra MiB", "extra_mib", ".1f"),
                               ("err_loss", "err_loss", ".1e"), ("err_dh", "err_dh", ".1e"),
                               ("err_dw", "err_dw", ".1e")],
                        title=f"{describe()} (simulated: one rank of {world}, no communication)")
            if not dry:
                print("results:", append_rows("linear_ce_tp", rows, args.out))
        finally:
            dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world", type=int, default=2, help="GPUs (processes), default 2")
    p.add_argument("--shapes", default="llama3", help=f"comma-separated, of {list(SHAPES)}")
    p.add_argument("--reps", type=int, default=200, help="ms of timed calls per method")
    p.add_argument("--dry", action="store_true",
                   help="gloo on CPU with the tiny shape (checks the script; times mean nothing)")
    p.add_argument("--simulate", action="store_true",
                   help="one GPU: one rank's shard of --world alone (no communication) and the "
                        "split's check with the whole weight, next to the one-GPU op")
    add_out_arg(p)
    args = p.parse_args()
    if args.dry:
        args.shapes = "tiny"
    if args.simulate:
        if not (args.dry or torch.cuda.is_available()):
            sys.exit("--simulate needs a CUDA GPU (with --dry it runs the tiny shape on the CPU)")
        simulate(args)
        return
    elif not args.dry and torch.cuda.device_count() < args.world:
        sys.exit(f"needs {args.world} GPUs, found {torch.cuda.device_count()}; --simulate "
                 "measures one rank's shard on one GPU")
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(args.world, os.path.join(tmp, "init"), args), nprocs=args.world)


if __name__ == "__main__":
    main()
