"""linear_cross_entropy misuse: repeated backward, double backward, argument types and devices."""

import pytest
import torch

from fusedops.linear_ce import linear_cross_entropy

HAS_GPU = torch.cuda.is_available()


def _backends():
    out = [("torch", "cpu")]
    if HAS_GPU:
        out += [pytest.param(b, "cuda", marks=pytest.mark.gpu) for b in ("triton", "cuda")]
    return out


def _inputs(n=6, h=16, v=11, device="cpu", dtype=torch.float32, bias=False):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, h, generator=g).to(device, dtype).requires_grad_()
    w = (torch.randn(v, h, generator=g) / 4).to(device, dtype).requires_grad_()
    t = torch.randint(0, v, (n,), generator=g).to(device)
    b = torch.randn(v, generator=g).to(device, dtype).requires_grad_() if bias else None
    return x, w, t, b


def _dtype(device):
    return torch.bfloat16 if device == "cuda" else torch.float32


@pytest.mark.parametrize("backend,device", _backends())
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_backward_twice_with_retain_graph(backend, device, reduction):
    """Both backwards give the gradients F.cross_entropy's would: the second adds the same."""
    x, w, t, b = _inputs(device=device, dtype=_dtype(device), bias=True)
    loss = linear_cross_entropy(x, w, t, b, reduction=reduction, backend=backend)
    loss = loss.sum() * 3.0 if reduction == "none" else loss * 3.0  # upstream gradient != 1
    loss.backward(retain_graph=True)
    first = [p.grad.clone() for p in (x, w, b)]
    loss.backward()
    for p, g in zip((x, w, b), first, strict=True):
        torch.testing.assert_close(p.grad.float(), 2 * g.float(), rtol=2e-2, atol=1e-3)


@pytest.mark.parametrize("backend,device", _backends())
def test_grad_of_hidden_then_of_weight(backend, device):
    x, w, t, _ = _inputs(device=device, dtype=_dtype(device))
    loss = linear_cross_entropy(x, w, t, backend=backend)
    dx, = torch.autograd.grad(loss, x, retain_graph=True)
    dw, = torch.autograd.grad(loss, w)
    ref = linear_cross_entropy(x, w, t, backend=backend)
    rx, rw = torch.autograd.grad(ref, (x, w))
    torch.testing.assert_close(dx, rx)
    torch.testing.assert_close(dw, rw)


@pytest.mark.parametrize("backend,device", _backends())
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_double_backward_raises_a_clear_error(backend, device, reduction):
    x, w, t, _ = _inputs(device=device, dtype=_dtype(device))
    loss = linear_cross_entropy(x, w, t, reduction=reduction, backend=backend).sum()
    dx, = torch.autograd.grad(loss, x, create_graph=True)
    with pytest.raises(RuntimeError, match="double backward .* is not supported"):
        torch.autograd.grad(dx.sum(), w)


def test_gradgradcheck_raises_instead_of_passing_wrong_values():
    x, w, t, _ = _inputs(n=3, h=4, v=5, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.gradgradcheck(lambda x, w: linear_cross_entropy(x, w, t), (x, w))


def test_first_order_gradients_with_create_graph_are_still_right():
    x, w, t, _ = _inputs()
    plain = torch.autograd.grad(linear_cross_entropy(x, w, t), (x, w))
    graph = torch.autograd.grad(linear_cross_entropy(x, w, t), (x, w), create_graph=True)
    for a, b in zip(plain, graph, strict=True):
        torch.testing.assert_close(a, b.detach())


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(ignore_index=-100.0), TypeError, "ignore_index must be an int"),
    (dict(ignore_index=None), TypeError, "ignore_index must be an int"),
    (dict(ignore_index=2**63), ValueError, "ignore_index must fit in int64"),
    (dict(reduction=None), ValueError, "reduction must be one of"),
    (dict(label_smoothing="0.1"), TypeError, "label_smoothing must be a number"),
    (dict(softcap=True), TypeError, "softcap must be a number or None"),
    (dict(z_loss=None), TypeError, "z_loss must be a number"),
    (dict(return_lse=1), TypeError, "return_lse must be a bool"),
    (dict(check_targets="no"), TypeError, "check_targets must be a bool"),
    (dict(memory_budget_mib="64"), TypeError, "memory_budget_mib must be a number"),
    (dict(memory_budget_mib=-1), ValueError, "memory_budget_mib must be a positive"),
])
def test_bad_option_types(kwargs, exc, match):
    x, w, t, _ = _inputs()
    with pytest.raises(exc, match=match):
        linear_cross_entropy(x, w, t, backend="torch", **kwargs)


