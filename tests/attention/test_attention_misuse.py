"""Attention misuse: argument types, double backward, repeated backward, empty batches."""

import os

import numpy as np
import pytest
import torch

from fusedops.attention import attention

HAS_GPU = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
try:
    import triton  # noqa: F401
    HAS_TRITON = True
except ImportError:
    HAS_TRITON = False
BACKENDS = ["torch"] + ([pytest.param("triton", marks=pytest.mark.gpu)] if HAS_GPU else [])


def _qkv(b=1, s=5, hq=4, hkv=2, d=16, dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(b, s, h, d, generator=g).to(device, dtype) for h in (hq, hkv, hkv))


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(causal="yes"), TypeError, "causal must be a bool"),
    (dict(causal=1), TypeError, "causal must be a bool"),
    (dict(window_size=(1.5, 2)), TypeError, "window_size left must be an int"),
    (dict(window_size=(4, True)), TypeError, "window_size right must be an int"),
    (dict(window_size=4), TypeError, r"window_size must be a \(left, right\) pair"),
    (dict(window_size=(1, 2, 3)), TypeError, r"window_size must be a \(left, right\) pair"),
    (dict(softcap="30"), TypeError, "softcap must be a number"),
    (dict(softmax_scale=[0.1]), TypeError, "softmax_scale must be a number"),
    (dict(softmax_scale=float("nan")), ValueError, "softmax_scale must not be NaN"),
    (dict(return_lse=None), TypeError, "return_lse must be a bool"),
    # the kernels take scale and softcap as float32: past its range they would be inf or 0
    (dict(softmax_scale=1e39), ValueError, "softmax_scale must be finite and below"),
    (dict(softmax_scale=-1e300), ValueError, "softmax_scale must be finite and below"),
    (dict(softcap=1e-50), ValueError, "softcap must be a positive finite number"),
    (dict(softcap=1e39), ValueError, "softcap must be a positive finite number"),
])
def test_bad_option_types(kwargs, exc, match):
    q, k, v = _qkv()
    with pytest.raises(exc, match=match):
        attention(q, k, v, backend="torch", **kwargs)


def test_window_past_int64_is_unlimited():
    """A window side of Sq + Sk keys or more sees every key: it runs as -1, so that an int past
    int64 never reaches an op argument (the custom op's schema refused 2**63 under compile)."""
    q, k, v = _qkv()
    want = attention(q, k, v, causal=True, backend="torch")

    def f(q, k, v):
        return attention(q, k, v, causal=True, window_size=(2**63, 2**64), backend="torch")

    torch.testing.assert_close(f(q, k, v), want)
    torch.testing.assert_close(torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v),
                               want)


@pytest.mark.parametrize("varlen", [False, True])
def test_meta_tensors_give_shapes(varlen):
    """Meta tensors (shape inference) get the outputs' shapes and a backward, as
    linear_cross_entropy's do, instead of the reference failing to read their values."""
    q, k, v = (t.to("meta").requires_grad_() for t in _qkv(b=2))
    kwargs = {}
    if varlen:
        q, k, v = (t.flatten(0, 1) for t in (q, k, v))
        cu = torch.tensor([0, 5, 10], dtype=torch.int32, device="meta")
        kwargs = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=5, max_seqlen_k=5)
    out, lse = attention(q, k, v, causal=True, return_lse=True, **kwargs)
    assert out.device.type == "meta" and out.shape == q.shape
    assert lse.shape == ((4, 10) if varlen else (2, 4, 5))
    out.sum().backward()


def test_one_dtype_and_one_device():
    q, k, v = _qkv()
    with pytest.raises(TypeError, match="v dtype torch.float64 differs from q dtype"):
        attention(q, k, v.double(), backend="torch")
    with pytest.raises(ValueError, match="k is on meta but q is on cpu"):
        attention(q, k.to("meta"), v, backend="torch")


