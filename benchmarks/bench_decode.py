"""Benchmark: decode attention over a KV cache (attention_with_kvcache) against SDPA on the padded
cache and FlashAttention-4's paged forward, with the device copy bandwidth of the same run.

bf16, D=128, 32 query heads over 8 KV heads, one query per sequence, every sequence holding ctx
keys; contiguous caches (B, ctx, Hkv, D) and paged ones (pages of --page-size). Appends one JSON
object per row to benchmarks/results/attention_decode.jsonl (or <--out>/attention_decode.jsonl):
op "attention_decode", method, B, ctx, paged, gbps (bytes of K and V read per second / 1e9:
2 * B * ctx * Hkv * D * 2 bytes over the median time) and copy_gbps (a device-to-device copy of
1 GiB, bytes read plus bytes written per second / 1e9, measured in the same run).

    python benchmarks/bench_decode.py [--batches 1,8,64] [--contexts 1024,...,131072]
    python benchmarks/bench_decode.py --methods triton --num-splits 8,16,32,64,128  # split sweep
    python benchmarks/bench_decode.py --methods triton --configs 64x4x3,128x8x2 --num-splits 16,64

The calls are captured in a CUDA graph and the replays are timed (a decode step is launched that
way; eager timing would measure Python, not the kernels); a method that cannot be captured is
timed eagerly and its row says graph=false. As in a model's decode step, one graph holds one
call per layer, each layer with its own cache (--layers; by default enough layers for about
1 GiB of K/V), so that a small cache's time is not the fixed cost of a replay and its events
(graph_floor_ms in each row: an empty graph's replay); rows give the time per call and
"layers". triton.testing.do_bench clears the L2 cache before each replay, and the layers'
caches together exceed the L2. --check compares every method with the float64 reference on a
small case first.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F
from common import (
    add_out_arg,
    append_rows,
    describe,
    env_set,
    print_table,
    results_path,
    run_meta,
    time_ms,
)

from fusedops.attention import attention_with_kvcache

HQ, HKV, D = 32, 8, 128
DTYPE = torch.bfloat16


def fused(backend, num_splits=None):
    def fn(q, kc, vc, lens, pt):
        return attention_with_kvcache(q, kc, vc, lens, page_table=pt, backend=backend,
                                      check=False, num_splits=num_splits)
    return fn


def fused_config(config, num_splits=None):
    """Triton with the kernel configuration (BLOCK_N, warps, stages) replaced for the call, to
    tune kvcache_triton._config (--configs)."""
    from fusedops.attention import kvcache_triton
    inner = fused("triton", num_splits)

    def fn(*args):
        saved = kvcache_triton._config
        kvcache_triton._config = lambda *args: config
        try:
            return inner(*args)
        finally:
            kvcache_triton._config = saved
    return fn


def triton_pdl(mode):
    """Triton with FUSEDOPS_ATTN_DECODE_PDL set to `mode` for each call (0: no programmatic
    dependent launch; 2: the partial kernel too; methods triton-pdlN)."""
    inner = fused("triton")

    def fn(*args):
        with env_set("FUSEDOPS_ATTN_DECODE_PDL", str(mode)):
            return inner(*args)
    return fn


def cuda(name, num_splits=None):
    """The CUDA kernel (cuda-sm90: its sm_90a build on a 9.0 GPU; cuda-sm80 the same source)."""
    from fusedops.attention.kvcache_backends import CUDA_ENABLED
    if not CUDA_ENABLED:
        raise ImportError("the CUDA decode kernel is disabled (FUSEDOPS_ATTN_DECODE_CUDA=0)")
    return fused(name, num_splits)


def cuda_stages(name, stages):
    """The CUDA kernel with FUSEDOPS_ATTN_DECODE_STAGES set to `stages` for each call (its K/V
    pipeline depth; a CUDA graph keeps what the captured call read)."""
    inner = cuda(name)

    def fn(*args):
        with env_set("FUSEDOPS_ATTN_DECODE_STAGES", str(stages)):
            return inner(*args)
    return fn


def sdpa():
    """PyTorch SDPA on the padded contiguous cache (every key valid here: no mask needed)."""
    def fn(q, kc, vc, lens, pt):
        out = F.scaled_dot_product_attention(q.transpose(1, 2), kc.transpose(1, 2),
                                             vc.transpose(1, 2), enable_gqa=True)
        return out.transpose(1, 2)
    return fn


def fa4():
    """FlashAttention-4's forward (flash-attn-4, CuTe DSL) with seqused_k, and page_table for a
    paged cache; its own split heuristic (num_splits=0), except on compute capability 9.x,
    where its sm_90 forward has no split-KV path (one split)."""
    from flash_attn.cute import flash_attn_varlen_func

    splits = 1 if torch.cuda.get_device_capability()[0] == 9 else 0

    def fn(q, kc, vc, lens, pt):
        out = flash_attn_varlen_func(q, kc, vc, seqused_k=lens, page_table=pt, causal=True,
                                     num_splits=splits)
        return out[0] if isinstance(out, tuple) else out
    return fn


def read_floor(config=None, splits=None):
    """A lower bound for any split-KV decode kernel on a contiguous cache: a Triton kernel with
    the Triton decode's grid, split count, key blocks, warps and stages that only reads each
    program's K and V rows and writes one sum per program (no products, no softmax, no
    combine). Rows with method "read"; with `config` (BLOCK_N, warps, stages) and `splits` in
    place of the decode's (--read-variants), "read-cBxWxS-sN"."""
    import triton
    import triton.language as tl

    from fusedops.attention import kvcache_triton
    from fusedops.attention.kvcache import num_splits_heuristic, sm_count

    @triton.jit
    def read_kernel(K, V, OUT, ctx, stride_kb, stride_ks, stride_kh, BLOCK_N: tl.constexpr,
                    HEAD_DIM: tl.constexpr):
        split, kvh, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        chunk = tl.cdiv(tl.cdiv(ctx, tl.num_programs(0)), BLOCK_N) * BLOCK_N
        lo = split * chunk
        hi = tl.minimum(ctx, lo + chunk)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, HEAD_DIM)
        acc = tl.zeros((BLOCK_N, HEAD_DIM), tl.float32)
        base = b.to(tl.int64) * stride_kb + kvh.to(tl.int64) * stride_kh
        for start in range(lo, hi, BLOCK_N):
            cols = start + offs_n
            off = base + cols.to(tl.int64)[:, None] * stride_ks + offs_d[None, :]
            keep = (cols < hi)[:, None]
            acc += tl.load(K + off, mask=keep, other=0.0).to(tl.float32)
            acc += tl.load(V + off, mask=keep, other=0.0).to(tl.float32)
        tl.store(OUT + (b * tl.num_programs(1) + kvh) * tl.num_programs(0) + split, tl.sum(acc))

    def fn(q, kc, vc, lens, pt):
        if pt is not None:
            raise NotImplementedError("the read floor is for contiguous caches")
        b, ctx, hkv, d = kc.shape
        sms = sm_count(q.device)
        block_n, warps, stages = config or kvcache_triton._config(d, q.dtype, False, b * hkv,
                                                                  sms)
        n = splits or num_splits_heuristic(b, hkv, ctx, sms, block_n,
                                           per_sm=kvcache_triton._per_sm(stages, False))
        out = torch.empty(b * hkv * n, device=q.device, dtype=torch.float32)
        read_kernel[(n, hkv, b)](kc, vc, out, ctx, kc.stride(0), kc.stride(1), kc.stride(2),
                                      BLOCK_N=block_n, HEAD_DIM=d, num_warps=warps,
                                      num_stages=stages)
        return out
    return fn


