"""The backends of attention: what each supports and the order auto dispatch tries."""

from __future__ import annotations

import torch

from fusedops import dispatch
from fusedops.dispatch import Backend, InputSig, OpBackends, register

_HALF = (torch.float16, torch.bfloat16)
# The head dims each CUDA family's kernels are instantiated for. cuda-sm90's forward also takes
# 256; no CUDA backward is built there, so its backward is Triton's (_sm90_bwd_by).
CUDA_HEAD_DIMS = {"cuda-sm90": (64, 128, 256), "cuda-sm80": (64, 128)}


def _dims(dims) -> str:
    return ", ".join(map(str, dims[:-1])) + " and " + str(dims[-1])


def _cuda_limits(name: str):
    dims = CUDA_HEAD_DIMS[name]

    def limits(sig: InputSig) -> str | None:
        if sig.inner_dim not in dims:
            also = ("; on Hopper cuda-sm90's forward takes 256" if sig.inner_dim == 256
                    and name != "cuda-sm90" else "")
            return (f"head dim {sig.inner_dim}: the {name} kernels are built for {_dims(dims)} "
                    f"(Triton runs the others{also})")
        return None
    return limits


def _sm90_bwd_by(head_dim: int) -> str | None:
    """cuda-sm90's backward: its own kernels at head dims 64 and 128 (the C++ binding runs the
    sm80 ones instead under FUSEDOPS_ATTN_SM90_BWD=sm80 or for overlapping rows), else Triton's,
    which reads the same lse (float32 (Hq, total_q), natural log, -inf for rows that see no key)."""
    return None if head_dim in CUDA_HEAD_DIMS["cuda-sm80"] else "triton"


def _triton_limits(sig: InputSig) -> str | None:
    if sig.inner_dim > 256:
        return f"head dim {sig.inner_dim} is above 256"
    return None


BACKENDS = (
    Backend("cuda-sm90", "cuda", _HALF, arch=90, cc_range=((9, 0), (9, 0)),
            limits=_cuda_limits("cuda-sm90"), bwd_by=_sm90_bwd_by,
            summary="Hopper kernels (wgmma + TMA, a producer warpgroup and two consumer "
                    "warpgroups): forward at head dims 64, 128 and 256, backward at 64 and 128 "
                    "(dQ by float32 reductions, or deterministic by reductions in a fixed "
                    "order), Triton's backward at 256"),
    Backend("cuda-sm80", "cuda", _HALF, arch=80, cc_range=((8, 0), (9, 0)),
            limits=_cuda_limits("cuda-sm80"),
            summary="mma.sync + cp.async kernels, head dims 64 and 128; dQ by float32 atomics "
                    "or a deterministic separate pass"),
    Backend("triton", "triton", (torch.float32, torch.float16, torch.bfloat16),
            limits=_triton_limits,
            summary="Triton kernels, head dims up to 256; dQ by a deterministic separate pass "
                    "or float32 atomics"),
    Backend("torch", "torch", (torch.float32, torch.float16, torch.bfloat16, torch.float64),
            summary="plain PyTorch over query blocks: the CPU path and the test oracle"),
)


def order(sig: InputSig, forced_sm80: bool) -> list[str]:
    cuda = ["cuda-sm80"] if forced_sm80 else ["cuda-sm90", "cuda-sm80"]
    if sig.device_type != "cuda":
        return cuda + ["torch"]
    hopper = torch.cuda.is_available() and dispatch.capability(sig) >= (9, 0)
    if hopper and sig.inner_dim in CUDA_HEAD_DIMS["cuda-sm90"] and not forced_sm80:
        # At D=64 and 128 the sm90 forward is 1.2-1.9x the sm80 one from L=4096, and the sm90
        # backward 1.6x the sm80 one from L=4096, 1.3-1.5x at L=1024 (rows of git bc3f69e and
        # 657fd6b in benchmarks/results/attention.jsonl), both ahead of Triton's. At D=256 the
        # sm90 forward is 2.2-2.3x Triton's (763 against 332 TFLOP/s at L=4096, 633 against 294
        # causal, the D=256 rows of git 657fd6b) and the backward is Triton's either way.
        return cuda + ["triton", "torch"]
    if hopper and not forced_sm80:  # other head dims: no CUDA kernels
        return ["triton"] + cuda + ["torch"]
    # Ampere, or FUSEDOPS_CUDA_ARCH=sm80 (the sm80 kernels asked for by name).
    return cuda + ["triton", "torch"]


TABLE = register(OpBackends("attention", "head dim", BACKENDS, order))
