"""The mean/sum fast path (gradients in the forward, chunked by a memory budget) on every backend:
chunk plans, parity at budgets that force many chunks, mixed precision, the g == 1 scaling, CUDA
graph capture, and the memory budget itself on the GPU."""

import math

import pytest
import torch

import lce_oracle as O
from fusedops import dispatch
from fusedops.linear_ce import chunked, linear_cross_entropy, ops

BACKENDS = O.backend_params(O.available_backends())
_ORACLE = {}


def _dtype(backend, device):
    if device == "cpu" and backend == "triton":
        return torch.float32  # the interpreter has no bfloat16
    return torch.float32 if device == "cpu" else torch.bfloat16


# (N, H, V, budget MiB): whole rows in several token chunks; vocab chunks (four GEMMs) over
# several token chunks; one chunk. The last three are small enough for the Triton interpreter.
BUDGETS = [(300, 64, 1000, 2.3), (1000, 64, 5003, 4.0), (40, 16, 301, 2.03),
           (40, 16, 6001, 2.05), (37, 64, 123, None)]
FAST_FEATURES = {
    "plain": dict(ignore_frac=0.2),
    "sum_all": dict(reduction="sum", bias=True, ignore_frac=0.2, label_smoothing=0.1,
                    softcap=5.0, z_loss=1e-3, noncontig=True),
}


@pytest.mark.parametrize("n,h,v,budget", BUDGETS)
def test_plan_respects_budget(n, h, v, budget):
    b = chunked.budget_bytes(budget)
    for elem, need_dh in ((2, True), (4, True), (2, False)):
        plan = chunked.plan_chunks(n, h, v, elem, b, need_dh)
        acc = not plan.full_rows and need_dh
        used = plan.rows * plan.cols * elem + (plan.rows * h * 4 if acc else 0)
        assert used + 64 * n + (2 << 20) <= b
        assert 1 <= plan.rows <= n and 1 <= plan.cols <= v
        assert plan.cols == v or not plan.full_rows


def test_plan_llama3_default_and_lowmem():
    """The two settings the benchmark reports: 4 chunks of 2048 whole rows; 64 MiB vocab chunks."""
    full = chunked.plan_chunks(8192, 4096, 128256, 2, chunked.budget_bytes(None), True)
    assert (full.rows, full.cols, full.full_rows) == (2048, 128256, True)
    low = chunked.plan_chunks(8192, 4096, 128256, 2, chunked.budget_bytes(64), True)
    assert not low.full_rows and low.rows * low.cols * 2 + low.rows * 4096 * 4 <= 64 << 20
    assert low.cols % 256 == 0 and low.rows % 128 == 0


def test_min_full_rows_switch(monkeypatch):
    """FUSEDOPS_LCE_MIN_FULL_ROWS lowers the fewest tokens a whole-row chunk may hold: at
    Llama-3.2-1B's head (H 2048, V 128256) a 100 MiB budget holds 398 whole rows, below the
    default 512 (vocab chunks), above 256 (whole rows); 64 MiB at Llama-2 holds 1007 (whole
    rows by default)."""
    budget = chunked.budget_bytes(100)
    assert not chunked.plan_chunks(8192, 2048, 128256, 2, budget, True).full_rows
    assert chunked.plan_chunks(4096, 4096, 32000, 2, chunked.budget_bytes(64), True).full_rows
    monkeypatch.setenv("FUSEDOPS_LCE_MIN_FULL_ROWS", "256")
    plan = chunked.plan_chunks(8192, 2048, 128256, 2, budget, True)
    assert plan.full_rows and 256 <= plan.rows < 512
    assert plan.rows * plan.cols * 2 <= budget
    for bad in ("0", "-3", "many"):
        monkeypatch.setenv("FUSEDOPS_LCE_MIN_FULL_ROWS", bad)
        with pytest.raises(ValueError, match="FUSEDOPS_LCE_MIN_FULL_ROWS"):
            chunked.plan_chunks(8192, 2048, 128256, 2, budget, True)


def test_plan_rejects_tiny_budget():
    with pytest.raises(ValueError, match="memory_budget_mib"):
        chunked.plan_chunks(10**6, 64, 1000, 2, 1 << 20, True)
    with pytest.raises(ValueError, match="memory_budget_mib"):
        linear_cross_entropy(torch.randn(4, 8), torch.randn(5, 8), torch.zeros(4, dtype=int),
                             memory_budget_mib=-1)


