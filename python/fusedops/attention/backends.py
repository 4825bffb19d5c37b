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
            limits=_cuda_limits,
            summary="Hopper forward (wgmma + TMA, a producer warpgroup and two consumer "
                    "warpgroups), head dims 64 and 128; the backward is cuda-sm80's"),
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
    hopper = torch.cuda.is_available() and dispatch.capability(sig) >= (9, 0)
    if hopper and sig.inner_dim in CUDA_HEAD_DIMS and not forced_sm80:
        # The sm90 forward is 1.2-1.9x the sm80 one at D=64 and D=128 from L=4096 (equal at
        # D=64 causal L=1024) and the backward is the same kernel, so a step is faster than
        # cuda-sm80's everywhere, and than Triton's (forward 410 against 324 TFLOP/s at D=64
        # L=4096, where Triton's backward is 2% ahead): rows of runs 161853ac and 753fb837 in
        # benchmarks/results/attention.jsonl.
        return cuda + ["triton", "torch"]
    if hopper and not forced_sm80:  # other head dims: no CUDA kernels
        return ["triton"] + cuda + ["torch"]
    # Ampere, or FUSEDOPS_CUDA_ARCH=sm80 (the sm80 kernels asked for by name).
    return cuda + ["triton", "torch"]


TABLE = register(OpBackends("attention", "head dim", BACKENDS, order))
