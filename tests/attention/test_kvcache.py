"""attention_with_kvcache: parity against the float64 oracle, the append, bad input, dispatch."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import attn_oracle as A
import numpy as np
import pytest
import torch

from fusedops import _ext, dispatch
from fusedops.attention import attention, attention_with_kvcache, kvcache
from fusedops.attention.kvcache_backends import CUDA_ENABLED as CUDA_DECODE
from fusedops.attention.kvcache_backends import CUDA_MAX_ROWS

HAS_GPU = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
try:
    import triton  # noqa: F401

    from fusedops.attention import kvcache_triton
    HAS_TRITON = True
except ImportError:
    HAS_TRITON = False
# The CUDA decode kernel runs only when built and enabled (FUSEDOPS_ATTN_DECODE_CUDA=1: it is
# slower than the Triton kernel on the H200, so opt-in).
NEEDS_CUDA_DECODE = [pytest.mark.skipif(not _ext.available(), reason="fusedops._C not built"),
                     pytest.mark.skipif(not CUDA_DECODE, reason="FUSEDOPS_ATTN_DECODE_CUDA=1 "
                                        "not set")]


@dataclass
class Case:
    lens: tuple  # cache_seqlens before the append, one per sequence
    sq: int
    heads_q: int
    heads_kv: int
    head_dim: int
    capacity: int  # keys per sequence the cache can hold
    dtype: torch.dtype
    device: str
    n_new: int = 0  # keys appended (k_new / v_new)
    page_size: int | None = None  # None: a contiguous cache
    causal: bool = True
    window: tuple = (-1, -1)
    softcap: float | None = None
    num_splits: int | None = None
    seed: int = 0
    extra: dict = field(default_factory=dict)

    def kwargs(self):
        return dict(causal=self.causal, window_size=self.window, softcap=self.softcap)


def make_inputs(c: Case):
    """Float32 host tensors: q, the logical cache (B, capacity, Hkv, D) filled with noise past
    each length (must never be read), k_new/v_new, and for a paged cache a shuffled pool of
    pages with the page table (entries past the used pages out of range)."""
    g = torch.Generator().manual_seed(c.seed)
    b = len(c.lens)
    q = torch.randn(b, c.sq, c.heads_q, c.head_dim, generator=g)
    k = torch.randn(b, c.capacity, c.heads_kv, c.head_dim, generator=g)
    v = torch.randn(b, c.capacity, c.heads_kv, c.head_dim, generator=g)
    new = [torch.randn(b, c.n_new, c.heads_kv, c.head_dim, generator=g) for _ in range(2)]
    lens = torch.tensor(c.lens, dtype=torch.int32)
    inp = dict(q=q, k=k, v=v, k_new=new[0] if c.n_new else None,
               v_new=new[1] if c.n_new else None, lens=lens, page_table=None)
    if c.page_size is not None:
        ps = c.page_size
        assert c.capacity % ps == 0
        max_pages = c.capacity // ps
        num_pages = b * max_pages + 3
        perm = torch.randperm(num_pages, generator=g)[:b * max_pages].view(b, max_pages)
        pool_k = torch.randn(num_pages, ps, c.heads_kv, c.head_dim, generator=g)
        pool_v = torch.randn(num_pages, ps, c.heads_kv, c.head_dim, generator=g)
        pool_k[perm] = k.view(b, max_pages, ps, c.heads_kv, c.head_dim)
        pool_v[perm] = v.view(b, max_pages, ps, c.heads_kv, c.head_dim)
        table = perm.to(torch.int32).clone()
        for row, n in enumerate(c.lens):
            used = -(-(n + c.n_new) // ps)
            table[row, used:] = num_pages + 7 + row  # never read: out of range on purpose
        inp.update(k=pool_k, v=pool_v, page_table=table)
    return inp


def call(fn, inp, c: Case, dtype, **kw):
    """Runs fn on copies of the inputs in `dtype`; returns out, lse and the caches after."""
    dev = c.device
    # copies always: the call appends in place, and the inputs must stay as make_inputs left
    # them (for float32 CPU cases .to() would return the input itself)
    cast = lambda t: None if t is None else t.to(dev, dtype, copy=True)  # noqa: E731
    kc, vc = cast(inp["k"]), cast(inp["v"])
    pt = None if inp["page_table"] is None else inp["page_table"].to(dev)
    lens = inp["lens"].to(dev)
    with torch.no_grad():
        out, lse = fn(cast(inp["q"]), kc, vc, lens, k_new=cast(inp["k_new"]),
                      v_new=cast(inp["v_new"]), page_table=pt, return_lse=True,
                      num_splits=c.num_splits, **c.kwargs(), **kw)
    assert torch.equal(lens.cpu(), inp["lens"])  # cache_seqlens is not changed
    return dict(out=out, lse=lse, k=kc, v=vc)


def logical(cache, page_table, n):
    """Logical keys (capacity, Hkv, D) of every sequence of a cache."""
    if page_table is None:
        return cache
    return cache[page_table.clamp(0, cache.shape[0] - 1).long()].flatten(1, 2)


def eager(inp, c: Case, dtype, after):
    """Plain PyTorch in `dtype` on each sequence's keys after the append (scores and p @ v in
    that dtype, softmax in float32), through the attention oracle's dense formula."""
    kl = logical(after["k"].cpu(), inp["page_table"], c.capacity)
    vl = logical(after["v"].cpu(), inp["page_table"], c.capacity)
    q = inp["q"].to(dtype)
    outs, lses = [], []
    for b, n in enumerate(c.lens):
        total = n + c.n_new
        o, lse = A._eager_one(q[b], kl[b, :total].to(dtype), vl[b, :total].to(dtype),
                              c.causal, c.window, c.softcap)
        outs.append(o)
        lses.append(lse)
    return dict(out=torch.stack(outs), lse=torch.stack(lses))