@pytest.mark.parametrize("backend", BACKENDS)
def test_autocast_casts_inputs(backend):
    """Under torch.autocast q, k, v go to the autocast dtype first (as SDPA's do): float32 q, k
    with a bfloat16 v give what all-bfloat16 inputs give, gradients in each input's dtype; a
    backward called inside autocast gives the same gradients."""
    device = "cuda" if backend == "triton" else "cpu"
    q, k, v = _qkv(s=9, device=device)
    v = v.to(torch.bfloat16)
    want = attention(*(t.to(torch.bfloat16) for t in (q, k, v)), causal=True, backend=backend)
    grads = []
    for backward_in_autocast in (False, True):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        with torch.autocast(device, dtype=torch.bfloat16):
            out = attention(*leaves, causal=True, backend=backend)
            if backward_in_autocast:
                out.float().square().sum().backward()
        if not backward_in_autocast:
            out.float().square().sum().backward()
        assert out.dtype == torch.bfloat16
        assert torch.equal(out, want)
        assert [t.grad.dtype for t in leaves] == [torch.float32, torch.float32, torch.bfloat16]
        grads.append([t.grad for t in leaves])
    for a, b in zip(*grads, strict=True):
        assert torch.equal(a, b)
    # Off autocast the dtypes must still agree.
    with pytest.raises(TypeError, match="v dtype torch.bfloat16 differs from q dtype"):
        attention(q, k, v)
    if backend == "torch":  # float64 stays float64 under autocast, as in SDPA
        q64, k64, v64 = (t.double() for t in (q, k, v))
        with torch.autocast(device, dtype=torch.bfloat16):
            out = attention(q64, k64, v64, causal=True, backend=backend)
        assert out.dtype == torch.float64
        assert torch.equal(out, attention(q64, k64, v64, causal=True, backend=backend))


def test_varlen_bool_max_seqlen_and_non_contiguous_cu_seqlens():
    q = torch.randn(10, 2, 16)
    k = torch.randn(12, 2, 16)
    cu_q = torch.tensor([0, 4, 10], dtype=torch.int32)
    cu_k = torch.tensor([0, 5, 12], dtype=torch.int32)
    with pytest.raises(TypeError, match="max_seqlen_q must be an int"):
        attention(q, k, k, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=True,
                  max_seqlen_k=7, backend="torch")
    strided = torch.tensor([0, 9, 4, 9, 10, 9], dtype=torch.int32)[::2]
    with pytest.raises(ValueError, match="cu_seqlens_q must be contiguous"):
        attention(q, k, k, cu_seqlens_q=strided, cu_seqlens_k=cu_k, max_seqlen_q=6,
                  max_seqlen_k=7, backend="torch")


@pytest.mark.parametrize("backend", BACKENDS)
def test_double_backward_raises_a_clear_error(backend):
    device = "cuda" if backend != "torch" else "cpu"
    q, k, v = (t.requires_grad_() for t in _qkv(device=device))
    out = attention(q, k, v, causal=True, backend=backend)
    dq, = torch.autograd.grad(out.square().sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="double backward .* is not supported"):
        torch.autograd.grad(dq.sum(), (q, k))


def test_gradgradcheck_raises_instead_of_passing_wrong_values():
    q, k, v = (t.double().requires_grad_() for t in _qkv(s=3, d=8))
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.gradgradcheck(lambda q, k, v: attention(q, k, v, backend="torch"),
                                     (q, k, v))


def test_first_order_gradients_with_create_graph_are_still_right():
    """create_graph=True for a first derivative (as gradient-penalty code does) gives the same
    gradients; only differentiating them again raises."""
    q, k, v = (t.requires_grad_() for t in _qkv())
    out = attention(q, k, v, causal=True, backend="torch")
    plain = torch.autograd.grad(out.square().sum(), (q, k, v), retain_graph=True)
    graph = torch.autograd.grad(out.square().sum(), (q, k, v), create_graph=True)
    for a, b in zip(plain, graph, strict=True):
        torch.testing.assert_close(a, b.detach())


def test_backward_twice_with_retain_graph():
    q, k, v = (t.requires_grad_() for t in _qkv())
    out = attention(q, k, v, causal=True, backend="torch")
    loss = out.square().sum()
    loss.backward(retain_graph=True)
    first = [t.grad.clone() for t in (q, k, v)]
    loss.backward()
    for t, g in zip((q, k, v), first, strict=True):
        torch.testing.assert_close(t.grad, 2 * g)


@pytest.mark.parametrize("shape", [(0, 5, 5), (2, 0, 5), (2, 5, 0)])
def test_empty_batch_or_sequence(shape):
    b, sq, sk = shape
    q = torch.randn(b, sq, 4, 16, requires_grad=True)
    k = torch.randn(b, sk, 2, 16, requires_grad=True)
    v = torch.randn(b, sk, 2, 16, requires_grad=True)
    out, lse = attention(q, k, v, return_lse=True, backend="torch")
    assert out.shape == q.shape and lse.shape == (b, 4, sq)
    assert torch.all(out == 0) and torch.all(lse == float("-inf"))
    out.sum().backward()
    for t in (q, k, v):
        assert t.grad.shape == t.shape and torch.all(t.grad == 0)


