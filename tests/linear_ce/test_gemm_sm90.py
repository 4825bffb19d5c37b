"""The Hopper GEMMs of the linear cross-entropy (torch.ops.fusedops.lce_gemm_sm90): the three
layouts in fp16/bf16, overwrite and accumulate, ragged and tiny sizes, operands in padded rows,
many tiles per CTA, several tile groups, split-K, NaN-poisoned outputs and guard cells around a
strided output, the tile order's group size, opcheck, bad arguments, and the opt-in
FUSEDOPS_LCE_GEMM=sm90 path of chunked.py.

Each result is checked element by element against the float64 product: at most one rounding to
the output dtype (unit roundoff u times |exact|) plus a float32 accumulation slack of 2^-12 times
(|a| @ |b| + |C_old|), and its largest error at most 2x cuBLAS's (torch.mm in the same dtype) plus
the same slack. An unwritten tile stays NaN; a lost or repeated k-block (64 products of N(0, 1)
pairs, about 8 in size) exceeds the bound, which is under 1 at K = 4096."""

import pytest
import torch

from fusedops import _ext
from fusedops.linear_ce import chunked, gemm_sm90, linear_cross_entropy

HAS_GPU = torch.cuda.is_available()
OP = gemm_sm90.op_available()
SM90 = HAS_GPU and gemm_sm90.supported(torch.device("cuda"))

needs_op = pytest.mark.skipif(not (HAS_GPU and OP),
                              reason="needs the lce_gemm_sm90 op on a CUDA GPU")
needs_sm90 = pytest.mark.skipif(
    not SM90, reason="needs compute capability 9.0 and fusedops._C built for 9.0a")
DTYPES = [torch.bfloat16, torch.float16]
UNIT = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
SLACK = 2.0**-12

# (name, layout, M, N, K). Row strides must be multiples of 8 elements: layouts 1 and 2 take any
# M, layout 3 any K (the token count of d_weight).
CASES = [
    ("ragged", 1, 2048 + 37, 1000, 4096 + 8),
    ("ragged", 2, 2048 + 37, 1000, 4096 + 8),
    ("ragged", 3, 1000, 4096 + 8, 2048 + 37),
    ("tiny", 1, 1, 8, 8),
    ("tiny", 2, 1, 8, 8),
    ("tiny", 3, 8, 8, 1),
    ("one_tile", 1, 128, 256, 64),
    ("one_tile", 2, 128, 256, 64),
    ("one_tile", 3, 128, 256, 64),
    ("edges", 1, 129, 264, 72),
    ("edges", 2, 65, 264, 72),
    ("edges", 3, 136, 264, 65),
    # 264 tiles: every CTA takes two or more, with k-block counts that do not divide the ring.
    ("persistent", 1, 1000, 8448, 328),
    ("persistent", 2, 1000, 8448, 328),
    ("persistent", 3, 8448, 1000, 330),
    # More tile rows (columns) than one group of the tile order along the fast dimension.
    ("groups", 1, 2179, 5120, 64),
    ("groups", 2, 2179, 5120, 136),
    ("groups", 3, 5120, 4360, 72),
    # Operands in padded rows (NaN in the padding, which TMA must never read): inner sizes that
    # are not multiples of 8.
    ("strided", 1, 300, 522, 1001),
    ("strided", 2, 300, 522, 1001),
    ("strided", 3, 302, 522, 1001),
    # N below 8 (no TMA store at all: every column is a tail column) and N % 8 = 7, with the
    # tail in the second box of a tile column.
    ("strided_narrow", 1, 130, 5, 72),
    ("strided_narrow", 2, 130, 5, 72),
    ("strided_narrow", 3, 136, 5, 65),
    ("strided_tail7", 1, 129, 327, 200),
    ("strided_tail7", 2, 129, 327, 200),
    ("strided_tail7", 3, 136, 327, 130),
]

# Accumulation is built for layout 3 (d_weight) only.
PARITY = [c + (acc,) for c in CASES for acc in ((False, True) if c[1] == 3 else (False,))]
PARITY_IDS = [f"{c[0]}-l{c[1]}-{'acc' if c[5] else 'store'}" for c in PARITY]