def appended(inp, c: Case, dtype):
    """The caches the append must leave: the inputs with k_new/v_new written at lens + t."""
    k, v = inp["k"].to(dtype).clone(), inp["v"].to(dtype).clone()
    for b, n in enumerate(c.lens):
        for t in range(c.n_new):
            p = n + t
            if inp["page_table"] is None:
                at = (b, p)
            else:
                at = (int(inp["page_table"][b, p // c.page_size]), p % c.page_size)
            k[at] = inp["k_new"][b, t].to(dtype)
            v[at] = inp["v_new"][b, t].to(dtype)
    return k, v


def check(c: Case, backend: str, fn=attention_with_kvcache):
    """The repository's rule: error against float64 <= 2x plain PyTorch's + slack."""
    inp = make_inputs(c)
    k0, v0 = inp["k"].clone(), inp["v"].clone()
    ref = call(attention_with_kvcache, inp, c, torch.float64, backend="torch")
    got = call(fn, inp, c, c.dtype, backend=backend)
    assert torch.equal(inp["k"], k0) and torch.equal(inp["v"], v0)  # the inputs stay
    want_k, want_v = appended(inp, c, c.dtype)
    assert torch.equal(got["k"].cpu(), want_k) and torch.equal(got["v"].cpu(), want_v)
    plain = eager(inp, c, c.dtype, ref)
    table = {}
    for name in ("out", "lse"):
        assert got[name].shape == ref[name].shape, (name, got[name].shape)
        e_got = A.scaled_err(got[name].cpu(), ref[name].cpu())
        e_plain = A.scaled_err(plain[name], ref[name].cpu())
        table[name] = (e_got, e_plain)
        assert e_got <= 2 * e_plain + A.SLACK[c.dtype], (
            f"{name}: error {e_got:.3e} > 2 x plain {e_plain:.3e} + {A.SLACK[c.dtype]:.0e}")
    assert got["out"].dtype == c.dtype and got["lse"].dtype == torch.float32
    return table


# Tiny CPU cases (each well under a second under the Triton interpreter): ragged lengths with 0,
# Sq 1 and 3, GQA 4:1 and MQA, appends, contiguous and paged (pages of 4 and 16, a block of 16
# keys spanning pages), windows, softcap, non-causal, rows that see no key (Sq > L), head dim 24.
CPU_CASES = {
    "gqa-sq1": dict(lens=(0, 5, 37), sq=1, heads_q=8, heads_kv=2, head_dim=16, capacity=40),
    "gqa-sq3-append": dict(lens=(2, 0, 30), sq=3, heads_q=8, heads_kv=2, head_dim=16,
                           capacity=36, n_new=3),
    "mqa-append": dict(lens=(9, 21), sq=1, heads_q=4, heads_kv=1, head_dim=16, capacity=24,
                       n_new=1),
    "paged4-sq3-append": dict(lens=(0, 13, 6), sq=3, heads_q=8, heads_kv=2, head_dim=16,
                              capacity=20, n_new=3, page_size=4),
    "paged16-sq1": dict(lens=(0, 47, 17), sq=1, heads_q=8, heads_kv=2, head_dim=16,
                        capacity=48, page_size=16),
    "window-append": dict(lens=(3, 25), sq=3, heads_q=8, heads_kv=2, head_dim=16, capacity=32,
                          n_new=3, page_size=8, window=(5, 0)),
    "softcap": dict(lens=(11, 30), sq=1, heads_q=4, heads_kv=2, head_dim=16, capacity=32,
                    softcap=2.0),
    "noncausal-window": dict(lens=(7, 29), sq=3, heads_q=4, heads_kv=2, head_dim=16,
                             capacity=32, n_new=2, causal=False, window=(6, 1)),
    "everything-mqa-paged": dict(lens=(1, 18, 0), sq=3, heads_q=4, heads_kv=1, head_dim=16,
                                 capacity=24, n_new=3, page_size=4, window=(9, 0),
                                 softcap=3.0),
    "rows-see-nothing": dict(lens=(1, 0, 2), sq=3, heads_q=4, heads_kv=2, head_dim=16,
                             capacity=8),
    "head-dim-24": dict(lens=(5, 19), sq=1, heads_q=6, heads_kv=3, head_dim=24, capacity=20,
                        n_new=1),
    "splits-5": dict(lens=(0, 70, 33), sq=3, heads_q=8, heads_kv=2, head_dim=16, capacity=80,
                     n_new=2, page_size=16, num_splits=5),
    "splits-1": dict(lens=(4, 39), sq=1, heads_q=8, heads_kv=2, head_dim=16, capacity=40,
                     num_splits=1),
    # 24 rows per KV head: two blocks of rows under the interpreter (16 rows a program)
    "rows-two-blocks": dict(lens=(0, 29, 11), sq=3, heads_q=16, heads_kv=2, head_dim=16,
                            capacity=32, n_new=2, page_size=8, window=(12, 0), num_splits=3),
    # The combine's shapes: D=40 (two column programs, the second half masked), paged; D=24
    # (columns past the head dim) with 20 splits (more than one tile of splits); D=80, two row
    # blocks, a window and 11 splits; D=8 MQA, one row, 9 splits.
    "combine-d40": dict(lens=(0, 45, 21), sq=1, heads_q=8, heads_kv=2, head_dim=40,
                        capacity=48, page_size=16, num_splits=3),
    "combine-d24-splits20": dict(lens=(300, 7), sq=2, heads_q=16, heads_kv=2, head_dim=24,
                                 capacity=320, n_new=2, num_splits=20),
    "combine-d80-window": dict(lens=(0, 150, 61), sq=3, heads_q=16, heads_kv=2, head_dim=80,
                               capacity=176, n_new=2, page_size=16, window=(40, 0),
                               num_splits=11),
    "combine-d8-mqa": dict(lens=(1, 140), sq=1, heads_q=1, heads_kv=1, head_dim=8,
                           capacity=144, num_splits=9),
}

# GPU cases at real sizes: bf16/fp16, D=128 and 64, 32 heads over 8 (GQA 4:1) and MQA, lengths
# 0, 1, 1000 and near the capacity, pages of 16, 64 and 256, appends, Sq 1 and 3, window, softcap.
GPU_CASES = {
    "contig-sq1": dict(lens=(0, 1, 1000, 4095), sq=1, heads_q=32, heads_kv=8, head_dim=128,
                       capacity=4096, n_new=1),
    "contig-sq3": dict(lens=(0, 1, 1000, 8189), sq=3, heads_q=32, heads_kv=8, head_dim=128,
                       capacity=8192, n_new=3),
    "paged16": dict(lens=(0, 17, 1000, 4093), sq=1, heads_q=32, heads_kv=8, head_dim=128,
                    capacity=4096, n_new=1, page_size=16),
    "paged64-sq3": dict(lens=(5, 777, 4000, 8186), sq=3, heads_q=32, heads_kv=8, head_dim=128,
                        capacity=8192, n_new=3, page_size=64),
    "paged256": dict(lens=(0, 255, 2049, 8191), sq=1, heads_q=32, heads_kv=8, head_dim=128,
                     capacity=8192, n_new=1, page_size=256),
    "mqa-d64": dict(lens=(3, 2000), sq=1, heads_q=16, heads_kv=1, head_dim=64, capacity=2048,
                    n_new=1, page_size=64),
    "window-softcap": dict(lens=(100, 3000, 4090), sq=3, heads_q=32, heads_kv=8, head_dim=128,
                           capacity=4096, n_new=3, page_size=64, window=(511, 0), softcap=30.0),
    "batch64-one-split": dict(lens=tuple(range(0, 64 * 60, 60)), sq=1, heads_q=32, heads_kv=8,
                              head_dim=128, capacity=4096, n_new=1, page_size=64),
    # MQA with 4 queries: 128 rows per KV head, two Triton programs of 64 rows (CUDA: too many)
    "mqa-sq4-128rows": dict(lens=(0, 333, 2044), sq=4, heads_q=32, heads_kv=1, head_dim=128,
                            capacity=2048, n_new=4, page_size=16),
}


def _rows(case: dict) -> int:
    return case["heads_q"] // case["heads_kv"] * case["sq"]


def _params():
    out = []
    for name in CPU_CASES:
        out.append(pytest.param("torch", "cpu", torch.float32, name, CPU_CASES,
                                id=f"torch-cpu-float32-{name}"))
        if INTERPRET and HAS_TRITON and not HAS_GPU:
            for dtype in (torch.float32, torch.float16):
                out.append(pytest.param("triton", "cpu", dtype, name, CPU_CASES,
                                        id=f"triton-cpu-{str(dtype)[6:]}-{name}"))
    for backend in ("cuda-sm80", "triton", "torch"):
        marks = [pytest.mark.gpu] + (NEEDS_CUDA_DECODE if backend.startswith("cuda") else [])
        for dtype in (torch.bfloat16, torch.float16):
            if backend == "torch" and dtype != torch.bfloat16:
                continue
            for name in GPU_CASES:
                if backend.startswith("cuda") and _rows(GPU_CASES[name]) > CUDA_MAX_ROWS:
                    continue
                out.append(pytest.param(backend, "cuda", dtype, name, GPU_CASES, marks=marks,
                                        id=f"{backend}-cuda-{str(dtype)[6:]}-{name}"))
    return out


@pytest.mark.parametrize("backend,device,dtype,name,cases", _params())
def test_parity(backend, device, dtype, name, cases):
    check(Case(**cases[name], dtype=dtype, device=device), backend)


def test_rows_no_split_saw_in_every_column_program():
    """Splits that all see nothing (length 0; the first query of a length-1 sequence with Sq=2):
    zeros and lse -inf from every head-dim program of the combine (D=72: five), no NaN."""
    if not (INTERPRET and HAS_TRITON and not HAS_GPU):
        pytest.skip("the Triton backend runs on the CPU only under TRITON_INTERPRET=1")
    g = torch.Generator().manual_seed(4)
    q = torch.randn(2, 2, 8, 72, generator=g)
    kc, vc = torch.randn(2, 64, 2, 72, generator=g), torch.randn(2, 64, 2, 72, generator=g)
    lens = torch.tensor([0, 1], dtype=torch.int32)
    out, lse = attention_with_kvcache(q, kc, vc, lens, backend="triton", num_splits=4,
                                      return_lse=True)
    assert not out.isnan().any() and not lse.isnan().any()
    assert torch.all(out[0] == 0) and torch.all(lse[0] == -math.inf)
    assert torch.all(out[1, 0] == 0) and torch.all(lse[1, :, 0] == -math.inf)
    ref, ref_lse = attention_with_kvcache(q, kc, vc, lens, backend="torch", return_lse=True)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)


def test_reference_matches_dense_attention_float64():
    """The decode reference equals fusedops.attention's float64 reference run on each
    sequence's keys (bottom-right causal alignment, windows, softcap, empty rows)."""
    for name in ("gqa-sq3-append", "everything-mqa-paged", "noncausal-window",
                 "rows-see-nothing"):
        c = Case(**CPU_CASES[name], dtype=torch.float64, device="cpu")
        inp = make_inputs(c)
        got = call(attention_with_kvcache, inp, c, torch.float64, backend="torch")
        kl, vl = logical(got["k"], inp["page_table"], c.capacity), logical(
            got["v"], inp["page_table"], c.capacity)
        for b, n in enumerate(c.lens):
            total = n + c.n_new
            if total == 0:
                assert torch.all(got["out"][b] == 0)
                assert torch.all(got["lse"][b] == float("-inf"))
                continue
            out, lse = attention(inp["q"][b:b + 1].double(), kl[b:b + 1, :total],
                                 vl[b:b + 1, :total], return_lse=True, backend="torch",
                                 **c.kwargs())
            assert A.rel_err(got["out"][b:b + 1], out) < 1e-12, (name, b)
            assert A.rel_err(got["lse"][b:b + 1], lse) < 1e-12, (name, b)


def test_rows_that_see_no_key_are_zero_with_lse_minus_inf():
    q = torch.randn(2, 3, 4, 16)
    kc, vc = torch.randn(2, 8, 2, 16), torch.randn(2, 8, 2, 16)
    lens = torch.tensor([1, 0], dtype=torch.int32)
    out, lse = attention_with_kvcache(q, kc, vc, lens, return_lse=True, backend="torch")
    # Sequence 0 holds one key, seen only by the last query; sequence 1 holds none.
    assert torch.all(out[0, :2] == 0) and torch.all(lse[0, :, :2] == float("-inf"))
    assert torch.isfinite(lse[0, :, 2]).all()
    assert torch.all(out[1] == 0) and torch.all(lse[1] == float("-inf"))


@pytest.mark.parametrize("wrong", ["scale", "not_causal", "append_extra"])
def test_checker_rejects_a_wrong_implementation(wrong):
    """A wrong softmax scale, a decode step that forgets the causal mask of its Sq queries, or
    an append that also writes past the new keys must fail the rule the parity tests use."""
    c = Case(**CPU_CASES["gqa-sq3-append"], dtype=torch.float32, device="cpu")

    def bad(*args, **kw):
        if wrong == "scale":
            kw["softmax_scale"] = 0.26
        elif wrong == "not_causal":
            kw["causal"] = False
        out = attention_with_kvcache(*args, **kw)
        if wrong == "append_extra":  # one slot past sequence 0's new keys
            args[1][0, int(args[3][0]) + kw["k_new"].shape[1]] = 99.0
        return out

    check(c, "torch")
    with pytest.raises(AssertionError, match=None if wrong == "append_extra" else "out: error"):
        check(c, "torch", fn=bad)


def test_int_cache_seqlens_and_num_splits_agree():
    """An int cache_seqlens is every sequence's length; the number of splits changes nothing
    but rounding."""
    torch.manual_seed(1)
    q = torch.randn(2, 1, 4, 16)
    kc, vc = torch.randn(2, 30, 2, 16), torch.randn(2, 30, 2, 16)
    a = attention_with_kvcache(q, kc, vc, 17, backend="torch")
    b = attention_with_kvcache(q, kc, vc, torch.tensor([17, 17], dtype=torch.int32),
                               backend="torch")
    assert torch.equal(a, b)
    # a NumPy integer is an int too (it used to be refused as "not an int32 Tensor")
    assert torch.equal(attention_with_kvcache(q, kc, vc, np.int32(17), backend="torch"), a)
    with pytest.raises(ValueError, match="cache_seqlens"):
        attention_with_kvcache(q, kc, vc, np.int64(31), backend="torch")
    if INTERPRET and HAS_TRITON and not HAS_GPU:
        for splits in (1, 2, 7):
            c = attention_with_kvcache(q, kc, vc, 17, backend="triton", num_splits=splits)
            torch.testing.assert_close(c, a, rtol=1e-5, atol=1e-5)


def test_no_host_synchronisation_with_check_false(monkeypatch):
    """With check=False nothing reads tensor values on the host (what a CUDA graph capture
    needs): .tolist() and .item() are refused during the call."""
    c = Case(**CPU_CASES["paged4-sq3-append"], dtype=torch.float32, device="cpu")
    inp = make_inputs(c)
    # valid page numbers everywhere: unchecked input must be valid input
    inp["page_table"] = inp["page_table"].clamp(max=inp["k"].shape[0] - 1)
    want = call(attention_with_kvcache, inp, c, torch.float32, backend="torch")

    def refuse(*a, **k):
        raise AssertionError("host synchronisation")

    backends = ["torch"] + (["triton"] if INTERPRET and HAS_TRITON and not HAS_GPU else [])
    for backend in backends:
        with monkeypatch.context() as m:
            for method in ("tolist", "item", "__bool__", "__int__", "__float__", "nonzero",
                           "numpy"):
                m.setattr(torch.Tensor, method, refuse)
            got = call(attention_with_kvcache, inp, c, torch.float32, backend=backend,
                       check=False)
        torch.testing.assert_close(got["out"], want["out"], rtol=1e-5, atol=1e-5)
        assert torch.equal(got["k"], want["k"])


def test_strided_lengths_and_page_table():
    """cache_seqlens and page_table given as strided views mean what their values say."""
    c = Case(**CPU_CASES["paged16-sq1"], dtype=torch.float32, device="cpu")
    inp = make_inputs(c)
    want = call(attention_with_kvcache, inp, c, torch.float32, backend="torch")
    lens = torch.stack([inp["lens"], torch.full_like(inp["lens"], 99)], 1)[:, 0]
    table = inp["page_table"].t().contiguous().t()
    assert not lens.is_contiguous() and table.stride(-1) != 1
    backends = ["torch"] + (["triton"] if INTERPRET and HAS_TRITON and not HAS_GPU else [])
    for backend in backends:
        with torch.no_grad():
            out = attention_with_kvcache(inp["q"], inp["k"], inp["v"], lens, page_table=table,
                                         backend=backend)
        torch.testing.assert_close(out, want["out"], rtol=1e-5, atol=1e-5)


def test_compiles_without_graph_breaks():
    """torch.compile(fullgraph=True) traces a decode step with an append (no value checks, no
    host synchronisation under compile), with the eager result and the same cache."""
    torch.manual_seed(2)
    q, kn, vn = torch.randn(2, 1, 4, 16), torch.randn(2, 1, 2, 16), torch.randn(2, 1, 2, 16)
    kc, vc = torch.randn(2, 8, 2, 16), torch.randn(2, 8, 2, 16)
    lens = torch.tensor([3, 5], dtype=torch.int32)

    def step(q, kc, vc, lens, kn, vn):
        return attention_with_kvcache(q, kc, vc, lens, k_new=kn, v_new=vn, window_size=(4, 0),
                                      softcap=5.0, backend="torch")

    kc2, vc2 = kc.clone(), vc.clone()
    want = step(q, kc, vc, lens, kn, vn)
    got = torch.compile(step, fullgraph=True, backend="aot_eager")(q, kc2, vc2, lens, kn, vn)
    torch.testing.assert_close(got, want)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)


def test_gradients_are_refused():
    q = torch.randn(1, 1, 4, 16, requires_grad=True)
    kc, vc = torch.randn(1, 8, 2, 16), torch.randn(1, 8, 2, 16)
    with pytest.raises(RuntimeError, match="inference only.*detach q"):
        attention_with_kvcache(q, kc, vc, 3)
    kn = torch.randn(1, 1, 2, 16, requires_grad=True)
    with pytest.raises(RuntimeError, match="k_new"):
        attention_with_kvcache(q.detach(), kc, vc, 3, k_new=kn, v_new=kn.detach())
    with torch.no_grad():
        assert attention_with_kvcache(q, kc, vc, 3).shape == q.shape


def _good():
    g = torch.Generator().manual_seed(0)
    return dict(q=torch.randn(2, 1, 4, 16, generator=g),
                k_cache=torch.randn(2, 10, 2, 16, generator=g),
                v_cache=torch.randn(2, 10, 2, 16, generator=g),
                cache_seqlens=torch.tensor([3, 9], dtype=torch.int32))


def _paged():
    g = torch.Generator().manual_seed(0)
    return dict(q=torch.randn(2, 1, 4, 16, generator=g),
                k_cache=torch.randn(5, 4, 2, 16, generator=g),
                v_cache=torch.randn(5, 4, 2, 16, generator=g),
                cache_seqlens=torch.tensor([3, 6], dtype=torch.int32),
                page_table=torch.tensor([[4, 9], [0, 2]], dtype=torch.int32))


def _new(a, n=1, **kw):
    shape = (a["q"].shape[0], n, a["k_cache"].shape[2], a["k_cache"].shape[3])
    return {**a, "k_new": torch.randn(shape, **kw), "v_new": torch.randn(shape, **kw)}


BAD = [
    (lambda: {**_good(), "q": _good()["q"].numpy()}, TypeError, "q must be a Tensor"),
    (lambda: {**_good(), "q": _good()["q"].long()}, TypeError, "q must be float16"),
    (lambda: {**_good(), "k_cache": _good()["k_cache"].half()}, TypeError,
     "k_cache dtype torch.float16 differs"),
    (lambda: {**_good(), "q": _good()["q"][0]}, ValueError, r"q must be \(B, Sq, Hq, D\)"),
    (lambda: {**_good(), "v_cache": _good()["v_cache"][:, :5]}, ValueError,
     "k_cache and v_cache must have one shape"),
    (lambda: {**_good(), "k_cache": _good()["k_cache"][..., :8],
              "v_cache": _good()["v_cache"][..., :8]}, ValueError, "head dims differ"),
    (lambda: {**_good(), "k_cache": torch.randn(2, 10, 3, 16),
              "v_cache": torch.randn(2, 10, 3, 16)},
     ValueError, r"q heads \(4\) must be a multiple of the number of k_cache/v_cache heads \(3\)"),
    (lambda: {**_good(), "k_cache": torch.randn(2, 10, 16, 2).transpose(2, 3),
              "v_cache": torch.randn(2, 10, 16, 2).transpose(2, 3)}, ValueError,
     "k_cache must have a contiguous last"),
    (lambda: {**_good(), "k_cache": torch.randn(3, 10, 2, 16),
              "v_cache": torch.randn(3, 10, 2, 16)},
     ValueError, "q has batch 2, k_cache and v_cache have batch 3"),
    (lambda: {**_good(), "cache_seqlens": _good()["cache_seqlens"].long()}, TypeError,
     "cache_seqlens must be int32"),
    (lambda: {**_good(), "cache_seqlens": torch.tensor([3], dtype=torch.int32)}, ValueError,
     r"cache_seqlens must have shape \(2,\)"),
    (lambda: {**_good(), "cache_seqlens": [3, 4]}, TypeError, "cache_seqlens must be an int32"),
    (lambda: {**_good(), "cache_seqlens": torch.tensor([3, 11], dtype=torch.int32)},
     ValueError, r"cache_seqlens\[1\] \+ S_new = 11 \+ 0 = 11 keys, past the capacity"),
    (lambda: {**_good(), "cache_seqlens": torch.tensor([-1, 2], dtype=torch.int32)},
     ValueError, r"cache_seqlens\[0\] = -1 is negative"),
    (lambda: _new(_good(), n=2), ValueError, r"cache_seqlens\[1\] \+ S_new = 9 \+ 2 = 11"),
    (lambda: _new({**_good(), "cache_seqlens": torch.tensor([3, 8], dtype=torch.int32)}, n=3),
     ValueError, r"cache_seqlens\[1\] \+ S_new = 8 \+ 3 = 11 keys, past"),
    (lambda: _new(_good(), n=11), ValueError, r"S_new = 11 keys cannot fit"),
    (lambda: {**_new(_good()), "v_new": None}, ValueError, "pass both k_new and v_new"),
    (lambda: {**_new(_good()), "k_new": torch.randn(2, 1, 1, 16)}, ValueError,
     r"k_new must be \(B, S_new, Hkv, D\) = \(2, 1, 2, 16\)"),
    (lambda: {**_new(_good()), "v_new": torch.randn(2, 1, 2, 16).double()}, TypeError,
     "v_new dtype torch.float64 differs"),
    (lambda: {**_paged(), "page_table": _paged()["page_table"].long()}, TypeError,
     "page_table must be int32"),
    (lambda: {**_paged(), "page_table": _paged()["page_table"][:1]}, ValueError,
     r"page_table must be \(B, max_pages\)"),
    (lambda: {**_paged(), "page_table": [[0, 1], [2, 3]]}, TypeError,
     "page_table must be an int32"),
    (lambda: {**_paged(), "page_table": torch.tensor([[5, 1], [0, 2]], dtype=torch.int32)},
     ValueError, r"page_table\[0, 0\] = 5 is not a page of k_cache \(0 to 4\)"),
    (lambda: {**_paged(), "page_table": torch.tensor([[1, 2], [0, -1]], dtype=torch.int32)},
     ValueError, r"page_table\[1, 1\] = -1 is not a page"),
    (lambda: {**_paged(), "cache_seqlens": torch.tensor([3, 9], dtype=torch.int32)},
     ValueError, "past the capacity: page_table holds 2 pages of 4"),
    (lambda: (lambda a: {**_new(a), "v_cache": a["k_cache"]})(_good()), ValueError,
     "k_cache and v_cache are one tensor"),
    (lambda: {**_good(), "window_size": (-2, 0)}, ValueError, "window_size"),
    (lambda: {**_good(), "window_size": 4}, TypeError, "window_size must be a"),
    (lambda: {**_good(), "softcap": -1.0}, ValueError, "softcap"),
    (lambda: {**_good(), "softmax_scale": float("inf")}, ValueError, "softmax_scale"),
    (lambda: {**_good(), "num_splits": 0}, ValueError, "num_splits must be in"),
    (lambda: {**_good(), "num_splits": 2.0}, TypeError, "num_splits must be an int"),
    (lambda: {**_good(), "causal": 1}, TypeError, "causal must be a bool"),
    (lambda: {**_good(), "check": "yes"}, TypeError, "check must be a bool"),
    (lambda: {**_good(), "q": torch.randn(2, 1, 4, 300), "k_cache": torch.randn(2, 10, 2, 300),
              "v_cache": torch.randn(2, 10, 2, 300)}, ValueError, "head dim must be"),
    # An int length is checked even with check=False (it costs no synchronisation)
    (lambda: {**_good(), "cache_seqlens": 11, "check": False}, ValueError,
     r"cache_seqlens = 11 with S_new = 0 must lie in \[0, 10\]"),
    (lambda: {**_new(_good(), n=2), "cache_seqlens": 9, "check": False}, ValueError,
     r"cache_seqlens = 9 with S_new = 2 must lie in \[0, 8\]"),
    (lambda: {**_good(), "cache_seqlens": -1, "check": False}, ValueError,
     r"cache_seqlens = -1"),
    # past int32: named, not torch.full's overflow error
    (lambda: {**_good(), "cache_seqlens": 2**40}, ValueError,
     r"cache_seqlens = 1099511627776 with S_new = 0 must lie in \[0, 10\]"),
    # An append writes the cache in place: an expanded one would get one key for several rows
    (lambda: {**_new(_good()), "k_cache": torch.randn(1, 10, 2, 16).expand(2, 10, 2, 16)},
     ValueError, r"k_cache is expanded \(stride 0 in dimension 0\)"),
    (lambda: {**_new(_paged()), "v_cache": torch.randn(5, 4, 1, 16).expand(5, 4, 2, 16)},
     ValueError, r"v_cache is expanded \(stride 0 in dimension 2\)"),
    (lambda: {**_paged(), "k_cache": torch.randn(1, 2**16, 1, 1),
              "v_cache": torch.randn(1, 2**16, 1, 1), "q": torch.randn(2, 1, 1, 1),
              "page_table": torch.zeros(2, 2**15, dtype=torch.int32)}, ValueError,
     "the cache holds 2147483648 keys per sequence"),
]


@pytest.mark.parametrize("make,exc,match", BAD, ids=[m for _, _, m in BAD])
def test_bad_input_names_the_argument(make, exc, match):
    args = make()
    with pytest.raises(exc, match=match):
        attention_with_kvcache(**args, backend="torch")


def test_expanded_cache_without_append_is_read():
    """Only an append refuses an expanded (stride 0) cache; reading one is fine."""
    a = _good()
    kc, vc = torch.randn(1, 10, 2, 16).expand(2, 10, 2, 16), torch.randn(2, 10, 2, 16)
    out = attention_with_kvcache(a["q"], kc, vc, a["cache_seqlens"], backend="torch")
    want = attention_with_kvcache(a["q"], kc.clone(), vc, a["cache_seqlens"], backend="torch")
    torch.testing.assert_close(out, want)


def test_unused_page_table_entries_are_not_checked():
    """Pages past a sequence's length may hold anything (as a paged allocator leaves them)."""
    a = _paged()
    a["page_table"] = torch.tensor([[4, 99], [0, 2]], dtype=torch.int32)
    out = attention_with_kvcache(**a, backend="torch")
    assert torch.isfinite(out).all()


def test_dispatch_declares_the_decode_op():
    table = dispatch.op_backends("attention_decode")
    assert [b.name for b in table.backends] == list(dispatch.BACKENDS)
    sig = dispatch.InputSig("attention_decode", "cuda", 0, torch.bfloat16, 128, True)
    # cuda-sm90 is the same kernel's sm_90a build, declared as such, and opt-in like cuda-sm80
    sm90 = table.by_name["cuda-sm90"]
    assert sm90.arch == 90 and sm90.cc_range == ((9, 0), (9, 0))
    assert "cuda-sm80's split-KV decode kernel built for sm_90a" in sm90.summary
    if not CUDA_DECODE:
        for name in ("cuda-sm90", "cuda-sm80"):
            assert "slower than the Triton one" in dispatch.why_not(name, sig)
    sig96 = dispatch.InputSig("attention_decode", "cuda", 0, torch.bfloat16, 96, True)
    for name in ("cuda-sm90", "cuda-sm80"):
        assert "head dim 96" in (table.by_name[name].limits(sig96) or "")
    assert table.order(sig, False)[:3] == ["cuda-sm90", "cuda-sm80", "triton"]
    assert table.order(sig, True)[:2] == ["cuda-sm80", "triton"]
    x = torch.randn(2, 1, 4, 16)
    assert dispatch.select("attention_decode", x, 16, causal=True) == "torch"
    with pytest.raises(RuntimeError, match="cuda-sm90: .*inputs are on cpu|slower than the Triton"):
        attention_with_kvcache(x, torch.randn(2, 4, 2, 16), torch.randn(2, 4, 2, 16), 2,
                               backend="cuda-sm90")


def test_auto_moves_groups_too_large_for_cuda_to_triton(monkeypatch):
    """The CUDA kernels take (Hq / Hkv) * Sq <= 16 rows per KV head; dispatch sees the head dim
    only, so a larger group picked for CUDA by auto runs on Triton, and an explicit CUDA request
    names the limit (instead of failing inside the op)."""
    asked = []

    def fake_select(op, x, inner, backend=None, causal=False):
        asked.append(backend)
        return "triton" if backend == "triton" else "cuda-sm90"

    monkeypatch.setattr(kvcache.dispatch, "select", fake_select)
    monkeypatch.delenv("FUSEDOPS_BACKEND", raising=False)
    big, small = torch.randn(2, 3, 32, 64), torch.randn(2, 4, 8, 64)  # 48 and 16 rows over 2
    assert kvcache.select_backend(big, 2, None, True) == "triton"
    assert asked == [None, "triton"]
    assert kvcache.select_backend(small, 2, None, True) == "cuda-sm90"
    for request in ("cuda", "cuda-sm90"):
        with pytest.raises(ValueError, match=r"\(Hq / Hkv\) \* Sq <= 16 .* got 48"):
            kvcache.select_backend(big, 2, request, True)
    monkeypatch.setenv("FUSEDOPS_BACKEND", "cuda")
    with pytest.raises(ValueError, match="got 48"):
        kvcache.select_backend(big, 2, None, True)


def test_no_query_heads_or_queries_give_empty_outputs():
    """q with no heads (or no queries) returns empty out and lse, after the append (no kernel
    with a group of 0 heads is compiled)."""
    runs = [("torch", "cpu")]
    if INTERPRET and HAS_TRITON and not HAS_GPU:
        runs.append(("triton", "cpu"))
    if HAS_GPU and HAS_TRITON:
        runs += [("triton", "cuda"), ("torch", "cuda")]
    for backend, dev in runs:
        for shape in ((2, 1, 0, 16), (2, 0, 4, 16), (0, 1, 4, 16)):
            b = shape[0]
            kc, vc = torch.zeros(b, 8, 2, 16, device=dev), torch.zeros(b, 8, 2, 16, device=dev)
            kn, vn = torch.ones(b, 1, 2, 16, device=dev), torch.ones(b, 1, 2, 16, device=dev)
            out, lse = attention_with_kvcache(torch.randn(shape, device=dev), kc, vc, 3,
                                              k_new=kn, v_new=vn, return_lse=True,
                                              backend=backend)
            assert out.shape == shape and lse.shape == (b, shape[2], shape[1])
            assert torch.all(kc[:, 3] == 1) and torch.all(kc[:, 4] == 0)
        # an empty batch with a paged cache and tensor lengths
        pt = torch.zeros(0, 2, dtype=torch.int32, device=dev)
        lens = torch.zeros(0, dtype=torch.int32, device=dev)
        kc = torch.zeros(3, 4, 2, 16, device=dev)
        out = attention_with_kvcache(torch.randn(0, 1, 4, 16, device=dev), kc, kc, lens,
                                     page_table=pt, backend=backend)
        assert out.shape == (0, 1, 4, 16)


def test_num_splits_heuristic():
    from fusedops.attention.kvcache import num_splits_heuristic
    # H200 (132 SMs), 8 KV heads, 64-key blocks: one wave of per_sm programs on each SM
    assert num_splits_heuristic(1, 8, 131072, 132, 64, per_sm=2) == 33
    assert num_splits_heuristic(8, 8, 8192, 132, 64) == 8
    assert num_splits_heuristic(16, 8, 8192, 132, 64) == 4
    assert num_splits_heuristic(32, 8, 8192, 132, 64) == 2
    assert num_splits_heuristic(64, 8, 131072, 132, 64) == 1
    assert num_splits_heuristic(128, 8, 131072, 132, 64) == 1
    assert num_splits_heuristic(1, 8, 256, 132, 64) == 1  # four blocks: one split
    assert num_splits_heuristic(1, 8, 8192, 132, 64) == 32  # capped at four blocks a split
    assert num_splits_heuristic(1, 1, 10**6, 132, 64) == 64
    assert num_splits_heuristic(2, 8, 32768, 132, 64, per_sm=2) == 16


def test_split_heuristic_inputs_of_the_triton_kernel():
    """What decode_fwd passes the heuristic: two programs per SM with three stages, four with
    two, and four on paged caches whatever the stages."""
    if not HAS_TRITON:
        pytest.skip("needs triton")
    assert kvcache_triton._per_sm(3, False) == 2
    assert kvcache_triton._per_sm(2, False) == 4
    assert kvcache_triton._per_sm(3, True) == 4


def test_cuda_num_splits():
    from fusedops.attention.kvcache import cuda_num_splits
    # H200 (132 SMs), 8 KV heads: about one wave of two CTAs per SM
    assert cuda_num_splits(1, 8, 131072, 132) == 33
    assert cuda_num_splits(8, 8, 8192, 132) == 4
    assert cuda_num_splits(64, 8, 8192, 132) == 1
    assert cuda_num_splits(1, 8, 256, 132) == 2  # at least two 64-key tiles a split
    assert cuda_num_splits(1, 8, 64, 132) == 1
    assert cuda_num_splits(1, 1, 10**6, 132) == 128


def _gpu_cache(b, cap, hkv, d, paged, ps=64):
    """bf16 K and V caches on the GPU with cap keys per sequence, contiguous or in pages of ps
    (a random page table), and the page table (None when contiguous)."""
    dev = "cuda"
    if paged:
        pages = torch.randperm(b * cap // ps, device=dev).to(torch.int32).view(b, cap // ps)
        shape = (b * cap // ps, ps, hkv, d)
    else:
        pages, shape = None, (b, cap, hkv, d)
    kc, vc = (torch.randn(shape, device=dev, dtype=torch.bfloat16) for _ in range(2))
    return kc, vc, pages


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", pytest.param("cuda-sm80", marks=NEEDS_CUDA_DECODE)])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged64"])
def test_cuda_graph_capture_of_a_decode_step(paged, backend):
    """A decode step (append one key, attend) is captured once and replayed with new inputs and
    lengths copied into the static tensors: the replays equal eager calls."""
    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    b, hq, hkv, d = 4, 32, 8, 128
    kc, vc, pages = _gpu_cache(b, 4096, hkv, d, paged)
    kc_eager, vc_eager = kc.clone(), vc.clone()
    q = torch.randn(b, 1, hq, d, device=dev, dtype=dt)
    kn, vn = (torch.randn(b, 1, hkv, d, device=dev, dtype=dt) for _ in range(2))
    lens = torch.tensor([0, 100, 2000, 4000], dtype=torch.int32, device=dev)

    def step():
        return attention_with_kvcache(q, kc, vc, lens, k_new=kn, v_new=vn, page_table=pages,
                                      backend=backend, check=False)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up (Triton compiles) outside the capture
        step()
    torch.cuda.current_stream().wait_stream(stream)
    kc.copy_(kc_eager)
    vc.copy_(vc_eager)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for it in range(3):
        q.copy_(torch.randn_like(q))
        kn.copy_(torch.randn_like(kn))
        vn.copy_(torch.randn_like(vn))
        lens.copy_(torch.tensor([it, 100 + it, 2000 + it, 4000 + it], dtype=torch.int32))
        graph.replay()
        want = attention_with_kvcache(q, kc_eager, vc_eager, lens, k_new=kn, v_new=vn,
                                      page_table=pages, backend=backend, check=True)
        torch.cuda.synchronize()
        assert torch.equal(out, want), it
        assert torch.equal(kc, kc_eager) and torch.equal(vc, vc_eager), it


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", pytest.param("cuda-sm80", marks=NEEDS_CUDA_DECODE)])
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged16"])
def test_no_synchronising_call_on_the_gpu(paged, backend):
    """With check=False a decode step with an append (int and tensor lengths, splits and one
    split) makes no synchronising CUDA call: torch's sync debug mode raises on any."""
    torch.manual_seed(0)
    dev, dt = "cuda", torch.float16
    b, cap, ps = 3, 512, 16
    pages = (torch.randperm(b * cap // ps, device=dev).to(torch.int32).view(b, -1) if paged
             else None)
    shape = (b * cap // ps, ps, 2, 64) if paged else (b, cap, 2, 64)
    kc, vc = (torch.randn(shape, device=dev, dtype=dt) for _ in range(2))
    q = torch.randn(b, 2, 8, 64, device=dev, dtype=dt)
    kn, vn = (torch.randn(b, 2, 2, 64, device=dev, dtype=dt) for _ in range(2))
    lens = torch.tensor([0, 7, 400], dtype=torch.int32, device=dev)
    for seqlens in (lens, 100):
        for splits in (None, 1, 3):
            attention_with_kvcache(q, kc, vc, seqlens, k_new=kn, v_new=vn, page_table=pages,
                                   num_splits=splits, backend=backend, check=False)  # warm-up
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                attention_with_kvcache(q, kc, vc, seqlens, k_new=kn, v_new=vn, page_table=pages,
                                       num_splits=splits, backend=backend, check=False,
                                       return_lse=True)
            finally:
                torch.cuda.set_sync_debug_mode("default")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", pytest.param("cuda-sm80", marks=NEEDS_CUDA_DECODE)])
def test_poisoned_output_is_overwritten(backend):
    """Every output element is written (NaN-filled memory in the allocator does not leak)."""
    torch.manual_seed(0)
    for splits in (1, 4):
        q = torch.randn(3, 3, 8, 64, device="cuda", dtype=torch.float16)
        kc, vc = (torch.randn(3, 512, 2, 64, device="cuda", dtype=torch.float16)
                  for _ in range(2))
        lens = torch.tensor([0, 1, 500], dtype=torch.int32, device="cuda")
        junk = torch.full((10**6,), float("nan"), device="cuda")
        del junk
        out, lse = attention_with_kvcache(q, kc, vc, lens, return_lse=True, backend=backend,
                                          num_splits=splits)
        assert not out.isnan().any() and not lse.isnan().any()
        assert torch.all(out[0] == 0) and torch.all(lse[0] == -math.inf)


@pytest.mark.gpu
@pytest.mark.parametrize("case,match", [
    ("head_dim", "head dim 64 or 128"), ("rows", "<= 16 query rows"),
    ("arch", "arch must be 80 or 90"),
    ("dtype", "float16 or bfloat16"), ("strides", "multiples of 8")])
def test_cuda_decode_op_checks_its_inputs(case, match):
    """The C++ op names what it refuses (callers going around the Python API)."""
    if not _ext.available():
        pytest.skip("fusedops._C not built")
    dev, dt = "cuda", torch.bfloat16
    d, hq, sq = (96 if case == "head_dim" else 64), (32 if case == "rows" else 8), 1
    q = torch.randn(2, sq, hq, d, device=dev, dtype=dt)
    kc = torch.randn(2, 64, 2 if case != "rows" else 1, d, device=dev, dtype=dt)
    if case == "dtype":
        q, kc = q.float(), kc.float()
    if case == "strides":
        kc = torch.randn(2, 64, 2, d + 4, device=dev, dtype=dt)[..., :d]
    lens = torch.tensor([3, 64], dtype=torch.int32, device=dev)
    with pytest.raises((ValueError, TypeError), match=match):
        torch.ops.fusedops.attention_decode_cuda(q, kc, kc, lens, None, 0.125, True, -1, -1, 0.0,
                                                 1, 70 if case == "arch" else 80)


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [None, 2], ids=["auto-splits", "splits2"])
@pytest.mark.parametrize("backend", ["triton", pytest.param("cuda-sm80", marks=NEEDS_CUDA_DECODE)])
def test_compiles_on_the_gpu_without_graph_breaks(backend, num_splits):
    """torch.compile(fullgraph=True) of a decode step with an append on the GPU kernels (the
    CUDA op through its fake implementation, Triton's launches traced), equal to eager."""
    torch.manual_seed(3)
    dev, dt = "cuda", torch.bfloat16
    q = torch.randn(2, 1, 8, 64, device=dev, dtype=dt)
    kn, vn = (torch.randn(2, 1, 2, 64, device=dev, dtype=dt) for _ in range(2))
    kc, vc = (torch.randn(2, 256, 2, 64, device=dev, dtype=dt) for _ in range(2))
    lens = torch.tensor([3, 200], dtype=torch.int32, device=dev)

    def step(q, kc, vc, lens, kn, vn):
        return attention_with_kvcache(q, kc, vc, lens, k_new=kn, v_new=vn, window_size=(100, 0),
                                      num_splits=num_splits, backend=backend, return_lse=True)

    kc2, vc2 = kc.clone(), vc.clone()
    want = step(q, kc, vc, lens, kn, vn)
    got = torch.compile(step, fullgraph=True)(q, kc2, vc2, lens, kn, vn)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)


@pytest.mark.gpu
def test_cuda_sm90_runs_the_sm80_kernel_on_hopper():
    """cuda-sm90 is the sm80-family kernel's sm_90a build: on a 9.0 GPU both names give the
    same bits (paged, GQA, two splits)."""
    if not (_ext.available() and CUDA_DECODE):
        pytest.skip("needs fusedops._C and FUSEDOPS_ATTN_DECODE_CUDA=1")
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs compute capability 9.0")
    c = Case(**GPU_CASES["paged64-sq3"], dtype=torch.bfloat16, device="cuda")
    inp = make_inputs(c)
    a = call(attention_with_kvcache, inp, c, c.dtype, backend="cuda-sm90")
    b = call(attention_with_kvcache, inp, c, c.dtype, backend="cuda-sm80")
    assert torch.equal(a["out"], b["out"]) and torch.equal(a["lse"], b["lse"])
    check(c, "cuda-sm90")


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["contig-sq3", "paged16", "window-softcap", "mqa-d64"])
def test_cuda_split_merge_at_every_split_count(name):
    """The CUDA kernel merges its splits itself (the last split of each sequence and KV head to
    finish merges them and resets its counter for the next call): from 1 to 256 splits (more
    splits than tiles: empty ones) each agrees with the oracle, a repeat gives the same bits,
    and calls alternating split counts and streams (one counter buffer per stream) stay right."""
    if not (_ext.available() and CUDA_DECODE):
        pytest.skip("needs fusedops._C and the CUDA decode kernel enabled")
    outs = {}
    for splits in (1, 2, 7, 33, 256):
        c = Case(**{**GPU_CASES[name], "num_splits": splits}, dtype=torch.bfloat16, device="cuda")
        check(c, "cuda-sm80")
        inp = make_inputs(c)
        first = call(attention_with_kvcache, inp, c, c.dtype, backend="cuda-sm80")
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            other = call(attention_with_kvcache, inp, c, c.dtype, backend="cuda-sm80")
        torch.cuda.current_stream().wait_stream(side)
        again = call(attention_with_kvcache, inp, c, c.dtype, backend="cuda-sm80")
        for got in (other, again):
            assert torch.equal(got["out"], first["out"]) and torch.equal(got["lse"], first["lse"])
        outs[splits] = first["out"].float()
    for splits, out in outs.items():  # the split count changes rounding only
        torch.testing.assert_close(out, outs[1], rtol=2e-2, atol=2e-2, msg=f"{splits} splits")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", pytest.param("cuda-sm80", marks=NEEDS_CUDA_DECODE)])