def copy_gbps(rep_ms: int) -> float:
    """Device copy bandwidth: bytes read + written per second / 1e9, 1 GiB buffers."""
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), rep_ms)
    return 2 * 2**30 / ms / 1e6


def graph_timed(fn, layers, rep_ms: int):
    """(median ms per call, captured) of fn on each layer's inputs in turn, by the replay of one
    CUDA graph holding every layer's call (a model's decode step: one call per layer, each on
    its own cache), when it can be captured."""
    def step():
        for args in layers:
            fn(*args)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # compile / autotune outside the capture
            fn(*layers[0])
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        torch.cuda.synchronize()
        return time_ms(graph.replay, rep_ms) / len(layers), True
    except Exception as exc:  # noqa: BLE001 - report and time eagerly
        print(f"  not capturable ({type(exc).__name__}: {str(exc)[:120]}); timed eagerly",
              file=sys.stderr)
        torch.cuda.synchronize()
        return time_ms(step, rep_ms) / len(layers), False


def graph_floor_ms(rep_ms: int) -> float:
    """Time of one replay of a graph holding a single 4-byte memset: the fixed cost of the
    timing itself."""
    x = torch.zeros(1, device="cuda")
    return graph_timed(lambda t: t.zero_(), [(x,)], rep_ms)[0]


