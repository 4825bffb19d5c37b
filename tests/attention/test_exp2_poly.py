"""A float32 model of ex2_poly (csrc/device_utils.cuh), the polynomial 2^x of the Hopper forward's
softmax: its coefficients and rounding constant are read from the header, and the model repeats the
device steps (max.NaN clamp, round-to-nearest sum, exact fraction, FFMA Horner, exponent-bits
scale) in float32, so that the error figures quoted in the header are checked here on the CPU."""

import math
import pathlib
import re

import pytest

np = pytest.importorskip("numpy")

HEADER = pathlib.Path(__file__).resolve().parents[2] / "csrc" / "device_utils.cuh"
K_SLACK = 8.0  # attention_common.cuh: the softmax's x <= kSlack (lazy rescaling)


def _constants():
    text = HEADER.read_text()
    body = text[text.index("float ex2_poly(float x)"):]
    body = body[:body.index("\n}\n")]
    k_round = float(re.search(r"kRound = ([0-9.]+)f;", body).group(1))
    deg3 = body[body.index("kDegree == 3) {"):body.index("} else {")]
    deg4 = body[body.index("} else {"):]
    lit = r"(-?[0-9]+\.[0-9]+(?:e-?[0-9]+)?)f"
    coef = {3: [float(c) for c in re.findall(lit, deg3)],
            4: [float(c) for c in re.findall(lit, deg4.split("return")[0])]}
    return k_round, coef  # coefficients from the highest power down


K_ROUND, COEF = _constants()


def _fma(a, b, c):
    # a * b is exact in float64 (two 24-bit significands); one rounding to float64, then float32.
    return (a.astype(np.float64) * b + c).astype(np.float32)


def ex2_poly(x, degree):
    """The device function's steps on float32 arrays."""
    x = np.asarray(x, dtype=np.float32)
    f32 = np.float32
    xc = np.where(np.isnan(x), x, np.maximum(x, f32(-127.0)))  # max.NaN.f32
    t = xc + f32(K_ROUND)  # float32 add, round to nearest even
    f = xc - (t - f32(K_ROUND))
    c = [f32(v) for v in COEF[degree]]
    p = _fma(f, c[0], c[1])
    for ck in c[2:]:
        p = _fma(p, f, ck)
    scale = (t.view(np.uint32) << np.uint32(23)).view(np.float32)
    with np.errstate(invalid="ignore"):
        return p * scale


def _grid():
    # Dense over [-126, kSlack], plus every integer and half-integer (the reduction's seams) and
    # their float32 neighbours.
    dense = np.linspace(-126.0, K_SLACK, 1 << 22, dtype=np.float32)
    seams = np.arange(-126.0, K_SLACK + 0.25, 0.5, dtype=np.float32)
    near = np.concatenate([np.nextafter(seams, np.float32(-np.inf)), seams,
                           np.nextafter(seams, np.float32(np.inf))])
    x = np.concatenate([dense, near])
    return x[(x >= -126.0) & (x <= K_SLACK)]


def max_rel_error(degree):
    x = _grid()
    ref = np.exp2(x.astype(np.float64))
    return float(np.max(np.abs(ex2_poly(x, degree).astype(np.float64) / ref - 1.0)))


def test_coefficients_parsed():
    assert K_ROUND == 1.5 * 2**23 + 127
    assert len(COEF[3]) == 4 and len(COEF[4]) == 5
    # Near ln2^k / k!: a sanity check of the parse, not of the fit.
    for deg in (3, 4):
        for k, c in enumerate(reversed(COEF[deg])):
            assert abs(c - math.log(2) ** k / math.factorial(k)) < 0.01


@pytest.mark.parametrize("degree,bound", [(3, 8e-5), (4, 3e-6)])
def test_relative_error(degree, bound):
    # The header quotes 7.5e-5 (degree 3) and 2.7e-6 (degree 4) over [-126, kSlack].
    assert max_rel_error(degree) < bound