def _operands(layout, m, n, k, dtype, seed=0, padded=False):
    """a and b of the layout, seeded; with padded, views into rows padded to a multiple of 8
    elements plus 8 whose padding holds NaN."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    a_shape = (k, m) if layout == 3 else (m, k)
    b_shape = (n, k) if layout == 1 else (k, n)

    def make(shape):
        x = torch.randn(shape, generator=g, device="cuda").to(dtype)
        if not padded:
            return x
        buf = torch.full((shape[0], (shape[1] + 7) // 8 * 8 + 8), float("nan"), device="cuda",
                         dtype=dtype)
        buf[:, :shape[1]] = x
        return buf[:, :shape[1]]

    return make(a_shape), make(b_shape)


def _prod(layout, a, b):
    """The layout's product of a and b as given (float64 in, float64 out; or any dtype)."""
    if layout == 1:
        return a @ b.T
    if layout == 2:
        return a @ b
    return a.T @ b


def _check(out, ref, mag, dtype, cublas_err, what):
    err = (out.double() - ref).abs()
    bound = UNIT[dtype] * ref.abs() + SLACK * mag
    bad = ~(err <= bound)  # NaN (an unwritten element) is bad
    if bool(bad.any()):
        idx = tuple(int(i) for i in torch.nonzero(bad)[0])
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {bad.numel()} elements out of bound, first at {idx}: "
            f"got {float(out[idx])}, exact {float(ref[idx])}, bound {float(bound[idx])}")
    worst = float(err.max())
    limit = 2 * cublas_err + SLACK * float(mag.max())
    assert worst <= limit, f"{what}: max error {worst} > 2 x cuBLAS's {cublas_err} + slack"


def _cublas_err(layout, a, b, ref, c_old=None):
    prod = _prod(layout, a, b)
    if c_old is not None:
        prod = torch.addmm(c_old, a.T, b)
    return float((prod.double() - ref).abs().max())


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("name,layout,m,n,k,accumulate", PARITY, ids=PARITY_IDS)
def test_gemm_parity(name, layout, m, n, k, dtype, accumulate):
    _run_case(name, layout, m, n, k, dtype, accumulate)


def _run_case(name, layout, m, n, k, dtype, accumulate):
    a, b = _operands(layout, m, n, k, dtype, padded=name.startswith("strided"))
    a64, b64 = a.double(), b.double()
    ref = _prod(layout, a64, b64)
    mag = _prod(layout, a64.abs(), b64.abs())
    # A strided output with guard cells right of and below it: nothing outside may change (TMA
    # stores clip a row only at 16-byte granularity: the last N % 8 columns must not go by TMA).
    ld = (n + 7) // 8 * 8 + 16
    guard = 7.0
    big = torch.full((m + 3, ld), guard, device="cuda", dtype=dtype)
    out = big[:m, :n]
    c_old = None
    if accumulate:
        g = torch.Generator(device="cuda").manual_seed(1)
        out.copy_(torch.randn(m, n, generator=g, device="cuda") * 4)
        c_old = out.clone()
        ref = ref + c_old.double()
        mag = mag + c_old.double().abs()
    else:
        out.fill_(float("nan"))
    gemm_sm90.gemm(a, b, out, layout, accumulate)
    torch.cuda.synchronize()
    what = f"{name} layout {layout} {dtype} M={m} N={n} K={k} accumulate={accumulate}"
    _check(out, ref, mag, dtype, _cublas_err(layout, a, b, ref, c_old), what)
    assert bool((big[:m, n:] == guard).all()), f"{what}: wrote right of the output"
    assert bool((big[m:] == guard).all()), f"{what}: wrote below the output"


