"""The Hopper forward's measurable variants against the oracle rule on the GPU: the polynomial
exponentials (FUSEDOPS_ATTN_SM90_EXP2=poly), the 192-query tiles (FUSEDOPS_ATTN_SM90_TILE=m192,
three consumer warpgroups, D=64) and the q-blocks' alignment (FUSEDOPS_ATTN_SM90_QALIGN), under
both overlapped schedules, masks and rows that see no key included (the default variants run in
test_attention.py's parity suite)."""

import attn_oracle as A
import pytest
import torch
from test_attention import FEATURES, poison_cuda_outputs

from fusedops import _ext

ON_SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
NEEDS_SM90 = pytest.mark.skipif(not (_ext.available() and ON_SM90),
                                reason="needs fusedops._C and a compute capability 9.0 GPU")
# (B, Sq, Sk, Hq, Hkv, D): tail tiles in both directions (1025 = 5 x 192 + 65 = 8 x 128 + 1),
# GQA; 211 x 97 causal leaves rows without keys (bottom-right alignment).
SHAPES = [(2, 1025, 1025, 4, 4, 64), (2, 97, 211, 4, 2, 128), (2, 211, 97, 4, 1, 64)]
VARIANTS = {
    "poly": {"FUSEDOPS_ATTN_SM90_EXP2": "poly"},
    "m192": {"FUSEDOPS_ATTN_SM90_TILE": "m192"},
    "m192-poly": {"FUSEDOPS_ATTN_SM90_TILE": "m192", "FUSEDOPS_ATTN_SM90_EXP2": "poly"},
    # q-blocks counted from the sequence's start under a causal mask (the default there counts
    # them from its end), and from its end without one
    "m192-qstart": {"FUSEDOPS_ATTN_SM90_TILE": "m192", "FUSEDOPS_ATTN_SM90_QALIGN": "start"},
    "qstart": {"FUSEDOPS_ATTN_SM90_QALIGN": "start"},
    "qend": {"FUSEDOPS_ATTN_SM90_QALIGN": "end"},
}


def _params():
    out = []
    for variant in VARIANTS:
        for dtype in (torch.bfloat16, torch.float16):
            for shape in SHAPES:
                if variant.startswith("m192") and shape[-1] != 64:
                    continue
                for feature in ("plain", "causal", "varlen_everything"):
                    out.append(pytest.param(
                        variant, dtype, shape, feature, marks=[pytest.mark.gpu, NEEDS_SM90],
                        id=f"{variant}-{str(dtype)[6:]}-{'x'.join(map(str, shape))}-{feature}"))
    return out


_CACHE = {}


@pytest.mark.parametrize("variant,dtype,shape,feature", _params())
@pytest.mark.parametrize("schedule", ["overlap", "pingpong"])
def test_sm90_variant_parity(variant, dtype, shape, feature, schedule, monkeypatch):
    for k, v in VARIANTS[variant].items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("FUSEDOPS_ATTN_SM90_SCHEDULE", schedule)
    poison_cuda_outputs(monkeypatch)  # an unwritten row fails, whatever the last test left
    case = A.Case(*shape, dtype, "cuda", **FEATURES[feature])
    A.check(case, "cuda-sm90", _CACHE)


def _jump_inputs(causal, seed=7):
    """Scores that jump up along the keys: full key tiles take the forward's speculative
    exponentials (base: the running maximum) once a row has one, and a tile with a larger score
    must be redone exactly. Key 300 (tile 2) scores up to about 6x the others: the maximum moves
    by more than kSlack. Key 700 (tile 5) about 40x: 2^(x - m) overflows float32, so the
    speculative pass holds infinities. Batch 1 ramps every key's scale from 0.5 to 3 (the maximum
    creeps up tile by tile), and its key 900 is scaled by 1e-3 at a tile boundary. Batch 2's keys
    after the first tile score about twice as high (they settle above the first tile's maximum,
    by less than kSlack for many)."""
    g = torch.Generator().manual_seed(seed)
    sq, sk = (200, 1100) if causal else (1024, 1024)
    q = torch.randn(3, sq, 2, 128, generator=g)
    k = torch.randn(3, sk, 2, 128, generator=g)
    v = torch.randn(3, sk, 2, 128, generator=g)
    scale = torch.ones(3, sk, 2, 1)
    scale[:2, 300] = 6.0
    scale[:2, 700] = 40.0
    scale[1] *= torch.linspace(0.5, 3.0, sk)[:, None, None]
    scale[1, 900] *= 1e-3
    scale[2, 128:] = 2.0
    return q, k * scale, v, torch.randn(q.shape, generator=g)


# (head dim, launch overrides): D=64 in its 192- and 128-query tiles, D=128 with and without
# K/V multicast (required: the launch fails where it cannot apply).
_JUMP_LAUNCHES = {
    "d64": (64, {}), "d64-m128": (64, {"FUSEDOPS_ATTN_SM90_TILE": "m128"}),
    "d128": (128, {"FUSEDOPS_ATTN_SM90_MULTICAST": "0"}),
    "d128-multicast": (128, {"FUSEDOPS_ATTN_SM90_MULTICAST": "require"}),
    # several work tiles per CTA (spec_ok starts over with each), and the 176-key tiles
    "d64-3cta": (64, {"FUSEDOPS_ATTN_SM90_PERSISTENT": "3"}),
    "d128-3cta": (128, {"FUSEDOPS_ATTN_SM90_PERSISTENT": "3", "FUSEDOPS_ATTN_SM90_MULTICAST": "0"}),
    "d128-bn176": (128, {"FUSEDOPS_ATTN_SM90_BLOCK_N": "176"}),
}


@pytest.mark.gpu
@NEEDS_SM90
@pytest.mark.parametrize("launch", list(_JUMP_LAUNCHES))
@pytest.mark.parametrize("schedule", ["serial", "overlap", "pingpong"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_sm90_score_jumps(launch, schedule, causal, dtype, monkeypatch):
    D, env = _JUMP_LAUNCHES[launch]
    if causal and "multicast" in launch:
        pytest.skip("multicast applies only without a mask")
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("FUSEDOPS_ATTN_SM90_SCHEDULE", schedule)
    poison_cuda_outputs(monkeypatch)
    q, k, v, dout = (t[..., :D].contiguous() for t in _jump_inputs(causal))
    inp = dict(q=q.cuda(), k=k.cuda(), v=v.cuda(), dout=dout.cuda(), extra={})
    case = A.Case(3, q.shape[1], k.shape[1], 2, 2, D, dtype, "cuda", causal=causal)
    ref = A.run(lambda *a, **kw: A.attention(*a, **kw, return_lse=True, backend="torch"), inp,
                case, torch.float64)
    eager = A.run(A.eager_attention, inp, case, dtype)
    got = A.run(lambda *a, **kw: A.attention(*a, **kw, return_lse=True, backend="cuda-sm90"),
                inp, case, dtype)
    for name in ("out", "lse"):
        e_got, e_eager = A.scaled_err(got[name], ref[name]), A.scaled_err(eager[name], ref[name])
        assert e_got <= 2 * e_eager + A.SLACK[dtype], f"{name}: {e_got:.3e} vs eager {e_eager:.3e}"
    assert torch.isfinite(got["out"]).all()
