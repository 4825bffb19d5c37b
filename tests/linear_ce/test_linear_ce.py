"""Parity suite for fused linear cross-entropy: each backend here against the float64 oracle."""

import pytest
import torch

import lce_oracle as O
from fusedops import _ext
from fusedops.linear_ce import linear_cross_entropy

BACKENDS = O.available_backends()
BACKEND_PARAMS = O.backend_params(BACKENDS)

# (leading shape, H, V). Sizes that are not multiples of any tile, 3-D hidden, the large shapes.
SHAPES_SMALL = [((1,), 64, 123), ((37,), 120, 123), ((2, 19), 64, 123)]
SHAPES_CPU = SHAPES_SMALL + [((1000,), 64, 123), ((37,), 64, 32003), ((37,), 4096, 123),
                             ((37,), 64, 128256)]
SHAPES_GPU = SHAPES_CPU + [((1000,), 4096, 32003), ((1000,), 4096, 128256)]

FEATURES = {
    "plain": {},
    "sum_bias": dict(reduction="sum", bias=True),
    "none_ignored": dict(reduction="none", ignore_frac=0.2),
    "smoothing": dict(label_smoothing=0.1, ignore_frac=0.2),
    "softcap": dict(softcap=5.0),
    "zloss_lse": dict(z_loss=1e-3, return_lse=True),
    "all_ignored": dict(ignore_frac=1.0, bias=True),
    "everything": dict(reduction="none", bias=True, ignore_frac=0.2, label_smoothing=0.1,
                       softcap=5.0, z_loss=1e-3, return_lse=True, noncontig=True),
}
BIG_FEATURES = ("plain", "everything", "none_ignored")

_ORACLE = {}


def _dtypes(backend, device):
    if backend.startswith("cuda"):
        return [torch.bfloat16, torch.float16]
    if backend == "triton" and device == "cpu":
        return [torch.float32, torch.float16]  # the interpreter has no bfloat16
    return [torch.float32, torch.bfloat16, torch.float16]


def _param(backend, device, dtype, lead, hs, vs, fname):
    marks = [pytest.mark.gpu] if device == "cuda" else []
    return pytest.param(backend, device, dtype, lead, hs, vs, fname, marks=marks,
                        id=f"{backend}-{device}-{str(dtype)[6:]}-"
                           f"{'x'.join(map(str, lead))}-{hs}-{vs}-{fname}")


def _params():
    for backend, device in BACKENDS:
        interp = backend == "triton" and device == "cpu"
        shapes = SHAPES_SMALL if interp else (SHAPES_GPU if device == "cuda" else SHAPES_CPU)
        for dtype in _dtypes(backend, device):
            for lead, hs, vs in shapes:
                big = lead[0] * hs * vs > 10**9
                for fname in FEATURES:
                    if big and fname not in BIG_FEATURES:
                        continue
                    if interp and fname not in ("plain", "everything", "all_ignored",
                                                "sum_bias"):
                        continue
                    yield _param(backend, device, dtype, lead, hs, vs, fname)


def _recompute_params():
    for backend, device in BACKENDS:
        dtype = _dtypes(backend, device)[0]
        big = [((1000,), 4096, 32003)] if device == "cuda" else []
        for lead, hs, vs in SHAPES_SMALL + big:
            for fname in ("plain", "everything"):
                yield _param(backend, device, dtype, lead, hs, vs, fname)


def _check_parity(backend, device, dtype, lead, hidden_size, vocab_size, feature):
    case = O.Case(lead, hidden_size, vocab_size, dtype, device, **FEATURES[feature])

    def impl(h, w, t, b, **kw):
        return linear_cross_entropy(h, w, t, b, backend=backend, **kw)

    O.check(case, impl, _ORACLE)


@pytest.mark.parametrize("backend,device,dtype,lead,hidden_size,vocab_size,feature",
                         list(_params()))
def test_parity(backend, device, dtype, lead, hidden_size, vocab_size, feature):
    _check_parity(backend, device, dtype, lead, hidden_size, vocab_size, feature)


@pytest.mark.parametrize("backend,device,dtype,lead,hidden_size,vocab_size,feature",
                         list(_recompute_params()))
def test_parity_recompute_algorithm(backend, device, dtype, lead, hidden_size, vocab_size,
                                    feature, monkeypatch):
    """FUSEDOPS_LCE_ALGO=recompute (fusedops::linear_ce_fwd / linear_ce_bwd) on each backend."""
    monkeypatch.setenv("FUSEDOPS_LCE_ALGO", "recompute")
    _check_parity(backend, device, dtype, lead, hidden_size, vocab_size, feature)


