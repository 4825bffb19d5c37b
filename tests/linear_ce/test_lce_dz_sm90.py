"""dz computed from z inside the Hopper d_hidden and d_weight GEMMs
(torch.ops.fusedops.lce_dz_gemm_sm90, gemm_sm90.dz_gemm) and the opt-in route
FUSEDOPS_LCE_GEMM=sm90-fused2 of chunked.fused_forward that uses it instead of the row kernel's
dz pass.

The op is checked against float64 torch computing dz from the same z, lse, w and targets (the
torch row kernel's MODE_DZ in float64, chunked._rows_torch), then the product: ragged sizes,
targets in the last k-block and the last column, ignore_index rows (w = 0), non-uniform w,
bias, softcap, label smoothing, z-loss, a padded z, split-K (layout 2), accumulation and d_bias
(layout 3), NaN-poisoned outputs and guard cells. The whole loss and gradients under the switch
go through the repository's oracle rule (lce_oracle.check), with counters proving that the dz
GEMMs ran and the row kernel did not. The CPU tests cover the switch, the route's reasons, the
wiring of fused_forward with both ops emulated in torch, and the checker, which must reject
wrong dz formulas.
"""

import math

import pytest
import torch

import lce_oracle as O
from fusedops import _ext
from fusedops.linear_ce import chunked, gemm_sm90, linear_cross_entropy

HAS_GPU = torch.cuda.is_available()
DZ_OP = gemm_sm90.dz_op_available() and gemm_sm90.stats_op_available()
SM90 = HAS_GPU and DZ_OP and gemm_sm90.supported(torch.device("cuda"))
needs_sm90 = pytest.mark.skipif(
    not SM90, reason="needs compute capability 9.0 and the lce_dz_gemm_sm90 op (9.0a)")
needs_c = pytest.mark.skipif(not _ext.available(), reason="needs fusedops._C (the row kernels)")
DTYPES = [torch.bfloat16, torch.float16]


# ---- the float64 reference and the checker ----------------------------------------------------

def dz_reference(z, bias, target, lse, w, eps, zl, softcap, dtype=torch.float64):
    """dz of the stored z in `dtype` (the torch row kernel's dz pass)."""
    d = z.to(dtype).clone()
    tokens, vocab = d.shape
    cast = lambda x: None if x is None else x.to(dtype)  # noqa: E731
    chunked._rows_torch(d, cast(bias), target, 0, vocab, cast(w), cast(lse), None, None, None,
                        None, eps, zl, softcap, chunked.MODE_DZ)
    return d


def product(dz, b, layout):
    return dz @ b if layout == 2 else dz.T @ b


def check_out(out, old, z, b, layout, args, what, dbias=None):
    """out against float64: the operand dz rounded once to z's dtype (u relative per element),
    float32 accumulation, one rounding of out (plus float(old) first when accumulating)."""
    dz = dz_reference(z, *args)
    ref = product(dz, b.double(), layout)
    mag = product(dz.abs(), b.double().abs(), layout)
    if old is not None:
        ref = ref + old.double()
        mag = mag + old.double().abs()
    unit = 2.0**-8 if z.dtype == torch.bfloat16 else 2.0**-11
    err = (out.double() - ref).abs()
    tol = unit * ref.abs() + 1.5 * unit * mag + 1e-6 * float(mag.max()) + 1e-30
    bad = ~(err <= tol)
    if bool(bad.any()):
        r, c = (int(i) for i in torch.nonzero(bad)[0])
        raise AssertionError(f"{what}: out wrong at ({r}, {c}): got {float(out[r, c])}, exact "
                             f"{float(ref[r, c])}, tol {float(tol[r, c])}, {int(bad.sum())} bad")
    if dbias is not None:
        ref_b = dz.sum(0)
        # float32 dz summed before rounding; the softcap's tanh carries 1e-6 softcap absolute.
        tol_b = (1e-5 + 4e-6 * float(args[-1])) * dz.abs().sum(0) + 1e-7
        errb = (dbias.double() - ref_b).abs()
        badb = ~(errb <= tol_b)
        if bool(badb.any()):
            c = int(torch.nonzero(badb)[0])
            raise AssertionError(f"{what}: dbias wrong at {c}: got {float(dbias[c])}, exact "
                                 f"{float(ref_b[c])}")


