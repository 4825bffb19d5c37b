"""The backends of attention_decode (attention over a KV cache) and the order auto tries."""

from __future__ import annotations

import torch

from fusedops.dispatch import Backend, InputSig, OpBackends, register

_HALF = (torch.float16, torch.bfloat16)
_UNBUILT = ("no CUDA decode kernels are built yet (the Triton split-KV kernels run on these "
            "GPUs)")


def _triton_limits(sig: InputSig) -> str | None:
    if sig.inner_dim > 256:
        return f"head dim {sig.inner_dim} is above 256"
    return None


BACKENDS = (
    Backend("cuda-sm90", "cuda", _HALF, arch=90, cc_range=((9, 0), (9, 0)), unbuilt=_UNBUILT,
            summary="declared, not built: split-KV decode for Hopper"),
    Backend("cuda-sm80", "cuda", _HALF, arch=80, cc_range=((8, 0), (9, 0)), unbuilt=_UNBUILT,
            summary="declared, not built: split-KV decode with cp.async loads"),
    Backend("triton", "triton", (torch.float32, torch.float16, torch.bfloat16),
            limits=_triton_limits,
            summary="Triton split-KV (flash-decoding) kernels: the GQA group as one query tile, "
                    "contiguous or paged cache, an lse-weighted combine; head dims up to 256"),
    Backend("torch", "torch", (torch.float32, torch.float16, torch.bfloat16, torch.float64),
            summary="plain PyTorch over key chunks: the CPU path and the test oracle"),
)


def order(sig: InputSig, forced_sm80: bool) -> list[str]:
    cuda = ["cuda-sm80"] if forced_sm80 else ["cuda-sm90", "cuda-sm80"]
    if sig.device_type != "cuda":
        return cuda + ["torch"]
    # Not measured yet: the CUDA entries are declared but unbuilt, so Triton runs on GPUs.
    return cuda + ["triton", "torch"]


TABLE = register(OpBackends("attention_decode", "head dim", BACKENDS, order))
