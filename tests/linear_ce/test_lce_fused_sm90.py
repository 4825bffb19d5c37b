"""The cross-entropy statistics in the Hopper logits GEMM's epilogue
(torch.ops.fusedops.lce_logits_ce_stats_sm90) and the opt-in route FUSEDOPS_LCE_GEMM=sm90-fused
of chunked.fused_forward that uses it.

The epilogue's partials (max, sum of exp, target logit, logit sum per row and 256-column tile)
and the merged lse, zt, zsum are checked against float64 torch computed from the z the kernel
stored (so the check sees the epilogue's math alone; z itself is checked against the float64
product): ragged V, rows not a multiple of 128, targets in the last partial tile, ignore_index,
bias, softcap, a padded z with an odd V, NaN-poisoned outputs and guard cells around z. The
whole loss and gradients under the switch go through the repository's oracle rule
(lce_oracle.check) with label smoothing, z-loss, bias, softcap and ignore_index, with counters
proving the route ran (the statistics op once per token chunk, the row kernel in MODE_DZ only).
The CPU tests cover the route selection, the budget with the partials, the wiring of
fused_forward (the op emulated in torch) and the checker itself, which must reject wrong
statistics.
"""

import math

import pytest
import torch

import lce_oracle as O
from fusedops import _ext
from fusedops.linear_ce import chunked, gemm_sm90, linear_cross_entropy

HAS_GPU = torch.cuda.is_available()
STATS_OP = gemm_sm90.stats_op_available()
SM90 = HAS_GPU and STATS_OP and gemm_sm90.supported(torch.device("cuda"))
needs_sm90 = pytest.mark.skipif(
    not SM90, reason="needs compute capability 9.0 and the lce_logits_ce_stats_sm90 op (9.0a)")
needs_c = pytest.mark.skipif(not _ext.available(), reason="needs fusedops._C (the row kernels)")
DTYPES = [torch.bfloat16, torch.float16]
BN = gemm_sm90.STATS_BLOCK_N


# ---- the float64 reference of the epilogue and the checker ------------------------------------

def logits_of(z, bias, softcap, dtype=torch.float64):
    """softcap(z + bias) in `dtype`, the logits the statistics see (the row kernels' order)."""
    v = z.to(dtype)
    if bias is not None:
        v = v + bias.to(dtype)
    if softcap:
        v = softcap * torch.tanh(v / softcap)
    return v