def make_inputs(tokens, vocab, h, *, bias, softcap, eps, zl, dtype, device, seed=0,
                uniform_w=False, layout=2):
    g = torch.Generator(device="cpu").manual_seed(seed)
    z = (torch.randn(tokens, vocab, generator=g) * 3).to(dtype)
    b_vocab = torch.randn(vocab, generator=g) * 0.5 if bias else None
    t = torch.randint(0, vocab, (tokens,), generator=g)
    t[1::5] = vocab - 1  # the last column (last k-block of layout 2, last M tile of layout 3)
    t[2::9] = (vocab - 1) // 64 * 64
    t[3::11] = 0
    t[::7] = -100  # ignore_index: w = 0
    v = z.double()
    if b_vocab is not None:
        v = v + b_vocab.double()
    if softcap:
        v = softcap * torch.tanh(v / softcap)
    lse = torch.logsumexp(v, 1).float()
    w = torch.full((tokens,), 1.0 / tokens) if uniform_w else torch.rand(tokens, generator=g)
    w = torch.where(t == -100, 0.0, w).float()
    rows = vocab if layout == 2 else tokens
    bmat = (torch.randn(rows, h, generator=g) / math.sqrt(rows) * 8).to(dtype)
    dev = lambda x: None if x is None else x.to(device)  # noqa: E731
    return (dev(z), dev(bmat), dev(b_vocab), dev(t), dev(lse), dev(w), float(eps), float(zl),
            float(softcap))


def emulated_out(z, b, layout, args, drop=None):
    """What the kernel computes, in float32 torch (dz rounded to z's dtype), optionally with one
    term dropped: the checker must accept the first and reject the others."""
    bias, t, lse, w, eps, zl, cap = args
    if drop == "eps":
        eps = 0.0
    if drop == "zloss":
        zl = 0.0
    if drop == "softcap":
        cap = 0.0
    if drop == "bias":
        bias = None
    if drop == "target":
        t = torch.where(t >= 0, (t + 1) % z.shape[1], t)
    dz = dz_reference(z, bias, t, lse, w, eps, zl, cap, torch.float32).to(z.dtype)
    return product(dz.float(), b.float(), layout)


# ---- CPU: the checker, the switch, the route, the wiring -------------------------------------

@pytest.mark.parametrize("layout", [2, 3])
def test_checker_accepts_emulation_rejects_wrong(layout):
    tokens, vocab, h = 40, 300, 16
    z, b, bv, t, lse, w, eps, zl, cap = make_inputs(tokens, vocab, h, bias=True, softcap=5.0,
                                                    eps=0.1, zl=1e-2, dtype=torch.bfloat16,
                                                    device="cpu", layout=layout)
    args = (bv, t, lse, w, eps, zl, cap)
    check_out(emulated_out(z, b, layout, args), None, z, b, layout, args, "emulation")
    for drop in ("eps", "zloss", "softcap", "bias", "target"):
        with pytest.raises(AssertionError):
            check_out(emulated_out(z, b, layout, args, drop), None, z, b, layout, args, drop)


def test_switch_values(monkeypatch):
    monkeypatch.setenv(gemm_sm90.ENV, "sm90-fused2")
    assert gemm_sm90.enabled() and gemm_sm90.fused_enabled() and gemm_sm90.dz_enabled()
    monkeypatch.setenv(gemm_sm90.ENV, "sm90-fused")
    assert gemm_sm90.fused_enabled() and not gemm_sm90.dz_enabled()
    monkeypatch.delenv(gemm_sm90.ENV, raising=False)
    assert not gemm_sm90.dz_enabled() and not gemm_sm90.enabled()


