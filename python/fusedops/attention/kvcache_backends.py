"""The backends of attention_decode (attention over a KV cache) and the order auto tries."""

from __future__ import annotations

import os

import torch

from fusedops.attention.backends import _triton_limits  # the same head-dim limit
from fusedops.dispatch import Backend, InputSig, OpBackends, register

_HALF = (torch.float16, torch.bfloat16)
# One CUDA kernel (csrc/attention_decode/: cp.async K/V tiles, mma.sync for QK^T and PV, the
# splits merged inside the kernel by the last split to finish), compiled into the sm_80 and the
# sm_90a device code of the extension. cuda-sm90 is that kernel on compute capability 9.0 (its
# sm_90a build), not a Hopper-specific design; cuda-sm80 runs it on 8.x (and on 9.0 when
# forced). It passes the decode parity tests and compute-sanitizer on the H200 but reads K/V at
# 0.83-1.09x the Triton kernels' bandwidth there, below it in most rows
# (benchmarks/results/attention_decode.jsonl, git e05e861: 3686 against 3990 GB/s at batch 1 with
# 128k keys, 4110 against 4435 at batch 64 with 32k), so both are offered only when
# FUSEDOPS_ATTN_DECODE_CUDA=1 is set before fusedops is imported.
CUDA_ENABLED = os.environ.get("FUSEDOPS_ATTN_DECODE_CUDA", "0") == "1"
_SLOWER = ("the CUDA decode kernel is slower than the Triton one on the H200 (0.83-1.09x its "
           "bandwidth, below it in most cases); set FUSEDOPS_ATTN_DECODE_CUDA=1 before importing "
           "fusedops to use it")
CUDA_NAMES = ("cuda-sm90", "cuda-sm80")
CUDA_HEAD_DIMS = (64, 128)
CUDA_MAX_ROWS = 16  # (Hq / Hkv) * Sq of its instantiations


def _cuda_limits(sig: InputSig) -> str | None:
    if sig.inner_dim not in CUDA_HEAD_DIMS:
        return (f"head dim {sig.inner_dim}: the CUDA decode kernel is built for 64 and 128 "
                "(Triton runs the others)")
    return None


BACKENDS = (
    Backend("cuda-sm90", "cuda", _HALF, arch=90, cc_range=((9, 0), (9, 0)),
            limits=_cuda_limits, unbuilt=None if CUDA_ENABLED else _SLOWER,
            summary="cuda-sm80's split-KV decode kernel built for sm_90a (cp.async, mma.sync; "
                    "no TMA or wgmma), head dims 64 and 128, (Hq / Hkv) * Sq <= 16; opt-in "
                    "(slower than Triton)"),
    Backend("cuda-sm80", "cuda", _HALF, arch=80, cc_range=((8, 0), (9, 0)),
            limits=_cuda_limits, unbuilt=None if CUDA_ENABLED else _SLOWER,
            summary="split-KV decode in one launch: cp.async K/V tiles (3 stages), mma.sync, "
                    "splits merged by the last to finish; head dims 64 and 128, "
                    "(Hq / Hkv) * Sq <= 16; opt-in (slower than Triton)"),
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
    # The CUDA entries are refused unless enabled (slower than Triton on the H200), so Triton
    # runs on GPUs by default.
    return cuda + ["triton", "torch"]


TABLE = register(OpBackends("attention_decode", "head dim", BACKENDS, order))
