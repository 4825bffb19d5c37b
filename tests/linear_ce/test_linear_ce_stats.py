"""The statistics path (reduction "none", return_lse; fusedops.linear_ce.chunked.statistics and
grads_sweep) on every backend: parity at budgets that force many chunks, the logits chunk kept
from the forward, agreement with the recompute algorithm, the ops' registration."""

import pytest
import torch

import lce_oracle as O
from fusedops.linear_ce import chunked, linear_cross_entropy, ops

BACKENDS = O.backend_params(O.available_backends())
_ORACLE = {}

# (N, H, V, budget MiB): whole rows over several token chunks; vocab chunks over several token
# chunks; one chunk (the kept buffer holds every token's logits); vocab chunks in the
# interpreter's reach.
BUDGETS = [(300, 64, 1000, 2.3), (1000, 64, 5003, 4.0), (37, 64, 123, None),
           (40, 16, 6001, 2.05)]
STATS_FEATURES = {
    "none": dict(reduction="none", ignore_frac=0.2),
    "lse_all": dict(reduction="none", return_lse=True, bias=True, ignore_frac=0.2,
                    label_smoothing=0.1, softcap=5.0, z_loss=1e-3, noncontig=True),
    "mean_lse": dict(reduction="mean", return_lse=True, z_loss=1e-3),
}


def _dtype(backend, device):
    if device == "cpu" and backend == "triton":
        return torch.float32  # the interpreter has no bfloat16
    return torch.float32 if device == "cpu" else torch.bfloat16


def test_budgets_cover_both_plans():
    plans = [chunked.plan_chunks(n, h, v, 4, chunked.budget_bytes(b), True)
             for n, h, v, b in BUDGETS]
    assert plans[0].full_rows and plans[0].rows < 300
    assert not plans[1].full_rows and plans[1].rows < 1000
    assert plans[2].full_rows and plans[2].rows == 37
    assert not plans[3].full_rows


@pytest.mark.parametrize("backend,device", BACKENDS)
@pytest.mark.parametrize("n,h,v,budget", BUDGETS)
@pytest.mark.parametrize("feature", list(STATS_FEATURES))
def test_stats_path_parity(backend, device, n, h, v, budget, feature):
    if backend == "triton" and device == "cpu" and n * v > 250_000:
        pytest.skip("too slow for the Triton interpreter")
    case = O.Case((n,), h, v, _dtype(backend, device), device, **STATS_FEATURES[feature])

    def impl(x, w, t, b, **kw):
        return linear_cross_entropy(x, w, t, b, backend=backend, memory_budget_mib=budget, **kw)

    O.check(case, impl, _ORACLE)


def _inputs(device, dtype, n=300, h=64, v=1000, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, generator=g, dtype=torch.float64)
    w = torch.randn(v, h, generator=g, dtype=torch.float64) / 4
    b = torch.randn(v, generator=g, dtype=torch.float64)
    t = torch.randint(0, v, (n,), generator=g)
    t[::7] = -100
    up = torch.randn(n, generator=g, dtype=torch.float64)
    lse_up = torch.randn(n, generator=g, dtype=torch.float64)
    return [a.to(device, dtype) for a in (x, w, b)], t.to(device), up.to(device), lse_up.to(device)


def _grads(params, t, up, lse_up, budget, backend=None, retain=False, **kw):
    leaves = [p.detach().clone().requires_grad_() for p in params]
    loss, lse = linear_cross_entropy(leaves[0], leaves[1], t, leaves[2], reduction="none",
                                     return_lse=True, memory_budget_mib=budget, backend=backend,
                                     **kw)
    total = (loss * up.to(loss.dtype)).sum() + (lse * lse_up.to(lse.dtype)).sum()
    first = torch.autograd.grad(total, leaves, retain_graph=retain)
    if not retain:
        return loss.detach(), lse.detach(), first
    second = torch.autograd.grad(total, leaves)
    return loss.detach(), lse.detach(), first, second