# Split-K (layout 2): automatic where the tiles fill the SMs' waves badly (d_hidden at Gemma-2's
# H = 2304: 17 x 9 tiles here), and forced split counts with ragged K and a single row.
SPLITS = [("auto", 2048 + 37, 2304, 16384 + 8), ("2", 300, 1000, 4096 + 8),
          ("7", 1, 264, 5000 + 8), ("16", 129, 520, 1000), ("3", 300, 522, 4001)]


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("splits,m,n,k", SPLITS, ids=[c[0] for c in SPLITS])
def test_gemm_split_k(splits, m, n, k, dtype, monkeypatch):
    if splits == "auto":
        monkeypatch.delenv("FUSEDOPS_LCE_GEMM_SPLITK", raising=False)
    else:
        monkeypatch.setenv("FUSEDOPS_LCE_GEMM_SPLITK", splits)
    _run_case(f"{'strided' if n % 8 else 'dense'} split-k {splits}", 2, m, n, k, dtype, False)


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("layout", [1, 2, 3])
def test_gemm_contiguous_and_group_sizes(layout, monkeypatch):
    """Contiguous outputs, and the same bits whatever the tile order (FUSEDOPS_LCE_GEMM_GROUP):
    each tile is computed alone, in the same k order."""
    m, n, k = (2304, 1536, 200) if layout == 3 else (1100, 2600, 200)
    a, b = _operands(layout, m, n, k, torch.bfloat16, seed=3)
    outs = []
    for group in ("16", "1", "3", "1000"):
        monkeypatch.setenv("FUSEDOPS_LCE_GEMM_GROUP", group)
        out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        outs.append(gemm_sm90.gemm(a, b, out, layout))
    ref = _prod(layout, a.double(), b.double())
    mag = _prod(layout, a.double().abs(), b.double().abs())
    _check(outs[0], ref, mag, torch.bfloat16, _cublas_err(layout, a, b, ref), f"layout {layout}")
    for o in outs[1:]:
        assert torch.equal(o, outs[0])


@pytest.mark.gpu
@needs_sm90
def test_gemm_accumulate_twice():
    """d_weight over two token chunks: the second call adds to the first's rounded result."""
    m, n, k = 1000, 520, 300
    a1, b1 = _operands(3, m, n, k, torch.bfloat16, seed=4)
    a2, b2 = _operands(3, m, n, k, torch.bfloat16, seed=5)
    out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    gemm_sm90.gemm(a1, b1, out, 3, False)
    first = out.clone()
    gemm_sm90.gemm(a2, b2, out, 3, True)
    ref = first.double() + a2.double().T @ b2.double()
    mag = first.double().abs() + a2.double().abs().T @ b2.double().abs()
    _check(out, ref, mag, torch.bfloat16, _cublas_err(3, a2, b2, ref, first), "two chunks")


@pytest.mark.gpu
@needs_sm90
def test_gemm_opcheck():
    """Schema (out mutated, nothing returned), fake implementation and dispatch agree."""
    a, b = _operands(1, 200, 264, 72, torch.bfloat16)
    out = torch.empty(200, 264, device="cuda", dtype=torch.bfloat16)
    torch.library.opcheck(torch.ops.fusedops.lce_gemm_sm90.default, (a, b, out, 1, False))


def _bad_args_cases():
    def mk(shape, dtype=torch.bfloat16, device="cuda"):
        return torch.randn(shape, device=device).to(dtype)

    cases = [
        ("float32", lambda: (mk((64, 64), torch.float32), mk((64, 64), torch.float32),
                             mk((64, 64), torch.float32), 1, False), TypeError, "bfloat16 or"),
        ("mixed dtypes", lambda: (mk((64, 64), torch.float16), mk((64, 64)), mk((64, 64)), 1,
                                  False), TypeError, "differs"),
        ("shapes", lambda: (mk((64, 32)), mk((64, 64)), mk((64, 64)), 1, False), ValueError,
         "layout 1 takes"),
        ("shapes l3", lambda: (mk((32, 64)), mk((64, 64)), mk((64, 64)), 3, False), ValueError,
         "layout 3 takes"),
        ("not row-major", lambda: (mk((64, 64)).T, mk((64, 64)), mk((64, 64)), 1, False),
         ValueError, "row-major"),
        ("row stride", lambda: (mk((64, 12))[:, :10], mk((64, 10)), mk((64, 64)), 1, False),
         ValueError, "row stride"),
        ("alignment", lambda: (mk((64 * 64 + 8,))[1:64 * 64 + 1].view(64, 64), mk((64, 64)),
                               mk((64, 64)), 1, False), ValueError, "16-byte aligned"),
        ("3-D", lambda: (mk((2, 64, 64)), mk((64, 64)), mk((64, 64)), 1, False), ValueError,
         "2-D"),
        ("layout", lambda: (mk((64, 64)), mk((64, 64)), mk((64, 64)), 4, False), ValueError,
         "layout must be"),
        ("accumulate l1", lambda: (mk((64, 64)), mk((64, 64)), mk((64, 64)), 1, True),
         ValueError, "accumulate"),
        ("cpu operand", lambda: (mk((64, 64), device="cpu"), mk((64, 64)), mk((64, 64)), 1,
                                 False), ValueError, "CUDA tensor"),
    ]
    return cases