def test_graphs_captured_on_one_stream_replay_in_any_order(backend):
    """Two graphs captured one after the other on a fresh stream (the CUDA kernel's split
    counters: one buffer per stream, zeroed by each graph before its first call), replayed in
    the reverse order, twice, then an eager call on that stream: every result equals eager."""
    torch.manual_seed(6)
    dev, dt = "cuda", torch.bfloat16
    kc, vc = (torch.randn(2, 2048, 8, 128, device=dev, dtype=dt) for _ in range(2))
    lens = torch.tensor([2048, 1500], dtype=torch.int32, device=dev)
    qs = [torch.randn(2, 1, 32, 128, device=dev, dtype=dt) for _ in range(2)]
    want = [attention_with_kvcache(q, kc, vc, lens, backend=backend, num_splits=8) for q in qs]
    stream = torch.cuda.Stream()
    graphs, outs = [], []
    for q in qs:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            outs.append(attention_with_kvcache(q, kc, vc, lens, backend=backend, num_splits=8,
                                               check=False))
        graphs.append(graph)
    for _ in range(2):
        for i in (1, 0):
            outs[i].zero_()
            graphs[i].replay()
            torch.cuda.synchronize()
            assert torch.equal(outs[i], want[i]), i
    with torch.cuda.stream(stream):
        again = attention_with_kvcache(qs[0], kc, vc, lens, backend=backend, num_splits=8)
    torch.cuda.synchronize()
    assert torch.equal(again, want[0])