def test_dz_route_reasons(monkeypatch):
    x = torch.zeros(8, 16, dtype=torch.bfloat16)
    dw = torch.zeros(64, 16, dtype=torch.bfloat16)
    why = gemm_sm90.dz_route_why_not
    monkeypatch.setenv(gemm_sm90.ENV, "sm90-fused")
    assert "sm90-fused2" in why(x, dw, None)
    monkeypatch.setenv(gemm_sm90.ENV, "sm90-fused2")
    monkeypatch.setattr(gemm_sm90, "dz_op_available", lambda: True)
    assert why(x, dw, None) is None
    assert why(x, None, torch.zeros(64)) is None
    assert "d_weight in hidden's dtype" in why(x, dw.float(), None)
    assert "float32 bias" in why(x, dw, torch.zeros(64).bfloat16())
    assert "float32 bias" in why(x, dw, torch.zeros(128)[::2])


def _emulated_stats(calls):
    def op(x, w, z, bias, target, softcap, partials, lse, zt, zsum):
        calls.append(("stats", z.shape[0]))
        z.copy_((x.float() @ w.float().T).to(z.dtype))
        v = z.float() + (0 if bias is None else bias)
        if softcap:
            v = softcap * torch.tanh(v / softcap)
        inside = (target >= 0) & (target < v.shape[1])
        lse.copy_(torch.logsumexp(v, 1))
        zt.copy_(torch.where(inside, v.gather(1, torch.where(inside, target, 0)[:, None])[:, 0],
                             0.0))
        zsum.copy_(v.sum(1))
    return op


def _emulated_dz(calls):
    def op(z, b, out, layout, accumulate, bias, lse, w, target, eps, zl, softcap, dbias=None):
        calls.append(("dz", layout, accumulate, dbias is not None))
        dz32 = dz_reference(z, bias, target, lse, w, eps, zl, softcap, torch.float32)
        dz = dz32.to(z.dtype).float()
        prod = product(dz, b.float(), layout)
        if accumulate:
            prod = prod + out.float()
        out.copy_(prod.to(out.dtype))
        if dbias is not None:
            dbias.copy_(dz32.sum(0))
        return out
    return op


@pytest.mark.parametrize("opts", [dict(), dict(bias=True, label_smoothing=0.1, softcap=5.0,
                                                z_loss=1e-3, reduction="sum")],
                         ids=["plain", "all_options"])
def test_fused2_wiring_cpu(opts, monkeypatch):
    """fused_forward under sm90-fused2 on the CPU with both ops emulated: per token chunk one
    statistics op, one layout-2 and one layout-3 dz GEMM (accumulating from the second chunk;
    d_bias from it with a bias), the row kernel never; loss and gradients equal today's path."""
    opts = dict(opts)
    bias = opts.pop("bias", False)
    n, h, v = 2100, 64, 1000
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, h, generator=g).bfloat16()
    w = torch.randn(v, h, generator=g).bfloat16()
    b = torch.randn(v, generator=g).bfloat16() if bias else None
    t = torch.randint(0, v, (n,), generator=g)
    t[::6] = -100

    def run():
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
        br = None if b is None else b.clone().requires_grad_()
        loss = linear_cross_entropy(xr, wr, t, br, backend="torch", memory_budget_mib=5.2,
                                    **opts)
        loss.backward()
        return [loss.detach(), xr.grad, wr.grad] + ([br.grad] if br is not None else [])

    monkeypatch.delenv(gemm_sm90.ENV, raising=False)
    base = run()
    calls, modes = [], []
    monkeypatch.setenv(gemm_sm90.ENV, "sm90-fused2")
    monkeypatch.setattr(gemm_sm90, "_stats_device_ok", lambda device: True)
    monkeypatch.setattr(gemm_sm90, "dz_op_available", lambda: True)
    monkeypatch.setattr(gemm_sm90, "logits_ce_stats", _emulated_stats(calls))
    monkeypatch.setattr(torch.ops.fusedops, "lce_dz_gemm_sm90", _emulated_dz(calls),
                        raising=False)
    real_rows = chunked._rows

    def rows(backend, *args):
        modes.append(args[-1])
        return real_rows(backend, *args)

    monkeypatch.setattr(chunked, "_rows", rows)
    ours = run()
    assert not modes, f"the row kernel ran: {modes}"
    stats = [c[1] for c in calls if c[0] == "stats"]
    assert len(stats) == 2 and sum(stats) == n, calls  # two token chunks of whole rows
    want = []
    for i in range(2):
        want += ["stats", ("dz", 2, False, False), ("dz", 3, i > 0, bias)]
    assert [c if c[0] == "dz" else "stats" for c in calls] == want, calls
    torch.testing.assert_close(ours[0], base[0], rtol=1e-5, atol=1e-5)
    for a, c in zip(ours[1:], base[1:], strict=True):
        diff = float((a.float() - c.float()).abs().max())
        assert diff <= 1e-2 * float(c.float().abs().max()), diff