VARLEN_BACKENDS = [("torch", "cpu")] + ([("triton", "cpu")] if INTERPRET and HAS_TRITON
                                         and not HAS_GPU else [])
if HAS_GPU:  # the kernels' int32 window arithmetic is what the clamp protects
    VARLEN_BACKENDS.append(pytest.param("triton", "cuda", marks=pytest.mark.gpu))


def _packed():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(10, 2, 16, generator=g)
    k = torch.randn(12, 2, 16, generator=g)
    v = torch.randn(12, 2, 16, generator=g)
    cu_q = torch.tensor([0, 4, 10], dtype=torch.int32)
    cu_k = torch.tensor([0, 5, 12], dtype=torch.int32)
    return q, k, v, cu_q, cu_k


@pytest.mark.parametrize("backend,device", VARLEN_BACKENDS)
@pytest.mark.parametrize("window", [(0, 2**31 - 1), (2**31 - 1, 2**31 - 1), (3, 1)])
def test_max_seqlen_above_the_packed_length(backend, device, window):
    """A maximum above the packed length is allowed (no sequence exceeds it) and counts as that
    length: it once left a window side of 2^31 - 1 keys "limited", whose int32 arithmetic in the
    Triton kernel overflowed into all-zero rows, and sized the launch grid."""
    q, k, v, cu_q, cu_k = _packed()
    want = attention(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=6,
                     max_seqlen_k=7, window_size=window, backend="torch")
    q, k, v, cu_q, cu_k = (t.to(device) for t in (q, k, v, cu_q, cu_k))
    got = attention(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=6,
                    max_seqlen_k=2**32, window_size=window, backend=backend)
    assert want.abs().max() > 0
    torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-4)


def test_max_seqlen_above_the_packed_length_reaches_no_op(monkeypatch):
    """The ops (and the launch grids they size) get the packed length, not 2^40."""
    import fusedops.attention as fa
    seen = []
    forward = fa._ops.forward

    def spy(q, k, v, cu_q, cu_k, max_q, max_k, *args):
        seen.append((max_q, max_k))
        return forward(q, k, v, cu_q, cu_k, max_q, max_k, *args)

    monkeypatch.setattr(fa._ops, "forward", spy)
    q, k, v, cu_q, cu_k = _packed()
    attention(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=2**40,
              max_seqlen_k=2**32, backend="torch")
    assert seen == [(10, 12)]


def test_max_seqlen_types():
    q, k, v, cu_q, cu_k = _packed()
    kw = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, backend="torch")
    want = attention(q, k, v, max_seqlen_q=6, max_seqlen_k=7, **kw)
    got = attention(q, k, v, max_seqlen_q=np.int64(6), max_seqlen_k=np.int32(7), **kw)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    for bad in (6.0, None, torch.tensor(6)):
        with pytest.raises(TypeError, match="max_seqlen_q must be an int with cu_seqlens"):
            attention(q, k, v, max_seqlen_q=bad, max_seqlen_k=7, **kw)
    with pytest.raises(ValueError, match="max_seqlen_k must be >= 0"):
        attention(q, k, v, max_seqlen_q=6, max_seqlen_k=-1, **kw)


def test_max_seqlen_without_cu_seqlens_raises():
    q, k, v = _qkv()
    for kw in (dict(max_seqlen_q=3), dict(max_seqlen_k=3), dict(max_seqlen_q=5, max_seqlen_k=5)):
        with pytest.raises(ValueError, match="max_seqlen_q and max_seqlen_k go with cu_seqlens"):
            attention(q, k, v, backend="torch", **kw)


def test_dense_token_count_past_int32_raises():
    """Dense batches run on int32 offsets (arange(B + 1) * S): B * S past 2^31 - 1 would wrap."""
    q = torch.empty(65536, 32768, 1, 8, device="meta")
    k = torch.empty(1, 8, 1, 8, device="meta").expand(65536, 8, 1, 8)
    with pytest.raises(ValueError, match=r"q holds B \* S = 65536 \* 32768 = 2147483648 tokens"):
        attention(q, k, k, backend="torch")
    with pytest.raises(ValueError, match=r"k holds B \* S"):
        attention(k[:, :1].expand(65536, 1, 1, 8), q, q, backend="torch")
