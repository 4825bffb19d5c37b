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