@pytest.mark.parametrize("backend,device", BACKENDS)
@pytest.mark.parametrize("n,h,v,budget", BUDGETS)
@pytest.mark.parametrize("feature", list(FAST_FEATURES))
def test_fast_path_parity(backend, device, n, h, v, budget, feature):
    if backend == "triton" and device == "cpu" and n * v > 250_000:
        pytest.skip("too slow for the Triton interpreter")
    case = O.Case((n,), h, v, _dtype(backend, device), device, **FAST_FEATURES[feature])

    def impl(x, w, t, b, **kw):
        return linear_cross_entropy(x, w, t, b, backend=backend, memory_budget_mib=budget, **kw)

    O.check(case, impl, _ORACLE)


@pytest.mark.parametrize("backend,device", BACKENDS)
def test_upstream_gradient_scales_and_one_is_exact(backend, device):
    dtype = _dtype(backend, device)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(40, 32, generator=g).to(device, dtype)
    w = (torch.randn(77, 32, generator=g) * 0.3).to(device, dtype)
    t = torch.randint(0, 77, (40,), generator=g).to(device)
    grads = []
    for up in (1.0, 2.0, 0.0):
        xa, wa = x.clone().requires_grad_(), w.clone().requires_grad_()
        loss = linear_cross_entropy(xa, wa, t, backend=backend, memory_budget_mib=2.07)
        loss.backward(torch.tensor(up, device=device))
        grads.append((xa.grad, wa.grad))
    for a, b in zip(grads[0], grads[1], strict=True):
        torch.testing.assert_close(b, 2 * a, rtol=1e-2, atol=0)  # one rounding of 2x: exact-ish
        assert torch.count_nonzero(a) > 0
    for a in grads[2]:
        assert torch.count_nonzero(a) == 0


@pytest.mark.parametrize("backend,device", BACKENDS)
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_mixed_precision_float32_weight(backend, device, reduction):
    """float32 weight and bias with low-precision hidden: float32 d_weight, within the oracle rule
    against eager's mixed-precision recipe (weights cast to the hidden dtype). "none" runs the
    statistics path."""
    low = torch.float16 if (backend == "triton" and device == "cpu") else torch.bfloat16
    g = torch.Generator().manual_seed(5)
    n, h, v = 300, 64, 1000
    x = torch.randn(n, h, generator=g, dtype=torch.float64)
    w = torch.randn(v, h, generator=g, dtype=torch.float64) * (3 / math.sqrt(h))
    b = torch.randn(v, generator=g, dtype=torch.float64) * 0.5
    t = torch.randint(0, v, (n,), generator=g)
    t[::5] = -100
    up = torch.randn(n, generator=g) if reduction == "none" else torch.tensor(0.7)

    def grads(fn, xd, wd):
        xx = x.to(device, xd).clone().requires_grad_()
        ww = w.to(device, wd).clone().requires_grad_()
        bb = b.to(device, wd).clone().requires_grad_()
        loss = fn(xx, ww, bb)
        loss.backward(up.to(device, loss.dtype))
        return loss.detach(), xx.grad, ww.grad, bb.grad

    def eager(xx, ww, bb):
        return O.eager_loss(xx, ww.to(xx.dtype), t.to(device), bb.to(xx.dtype),
                            reduction=reduction, label_smoothing=0.0, softcap=None, z_loss=0.0,
                            return_lse=False)

    ref = grads(lambda xx, ww, bb: linear_cross_entropy(xx, ww, t.to(device), bb,
                                                        reduction=reduction, backend="torch"),
                torch.float64, torch.float64)
    base = grads(eager, low, torch.float32)
    got = grads(lambda xx, ww, bb: linear_cross_entropy(xx, ww, t.to(device), bb, backend=backend,
                                                        reduction=reduction,
                                                        memory_budget_mib=2.3),
                low, torch.float32)
    assert got[2].dtype == torch.float32 and got[3].dtype == torch.float32
    for name, r, e, o in zip(("loss", "d_hidden", "d_weight", "d_bias"), ref, base, got,
                             strict=True):
        e_got, e_eager = O.rel_err(o, r), O.rel_err(e, r)
        assert e_got <= 2 * e_eager + O.SLACK[low], (name, e_got, e_eager)


def test_opcheck_fused_op_torch_backend():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(9, 16, generator=g, requires_grad=True)
    w = torch.randn(37, 16, generator=g, requires_grad=True)
    b = torch.randn(37, generator=g, requires_grad=True)
    t = torch.randint(0, 37, (9,), generator=g)
    for reduction in ("mean", "sum"):
        torch.library.opcheck(
            torch.ops.fusedops.linear_ce_fused.default,
            (x, w, b, t, -100, reduction, 0.1, 4.0, 1e-3, 3 << 20, True, True, True, True,
             "torch"), test_utils=("test_schema", "test_faketensor"))