@pytest.mark.gpu
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged64"])
def test_programmatic_dependent_launch_modes_agree(paged, monkeypatch):
    """The Triton kernels with programmatic dependent launch off (0), on the combine (1, the
    default) and on both kernels (2): eager calls and replays of a graph holding a chain of
    dependent steps (each step's query is the last one's output, each appends a key first, so
    a kernel that read before its predecessor finished would see stale values) give the same
    bits as mode 0 eager, and agree with the float64 oracle."""
    torch.manual_seed(11)
    dev, dt = "cuda", torch.bfloat16
    b, hq, hkv, d = 2, 32, 8, 128
    kc0, vc0, pages = _gpu_cache(b, 8192, hkv, d, paged)
    q0 = torch.randn(b, 1, hq, d, device=dev, dtype=dt)
    kn = torch.randn(b, 1, hkv, d, device=dev, dtype=dt)
    vn = torch.randn(b, 1, hkv, d, device=dev, dtype=dt)
    lens0 = torch.tensor([7000, 3000], dtype=torch.int32, device=dev)

    def chain(q, kc, vc, lens, backend="triton", steps=3):
        k1, v1 = kn.to(q.dtype), vn.to(q.dtype)
        for t in range(steps):
            q = attention_with_kvcache(q, kc, vc, lens + t, k_new=k1 * (t + 1), v_new=v1,
                                       page_table=pages, backend=backend, check=False)
        return q

    results = {}
    for mode in ("0", "1", "2"):
        monkeypatch.setenv("FUSEDOPS_ATTN_DECODE_PDL", mode)
        kc, vc = kc0.clone(), vc0.clone()
        results[mode, "eager"] = chain(q0, kc, vc, lens0)
        kc, vc, q, lens = kc0.clone(), vc0.clone(), q0.clone(), lens0.clone()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # compile outside the capture
            chain(q, kc.clone(), vc.clone(), lens)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = chain(q, kc, vc, lens)
        for _ in range(2):
            kc.copy_(kc0)
            vc.copy_(vc0)
            out.zero_()
            graph.replay()
            torch.cuda.synchronize()
            results[mode, "graph"] = out.clone()
    for key, out in results.items():
        assert torch.equal(out, results["0", "eager"]), key
    want = chain(q0.double(), kc0.double(), vc0.double(), lens0, backend="torch")
    torch.testing.assert_close(results["0", "eager"].double(), want, rtol=3e-2, atol=3e-2)