def _special_failures(fn):
    """What a 2^x implementation gets wrong at the inputs the softmax can pass besides ordinary
    scores; empty for a correct one."""
    f32 = np.float32
    bad = []
    with np.errstate(all="ignore"):
        # -inf (masked scores) and everything at or below -127 give exactly +0.
        low = np.array([-np.inf, -3.4e38, -1e6, -1000.0, -128.0, -127.5, -127.0], dtype=f32)
        out = fn(low)
        if not (np.all(out == 0.0) and not np.any(np.signbit(out))):
            bad.append(f"not +0 at or below -127: {out}")
        # Between -127 and -126: tiny, finite, non-negative (no garbage from the exponent bits).
        out = fn(np.linspace(-127.0, -126.0, 4097, dtype=f32))
        if not (np.all(np.isfinite(out)) and np.all(out >= 0.0) and np.all(out < 2.0 ** -125)):
            bad.append("garbage between -127 and -126")
        # NaN stays NaN (as MUFU.EX2 would give).
        if not np.isnan(fn(np.array([np.nan], dtype=f32))[0]):
            bad.append("NaN not kept")
    return bad


def _naive_ex2(x):
    """A deliberately wrong exponent-bit trick: j = floor(x) added into the bits of 2^f with no
    clamp, the way an unguarded Cody-Waite reduction is often written."""
    x = np.asarray(x, dtype=np.float32)
    j = np.floor(x)
    f = x - j
    p = np.float32(1.0) + f * (np.float32(0.6931472) + f * np.float32(0.2402265))
    jb = np.nan_to_num(j, nan=0.0, neginf=-(2.0**31), posinf=2.0**31 - 1).astype(np.int64)
    bits = (p.view(np.uint32).astype(np.int64) + (jb << 23)) & 0xFFFFFFFF
    return bits.astype(np.uint32).view(np.float32)


@pytest.mark.parametrize("degree", [3, 4])
def test_special_inputs(degree):
    assert _special_failures(lambda x: ex2_poly(x, degree)) == []


def test_special_inputs_reject_a_naive_exponent_trick():
    # The check above must see what an unclamped exponent-bit trick gives for -inf and deep
    # underflow (garbage bits, not 0), so that it is not passing vacuously.
    assert _special_failures(_naive_ex2)


@pytest.mark.parametrize("degree", [3, 4])
def test_top_of_range(degree):
    f32 = np.float32
    # The top of the range (the lazy rescaling lets x reach kSlack) stays accurate.
    top = np.array([0.0, 1.0, 7.5, K_SLACK], dtype=f32)
    rel = ex2_poly(top, degree).astype(np.float64) / np.exp2(top.astype(np.float64)) - 1.0
    assert np.all(np.abs(rel) < 1e-4)


def _rounding_mismatch(degree, dtype):
    """Fraction of P values whose rounding to `dtype` differs from the rounding of the exact 2^x,
    and the largest difference in units of the last place, over x in [-20, 0] (the probabilities
    that matter)."""
    x = np.linspace(-20.0, 0.0, 1 << 20, dtype=np.float32)
    exact = np.exp2(x.astype(np.float64)).astype(dtype)
    got = ex2_poly(x, degree).astype(dtype)
    diff = exact != got
    ulp = np.abs(exact.astype(np.float64) - got.astype(np.float64)) / np.spacing(exact)
    return float(diff.mean()), float(ulp.max())


@pytest.mark.parametrize("degree", [3, 4])
def test_fp16_rounding(degree):
    # P is rounded to bf16/fp16 right after the exponential: with degree 3 a few percent of fp16
    # values land one ulp from the exact value's rounding, never more (numbers: docs).
    frac, ulps = _rounding_mismatch(degree, np.float16)
    assert ulps <= 1.0 and frac < (0.2 if degree == 3 else 0.01)