@pytest.mark.parametrize("budget", [2.3, 2.05, None])
def test_matches_recompute_algorithm_float64(monkeypatch, budget):
    """The statistics path against the recompute algorithm (fusedops.linear_ce.reference, another
    order of operations) in float64: the same values to rounding."""
    params, t, up, lse_up = _inputs("cpu", torch.float64)
    opts = dict(softcap=5.0, z_loss=1e-3, label_smoothing=0.1)
    got = _grads(params, t, up, lse_up, budget, **opts)
    monkeypatch.setenv("FUSEDOPS_LCE_ALGO", "recompute")
    ref = _grads(params, t, up, lse_up, None, **opts)
    for a, r in zip((got[0], got[1], *got[2]), (ref[0], ref[1], *ref[2]), strict=True):
        torch.testing.assert_close(a, r, rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("backend,device", BACKENDS)
@pytest.mark.parametrize("budget", [2.3, None, 2.05])
def test_kept_chunk_then_retained_graph(backend, device, budget, monkeypatch):
    """The first backward uses the forward's last logits chunk (one logits GEMM fewer than a
    second backward through the retained graph, which recomputes it); both give the same bits."""
    params, t, up, lse_up = _inputs(device, _dtype(backend, device), n=120, v=700)
    gemms = []
    real_mm = chunked._mm

    def counting_mm(out, a, b, accumulate):
        gemms.append((tuple(out.shape), tuple(a.shape), tuple(b.shape)))
        real_mm(out, a, b, accumulate)

    monkeypatch.setattr(chunked, "_mm", counting_mm)
    leaves = [p.detach().clone().requires_grad_() for p in params]
    loss, lse = linear_cross_entropy(leaves[0], leaves[1], t, leaves[2], reduction="none",
                                     return_lse=True, memory_budget_mib=budget, backend=backend)
    plan = chunked.plan_chunks(120, 64, 700, leaves[0].element_size(),
                               chunked.budget_bytes(budget), True)
    token_chunks = -(-120 // plan.rows)
    vocab_chunks = -(-700 // plan.cols)
    assert len(gemms) == token_chunks * vocab_chunks  # the forward: logits only
    total = (loss * up.to(loss.dtype)).sum() + (lse * lse_up.to(lse.dtype)).sum()
    del gemms[:]
    first = torch.autograd.grad(total, leaves, retain_graph=True)
    n_first = len(gemms)
    del gemms[:]
    second = torch.autograd.grad(total, leaves)
    # every chunk: logits, d_hidden and d_weight products (d_hidden's into the float32 sum with
    # vocab chunks); the first backward skips the kept chunk's logits when rows are whole
    assert len(gemms) == 3 * token_chunks * vocab_chunks
    assert n_first == len(gemms) - (1 if plan.full_rows else 0)
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)
        assert torch.count_nonzero(a) > 0


def test_no_logits_kept_without_gradients():
    params, t, _, _ = _inputs("cpu", torch.float32)
    hidden, weight, bias = params
    _, _, _, kept = ops.linear_ce_stats(hidden, weight, bias, t, -100, 0.0, 3 << 20, True, True,
                                        False, "torch")
    assert kept.numel() == 0
    _, _, _, kept = ops.linear_ce_stats(hidden, weight, bias, t, -100, 0.0, 3 << 20, True, True,
                                        True, "torch")
    plan = chunked.plan_chunks(300, 64, 1000, 4, 3 << 20, True)
    assert kept.shape == (plan.rows * plan.cols,)
    with torch.no_grad():  # no graph: nothing to keep the logits for
        p = [x.requires_grad_() for x in params]
        loss = linear_cross_entropy(p[0], p[1], t, p[2], reduction="none")
    assert loss.grad_fn is None


def test_algo_switch_rejects_unknown_values(monkeypatch):
    params, t, _, _ = _inputs("cpu", torch.float32, n=8, v=20)
    monkeypatch.setenv("FUSEDOPS_LCE_ALGO", "fast")
    with pytest.raises(ValueError, match="FUSEDOPS_LCE_ALGO"):
        linear_cross_entropy(params[0], params[1], t, reduction="none")


def test_double_backward_raises():
    params, t, up, _ = _inputs("cpu", torch.float32, n=8, v=20)
    x, w = (p.detach().clone().requires_grad_() for p in params[:2])
    loss = linear_cross_entropy(x, w, t, reduction="none")
    (gx,) = torch.autograd.grad((loss * up.float()).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="double backward"):
        gx.sum().backward()


@pytest.mark.parametrize("bias", [True, False])
def test_opcheck_stats_ops_torch_backend(bias):
    params, t, _, _ = _inputs("cpu", torch.float32, n=9, h=16, v=37)
    x, w, b = params
    b = b if bias else None
    for keep in (False, True):
        torch.library.opcheck(torch.ops.fusedops.linear_ce_stats.default,
                              (x, w, b, t, -100, 4.0, 3 << 20, True, True, keep, "torch"),
                              test_utils=("test_schema", "test_faketensor"))
    lse, _, _, kept = ops.linear_ce_stats(x, w, b, t, -100, 4.0, 3 << 20, True, True, True,
                                          "torch")
    grads = [torch.randn(9) for _ in range(3)]
    for kept_arg in (kept, x.new_empty(0)):
        torch.library.opcheck(torch.ops.fusedops.linear_ce_stats_bwd.default,
                              (x, w, b, t, lse, *grads, kept_arg.clone(), 4.0, 3 << 20, True,
                               True, True, "torch"),
                              test_utils=("test_schema", "test_faketensor"))


def test_fake_shapes_of_stats_ops():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        x, w, t = torch.empty(5, 8), torch.empty(11, 8), torch.zeros(5, dtype=torch.long)
        lse, zt, zs, kept = ops.linear_ce_stats(x, w, None, t, -100, 0.0, 3 << 20, False, True,
                                                True, "torch")
        assert lse.shape == zt.shape == zs.shape == (5,) and kept.shape == (55,)
        dh, dw, db = ops.linear_ce_stats_bwd(x, w, None, t, lse, lse, lse, lse, kept, 0.0,
                                             3 << 20, True, False, True, "torch")
        assert dh.shape == (5, 8) and dw.shape == (0,) and db.shape == (0,)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_torch_compile_fullgraph_per_token(device):
    """reduction "none" with lse compiles without graph breaks, forward + backward."""
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    params, t, up, lse_up = _inputs(device, dtype, n=12, h=32, v=50)

    def step(x, w, b, t):
        loss, lse = linear_cross_entropy(x, w, t, b, reduction="none", return_lse=True,
                                         label_smoothing=0.1, softcap=8.0)
        return (loss * up.to(loss.dtype)).sum() + (lse * lse_up.to(lse.dtype)).sum()

    a = [p.detach().clone().requires_grad_() for p in params]
    c = [p.detach().clone().requires_grad_() for p in params]
    eager = step(*a, t)
    eager.backward()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager" if device == "cpu"
                             else "inductor")(*c, t)
    compiled.backward()
    torch.testing.assert_close(compiled, eager)
    for p, q in zip(a, c, strict=True):
        torch.testing.assert_close(p.grad, q.grad)


def test_kept_buffer_of_another_plan_is_not_used(monkeypatch):
    """A plan switch between forward and backward (FUSEDOPS_LCE_MIN_FULL_ROWS, a measurement
    switch read at each call) leaves the kept buffer unused: the gradients stay right."""
    params, t, up, lse_up = _inputs("cpu", torch.float32, n=120, v=5003)
    ref = _grads(params, t, up, lse_up, 2.05)
    assert not chunked.plan_chunks(120, 64, 5003, 4, chunked.budget_bytes(2.05), True).full_rows
    monkeypatch.setenv("FUSEDOPS_LCE_MIN_FULL_ROWS", "1")
    assert chunked.plan_chunks(120, 64, 5003, 4, chunked.budget_bytes(2.05), True).full_rows
    leaves = [p.detach().clone().requires_grad_() for p in params]
    loss, lse = linear_cross_entropy(leaves[0], leaves[1], t, leaves[2], reduction="none",
                                     return_lse=True, memory_budget_mib=2.05)
    monkeypatch.delenv("FUSEDOPS_LCE_MIN_FULL_ROWS")
    total = (loss * up.to(loss.dtype)).sum() + (lse * lse_up.to(lse.dtype)).sum()
    got = torch.autograd.grad(total, leaves)
    for a, r in zip(got, ref[2], strict=True):
        torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-6)