def test_float64_is_accepted_and_returns_float64():
    x, w, t, _ = _inputs(dtype=torch.float64)
    loss, lse = linear_cross_entropy(x, w, t, return_lse=True)
    assert loss.dtype == torch.float64 and lse.dtype == torch.float64
    ref = torch.nn.functional.cross_entropy(x @ w.T, t)
    torch.testing.assert_close(loss, ref)


def test_error_for_a_bad_dtype_lists_float64():
    x, w, t, _ = _inputs()
    with pytest.raises(TypeError, match="float32, float16, bfloat16 or float64"):
        linear_cross_entropy(x.detach().long(), w, t)


@pytest.mark.gpu
def test_targets_on_another_device_are_refused():
    x, w, t, _ = _inputs(device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="target is on cpu but hidden is on cuda"):
        linear_cross_entropy(x, w, t.cpu())


def _eager(x, w, t, **kw):
    return torch.nn.functional.cross_entropy(x.double() @ w.double().T, t, **kw)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_ignored_tokens_with_overflowing_logits_add_zero(reduction):
    """A padding row whose logits overflow (float16) or hold NaN adds exactly 0 to the loss, as
    with F.cross_entropy (0 * inf used to turn the mean into NaN)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 8, generator=g)
    w = torch.randn(5, 8, generator=g)
    t = torch.randint(0, 5, (6,), generator=g)
    t[0] = -100
    want = _eager(x[1:], w, t[1:], reduction=reduction)
    x16 = x.half()
    x16[0] = 30000.0  # its logits overflow float16
    got = linear_cross_entropy(x16, w.half(), t, reduction=reduction, backend="torch")
    assert torch.isfinite(got)
    torch.testing.assert_close(got.double(), want, rtol=2e-3, atol=2e-3)
    xn = x.clone()
    xn[0, 2] = float("nan")
    got = linear_cross_entropy(xn, w, t, reduction=reduction, backend="torch")
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_float16_gradients_scaled_past_65504_stay_finite():
    """GradScaler multiplies the loss by 2^16: the gradients are scaled in float32 and rounded
    once (a float16 2^16 is inf)."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(64, 16, generator=g)
    w = torch.randn(32, 16, generator=g)
    t = torch.randint(0, 32, (64,), generator=g)
    t[:4] = -100
    xh, wh = x.half().requires_grad_(), w.half().requires_grad_()
    (linear_cross_entropy(xh, wh, t, backend="torch") * 65536.0).backward()
    xd, wd = x.half().double().requires_grad_(), w.half().double().requires_grad_()
    (_eager(xd, wd, t) * 65536.0).backward()
    for got, want in ((xh.grad, xd.grad), (wh.grad, wd.grad)):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got.double(), want, rtol=2e-2, atol=2e-2 * want.abs().max())


@pytest.mark.parametrize("raw", ["abc", "nan", "inf", "-5", "0"])
def test_memory_budget_variable_is_checked_by_name(monkeypatch, raw):
    monkeypatch.setenv("FUSEDOPS_LCE_MEMORY_MIB", raw)
    x, w, t, _ = _inputs()
    with pytest.raises(ValueError, match="FUSEDOPS_LCE_MEMORY_MIB must be a positive number"):
        linear_cross_entropy(x, w, t, backend="torch")


@pytest.mark.parametrize("reduction,return_lse", [("mean", False), ("none", False),
                                                  ("none", True)])
def test_huge_budget_means_unlimited_and_empty_batches_need_none(reduction, return_lse):
    x, w, t, _ = _inputs()
    want = linear_cross_entropy(x, w, t, reduction=reduction, return_lse=return_lse,
                                backend="torch")
    got = linear_cross_entropy(x, w, t, reduction=reduction, return_lse=return_lse,
                               memory_budget_mib=1e300, backend="torch")
    for a, b in zip(got if return_lse else (got,), want if return_lse else (want,), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # no tokens: nothing to fit into even the smallest budget
    out = linear_cross_entropy(x[:0], w, t[:0], reduction=reduction, return_lse=return_lse,
                               memory_budget_mib=1e-6, backend="torch")
    loss = out[0] if return_lse else out
    assert loss.numel() == (1 if reduction == "mean" else 0)


def test_check_replicated_needs_a_group():
    x, w, t, _ = _inputs()
    with pytest.raises(TypeError, match="check_replicated must be a bool"):
        linear_cross_entropy(x, w, t, check_replicated="yes", backend="torch")
    with pytest.raises(ValueError, match="check_replicated=True compares hidden and target"):
        linear_cross_entropy(x, w, t, check_replicated=True, backend="torch")
    from fusedops.linear_ce import LinearCrossEntropyLoss
    with pytest.raises(TypeError, match="check_replicated must be a bool"):
        LinearCrossEntropyLoss(check_replicated="")