def test_reference_matches_torch_cross_entropy_float64():
    """The oracle itself equals F.cross_entropy on materialised float64 logits."""
    for feature in ("plain", "everything", "sum_bias", "smoothing"):
        case = O.Case((37,), 64, 123, torch.float64, "cpu", **FEATURES[feature])
        inp = O.make_inputs(case)
        ref = O.run(lambda *a, **k: linear_cross_entropy(*a, **k, backend="torch"), inp, case)
        direct = O.run(O.eager_loss, inp, case)
        for name in ref:
            assert O.rel_err(ref[name], direct[name]) < 1e-12, name


def test_reference_chunking_matches_unchunked():
    """Tiny chunks (many token and vocab chunks) give the same answer as one chunk."""
    from fusedops.linear_ce import reference
    g = torch.Generator().manual_seed(1)
    h = torch.randn(37, 16, generator=g, dtype=torch.float64)
    w = torch.randn(123, 16, generator=g, dtype=torch.float64)
    b = torch.randn(123, generator=g, dtype=torch.float64)
    t = torch.randint(0, 123, (37,), generator=g)
    one = reference.linear_ce_fwd(h, w, b, t, 3.0)
    many = reference.linear_ce_fwd(h, w, b, t, 3.0, chunk_elems=50)
    for a, c in zip(one, many, strict=True):
        torch.testing.assert_close(a, c)
    grads = [torch.randn(37, generator=g, dtype=torch.float64) for _ in range(3)]
    one = reference.linear_ce_bwd(h, w, b, t, one[0], *grads, 3.0, True, True, True)
    many = reference.linear_ce_bwd(h, w, b, t, many[0], *grads, 3.0, True, True, True,
                                   chunk_elems=50)
    for a, c in zip(one, many, strict=True):
        torch.testing.assert_close(a, c)


@pytest.mark.parametrize("backend,device", BACKEND_PARAMS)
def test_mean_all_ignored_is_zero_with_zero_grads(backend, device):
    dtype = _dtypes(backend, device)[0]
    h = torch.randn(5, 64, device=device, dtype=dtype, requires_grad=True)
    w = torch.randn(123, 64, device=device, dtype=dtype, requires_grad=True)
    t = torch.full((5,), -100, device=device)
    loss = linear_cross_entropy(h, w, t, backend=backend)
    loss.backward()
    assert loss.item() == 0.0
    assert torch.count_nonzero(h.grad) == 0 and torch.count_nonzero(w.grad) == 0


@pytest.mark.parametrize("backend,device", BACKEND_PARAMS)
def test_empty_batch(backend, device):
    dtype = _dtypes(backend, device)[0]
    h = torch.randn(0, 64, device=device, dtype=dtype, requires_grad=True)
    w = torch.randn(123, 64, device=device, dtype=dtype, requires_grad=True)
    t = torch.zeros(0, dtype=torch.long, device=device)
    loss = linear_cross_entropy(h, w, t, backend=backend)
    loss.backward()
    assert loss.item() == 0.0 and h.grad.shape == (0, 64)
    assert torch.count_nonzero(w.grad) == 0
    none = linear_cross_entropy(h, w, t, reduction="none", backend=backend)
    assert none.shape == (0,)


@pytest.mark.parametrize("backend,device", BACKEND_PARAMS)
def test_frozen_weight_and_int32_targets(backend, device):
    """Only the gradients asked for are computed; int32 targets equal int64 ones."""
    dtype = _dtypes(backend, device)[0]
    g = torch.Generator().manual_seed(3)
    h = torch.randn(37, 64, generator=g).to(device, dtype).requires_grad_()
    w = torch.randn(123, 64, generator=g).to(device, dtype)
    t = torch.randint(0, 123, (37,), generator=g).to(device)
    a = linear_cross_entropy(h, w, t, backend=backend)
    (ga,) = torch.autograd.grad(a, h)
    b = linear_cross_entropy(h, w, t.int(), backend=backend)
    (gb,) = torch.autograd.grad(b, h)
    assert torch.equal(a, b) and torch.equal(ga, gb)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", [b for b, d in BACKENDS if d == "cuda"])