# ---- GPU: the op -----------------------------------------------------------------------------

# (name, tokens, V, H, bias, softcap, eps, z_loss): ragged sizes (V not a multiple of 64 or
# 256, tokens not of 128); one token; many tiles per CTA; layout 2 with split-K (few tiles, a
# long K); a padded z.
OP_CASES = [
    ("ragged", 300, 1000, 136, False, 0.0, 0.0, 0.0),
    ("all_options", 300, 1000, 136, True, 5.0, 0.1, 1e-2),
    ("last_kblock_8", 129, 264, 72, True, 0.0, 0.2, 0.0),
    ("one_token", 1, 8, 8, True, 30.0, 0.0, 1e-3),
    ("persistent", 1000, 8448, 328, True, 0.0, 0.1, 0.0),
    ("splitk", 256, 4096, 2304, True, 10.0, 0.0, 0.0),
    ("padded_z", 200, 520, 200, True, 10.0, 0.1, 1e-3),
    # H not a multiple of 8 (b in padded rows): out's last H % 8 columns are not TMA-stored.
    ("odd_h", 300, 1000, 139, True, 0.0, 0.1, 0.0),
    # Many k-blocks of both parities (the A fragments alternate between two register sets).
    ("long_k", 1100, 8200, 264, False, 0.0, 0.0, 0.0),
]


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("layout,accumulate", [(2, False), (3, False), (3, True)],
                         ids=["dhidden", "dweight", "dweight_acc"])
