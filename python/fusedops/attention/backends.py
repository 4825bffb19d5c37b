"""The backends of attention: what each supports and the order auto dispatch tries."""

from __future__ import annotations

import torch

from fusedops import dispatch
from fusedops.dispatch import Backend, InputSig, OpBackends, register

_HALF = (torch.float16, torch.bfloat16)
CUDA_HEAD_DIMS = (64, 128)  # the head dims the CUDA kernels are instantiated for


def _cuda_limits(sig: InputSig) -> str | None:
    if sig.inner_dim not in CUDA_HEAD_DIMS:
        return (f"head dim {sig.inner_dim}: the CUDA attention kernels are built for "
                f"{' and '.join(map(str, CUDA_HEAD_DIMS))} (Triton runs the others)")
    return None


def _triton_limits(sig: InputSig) -> str | None:
    if sig.inner_dim > 256:
        return f"head dim {sig.inner_dim} is above 256"
    return None


BACKENDS = (
    Backend("cuda-sm90", "cuda", _HALF, arch=90, cc_range=((9, 0), (9, 0)),
            limits=_cuda_limits, summary="Hopper kernels (wgmma, TMA)",
            unbuilt="no Hopper (wgmma/TMA) attention kernel yet (cuda-sm80 runs on Hopper "
                    "GPUs)"),
    Backend("cuda-sm80", "cuda", _HALF, arch=80, cc_range=((8, 0), (9, 0)),
            limits=_cuda_limits,
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
    if (not forced_sm80 and dispatch.capability(sig) >= (9, 0)
            and not (sig.inner_dim == 128 or (sig.inner_dim == 64 and sig.causal))):
        # On the H200 a forward + backward step of the sm80 kernels is faster than Triton's at
        # D=128 (5-6%) and at D=64 causal (4%), 7% slower at D=64 non-causal (L=4096, rows
        # with runs 753fb837 and d21bd3e1 in benchmarks/results/attention.jsonl), and they
        # have no other head dims: Triton first in those other cases only.
        return ["triton"] + cuda + ["torch"]
    return cuda + ["triton", "torch"]


TABLE = register(OpBackends("attention", "head dim", BACKENDS, order))
