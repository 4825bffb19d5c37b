"""The backends of linear_cross_entropy: what each supports and the order auto dispatch tries."""

from __future__ import annotations

import torch

from fusedops.dispatch import Backend, InputSig, OpBackends, register

_HALF = (torch.float16, torch.bfloat16)


def _cuda_limits(sig: InputSig) -> str | None:
    if sig.inner_dim % 8 != 0:  # every global load is a 16-byte copy of 8 elements
        return f"hidden size {sig.inner_dim} is not a multiple of 8 (16-byte rows needed)"
    return None


BACKENDS = (
    Backend("cuda-sm90", "cuda", _HALF, arch=90, cc_range=((9, 0), (9, 0)), limits=_cuda_limits,
            summary="cuBLAS GEMMs and the Hopper-tuned row kernel; the mma.sync kernels "
                    "with a 4-stage pipeline (FUSEDOPS_LCE_ALGO=recompute)"),
    Backend("cuda-sm80", "cuda", _HALF, arch=80, cc_range=((8, 0), (9, 0)),
            limits=_cuda_limits,
            summary="cuBLAS GEMMs and the row kernel; mma.sync + cp.async kernels "
                    "(FUSEDOPS_LCE_ALGO=recompute)"),
    Backend("triton", "triton", (torch.float32, torch.float16, torch.bfloat16),
            summary="cuBLAS GEMMs and a Triton row kernel; Triton GEMM kernels "
                    "(FUSEDOPS_LCE_ALGO=recompute)"),
    Backend("torch", "torch", (torch.float32, torch.float16, torch.bfloat16, torch.float64),
            summary="plain PyTorch in chunks: the CPU path and the test oracle"),
)


def order(sig: InputSig, forced_sm80: bool) -> list[str]:
    # The mean/sum path (the training call) is cuBLAS GEMMs plus a row kernel on every backend:
    # on the H200 at the Llama-3 shape 39.6 ms with cuda-sm90, 41.4 with cuda-sm80 and 39.9
    # with triton (rows of git 6452815 in benchmarks/results/linear_ce.jsonl), so the CUDA
    # family that matches the GPU goes first (no JIT compilation), Triton next (float32, hidden
    # sizes that are not a multiple of 8), the torch reference last.
    cuda = ["cuda-sm80"] if forced_sm80 else ["cuda-sm90", "cuda-sm80"]
    triton = ["triton"] if sig.device_type == "cuda" else []
    return cuda + triton + ["torch"]


TABLE = register(OpBackends("linear_ce", "hidden size", BACKENDS, order))