@pytest.mark.gpu
@needs_op
@pytest.mark.parametrize("case", _bad_args_cases(), ids=[c[0] for c in _bad_args_cases()])
def test_gemm_bad_arguments(case):
    _, make, exc, match = case
    a, b, out, layout, acc = make()
    with pytest.raises(exc, match=match):
        torch.ops.fusedops.lce_gemm_sm90(a, b, out, layout, acc)


@pytest.mark.gpu
@needs_op
def test_gemm_overlap_and_arch():
    x = torch.randn(64, 64, device="cuda").bfloat16()
    with pytest.raises(ValueError, match="overlap"):
        torch.ops.fusedops.lce_gemm_sm90(x, torch.randn_like(x), x, 1, False)
    if not SM90:
        with pytest.raises(ValueError, match="compute capability 9.0"):
            torch.ops.fusedops.lce_gemm_sm90(x, x.clone(), torch.empty_like(x), 1, False)


# ---- the opt-in switch of chunked.py ----------------------------------------------------------

def test_switch_off_or_cpu_does_nothing(monkeypatch):
    """Without FUSEDOPS_LCE_GEMM=sm90, or on CPU tensors, try_mm leaves the product to torch."""
    a, b = torch.randn(5, 8), torch.randn(8, 3)
    out = torch.zeros(5, 3)
    monkeypatch.delenv("FUSEDOPS_LCE_GEMM", raising=False)
    assert not gemm_sm90.try_mm(out, a, b, False)
    monkeypatch.setenv("FUSEDOPS_LCE_GEMM", "sm90")
    assert not gemm_sm90.try_mm(out, a, b, False)
    chunked._mm(out, a, b, False)
    torch.testing.assert_close(out, a @ b)


@pytest.mark.gpu
@needs_sm90
@pytest.mark.skipif(not _ext.available(), reason="needs fusedops._C (the cuda backend)")
@pytest.mark.parametrize("n,v,budget,layouts", [(2100, 1000, None, {1, 2, 3}),
                                                (2100, 1000, 5.2, {1, 2, 3}),
                                                (600, 5000, 2.4, {1, 3})],
                         ids=["one_chunk", "token_chunks", "vocab_chunks"])
def test_switch_linear_ce(n, v, budget, layouts, monkeypatch):
    """The mean path with FUSEDOPS_LCE_GEMM=sm90 runs its products on our GEMMs (counted; the
    vocab-chunked path's d_hidden partials stay torch.mm) and gives cuBLAS's loss and gradients
    within bf16 rounding. Budgets: one chunk; two token chunks of whole rows (d_weight
    accumulated); vocab chunks."""
    g = torch.Generator(device="cuda").manual_seed(7)
    h = 256
    x = torch.randn(n, h, generator=g, device="cuda").bfloat16()
    w = (torch.randn(v, h, generator=g, device="cuda") / 8).bfloat16()
    t = torch.randint(0, v, (n,), generator=g, device="cuda")

    def run():
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
        loss = linear_cross_entropy(xr, wr, t, backend="cuda", memory_budget_mib=budget)
        loss.backward()
        return loss.detach(), xr.grad, wr.grad

    monkeypatch.delenv("FUSEDOPS_LCE_GEMM", raising=False)
    base = run()
    calls = []
    real = gemm_sm90.gemm

    def counting(a, b, out, layout, accumulate=False):
        calls.append((layout, accumulate))
        return real(a, b, out, layout, accumulate)

    monkeypatch.setattr(gemm_sm90, "gemm", counting)
    monkeypatch.setenv("FUSEDOPS_LCE_GEMM", "sm90")
    ours = run()
    assert {c[0] for c in calls} == layouts, calls
    if budget is not None:
        assert (3, True) in calls, "several chunks accumulate d_weight"
    torch.testing.assert_close(ours[0], base[0], rtol=1e-3, atol=1e-3)
    for name, a, b in zip(("d_hidden", "d_weight"), ours[1:], base[1:], strict=True):
        diff = float((a.float() - b.float()).abs().max())
        scale = float(b.float().abs().max())
        assert scale > 0 and diff <= 2e-2 * scale, f"{name}: max diff {diff} at max {scale}"
