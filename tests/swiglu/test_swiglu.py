"""swiglu against the float64 oracle on every backend, its in-place backward, misuse, bad input."""

import pytest
import torch

from fusedops import dispatch
from fusedops.swiglu import reference as ref
from fusedops.swiglu import swiglu

HAS_GPU = torch.cuda.is_available()
try:
    import triton  # noqa: F401
    HAS_TRITON = True
except ImportError:
    HAS_TRITON = False
INTERPRET = dispatch._interpreting()

# (backend, device, dtypes): Triton on the CPU runs under the interpreter (no bfloat16).
CASES = [("torch", "cpu", (torch.float32, torch.float16, torch.bfloat16))]
if HAS_TRITON and INTERPRET and not HAS_GPU:
    CASES.append(("triton", "cpu", (torch.float32, torch.float16)))
if HAS_GPU:
    CASES += [("torch", "cuda", (torch.float32, torch.bfloat16)),
              ("triton", "cuda", (torch.float32, torch.float16, torch.bfloat16))]
PARAMS = [pytest.param(b, d, dt, id=f"{b}-{d}-{str(dt)[6:]}",
                       marks=[pytest.mark.gpu] if d == "cuda" else [])
          for b, d, dts in CASES for dt in dts]
SHAPES = [(97,), (3, 1025), (2, 5, 123)]