@pytest.mark.skipif(not (HAS_TRITON and INTERPRET), reason="the Triton kernels on the CPU")
def test_unknown_programmatic_launch_mode_is_refused(monkeypatch):
    monkeypatch.setenv("FUSEDOPS_ATTN_DECODE_PDL", "yes")
    q = torch.randn(1, 1, 4, 16)
    kc, vc = torch.randn(1, 32, 1, 16), torch.randn(1, 32, 1, 16)
    with pytest.raises(ValueError, match="FUSEDOPS_ATTN_DECODE_PDL"):
        attention_with_kvcache(q, kc, vc, torch.tensor([20], dtype=torch.int32),
                               backend="triton")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", pytest.param("cuda-sm80", marks=NEEDS_CUDA_DECODE)])
def test_windows_wider_than_the_cache_are_unlimited(backend):
    """Window sides of 2**31 - 1 and 2**32 keys (past int32 arithmetic) give the unlimited
    window's result."""
    torch.manual_seed(7)
    dev, dt = "cuda", torch.bfloat16
    q = torch.randn(2, 3, 8, 64, device=dev, dtype=dt)
    kc, vc = (torch.randn(2, 512, 2, 64, device=dev, dtype=dt) for _ in range(2))
    lens = torch.tensor([1, 500], dtype=torch.int32, device=dev)
    for causal in (True, False):
        want = attention_with_kvcache(q, kc, vc, lens, causal=causal, backend=backend)
        for window in ((2**31 - 1, -1), (-1, 2**32), (2**32, 2**31 - 1)):
            got = attention_with_kvcache(q, kc, vc, lens, causal=causal, window_size=window,
                                         backend=backend)
            assert torch.equal(got, want), (causal, window)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", pytest.param("cuda-sm80", marks=NEEDS_CUDA_DECODE)])