@pytest.mark.parametrize("case", OP_CASES, ids=[c[0] for c in OP_CASES])
def test_dz_gemm(case, layout, accumulate, dtype):
    name, tokens, vocab, h, bias, cap, eps, zl = case
    z, b, bv, t, lse, w, eps, zl, cap = make_inputs(tokens, vocab, h, bias=bias, softcap=cap,
                                                    eps=eps, zl=zl, dtype=dtype, device="cuda",
                                                    layout=layout)
    if name == "padded_z":
        zp = torch.full((tokens, vocab + 24), float("nan"), device="cuda", dtype=dtype)
        zp[:, :vocab] = z
        z = zp[:, :vocab]
    if name == "odd_h":
        bp = torch.full((b.shape[0], (h + 7) // 8 * 8 + 8), float("nan"), device="cuda",
                        dtype=dtype)
        bp[:, :h] = b
        b = bp[:, :h]
    rows = tokens if layout == 2 else vocab
    guard = 7.0
    big = torch.full((rows + 2, (h + 7) // 8 * 8 + 8), guard, device="cuda", dtype=dtype)
    out = big[:rows, :h]
    old = None
    if accumulate:
        out.copy_(torch.randn(rows, h, device="cuda"))
        old = out.clone()
    else:
        out.fill_(float("nan"))
    dbias = torch.full((vocab,), float("nan"), device="cuda") if layout == 3 else None
    args = (bv, t, lse, w, eps, zl, cap)  # the emulation's order (dz_gemm: bias, lse, w, target)
    gemm_sm90.dz_gemm(z, b, out, layout, accumulate, bv, lse, w, t, eps, zl, cap, dbias=dbias)
    torch.cuda.synchronize()
    what = f"{name} layout {layout} acc={accumulate} {dtype}"
    assert bool((big[:rows, h:] == guard).all()) and bool((big[rows:] == guard).all()), \
        f"{what}: wrote outside out"
    check_out(out, old, z, b, layout, args, what, dbias)


@pytest.mark.gpu
@needs_sm90
@needs_c
@pytest.mark.parametrize("softcap,eps,zl", [(0.0, 0.0, 0.0), (5.0, 0.1, 1e-2)])
def test_dz_gemm_matches_row_kernel_pass(softcap, eps, zl):
    """The op equals MODE_DZ (CUDA row kernel) followed by the plain GEMM on the same inputs,
    within one rounding of dz."""
    tokens, vocab, h = 300, 1000, 136
    z, b, bv, t, lse, w, eps, zl, cap = make_inputs(tokens, vocab, h, bias=True,
                                                    softcap=softcap, eps=eps, zl=zl,
                                                    dtype=torch.bfloat16, device="cuda")
    out = torch.empty(tokens, h, device="cuda", dtype=torch.bfloat16)
    gemm_sm90.dz_gemm(z, b, out, 2, False, bv, lse, w, t, eps, zl, cap)
    dz = z.clone()
    torch.ops.fusedops.ce_rows_cuda(dz, bv, t, 0, vocab, w, lse, lse, lse, lse, lse, eps, zl,
                                    cap, chunked.MODE_DZ, 90)
    ref = (dz.float() @ b.float())
    mag = dz.float().abs() @ b.float().abs()
    assert bool(((out.float() - ref).abs() <= 2 * 2.0**-8 * mag + 1e-6).all())


@pytest.mark.gpu
@needs_sm90
def test_dz_gemm_opcheck():
    tokens, vocab, h = 130, 264, 72
    z, b, bv, t, lse, w, eps, zl, cap = make_inputs(tokens, vocab, h, bias=True, softcap=2.0,
                                                    eps=0.1, zl=0.0, dtype=torch.bfloat16,
                                                    device="cuda", layout=3)
    args = (z, b, torch.empty(vocab, h, device="cuda", dtype=torch.bfloat16), 3, False, bv, lse,
            w, t, eps, zl, cap, torch.empty(vocab, device="cuda"))
    torch.library.opcheck(torch.ops.fusedops.lce_dz_gemm_sm90.default, args)


def _bad_dz_args():
    tokens, vocab, h = 64, 264, 64

    def base(**kw):
        d = dict(z=torch.empty(tokens, vocab, device="cuda", dtype=torch.bfloat16),
                 b=torch.empty(vocab, h, device="cuda", dtype=torch.bfloat16),
                 out=torch.empty(tokens, h, device="cuda", dtype=torch.bfloat16), layout=2,
                 accumulate=False, bias=None, lse=torch.zeros(tokens, device="cuda"),
                 w=torch.zeros(tokens, device="cuda"),
                 target=torch.zeros(tokens, dtype=torch.int64, device="cuda"), eps=0.0,
                 z_loss=0.0, softcap=0.0)
        d.update(kw)
        return d

    return [
        ("layout", lambda: base(layout=1), ValueError, "layout must be 2"),
        ("accumulate layout 2", lambda: base(accumulate=True), ValueError, "accumulate"),
        ("shapes", lambda: base(b=torch.empty(vocab + 8, h, device="cuda").bfloat16()),
         ValueError, "takes z"),
        # Shapes and floats in the messages: formatted as strings by the binding (streaming
        # them into the check crashed the process on the H200).
        ("lse size", lambda: base(lse=torch.zeros(tokens - 1, device="cuda")), ValueError,
         r"lse must be .* got shape \(63\)"),
        ("w dtype", lambda: base(w=torch.zeros(tokens, device="cuda").half()), TypeError, "w "),
        ("target int32", lambda: base(target=torch.zeros(tokens, dtype=torch.int32,
                                                         device="cuda")), TypeError,
         "target must be Long"),
        ("bias alignment", lambda: base(bias=torch.zeros(vocab + 1, device="cuda")[1:]),
         ValueError, "8-byte aligned"),
        ("eps", lambda: base(eps=1.5), ValueError, r"eps .* got 1\.5"),
        ("z_loss", lambda: base(z_loss=float("inf")), ValueError, "z_loss must be finite, got inf"),
        ("softcap", lambda: base(softcap=-1.0), ValueError, "softcap .* got -1"),
        ("dbias layout 2", lambda: base(dbias=torch.zeros(vocab, device="cuda")), ValueError,
         "dbias"),
    ]


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("case", _bad_dz_args(), ids=[c[0] for c in _bad_dz_args()])
def test_dz_gemm_bad_arguments(case):
    _, make, exc, match = case
    with pytest.raises(exc, match=match):
        gemm_sm90.dz_gemm(**make())


# ---- GPU: the whole loss under FUSEDOPS_LCE_GEMM=sm90-fused2 ----------------------------------

LOSS_CASES = [
    ("plain", 1100, 256, 1000, None, dict(ignore_frac=0.2)),
    ("all_options_two_chunks", 2100, 256, 1000, 5.2,
     dict(bias=True, ignore_frac=0.2, label_smoothing=0.1, softcap=5.0, z_loss=1e-3,
          reduction="sum")),
    ("smoothing_zloss_mean", 1100, 256, 3000, None,
     dict(ignore_frac=0.1, label_smoothing=0.2, z_loss=1e-2, bias=True)),
    ("fp16", 1100, 256, 1000, None, dict(ignore_frac=0.2, bias=True, softcap=20.0)),
    ("gemma_h_splitk", 1100, 2304, 2048, None, dict(ignore_frac=0.1, softcap=30.0)),
]
_ORACLE = {}


@pytest.mark.gpu
@needs_sm90
@needs_c
@pytest.mark.parametrize("name,n,h,v,budget,opts", LOSS_CASES, ids=[c[0] for c in LOSS_CASES])
def test_fused2_route_oracle(name, n, h, v, budget, opts, monkeypatch):
    dtype = torch.float16 if name == "fp16" else torch.bfloat16
    case = O.Case((n,), h, v, dtype, "cuda", **opts)
    modes, active = [], [False]
    real_rows = chunked._rows

    def rows(backend, *args):
        if active[0]:
            modes.append(args[-1])
        return real_rows(backend, *args)

    monkeypatch.setattr(chunked, "_rows", rows)
    monkeypatch.setenv(gemm_sm90.ENV, "sm90-fused2")
    before = gemm_sm90.stats_calls, gemm_sm90.dz_calls

    def impl(x, w, t, b, **kw):
        active[0] = True
        try:
            return linear_cross_entropy(x, w, t, b, backend="cuda", memory_budget_mib=budget,
                                        **kw)
        finally:
            active[0] = False

    O.check(case, impl, _ORACLE)
    stats = gemm_sm90.stats_calls - before[0]
    dz = gemm_sm90.dz_calls - before[1]
    chunks = 2 if budget is not None else 1
    assert stats == chunks, f"the statistics epilogue ran {stats} times, want {chunks}"
    assert dz == 2 * chunks, f"the dz GEMMs ran {dz} times, want {2 * chunks}"
    assert not modes, f"the row kernel ran: {modes}"