def test_no_grad_forward_matches_and_returns_no_grads():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(40, 16, generator=g)
    w = torch.randn(6001, 16, generator=g)
    t = torch.randint(0, 6001, (40,), generator=g)
    assert not chunked.plan_chunks(40, 16, 6001, 4, chunked.budget_bytes(2.05), False).full_rows
    with torch.no_grad():
        a = linear_cross_entropy(x, w, t, memory_budget_mib=2.05)  # vocab chunks
        b = linear_cross_entropy(x, w, t)
    ref = torch.nn.functional.cross_entropy(x @ w.T, t)
    torch.testing.assert_close(a, ref)
    torch.testing.assert_close(b, ref)
    loss, _lse, dh, dw, db = ops.linear_ce_fused(x, w, None, t, -100, "mean", 0.0, 0.0, 0.0,
                                                 3 << 20, True, False, False, False, "torch")
    assert dh.numel() == dw.numel() == db.numel() == 0


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cuda-sm90", "cuda-sm80", "triton"])
@pytest.mark.parametrize("budget", [None, 64])
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("filter_eps", [None, 2**-12])
def test_cuda_graph_capture(backend, budget, reduction, filter_eps, monkeypatch):
    """Forward + backward of the fast path (mean) and of the statistics path (per-token losses
    and lse), targets unchecked, captured and replayed. With filter_eps the route is chosen
    without a host synchronisation during capture (the block-sparse kernels, which the eager
    runs here are made to take too)."""
    sig = dispatch.InputSig("linear_ce", "cuda", 0, torch.bfloat16, 256)
    if dispatch.why_not(backend, sig) is not None:
        pytest.skip(dispatch.why_not(backend, sig))
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(1024, 256, device="cuda", generator=g, dtype=torch.bfloat16)
    w = (torch.randn(32003, 256, device="cuda", generator=g) / 8).bfloat16().requires_grad_()
    t = torch.randint(0, 32003, (1024,), device="cuda", generator=g)
    x.requires_grad_()

    up = torch.rand(1024, device="cuda", generator=g)
    monkeypatch.setenv("FUSEDOPS_LCE_FILTER_ROUTE", "sparse")

    def run(xx, ww):
        if reduction == "mean":
            return linear_cross_entropy(xx, ww, t, backend=backend, check_targets=False,
                                        memory_budget_mib=budget, label_smoothing=0.1,
                                        filter_eps=filter_eps)
        loss, lse = linear_cross_entropy(xx, ww, t, backend=backend, check_targets=False,
                                         memory_budget_mib=budget, label_smoothing=0.1,
                                         reduction="none", return_lse=True,
                                         filter_eps=filter_eps)
        return (loss * up).sum() + 1e-2 * lse.square().sum()

    def step():
        loss = run(x, w)
        loss.backward()
        return loss

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # warm-up outside the graph (Triton compilation, cuBLAS handles)
            x.grad = w.grad = None
            step()
    torch.cuda.current_stream().wait_stream(side)
    ref = (step().detach().clone(), x.grad.clone(), w.grad.clone())
    x.grad = w.grad = None
    graph = torch.cuda.CUDAGraph()
    monkeypatch.setenv("FUSEDOPS_LCE_FILTER_ROUTE", "auto")
    with torch.cuda.graph(graph):
        loss = step()
    monkeypatch.setenv("FUSEDOPS_LCE_FILTER_ROUTE", "sparse")
    t.copy_(torch.randint(0, 32003, (1024,), device="cuda", generator=g))  # new data, same graph
    graph.replay()
    xf, wf = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    fresh = run(xf, wf)
    fresh.backward()
    assert not torch.equal(loss, ref[0])
    torch.testing.assert_close(loss, fresh)
    torch.testing.assert_close(x.grad, xf.grad)
    torch.testing.assert_close(w.grad, wf.grad)


@pytest.mark.gpu
@pytest.mark.parametrize("budget", [None, 64])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_extra_memory_within_budget(budget, reduction):
    """Peak memory above inputs and returned gradients stays within the budget (default 512), on
    the fast path (mean) and the statistics path (none, whose kept logits chunk is the budget's
    buffer)."""
    n, h, v = 4096, 1024, 128256
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(n, h, device="cuda", generator=g, dtype=torch.bfloat16).requires_grad_()
    w = (torch.randn(v, h, device="cuda", generator=g) / 32).bfloat16().requires_grad_()
    t = torch.randint(0, v, (n,), device="cuda", generator=g)

    def step():
        x.grad = w.grad = None
        loss = linear_cross_entropy(x, w, t, check_targets=False, memory_budget_mib=budget,
                                    reduction=reduction)
        loss.sum().backward()

    step()
    x.grad = w.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before - (x.numel() + w.numel()) * 2
    assert extra <= chunked.budget_bytes(budget), extra / 2**20
