"""Gradient filtering (filter_eps; fusedops.linear_ce.filtered): the gradients against an
independent float64 oracle of the filtered products on every backend, both paths and plans, the
block mask, exactness at eps 0 and without dropped blocks, and bad options."""

import math

import pytest
import torch

import lce_oracle as O
from fusedops.linear_ce import LinearCrossEntropyLoss, chunked, filtered, linear_cross_entropy

BACKENDS = O.backend_params(O.available_backends())
EPS = 1e-3
B = filtered.BLOCK


def _peaked(n, h, v, seed=0, ignore_every=9):
    """Logits as a trained model's: the target B0 above noise of std ~0.45, B0 set so that the
    tail's probabilities are ~1e-2 / V each (every one far below EPS) and the target's |p - 1|
    ~1e-2 (far above it), so the kept blocks are those holding a target. Targets avoid column
    blocks 3 and 7 and, past the first B rows, every column block but 0: whole blocks drop."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(v, h, generator=g, dtype=torch.float64) / math.sqrt(h)
    cols = [c for c in range(v) if c // B not in (3, 7)]
    t = torch.tensor(cols)[torch.randint(0, len(cols), (n,), generator=g)]
    t[B:] = torch.randint(0, B, (max(n - B, 0),), generator=g)
    x = torch.randn(n, h, generator=g, dtype=torch.float64) * 0.3
    wt = w[t]
    x = x - (x * wt).sum(1, keepdim=True) * wt / (wt * wt).sum(1, keepdim=True)
    x = x + math.log(v * 110.0) * wt / (wt * wt).sum(1, keepdim=True)
    t[::ignore_every] = -100
    up = torch.randn(n, generator=g, dtype=torch.float64)
    return x, w, t, up


def _oracle(x, w, t, up, reduction, eps, dtype):
    """(loss, d_hidden, d_weight): in float64 (dtype float64) or as plain PyTorch in `dtype`
    (logits rounded to it, softmax in float32, products in dtype), with the blocks of B x B
    entries of p - onehot whose every entry (of a counted token) is at most eps dropped from
    the products, B-blocks counted from 0 (the tests' data fit one chunk's alignment)."""
    cdt = torch.float64 if dtype == torch.float64 else torch.float32
    xd, wd = x.to(dtype), w.to(dtype)
    z = (xd @ wd.T).to(cdt)
    valid = t != -100
    tt = torch.where(valid, t, 0)
    lse = torch.logsumexp(z, 1)
    per = torch.where(valid, lse - z.gather(1, tt[:, None])[:, 0], 0.0)
    if reduction == "mean":
        coef = valid.to(cdt) / valid.sum()
        loss = per.sum() / valid.sum()
    elif reduction == "sum":
        coef = valid.to(cdt)
        loss = per.sum()
    else:
        coef = valid.to(cdt) * up.to(cdt)
        loss = per
    pmy = torch.softmax(z, 1)
    pmy[torch.arange(len(t)), tt] -= 1.0
    n, v = pmy.shape
    big = torch.zeros(-(-n // B) * B, -(-v // B) * B, dtype=torch.bool)
    big[:n, :v] = (pmy.abs() > eps) & valid[:, None]
    keep = big.view(-1, B, big.shape[1] // B, B).any(3).any(1)
    keep_full = keep.repeat_interleave(B, 0).repeat_interleave(B, 1)[:n, :v]
    dz = (pmy * coef[:, None] * keep_full).to(dtype)
    return loss, dz @ wd, dz.T @ xd, keep


def _run(x, w, t, up, reduction, dtype, device, **kw):
    xx = x.to(device, dtype).requires_grad_()
    ww = w.to(device, dtype).requires_grad_()
    loss = linear_cross_entropy(xx, ww, t.to(device), reduction=reduction, **kw)
    total = (loss * up.to(device, loss.dtype)).sum() if reduction == "none" else loss
    dh, dw = torch.autograd.grad(total, [xx, ww])
    return loss.detach().cpu(), dh.cpu(), dw.cpu()


def _dtype(backend, device):
    if device == "cpu":
        return torch.float32
    return torch.bfloat16


# (N, H, V, whole-row chunk rows): one whole-row chunk; whole rows over two token chunks of 128
# (d_weight accumulated, tiles with no kept block left alone); vocab chunks of 1792 columns
# (d_hidden accumulated in float32).
PLANS = {"rows": (200, 256, 1000), "two_chunks": (256, 256, 1000), "vocab": (200, 256, 5003)}


def _budget(plan, n, h, v, elem):
    """memory_budget_mib giving `plan` for elem-byte logits (chunked.plan_chunks' arithmetic)."""
    base = (2 << 20) + 64 * n
    if plan == "rows":
        return None
    if plan == "two_chunks":
        return (base + 192 * v * elem) / 2**20
    return (base + 200 * h * 4 + 200 * 2100 * elem) / 2**20


@pytest.mark.parametrize("backend,device", BACKENDS)
@pytest.mark.parametrize("plan", list(PLANS))
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("route", ["auto", "sparse", "dense"])
def test_filtered_gradients_match_oracle(backend, device, plan, reduction, route, monkeypatch):
    """route: FUSEDOPS_LCE_FILTER_ROUTE, the block-sparse kernels or cuBLAS on the zeroed chunk
    (a GPU's choice; elsewhere the dense route always runs)."""
    n, h, v = PLANS[plan]
    if backend == "triton" and device == "cpu" and plan != "rows":
        pytest.skip("the Triton interpreter: one plan is enough")
    if route != "auto" and device != "cuda":
        pytest.skip("the route is chosen on a GPU only")
    monkeypatch.setenv("FUSEDOPS_LCE_FILTER_ROUTE", route)
    if plan == "two_chunks":
        monkeypatch.setenv("FUSEDOPS_LCE_MIN_FULL_ROWS", "128")
    dtype = _dtype(backend, device)
    elem = torch.tensor([], dtype=dtype).element_size()
    budget = _budget(plan, n, h, v, elem)
    got_plan = chunked.plan_chunks(n, h, v, elem, chunked.budget_bytes(budget), True)
    assert (got_plan.full_rows, got_plan.rows, got_plan.cols) == {
        "rows": (True, n, v), "two_chunks": (True, 128, v), "vocab": (False, n, 1792)}[plan]
    x, w, t, up = _peaked(n, h, v)
    ref = _oracle(x, w, t, up, reduction, EPS, torch.float64)
    assert 0 < int(ref[3].sum()) < ref[3].numel() // 2  # whole blocks drop out
    eager = _oracle(x, w, t, up, reduction, EPS, dtype)
    got = _run(x, w, t, up, reduction, dtype, device, backend=backend, filter_eps=EPS,
               memory_budget_mib=budget)
    n_valid = int((t != -100).sum())
    slack = O.SLACK[dtype] + O.UNIT[dtype] / math.sqrt(n_valid)
    for name, a, r, e in zip(("loss", "d_hidden", "d_weight"), got, ref[:3], eager[:3],
                             strict=True):
        err, err_eager = O.rel_err(a, r), O.rel_err(e, r)
        assert err <= 2 * err_eager + slack, (
            f"{name}: {err:.3e} > 2 x {err_eager:.3e} + {slack:.0e}")


def test_oracle_rejects_unfiltered_gradients():
    """The check has teeth: exact gradients (filter off) miss the filtered oracle by far more
    than rounding, as would a filter that dropped nothing."""
    x, w, t, up = _peaked(200, 256, 1000)
    ref = _oracle(x, w, t, up, "mean", EPS, torch.float64)
    exact = _run(x, w, t, up, "mean", torch.float64, "cpu", backend="torch")
    assert O.rel_err(exact[1], ref[1]) > 1e-3
    assert O.rel_err(exact[2], ref[2]) > 1e-3
    got = _run(x, w, t, up, "mean", torch.float64, "cpu", backend="torch", filter_eps=EPS)
    assert O.rel_err(got[1], ref[1]) < 1e-12 and O.rel_err(got[2], ref[2]) < 1e-12


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("budget", [None, _budget("vocab", 200, 256, 5003, 4)])
def test_eps_zero_is_exact(reduction, budget):
    """filter_eps=0 drops only blocks that are exactly zero: the same bits as no filter."""
    x, w, t, up = _peaked(200, 256, 5003)
    a = _run(x, w, t, up, reduction, torch.float32, "cpu", backend="torch",
             memory_budget_mib=budget)
    b = _run(x, w, t, up, reduction, torch.float32, "cpu", backend="torch", filter_eps=0.0,
             memory_budget_mib=budget)
    for p, q in zip(a, b, strict=True):
        assert torch.equal(p, q)


@pytest.mark.parametrize("backend,device", BACKENDS)
def test_dense_logits_keep_every_block(backend, device):
    """Spread-out logits: every block holds an entry above eps, so the filtered gradients are
    the exact ones (to the kernels' rounding)."""
    g = torch.Generator().manual_seed(1)
    n, h, v = 150, 32, 700
    x = torch.randn(n, h, generator=g, dtype=torch.float64)
    w = torch.randn(v, h, generator=g, dtype=torch.float64) / math.sqrt(h)
    t = torch.randint(0, v, (n,), generator=g)
    up = torch.ones(n, dtype=torch.float64)
    dtype = _dtype(backend, device)
    a = _run(x, w, t, up, "mean", dtype, device, backend=backend)
    b = _run(x, w, t, up, "mean", dtype, device, backend=backend, filter_eps=EPS)
    ref = _run(x, w, t, up, "mean", torch.float64, "cpu", backend="torch")
    for p, q, r in zip(a, b, ref, strict=True):
        assert O.rel_err(q, r) <= 2 * O.rel_err(p, r) + O.SLACK[dtype] + O.UNIT[dtype] / 10


def test_block_mask_brute_force():
    g = torch.Generator().manual_seed(2)
    dz = torch.randn(300, 530, generator=g) * 1e-4
    dz[5, 7] = 1.0
    dz[200, 520] = -1.0
    dz[140, 300] = math.nan
    thr = torch.full((300,), 0.5)
    thr[5] = 2.0  # row 5's large entry is below its own threshold
    mask = filtered.block_mask(dz, thr)
    assert mask.shape == (3, 5) and mask.dtype == torch.int8
    expect = torch.zeros(3, 5, dtype=torch.int8)
    expect[1, 4] = 1  # (200, 520)
    expect[1, 2] = 1  # the NaN at (140, 300)
    assert torch.equal(mask, expect)
    z = dz.clone()
    filtered.zero_dropped_(z, mask)
    assert z[:128].abs().max() == 0 and z[200, 520] == -1.0 and z[256:].abs().max() == 0


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_block_mask_gpu_matches_cpu(dtype):
    g = torch.Generator().manual_seed(3)
    dz = (torch.randn(333, 1000, generator=g) * 1e-4).to(dtype)
    idx = torch.randint(0, 333 * 1000, (20,), generator=g)
    dz.view(-1)[idx] = 0.5
    thr = torch.rand(333, generator=g) * 0.6
    assert torch.equal(filtered.block_mask(dz.cuda(), thr.cuda()).cpu(),
                       filtered.block_mask(dz, thr))


def _kernel_params():
    """The Triton kernels on a GPU, or on the CPU under TRITON_INTERPRET=1."""
    out = []
    for backend, device in O.available_backends():
        if backend != "triton":
            continue
        marks = [pytest.mark.gpu] if device == "cuda" else []
        dtypes = [torch.bfloat16, torch.float16] if device == "cuda" else [torch.float16]
        out += [pytest.param(device, d, marks=marks, id=f"{device}-{str(d)[6:]}") for d in dtypes]
    return out or [pytest.param(None, None, marks=pytest.mark.skip(reason="needs Triton: a GPU "
                                                                   "or TRITON_INTERPRET=1"))]


@pytest.mark.parametrize("device,dtype", _kernel_params())
@pytest.mark.parametrize("accumulate", [False, True])
def test_sparse_kernels_match_masked_dense_products(device, dtype, accumulate):
    """The Triton mask and block-sparse d_hidden / d_weight kernels against zero_dropped_ and
    dense float64 products: ragged edges (rows, cols, H not multiples of the tiles), an empty
    row block and an empty column block; with accumulate, tiles without a kept block keep their
    old values bit for bit."""
    from fusedops.linear_ce import triton as tk
    g = torch.Generator().manual_seed(4)
    rows, cols, h = 300, 530, 136
    dz = torch.randn(rows, cols, generator=g) * 1e-4
    big = [(3, 10), (3, 300), (140, 130), (290, 520), (200, 10)]  # row block 2 keeps 0 and 4
    for r, c in big:
        dz[r, c] = 1.0
    dz = dz.to(dtype)
    thr = torch.full((rows,), 0.5)
    mask = filtered.block_mask(dz, thr)
    assert mask.sum() == 5 and mask[:, 3].sum() == 0  # column block 3 holds no large entry
    if device == "cuda":
        assert torch.equal(tk.filter_mask(dz.cuda(), thr.cuda(), B).cpu(), mask)
    w = (torch.randn(cols, h, generator=g) / 8).to(dtype)
    x = torch.randn(rows, h, generator=g).to(dtype)
    z = dz.clone()
    filtered.zero_dropped_(z, mask)
    z_dev = dz.to(device)
    tk.zero_blocks(z_dev, mask.to(device), B)
    assert torch.equal(z_dev.cpu(), z)
    ref_dh, ref_dw = z.double() @ w.double(), z.double().t() @ x.double()
    old_dh = torch.randn(rows, h, generator=g).to(dtype)
    old_dw = torch.randn(cols, h, generator=g).to(dtype)
    dh, dw = old_dh.clone().to(device), old_dw.clone().to(device)
    dev = dict(device=device)
    tk.sparse_dh(dz.to(**dev), w.to(**dev), dh, accumulate, mask.to(**dev), B)
    tk.sparse_dw(dz.to(**dev), x.to(**dev), dw, accumulate, mask.to(**dev), B)
    dh, dw = dh.cpu(), dw.cpu()
    if accumulate:
        ref_dh, ref_dw = ref_dh + old_dh.double(), ref_dw + old_dw.double()
        assert torch.equal(dw[3 * B: 4 * B], old_dw[3 * B: 4 * B])  # no kept block: untouched
    for got, ref in ((dh, ref_dh), (dw, ref_dw)):
        assert O.rel_err(got, ref) < 4e-3, O.rel_err(got, ref)  # half-precision rounding
    if not accumulate:
        assert dw[3 * B: 4 * B].abs().max() == 0


def _kernel_devices():
    """_kernel_params' devices, one parameter each (with its marks)."""
    out = {}
    for p in _kernel_params():
        out.setdefault(p.values[0], pytest.param(p.values[0], marks=p.marks, id=str(p.values[0])))
    return list(out.values())


@pytest.mark.parametrize("device", _kernel_devices())
def test_kept_lists_brute_force(device):
    """The kept-block lists of the sparse kernels (one prefix-sum launch) against the nonzero
    positions of each mask row and column: lists longer than one 1024-entry step, empty and full
    lists, and a 0-row mask."""
    from fusedops.linear_ce import triton as tk
    g = torch.Generator().manual_seed(7)
    masks = [(torch.rand(5, 2500, generator=g) < 0.3), (torch.rand(2500, 3, generator=g) < 0.5),
             torch.zeros(4, 7, dtype=torch.bool), torch.ones(3, 1030, dtype=torch.bool),
             torch.zeros(0, 9, dtype=torch.bool)]
    masks[0][1] = False
    masks[0][2] = True
    for m in masks:
        m8 = m.to(torch.int8)
        for dim in (0, 1):
            idx, cnt = tk.kept_lists(m8.to(device), dim)
            idx, cnt = idx.cpu(), cnt.cpu()
            lists = m if dim == 1 else m.t()
            assert cnt.dtype == torch.int32 and idx.dtype == torch.int32
            assert idx.shape == lists.shape
            for i, row in enumerate(lists):
                want = row.nonzero().flatten()
                assert int(cnt[i]) == len(want)
                assert torch.equal(idx[i, : len(want)].long(), want)


def test_sparse_route_below_the_dense_share(monkeypatch):
    """The block-sparse kernels take a chunk with fewer than DENSE_SHARE of its blocks kept;
    FUSEDOPS_LCE_FILTER_ROUTE forces either route and names itself when bad."""
    monkeypatch.delenv("FUSEDOPS_LCE_FILTER_ROUTE", raising=False)
    mask = torch.zeros(4, 10, dtype=torch.int8)
    mask.view(-1)[: int(40 * filtered.DENSE_SHARE) - 1] = 1
    assert filtered.sparse_pays(mask)
    mask.view(-1)[: int(40 * filtered.DENSE_SHARE)] = 1
    assert not filtered.sparse_pays(mask)
    assert filtered.sparse_pays(torch.zeros(0, 3, dtype=torch.int8))
    monkeypatch.setenv("FUSEDOPS_LCE_FILTER_ROUTE", "sparse")
    assert filtered.sparse_pays(mask)
    monkeypatch.setenv("FUSEDOPS_LCE_FILTER_ROUTE", "dense")
    assert not filtered.sparse_pays(torch.zeros(4, 10, dtype=torch.int8))
    monkeypatch.setenv("FUSEDOPS_LCE_FILTER_ROUTE", "fast")
    with pytest.raises(ValueError, match="FUSEDOPS_LCE_FILTER_ROUTE"):
        filtered.sparse_pays(mask)


def test_route_is_chosen_once_per_call(monkeypatch):
    """filtered.Route reads the kept share at the first chunk the sparse kernels could take and
    keeps that choice for the call's other chunks (one host synchronisation per call); chunks
    they cannot take (the CPU, float32) always go dense. A call through the chunked path asks
    once however many chunks it has."""
    monkeypatch.delenv("FUSEDOPS_LCE_FILTER_ROUTE", raising=False)
    asked = []
    real = filtered.sparse_pays
    monkeypatch.setattr(filtered, "sparse_pays", lambda m: asked.append(m) or real(m))
    monkeypatch.setattr(filtered, "sparse_ok", lambda dz: dz.dtype == torch.float16)
    dz = torch.zeros(2, 2, dtype=torch.float16)
    sparse, dense = torch.zeros(2, 2, dtype=torch.int8), torch.ones(2, 2, dtype=torch.int8)
    route = filtered.Route()
    assert not route.sparse(dz.float(), sparse) and not asked  # not the sparse kernels' chunk
    assert route.sparse(dz, sparse) and len(asked) == 1
    assert route.sparse(dz, dense) and len(asked) == 1  # kept
    assert not filtered.Route().sparse(dz, dense) and len(asked) == 2
    # the whole path: two token chunks, one question (answered "dense": the dropped blocks are
    # zeroed on the CPU; the mask comes from the Triton kernel, under the interpreter here)
    if not filtered._HAS_TRITON or torch.cuda.is_available():
        return
    monkeypatch.setattr(filtered, "sparse_ok", lambda dz: True)
    monkeypatch.setattr(filtered, "sparse_pays", lambda m: asked.append(m) or False)
    monkeypatch.setenv("FUSEDOPS_LCE_MIN_FULL_ROWS", "128")
    x, w, t, up = _peaked(*PLANS["two_chunks"])
    asked.clear()
    budget = _budget("two_chunks", *PLANS["two_chunks"], 4)
    _run(x, w, t, up, "mean", torch.float32, "cpu", filter_eps=EPS, memory_budget_mib=budget)
    assert len(asked) == 1


@pytest.mark.parametrize("bad,exc", [(-1e-3, ValueError), (1.0, ValueError), (math.nan, ValueError),
                                     (math.inf, ValueError), ("auto", TypeError),
                                     (True, TypeError)])
def test_bad_filter_eps(bad, exc):
    x = torch.randn(4, 8)
    w = torch.randn(10, 8)
    t = torch.tensor([1, 2, 3, 4])
    with pytest.raises(exc, match="filter_eps"):
        linear_cross_entropy(x, w, t, filter_eps=bad)
    with pytest.raises(exc, match="filter_eps"):
        LinearCrossEntropyLoss(filter_eps=bad)


def test_filter_eps_refused_with_recompute_and_vocab_parallel(monkeypatch):
    x = torch.randn(4, 8)
    w = torch.randn(10, 8)
    t = torch.tensor([1, 2, 3, 4])
    with pytest.raises(ValueError, match="filter_eps.*vocab parallel"):
        linear_cross_entropy(x, w, t, filter_eps=EPS, vocab_start=0)
    monkeypatch.setenv("FUSEDOPS_LCE_ALGO", "recompute")
    with pytest.raises(ValueError, match="filter_eps"):
        linear_cross_entropy(x, w, t, filter_eps=EPS)


def test_module_passes_filter_eps():
    x, w, t, up = _peaked(200, 256, 1000)
    mod = LinearCrossEntropyLoss(filter_eps=EPS, backend="torch")
    assert "filter_eps" in repr(mod)
    xx = x.clone().requires_grad_()
    mod(xx, w, t).backward()
    ref = _oracle(x, w, t, up, "mean", EPS, torch.float64)
    assert O.rel_err(xx.grad, ref[1]) < 1e-12


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_compiles_fullgraph_with_filter(reduction):
    """The ops carry filter_eps through torch.compile(fullgraph=True): the eager bits."""
    x, w, t, up = _peaked(200, 256, 1000)
    x, w = x.float(), w.float()

    def step(fn):
        xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
        loss = fn(xx, ww)
        (loss * up.float()).sum().backward() if reduction == "none" else loss.backward()
        return loss.detach(), xx.grad, ww.grad

    def fn(xx, ww):
        return linear_cross_entropy(xx, ww, t, reduction=reduction, filter_eps=EPS,
                                    check_targets=False, backend="torch")

    eager = step(fn)
    compiled = step(torch.compile(fn, fullgraph=True))
    for a, b in zip(eager, compiled, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