def stats_reference(z, bias, target, softcap, dtype=torch.float64, block=BN):
    """(partials (M, tiles, 4), lse, zt, zsum) of the stored z, in `dtype`."""
    v = logits_of(z, bias, softcap, dtype)
    m_rows, vocab = v.shape
    tiles = -(-vocab // block)
    pad = tiles * block - vocab
    vp = torch.nn.functional.pad(v, (0, pad), value=-math.inf).view(m_rows, tiles, block)
    valid = torch.arange(tiles * block, device=v.device).view(tiles, block) < vocab
    mx = vp.amax(2)
    s = torch.exp(vp - mx[..., None]).sum(2)
    zs = torch.where(valid, vp, 0.0).sum(2)
    t = target.long()
    inside = (t >= 0) & (t < vocab)
    tc = torch.where(inside, t, 0)
    zt_row = torch.where(inside, v.gather(1, tc[:, None])[:, 0], 0.0)
    zt_tile = torch.zeros(m_rows, tiles, dtype=dtype, device=v.device)
    zt_tile.scatter_(1, (tc // block)[:, None], zt_row[:, None])
    partials = torch.stack([mx, s, zt_tile, zs], -1)
    return partials, torch.logsumexp(v, 1), zt_row, v.sum(1)


def check_stats(partials, lse, zt, zsum, z, bias, target, softcap, what=""):
    """Asserts the kernel's statistics of the stored z match float64 within float32 rounding:
    the logits once rounded (2^-24 relative) and the softcap's tanh (1e-6 softcap absolute),
    exp by ex2.approx, sums of up to 256 terms per tile in float32."""
    ref_p, ref_lse, ref_zt, ref_zsum = stats_reference(z, bias, target, softcap)
    v = logits_of(z, bias, softcap).abs()
    cap = float(softcap or 0.0)
    vocab = z.shape[1]
    tiles = ref_p.shape[1]
    vp = torch.nn.functional.pad(v, (0, tiles * BN - vocab)).view(v.shape[0], tiles, BN)
    tile_max, tile_abs = vp.amax(2), vp.sum(2)
    tol_v = 2.0**-22 * tile_max + 2e-6 * cap + 1e-7  # one logit (max, target logit)
    tol_s = 3e-5 + 4 * tol_v  # relative, sum of exp
    tol_zs = 2.0**-17 * tile_abs + BN * 2e-6 * cap + 1e-6
    got = partials.double()
    assert bool(torch.isfinite(got[..., 1:]).all()), f"{what}: non-finite partials"
    checks = [
        ("max", (got[..., 0] - ref_p[..., 0]).abs(), tol_v),
        ("sum of exp", (got[..., 1] - ref_p[..., 1]).abs(), tol_s * ref_p[..., 1]),
        ("target logit", (got[..., 2] - ref_p[..., 2]).abs(), tol_v),
        ("logit sum", (got[..., 3] - ref_p[..., 3]).abs(), tol_zs),
    ]
    for name, err, tol in checks:
        bad = ~(err <= tol)
        if bool(bad.any()):
            r, t = (int(i) for i in torch.nonzero(bad)[0])
            k = [c[0] for c in checks].index(name)
            raise AssertionError(f"{what}: partial {name} wrong at row {r}, tile {t}: got "
                                 f"{float(got[r, t, k])}, exact {float(ref_p[r, t, k])}, "
                                 f"{int(bad.sum())} bad")
    row_max = tile_max.amax(1)
    row_tol_v = 2.0**-22 * row_max + 2e-6 * cap + 1e-7
    row_checks = [
        ("lse", lse, ref_lse, row_tol_v + 3e-5 + 4 * row_tol_v),
        ("zt", zt, ref_zt, row_tol_v),
        ("zsum", zsum, ref_zsum, 2.0**-17 * v.sum(1) + vocab * 2e-6 * cap + 1e-6),
    ]
    for name, x, ref, tol in row_checks:
        err = (x.double() - ref).abs()
        bad = ~(err <= tol)
        if bool(bad.any()):
            r = int(torch.nonzero(bad)[0])
            raise AssertionError(f"{what}: {name} wrong at row {r}: got {float(x[r])}, exact "
                                 f"{float(ref[r])}, {int(bad.sum())} bad")


def stats_emulated(z, bias, target, softcap):
    """What the epilogue computes, in float32 torch (the kernel's arithmetic but for the order of
    its sums): the checker must accept it."""
    p, lse, zt, zsum = stats_reference(z, bias, target, softcap, torch.float32)
    return p, lse, zt, zsum


def _stats_inputs(m, v, *, bias, softcap, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    z = (torch.randn(m, v, generator=g) * 3).to(dtype)
    b = torch.randn(v, generator=g) * 0.5 if bias else None
    t = torch.randint(0, v, (m,), generator=g)
    t[::7] = -100  # ignore_index rows still get statistics
    t[1::5] = v - 1  # the last column, in the last (partial) tile
    t[2::9] = (v - 1) // BN * BN  # the last tile's first column
    t[3::11] = 0
    cast = lambda x: None if x is None else x.to(device)  # noqa: E731
    return z.to(device), cast(b), t.to(device), float(softcap or 0.0)


# ---- CPU: the checker, the route, the budget, the wiring --------------------------------------

@pytest.mark.parametrize("bias,softcap", [(False, 0.0), (True, 0.0), (True, 5.0)])
def test_checker_accepts_emulation_rejects_wrong(bias, softcap):
    """The checker accepts float32 statistics computed the kernel's way and rejects each of the
    mistakes an epilogue could make."""
    m, v = 37, 1000
    z, b, t, cap = _stats_inputs(m, v, bias=bias, softcap=softcap)
    good = stats_emulated(z, b, t, cap)
    check_stats(*good, z, b, t, cap, "emulation")

    def rejects(stats, name):
        with pytest.raises(AssertionError):
            check_stats(*stats, z, b, t, cap, name)

    if bias:
        rejects(stats_emulated(z, None, t, cap), "bias dropped")
    if cap:
        rejects(stats_emulated(z, b, t, 0.0), "softcap dropped")
    rejects(stats_emulated(z, b, torch.where(t >= 0, (t + BN) % v, t), cap), "target moved")
    p, lse, zt, zsum = (x.clone() for x in good)
    p[:, -1] = torch.tensor([-math.inf, 0.0, 0.0, 0.0])  # last tile lost
    rejects((p, lse, zt, zsum), "last tile lost")
    rejects(stats_reference(z, b, t, cap, torch.float32, block=255), "tile boundaries")
    p, lse, zt, zsum = (x.clone() for x in good)
    rejects((p, lse + 1e-3, zt, zsum), "lse off")
    rejects((p, lse, zt, zsum * 1.001 + 0.01), "zsum off")


def _cpu_inputs(n=40, h=16, v=1000, dtype=torch.bfloat16, bias=False):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, h, generator=g).to(dtype)
    w = torch.randn(v, h, generator=g).to(dtype)
    b = torch.randn(v, generator=g) if bias else None
    t = torch.randint(0, v, (n,), generator=g)
    return x, w, b, t


def test_switch_values(monkeypatch):
    monkeypatch.delenv(gemm_sm90.ENV, raising=False)
    assert not gemm_sm90.enabled() and not gemm_sm90.fused_enabled()
    monkeypatch.setenv(gemm_sm90.ENV, "sm90")
    assert gemm_sm90.enabled() and not gemm_sm90.fused_enabled()
    monkeypatch.setenv(gemm_sm90.ENV, " SM90-Fused ")
    assert gemm_sm90.enabled() and gemm_sm90.fused_enabled()
    monkeypatch.setenv(gemm_sm90.ENV, "cublas")
    assert not gemm_sm90.enabled() and not gemm_sm90.fused_enabled()


def test_route_reasons(monkeypatch):
    """Every case but the one the route covers keeps today's path, with a reason."""
    x, w, b, t = _cpu_inputs(bias=True)
    why = gemm_sm90.stats_route_why_not
    monkeypatch.delenv(gemm_sm90.ENV, raising=False)
    assert "sm90-fused" in why(x, w, b, t, True)
    monkeypatch.setenv(gemm_sm90.ENV, "sm90")
    assert "sm90-fused" in why(x, w, b, t, True)
    monkeypatch.setenv(gemm_sm90.ENV, "sm90-fused")
    assert "vocab-chunked" in why(x, w, b, t, False)
    assert "float16/bfloat16" in why(x.float(), w.float(), b, t, True)
    assert "float16/bfloat16" in why(x, w.half(), b, t, True)
    x7, w7, b7, t7 = _cpu_inputs(v=1003, bias=True)
    assert "multiples of 8" in why(x7, w7, b7, t7, True)
    x9, w9, _, t9 = _cpu_inputs(h=12)
    assert "multiples of 8" in why(x9, w9, None, t9, True)
    assert "float32 bias" in why(x, w, b.bfloat16(), t, True)
    assert "float32 bias" in why(x, w, torch.randn(2 * 1000)[::2], t, True)
    assert "int64 target" in why(x, w, b, t.int(), True)
    assert "compute capability 9.0" in why(x, w, b, t, True)  # a CPU tensor
    monkeypatch.setattr(gemm_sm90, "_stats_device_ok", lambda device: True)
    assert why(x, w, b, t, True) is None
    assert why(x, w, None, t, True) is None


@pytest.mark.parametrize("n,h,v,budget", [(8192, 4096, 128256, None), (8192, 4096, 128256, 520),
                                          (4096, 4096, 128256, None), (2100, 256, 1000, 5.2)])
def test_stats_plan_counts_partials(n, h, v, budget, monkeypatch):
    """The route's plan keeps whole rows and fits the budget with its partials; at Llama-3's
    shape the 512 MiB default takes 5 chunks of 1664 tokens (4 of 2048 without partials), 520
    MiB 4 of 2048."""
    b = chunked.budget_bytes(budget)
    extra = gemm_sm90.stats_partial_bytes(v)
    plan = chunked.plan_chunks(n, h, v, 2, b, True, extra)
    assert plan.full_rows
    assert plan.rows * (v * 2 + extra) + 64 * n + (2 << 20) <= b
    if (n, v) == (8192, 128256):
        assert plan.rows == (1664 if budget is None else 2048)
    monkeypatch.setenv(gemm_sm90.ENV, "sm90-fused")
    monkeypatch.setattr(gemm_sm90, "_stats_device_ok", lambda device: True)
    x = torch.empty(n, h, dtype=torch.bfloat16, device="meta")
    base = chunked.plan_chunks(n, h, v, 2, b, True)
    # Meta tensors have no storage: the route's alignment checks see data_ptr 0.
    w = torch.empty(v, h, dtype=torch.bfloat16, device="meta")
    t = torch.empty(n, dtype=torch.int64, device="meta")
    assert chunked.stats_plan(base, x, w, None, t, b, True) == plan


def test_stats_plan_falls_back_without_whole_rows(monkeypatch):
    """A budget that holds the fewest whole rows a chunk may have (here all 1024 tokens) only
    without the partials keeps today's path."""
    n, h, v = 1024, 64, 128256
    monkeypatch.setenv("FUSEDOPS_LCE_MIN_FULL_ROWS", str(n))
    monkeypatch.setenv(gemm_sm90.ENV, "sm90-fused")
    monkeypatch.setattr(gemm_sm90, "_stats_device_ok", lambda device: True)
    rows_bytes = n * v * 2
    b = rows_bytes + 64 * n + (2 << 20) + 1000  # whole rows fit, partials (8 MiB) do not
    base = chunked.plan_chunks(n, h, v, 2, b, True)
    assert base.full_rows
    x = torch.empty(n, h, dtype=torch.bfloat16, device="meta")
    w = torch.empty(v, h, dtype=torch.bfloat16, device="meta")
    t = torch.empty(n, dtype=torch.int64, device="meta")
    assert chunked.stats_plan(base, x, w, None, t, b, True) is None


def _emulated_op(calls):
    """lce_logits_ce_stats_sm90 in torch (CPU): z = round(x w^T), statistics from the rounded z."""
    def op(x, w, z, bias, target, softcap, partials, lse, zt, zsum):
        calls.append(z.shape[0])
        z.copy_((x.float() @ w.float().T).to(z.dtype))
        p, l_, t_, s_ = stats_emulated(z, bias, target, softcap)
        partials.copy_(p)
        lse.copy_(l_)
        zt.copy_(t_)
        zsum.copy_(s_)
    return op


@pytest.mark.parametrize("opts", [dict(), dict(bias=True, label_smoothing=0.1, softcap=5.0,
                                                z_loss=1e-3, reduction="sum")],
                         ids=["plain", "all_options"])
def test_fused_forward_wiring_cpu(opts, monkeypatch):
    """fused_forward's route on the CPU with the op emulated: the statistics op runs once per
    token chunk, the row kernel only in MODE_DZ, and loss and gradients equal today's path (the
    same math; only summation orders differ)."""
    opts = dict(opts)
    bias = opts.pop("bias", False)
    n, h, v = 2100, 64, 1000
    x, w, b, t = _cpu_inputs(n, h, v, bias=bias)
    t[::6] = -100
    b = None if b is None else b.bfloat16()

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
    monkeypatch.setenv(gemm_sm90.ENV, "sm90-fused")
    monkeypatch.setattr(gemm_sm90, "_stats_device_ok", lambda device: True)
    monkeypatch.setattr(gemm_sm90, "logits_ce_stats", _emulated_op(calls))
    real_rows = chunked._rows

    def rows(backend, *args):
        modes.append(args[-1])
        return real_rows(backend, *args)

    monkeypatch.setattr(chunked, "_rows", rows)
    ours = run()
    assert len(calls) == 2 and sum(calls) == n, calls  # two token chunks of whole rows
    assert set(modes) == {chunked.MODE_DZ} and len(modes) == 2, modes
    torch.testing.assert_close(ours[0], base[0], rtol=1e-5, atol=1e-5)
    for a, c in zip(ours[1:], base[1:], strict=True):
        diff = float((a.float() - c.float()).abs().max())
        assert diff <= 1e-2 * float(c.float().abs().max()), diff


# ---- GPU: the op -----------------------------------------------------------------------------

# (name, M, V, K, bias, softcap): ragged V (not a multiple of 256) and M (not of 128); a last
# tile of 8 columns; one row; many tiles per CTA; a padded z with an odd V (scalar bias at the
# end); K not a multiple of 64.
OP_CASES = [
    ("ragged", 300, 1000, 136, False, 0.0),
    ("ragged_bias_cap", 300, 1000, 136, True, 5.0),
    ("last_tile_8", 129, 264, 72, True, 0.0),
    ("one_row", 1, 8, 8, True, 30.0),
    ("persistent", 1000, 8448, 328, True, 0.0),
    ("odd_v_padded_z", 200, 523, 200, True, 10.0),
]


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("name,m,v,k,bias,softcap", OP_CASES, ids=[c[0] for c in OP_CASES])
def test_stats_epilogue(name, m, v, k, bias, softcap, dtype):
    g = torch.Generator(device="cuda").manual_seed(11)
    x = torch.randn(m, k, generator=g, device="cuda").to(dtype)
    w = (torch.randn(v, k, generator=g, device="cuda") * (3.0 / math.sqrt(k))).to(dtype)
    b = torch.randn(v, generator=g, device="cuda") * 0.5 if bias else None
    _, _, t, cap = _stats_inputs(m, v, bias=False, softcap=softcap, device="cuda")
    ld = (v + 7) // 8 * 8 + (16 if name.endswith("padded_z") else 0)
    guard = 7.0
    big = torch.full((m + 2, ld), guard, device="cuda", dtype=dtype)
    z = big[:m, :v]
    z.fill_(float("nan"))
    tiles = gemm_sm90.stats_tiles(v)
    partials = torch.full((m, tiles, 4), float("nan"), device="cuda")
    lse, zt, zsum = (torch.full((m,), float("nan"), device="cuda") for _ in range(3))
    gemm_sm90.logits_ce_stats(x, w, z, b, t, cap, partials, lse, zt, zsum)
    torch.cuda.synchronize()
    what = f"{name} {dtype} M={m} V={v} K={k}"
    # z: one rounding of the float32-accumulated product.
    ref = x.double() @ w.double().T
    mag = x.double().abs() @ w.double().abs().T
    unit = 2.0**-8 if dtype == torch.bfloat16 else 2.0**-11
    err = (z.double() - ref).abs()
    assert bool((err <= unit * ref.abs() + 2.0**-12 * mag).all()), f"{what}: z wrong"
    assert bool((big[:m, v:] == guard).all()) and bool((big[m:] == guard).all()), \
        f"{what}: wrote outside z"
    check_stats(partials, lse, zt, zsum, z, b, t, cap, what)


@pytest.mark.gpu
@needs_sm90
@needs_c
@pytest.mark.parametrize("bias,softcap", [(False, 0.0), (True, 5.0)])
def test_stats_match_row_kernel(bias, softcap):
    """The epilogue's lse, zt, zsum equal the row kernel's (MODE_FULL) on the same z within
    float32 summation order."""
    m, v, k = 300, 1000, 136
    g = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn(m, k, generator=g, device="cuda").bfloat16()
    w = (torch.randn(v, k, generator=g, device="cuda") / 4).bfloat16()
    b = torch.randn(v, generator=g, device="cuda") * 0.5 if bias else None
    t = torch.randint(0, v, (m,), generator=g, device="cuda")
    t[::4] = -100
    z = torch.empty(m, v, device="cuda", dtype=torch.bfloat16)
    partials = torch.empty(m, gemm_sm90.stats_tiles(v), 4, device="cuda")
    lse, zt, zsum = (torch.empty(m, device="cuda") for _ in range(3))
    gemm_sm90.logits_ce_stats(x, w, z, b, t, softcap, partials, lse, zt, zsum)
    r_lse, r_zt, r_zsum = (torch.zeros(m, device="cuda") for _ in range(3))
    torch.ops.fusedops.ce_rows_cuda(z.clone(), b, t, 0, v, torch.ones(m, device="cuda"), r_lse,
                                    r_lse, r_lse, r_zt, r_zsum, 0.0, 0.0, softcap,
                                    chunked.MODE_FULL, 90)
    torch.testing.assert_close(lse, r_lse, rtol=0, atol=1e-4)
    torch.testing.assert_close(zt, r_zt, rtol=0, atol=1e-5)
    torch.testing.assert_close(zsum, r_zsum, rtol=1e-5, atol=1e-3)


@pytest.mark.gpu
@needs_sm90
def test_stats_opcheck():
    m, v, k = 130, 264, 72
    x = torch.randn(m, k, device="cuda").bfloat16()
    w = torch.randn(v, k, device="cuda").bfloat16()
    args = (x, w, torch.empty(m, v, device="cuda", dtype=torch.bfloat16),
            torch.randn(v, device="cuda"), torch.randint(0, v, (m,), device="cuda"), 2.0,
            torch.empty(m, gemm_sm90.stats_tiles(v), 4, device="cuda"),
            torch.empty(m, device="cuda"), torch.empty(m, device="cuda"),
            torch.empty(m, device="cuda"))
    torch.library.opcheck(torch.ops.fusedops.lce_logits_ce_stats_sm90.default, args)


def _bad_stats_args():
    m, v, k = 64, 264, 64

    def base(**kw):
        d = dict(x=torch.randn(m, k, device="cuda").bfloat16(),
                 w=torch.randn(v, k, device="cuda").bfloat16(),
                 z=torch.empty(m, v, device="cuda", dtype=torch.bfloat16), bias=None,
                 target=torch.zeros(m, dtype=torch.int64, device="cuda"), softcap=0.0,
                 partials=torch.empty(m, 2, 4, device="cuda"), lse=torch.empty(m, device="cuda"),
                 zt=torch.empty(m, device="cuda"), zsum=torch.empty(m, device="cuda"))
        d.update(kw)
        return d

    return [
        # Shapes and floats in the messages: formatted as strings by the binding (streaming
        # them into the check crashed the process on the H200).
        ("partials shape", lambda: base(partials=torch.empty(m, 1, 4, device="cuda")),
         ValueError, r"partials must be.*got shape \(64, 1, 4\)"),
        ("partials dtype", lambda: base(partials=torch.empty(m, 2, 4, device="cuda").half()),
         TypeError, "partials must be float32"),
        ("target int32", lambda: base(target=torch.zeros(m, dtype=torch.int32, device="cuda")),
         TypeError, "int64"),
        ("bias dtype", lambda: base(bias=torch.zeros(v, device="cuda").half()), TypeError,
         "bias must be float32"),
        ("bias size", lambda: base(bias=torch.zeros(v + 1, device="cuda")), ValueError, "bias"),
        ("bias alignment", lambda: base(bias=torch.zeros(v + 1, device="cuda")[1:]), ValueError,
         "8-byte aligned"),
        ("lse size", lambda: base(lse=torch.empty(m - 1, device="cuda")), ValueError,
         r"lse must be .* got shape \(63\)"),
        ("softcap", lambda: base(softcap=-1.0), ValueError, "softcap .* got -1"),
        ("shapes", lambda: base(w=torch.randn(v, k + 8, device="cuda").bfloat16()), ValueError,
         "takes x"),
    ]


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("case", _bad_stats_args(), ids=[c[0] for c in _bad_stats_args()])
def test_stats_bad_arguments(case):
    _, make, exc, match = case
    with pytest.raises(exc, match=match):
        gemm_sm90.logits_ce_stats(**make())


# ---- GPU: the whole loss under FUSEDOPS_LCE_GEMM=sm90-fused -----------------------------------

# (name, N, H, V, budget MiB, options): one chunk; two token chunks (d_weight accumulated)
# with every option; fp16; a V that is not a multiple of 8 (route not taken, today's path).
LOSS_CASES = [
    ("plain", 1100, 256, 1000, None, dict(ignore_frac=0.2)),
    ("all_options_two_chunks", 2100, 256, 1000, 5.2,
     dict(bias=True, ignore_frac=0.2, label_smoothing=0.1, softcap=5.0, z_loss=1e-3,
          reduction="sum")),
    ("smoothing_zloss_mean", 1100, 256, 3000, None,
     dict(ignore_frac=0.1, label_smoothing=0.2, z_loss=1e-2, bias=True)),
    ("fp16", 1100, 256, 1000, None, dict(ignore_frac=0.2, bias=True, softcap=20.0)),
    ("v_not_multiple_of_8", 1100, 256, 1003, None, dict(ignore_frac=0.2)),
]
_ORACLE = {}


@pytest.mark.gpu
@needs_sm90
@needs_c
@pytest.mark.parametrize("name,n,h,v,budget,opts", LOSS_CASES, ids=[c[0] for c in LOSS_CASES])
def test_fused_route_oracle(name, n, h, v, budget, opts, monkeypatch):
    dtype = torch.float16 if name == "fp16" else torch.bfloat16
    case = O.Case((n,), h, v, dtype, "cuda", **opts)
    modes, active = [], [False]  # the row kernel's modes in our run (not the oracle's)
    real_rows = chunked._rows

    def rows(backend, *args):
        if active[0]:
            modes.append(args[-1])
        return real_rows(backend, *args)

    monkeypatch.setattr(chunked, "_rows", rows)
    monkeypatch.setenv(gemm_sm90.ENV, "sm90-fused")
    before = gemm_sm90.stats_calls

    def impl(x, w, t, b, **kw):
        active[0] = True
        try:
            return linear_cross_entropy(x, w, t, b, backend="cuda", memory_budget_mib=budget,
                                        **kw)
        finally:
            active[0] = False

    O.check(case, impl, _ORACLE)
    calls = gemm_sm90.stats_calls - before
    if v % 8:
        assert calls == 0 and chunked.MODE_DZ not in modes, (calls, modes)
        return
    chunks = 2 if budget is not None else 1
    assert calls == chunks, f"the statistics epilogue ran {calls} times, want {chunks}"
    assert modes and set(modes) == {chunked.MODE_DZ}, modes


@pytest.mark.gpu
@needs_sm90
@needs_c
def test_fused_route_matches_default(monkeypatch):
    """Loss and gradients of the route next to today's path on the same inputs (bias, softcap,
    ignore_index): the statistics differ only in summation order."""
    g = torch.Generator(device="cuda").manual_seed(3)
    n, h, v = 2100, 256, 1000
    x = torch.randn(n, h, generator=g, device="cuda").bfloat16()
    w = (torch.randn(v, h, generator=g, device="cuda") / 8).bfloat16()
    b = (torch.randn(v, generator=g, device="cuda") * 0.3).bfloat16()
    t = torch.randint(0, v, (n,), generator=g, device="cuda")
    t[::5] = -100

    def run():
        xr, wr, br = (a.clone().requires_grad_() for a in (x, w, b))
        loss = linear_cross_entropy(xr, wr, t, br, backend="cuda", softcap=10.0,
                                    label_smoothing=0.1, memory_budget_mib=5.2)
        loss.backward()
        return loss.detach(), xr.grad, wr.grad, br.grad

    monkeypatch.delenv(gemm_sm90.ENV, raising=False)
    base = run()
    monkeypatch.setenv(gemm_sm90.ENV, "sm90-fused")
    before = gemm_sm90.stats_calls
    ours = run()
    assert gemm_sm90.stats_calls - before == 2
    torch.testing.assert_close(ours[0], base[0], rtol=1e-4, atol=1e-4)
    for name, a, c in zip(("d_hidden", "d_weight", "d_bias"), ours[1:], base[1:], strict=True):
        diff = float((a.float() - c.float()).abs().max())
        scale = float(c.float().abs().max())
        assert scale > 0 and diff <= 2e-2 * scale, f"{name}: max diff {diff} at max {scale}"