def test_deterministic_forward(backend):
    g = torch.Generator().manual_seed(5)
    h = torch.randn(300, 128, generator=g).cuda().bfloat16()
    w = torch.randn(1000, 128, generator=g).cuda().bfloat16()
    t = torch.randint(0, 1000, (300,), generator=g).cuda()
    a = linear_cross_entropy(h, w, t, reduction="none", backend=backend)
    b = linear_cross_entropy(h, w, t, reduction="none", backend=backend)
    assert torch.equal(a, b)


def test_module_matches_function():
    from fusedops import LinearCrossEntropyLoss
    g = torch.Generator().manual_seed(4)
    h = torch.randn(7, 16, generator=g)
    w = torch.randn(50, 16, generator=g)
    t = torch.randint(0, 50, (7,), generator=g)
    mod = LinearCrossEntropyLoss(label_smoothing=0.1, reduction="sum", backend="torch")
    assert "label_smoothing=0.1" in repr(mod)
    torch.testing.assert_close(
        mod(h, w, t),
        linear_cross_entropy(h, w, t, label_smoothing=0.1, reduction="sum", backend="torch"))


_BAD_MODULE_OPTIONS = [
    (dict(reduction="foo"), ValueError, "reduction"),
    (dict(reduction=None), ValueError, "reduction"),
    (dict(label_smoothing=1.5), ValueError, "label_smoothing"),
    (dict(label_smoothing=-0.1), ValueError, "label_smoothing"),
    (dict(label_smoothing="0.1"), TypeError, "label_smoothing"),
    (dict(softcap=0.0), ValueError, "softcap"),
    (dict(softcap=-2.0), ValueError, "softcap"),
    (dict(softcap=float("inf")), ValueError, "softcap"),
    (dict(z_loss=-1e-4), ValueError, "z_loss"),
    (dict(z_loss=None), TypeError, "z_loss"),
    (dict(ignore_index=-100.0), TypeError, "ignore_index"),
    (dict(ignore_index=2**63), ValueError, "ignore_index"),
    (dict(memory_budget_mib=0), ValueError, "memory_budget_mib"),
    (dict(memory_budget_mib="64"), TypeError, "memory_budget_mib"),
    (dict(return_lse=1), TypeError, "return_lse"),
    (dict(check_targets="no"), TypeError, "check_targets"),
    (dict(backend="cudnn"), ValueError, "backend"),
    (dict(backend=3), TypeError, "backend"),
]


@pytest.mark.parametrize("kwargs,exc,match", _BAD_MODULE_OPTIONS)
def test_module_refuses_bad_options_at_construction(kwargs, exc, match):
    """The module raises when built, with the error the function gives at its first call."""
    from fusedops import LinearCrossEntropyLoss
    with pytest.raises(exc, match=match) as built:
        LinearCrossEntropyLoss(**kwargs)
    g = torch.Generator().manual_seed(5)
    h, w = torch.randn(3, 8, generator=g), torch.randn(10, 8, generator=g)
    t = torch.randint(0, 10, (3,), generator=g)
    with pytest.raises(exc) as called:
        linear_cross_entropy(h, w, t, **{"backend": "torch", **kwargs})
    assert str(built.value) == str(called.value)


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(process_group=object()), TypeError, "process_group"),
    (dict(vocab_start="0"), TypeError, "vocab_start"),
    (dict(vocab_start=2.0), TypeError, "vocab_start"),
    (dict(check_replicated="yes"), TypeError, "check_replicated"),
])
def test_module_refuses_bad_parallel_options_at_construction(kwargs, exc, match):
    from fusedops import LinearCrossEntropyLoss
    with pytest.raises(exc, match=match):
        LinearCrossEntropyLoss(**kwargs)


def test_module_with_every_option_valid_constructs_and_runs():
    from fusedops import LinearCrossEntropyLoss
    opts = dict(ignore_index=-1, reduction="none", label_smoothing=1, softcap=30,
                z_loss=1e-4, return_lse=True, backend="TORCH", check_targets=False,
                memory_budget_mib=4)
    mod = LinearCrossEntropyLoss(**opts)
    g = torch.Generator().manual_seed(6)
    h, w = torch.randn(2, 3, 8, generator=g), torch.randn(10, 8, generator=g)
    t = torch.randint(0, 10, (2, 3), generator=g)
    t[0, 1] = -1
    for a, b in zip(mod(h, w, t), linear_cross_entropy(h, w, t, **opts), strict=True):
        torch.testing.assert_close(a, b)


def test_extension_status_is_reported():
    """Where the extension was built, it loads and says which archs it holds."""
    if _ext.available():
        assert _ext.built_archs(), "extension loaded without an arch list"
    else:
        assert _ext.EXT_ERROR