def layer_count(kv_bytes: int, fixed: int) -> int:
    """Layers per timed graph: --layers, or (0) enough distinct caches for about 1 GiB of K/V
    per replay, 1 to 16."""
    if fixed:
        return fixed
    return max(1, min(16, -(-(1 << 30) // kv_bytes)))


def make_cache(b: int, ctx: int, paged: bool, page_size: int):
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(b, 1, HQ, D, device="cuda", dtype=DTYPE, generator=g)
    if paged:
        pages = b * ctx // page_size
        shape = (pages, page_size, HKV, D)
        perm = torch.randperm(pages, device="cuda", generator=g).to(torch.int32)
        pt = perm.view(b, ctx // page_size)
    else:
        shape, pt = (b, ctx, HKV, D), None
    kc = torch.empty(shape, device="cuda", dtype=DTYPE).normal_(generator=g)
    vc = torch.empty(shape, device="cuda", dtype=DTYPE).normal_(generator=g)
    lens = torch.full((b,), ctx, dtype=torch.int32, device="cuda")
    return q, kc, vc, lens, pt


def check(fns, page_size: int) -> None:
    """Every method against the float64 reference on B=3, ctx=4096 (paged and not), full
    lengths and ragged ones (4096, 1000, 1; not for SDPA, which has no lengths here). A method
    that fails to run is dropped with a message; one that disagrees stops the run."""
    for paged, ragged in ((False, False), (False, True), (True, True)):
        q, kc, vc, lens, pt = make_cache(3, 4096, paged, page_size)
        if ragged:
            lens = torch.tensor([4096, 1000, 1], dtype=torch.int32, device="cuda")
        ref = attention_with_kvcache(q.double(), kc.double(), vc.double(), lens,
                                     page_table=pt, backend="torch")
        for name, fn in list(fns.items()):
            if name.startswith("read") or name == "sdpa" and (paged or ragged):
                continue
            try:
                out = fn(q, kc, vc, lens, pt)
            except Exception as exc:  # noqa: BLE001 - a method that cannot run is left out
                print(f"{name}: dropped, it failed on the check case paged={paged} "
                      f"({type(exc).__name__}: {str(exc)[:200]})")
                del fns[name]
                continue
            err = ((out.double() - ref).norm() / ref.norm()).item()
            print(f"check {name} paged={paged} ragged={ragged}: relative error {err:.2e}",
                  file=sys.stderr)
            if not err < 2e-2:
                raise SystemExit(f"{name} paged={paged} disagrees with the reference: {err}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--contexts", default="1024,2048,4096,8192,16384,32768,65536,131072")
    ap.add_argument("--methods", default="triton,cuda-sm90,torch,sdpa,fa4",
                    help="of triton, cuda-sm90, cuda-sm80 (on a 9.0 GPU the same code as "
                         "cuda-sm90), torch, sdpa, fa4, read (a read-only kernel with the "
                         "Triton decode's grid: the floor of its time), triton-pdl0 and "
                         "triton-pdl2 (FUSEDOPS_ATTN_DECODE_PDL=0 or 2)")
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--torch-max-keys", type=int, default=8 * 16384,
                    help="the torch reference runs only where B * ctx is at most this")
    ap.add_argument("--rep-ms", type=int, default=50)
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--num-splits", default="",
                    help="comma list: also time Triton with each fixed split count (methods "
                         "triton-sN, rows with num_splits), to tune the heuristic")
    ap.add_argument("--cuda-splits", default="",
                    help="comma list: also time the CUDA kernel (cuda-sm90) with each fixed "
                         "split count (methods cuda-sm90-sN)")
    ap.add_argument("--cuda-stages", default="",
                    help="comma list: also time the CUDA kernel with each K/V pipeline depth "
                         "(FUSEDOPS_ATTN_DECODE_STAGES, 2 to 6; methods cuda-sm90-stN)")
    ap.add_argument("--configs", default="",
                    help="comma list of BLOCK_NxWARPSxSTAGES: also time Triton with each kernel "
                         "configuration (methods triton-cBxWxS[-sN], at the heuristic's split "
                         "count and at each --num-splits; rows with config)")
    ap.add_argument("--read-variants", default="",
                    help="comma list of BLOCK_NxWARPSxSTAGES:SPLITS: also time the read floor "
                         "with that configuration and split count (methods read-cBxWxS-sN)")
    ap.add_argument("--layers", type=int, default=0,
                    help="calls per timed graph, each on its own cache (0: enough for about "
                         "1 GiB of K/V, 1 to 16; 1: one call per replay)")
    add_out_arg(ap)
    args = ap.parse_args()
    meta = run_meta()
    path = results_path("attention_decode", args.out)
    makers = {"triton": lambda: fused("triton"), "cuda-sm90": lambda: cuda("cuda-sm90"),
              "cuda-sm80": lambda: cuda("cuda-sm80"), "torch": lambda: fused("torch"),
              "sdpa": sdpa, "fa4": fa4, "read": read_floor,
              "triton-pdl0": lambda: triton_pdl(0), "triton-pdl2": lambda: triton_pdl(2)}
    unknown = [m for m in args.methods.split(",") if m not in makers]
    if unknown:
        ap.error(f"--methods: unknown {', '.join(unknown)} (known: {', '.join(makers)})")
    fns = {}
    for m in args.methods.split(","):
        try:
            fns[m] = makers[m]()
        except Exception as exc:  # noqa: BLE001 - FlashAttention-4 absent, CUDA not enabled
            print(f"{m}: skipped ({type(exc).__name__}: {str(exc)[:200]})")
    splits, configs = {}, {}
    counts = [int(n) for n in filter(None, args.num_splits.split(","))]
    for n in counts:
        fns[f"triton-s{n}"] = fused("triton", n)
        splits[f"triton-s{n}"] = n
    # the CUDA kernel at other pipeline depths (-stN) and fixed split counts (-sN)
    variants = [(f"cuda-sm90-st{n}", lambda n=n: cuda_stages("cuda-sm90", n), None)
                for n in map(int, filter(None, args.cuda_stages.split(",")))]
    variants += [(f"cuda-sm90-s{n}", lambda n=n: cuda("cuda-sm90", n), n)
                 for n in map(int, filter(None, args.cuda_splits.split(",")))]
    for name, make, n in variants:
        try:
            fns[name] = make()
        except ImportError as exc:
            print(f"{name}: skipped ({exc})")
            continue
        if n:
            splits[name] = n
    for c in filter(None, args.configs.split(",")):
        config = tuple(int(x) for x in c.split("x"))
        if len(config) != 3:
            raise SystemExit(f"--configs: {c!r} is not BLOCK_NxWARPSxSTAGES")
        for n in [None, *counts]:
            name = f"triton-c{c}" + (f"-s{n}" if n else "")
            fns[name], configs[name] = fused_config(config, n), c
            if n:
                splits[name] = n
    for v in filter(None, args.read_variants.split(",")):
        c, n = v.split(":")
        fns[f"read-c{c}-s{n}"] = read_floor(tuple(int(x) for x in c.split("x")), int(n))
    if args.check:
        check(fns, args.page_size)
    copy = copy_gbps(args.rep_ms)
    floor = graph_floor_ms(args.rep_ms)
    print(f"device copy: {copy:.0f} GB/s; one replay of an empty graph: {floor * 1e3:.1f} us",
          file=sys.stderr)
    rows = []
    for b in map(int, args.batches.split(",")):
        for ctx in map(int, args.contexts.split(",")):
            for paged in (False, True):
                kv_bytes = 2 * b * ctx * HKV * D * DTYPE.itemsize
                n_layers = layer_count(kv_bytes, args.layers)
                layers = [make_cache(b, ctx, paged, args.page_size) for _ in range(n_layers)]
                for name, fn in fns.items():
                    if (name == "sdpa" or name.startswith("read")) and paged:
                        continue
                    if name == "torch" and b * ctx > args.torch_max_keys:
                        continue
                    try:
                        ms, captured = graph_timed(fn, layers, args.rep_ms)
                    except Exception as exc:  # noqa: BLE001 - one method failing is a result
                        print(f"{name} B={b} ctx={ctx} paged={paged}: {type(exc).__name__}: "
                              f"{str(exc)[:200]}", file=sys.stderr)
                        torch.cuda.empty_cache()
                        continue
                    row = dict(op="attention_decode", method=name, B=b, ctx=ctx, paged=paged,
                               page_size=args.page_size if paged else None, Hq=HQ, Hkv=HKV,
                               D=D, Sq=1, dtype="bfloat16", ms=round(ms, 5),
                               gbps=round(kv_bytes / ms / 1e6, 1), copy_gbps=round(copy, 1),
                               frac_of_copy=round(kv_bytes / ms / 1e6 / copy, 3),
                               graph=captured, num_splits=splits.get(name),
                               config=configs.get(name), layers=n_layers,
                               graph_floor_ms=round(floor, 5), **meta)
                    rows.append(row)
                    append_rows("attention_decode", [row], args.out)
                del layers
                torch.cuda.empty_cache()
    print_table(rows, [("B", "B", "d"), ("ctx", "ctx", "d"), ("paged", "paged", ""),
                       ("method", "method", ""), ("ms", "ms", ".4f"), ("GB/s", "gbps", ".0f"),
                       ("of copy", "frac_of_copy", ".2f"), ("graph", "graph", "")],
                title=f"\n{describe(meta)} -> {path}; device copy {copy:.0f} GB/s")
    for method in ("triton", "cuda-sm90", "cuda-sm80"):
        if method not in fns:
            continue
        slow = [r for r in rows if r["method"] == method and r["ctx"] >= 8192
                and r["frac_of_copy"] < 0.85]
        print(f"{method} rows at ctx >= 8192 below 85% of the copy bandwidth: {len(slow)}"
              + "".join(f"\n  B={r['B']} ctx={r['ctx']} paged={r['paged']}: "
                        f"{r['frac_of_copy']:.2f}" for r in slow))


if __name__ == "__main__":
    main()