def test_q_views_with_unaligned_rows(backend):
    """q as a view whose rows are not 16-byte aligned (a slice of a wider tensor, an offset
    start): the result equals the one on a contiguous copy (the CUDA binding copies such a q)."""
    torch.manual_seed(5)
    dev, dt = "cuda", torch.bfloat16
    kc, vc = (torch.randn(2, 256, 2, 64, device=dev, dtype=dt) for _ in range(2))
    lens = torch.tensor([5, 200], dtype=torch.int32, device=dev)
    wide = torch.randn(2, 1, 8, 68, device=dev, dtype=dt)
    flat = torch.randn(2 * 8 * 64 + 3, device=dev, dtype=dt)
    for q in (wide[..., :64], flat[3:].view(2, 1, 8, 64)):
        want = attention_with_kvcache(q.contiguous(), kc, vc, lens, backend=backend)
        got = attention_with_kvcache(q, kc, vc, lens, backend=backend)
        assert torch.equal(got, want)


@pytest.mark.skipif(not (HAS_TRITON and (INTERPRET or HAS_GPU)), reason="needs Triton")
def test_batches_past_the_grid_limit_are_refused_by_the_kernels():
    """The GPU kernels have one grid z index per sequence (at most 65535); torch takes any."""
    dev = "cuda" if HAS_GPU else "cpu"
    q = torch.randn(65536, 1, 1, 1, device=dev)
    kc = torch.randn(65536, 2, 1, 1, device=dev)
    with pytest.raises(ValueError, match="q has 65536 sequences; the triton kernels take at most"):
        attention_with_kvcache(q, kc, kc, 1, backend="triton")
    assert attention_with_kvcache(q[:3], kc[:3], kc[:3], 1, backend="torch").shape == (3, 1, 1, 1)