def _inputs(shape, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    gate = (torch.randn(shape, generator=g) * 3).to(device=device, dtype=dtype)
    up = torch.randn(shape, generator=g).to(device=device, dtype=dtype)
    dh = torch.randn(shape, generator=g).to(device=device, dtype=dtype)
    return gate, up, dh


def _oracle(gate, up, dh):
    g, u, d = (t.double() for t in (gate, up, dh))
    s = torch.sigmoid(g)
    return g * s * u, d * g * s, d * u * s * (1 + g * (1 - s))


def _eager(gate, up, dh):
    """PyTorch's own silu(g) * up in the inputs' dtype: the error the rule allows twice of."""
    g, u = gate.clone().requires_grad_(), up.clone().requires_grad_()
    h = torch.nn.functional.silu(g) * u
    dg, du = torch.autograd.grad(h, (g, u), dh)
    return h, du, dg


def _err(x, want):
    return ((x.double() - want).norm() / want.norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("backend,device,dtype", PARAMS)
def test_matches_float64_oracle(backend, device, dtype, inplace, shape):
    if device == "cuda":
        shape = shape[:-1] + (shape[-1] * 64,)  # a wider last dimension on the GPU
    gate, up, dh = _inputs(shape, dtype, device, seed=len(shape) + 7 * inplace)
    want = _oracle(gate, up, dh)
    eager = _eager(gate, up, dh)
    g, u = gate.clone().requires_grad_(), up.clone().requires_grad_()
    h = swiglu(g * 1, u * 1, inplace_backward=inplace, backend=backend)
    d_g, d_u = torch.autograd.grad(h, (g, u), dh)
    slack = 0.0 if dtype == torch.float32 else 1e-3
    for name, got, base, w in (("h", h, eager[0], want[0]), ("d_up", d_u, eager[1], want[1]),
                               ("d_gate", d_g, eager[2], want[2])):
        assert got.dtype == dtype and got.shape == gate.shape
        assert _err(got, w) <= 2 * _err(base, w) + slack + 1e-6, name


def test_checker_rejects_a_wrong_gradient():
    """The rule above catches a backward that drops silu's derivative term."""
    gate, up, dh = _inputs((4096,), torch.float32, "cpu", seed=3)
    want = _oracle(gate, up, dh)
    s = torch.sigmoid(gate)
    wrong = dh * up * s  # missing (1 + g (1 - s))
    eager = _eager(gate, up, dh)
    assert _err(wrong, want[2]) > 2 * _err(eager[2], want[2]) + 1e-6


def test_inplace_backward_writes_over_gate_and_up():
    gate, up, dh = _inputs((257,), torch.float64, "cpu", seed=5)
    g, u = gate.clone().requires_grad_(), up.clone().requires_grad_()
    gi, ui = g * 1, u * 1
    h = swiglu(gi, ui, inplace_backward=True, backend="torch")
    h.backward(dh)
    _, du, dg = _oracle(gate, up, dh)
    torch.testing.assert_close(gi.detach(), dg)  # the buffers now hold the gradients
    torch.testing.assert_close(ui.detach(), du)
    torch.testing.assert_close(g.grad, dg)
    torch.testing.assert_close(u.grad, du)


def test_second_backward():
    gate, up, dh = _inputs((33,), torch.float64, "cpu", seed=9)
    g, u = gate.clone().requires_grad_(), up.clone().requires_grad_()
    h = swiglu(g * 1, u * 1, backend="torch")
    a = torch.autograd.grad(h, (g, u), dh, retain_graph=True)
    b = torch.autograd.grad(h, (g, u), dh)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    h = swiglu(g * 1, u * 1, inplace_backward=True, backend="torch")
    torch.autograd.grad(h, (g, u), dh, retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward"):
        torch.autograd.grad(h, (g, u), dh)


def test_double_backward_raises():
    gate, up, dh = _inputs((33,), torch.float64, "cpu", seed=11)
    g, u = gate.clone().requires_grad_(), up.clone().requires_grad_()
    h = swiglu(g, u, backend="torch")
    dg, _ = torch.autograd.grad(h, (g, u), dh, create_graph=True)
    with pytest.raises(RuntimeError, match="no second derivative"):
        dg.sum().backward()


def test_gradcheck():
    g = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    u = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: swiglu(a, b, backend="torch"), (g, u))


def test_non_contiguous_and_empty():
    gate, up, dh = _inputs((8, 6), torch.float32, "cpu", seed=13)
    g, u = gate.t(), up.t()
    torch.testing.assert_close(swiglu(g, u), torch.nn.functional.silu(g) * u)
    e = torch.empty(0, 4, requires_grad=True)
    out = swiglu(e, e.detach().clone().requires_grad_())
    assert out.shape == (0, 4)
    out.sum().backward()
    assert e.grad.shape == (0, 4)


def test_bad_input():
    x = torch.randn(4, 3)
    with pytest.raises(TypeError, match="gate must be a torch.Tensor"):
        swiglu([1.0], x)
    with pytest.raises(ValueError, match="one shape"):
        swiglu(x, torch.randn(4, 2))
    with pytest.raises(ValueError, match="one dtype"):
        swiglu(x, x.double())
    with pytest.raises(ValueError, match="floating-point"):
        swiglu(x.long(), x.long())
    with pytest.raises(TypeError, match="inplace_backward"):
        swiglu(x, x, inplace_backward=1)
    leaf = torch.randn(4, 3, requires_grad=True)
    with pytest.raises(ValueError, match="leaf tensor"):
        swiglu(leaf, x, inplace_backward=True)
    with pytest.raises(RuntimeError, match="swiglu"):
        swiglu(x, x, backend="cuda-sm90")
    if HAS_GPU:
        with pytest.raises(ValueError, match="up is on cpu"):
            swiglu(x.cuda(), x)


def test_reference_slices_match_one_pass(monkeypatch):
    """The oracle's slicing (2^22 elements) gives the same values as one pass."""
    monkeypatch.setattr(ref, "_SLICE", 7)
    gate, up, dh = _inputs((50,), torch.float64, "cpu", seed=17)
    want = _oracle(gate, up, dh)
    torch.testing.assert_close(ref.swiglu_fwd(gate, up), want[0])
    dg, du = torch.empty_like(gate), torch.empty_like(up)
    ref.swiglu_bwd(dh, gate, up, dg, du)
    torch.testing.assert_close(du, want[1])
    torch.testing.assert_close(dg, want[2])


BACKENDS = sorted({b for b, _, _ in CASES})


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", ["same", "split", "overlap"])
def test_inplace_backward_with_shared_memory(backend, layout):
    """gate and up from one buffer: one tensor, the two halves of a fused projection (disjoint
    views, written in place) or overlapping views (the backward then allocates): the gradient
    reaching the buffer matches the oracle's."""
    device = "cuda" if HAS_GPU else "cpu"
    n = 256
    g = torch.Generator().manual_seed(19)
    base = torch.randn(2 * n, generator=g).to(device).requires_grad_()
    dh = torch.randn(n, generator=g).to(device)
    lo, hi = {"same": (0, 0), "split": (0, n), "overlap": (0, n // 4)}[layout]
    buf = base * 1
    h = swiglu(buf[lo:lo + n], buf[hi:hi + n], inplace_backward=True, backend=backend)
    (got,) = torch.autograd.grad(h, base, dh)
    x = base.detach().double()
    _, du, dg = _oracle(x[lo:lo + n], x[hi:hi + n], dh)
    want = torch.zeros_like(x)
    want[lo:lo + n] += dg
    want[hi:hi + n] += du
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_inplace_backward_leaves_inputs_without_grad(backend):
    """An input that needs no gradient (the caller's data, a frozen activation) keeps its value."""
    device = "cuda" if HAS_GPU else "cpu"
    gate, up, dh = _inputs((129,), torch.float32, device, seed=23)
    w = up.clone().requires_grad_()
    kept = gate.clone()
    h = swiglu(gate, w * 1, inplace_backward=True, backend=backend)
    (du,) = torch.autograd.grad(h, w, dh)
    assert torch.equal(gate, kept)
    torch.testing.assert_close(du.double(), _oracle(gate, up, dh)[1], rtol=1e-5, atol=1e-6)


def test_inplace_backward_refuses_views_of_leaves():
    p = torch.randn(2, 8, requires_grad=True)
    with pytest.raises(ValueError, match="view of a leaf"):
        swiglu(p[0], p[1], inplace_backward=True)
    swiglu(p[0], p[1]).sum().backward()  # allowed without the in-place backward
