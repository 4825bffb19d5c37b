"""The backends of swiglu (silu(gate) * up, the gated MLP's activation) and the order auto tries."""

from __future__ import annotations

import torch

from fusedops.dispatch import Backend, OpBackends, register

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)

# An elementwise op: one read of gate and up and one write forward, one read of gate, up and
# the incoming gradient and two writes backward. Triton reaches the memory bandwidth on such
# loops, so there is no CUDA kernel.
BACKENDS = (
    Backend("triton", "triton", _FLOATS,
            summary="one elementwise kernel each way, float32 arithmetic, one rounding; the "
                    "backward may write d_gate and d_up over gate and up (inplace_backward)"),
    Backend("torch", "torch", _FLOATS + (torch.float64,),
            summary="plain PyTorch in slices of 2^22 elements: the CPU path and the test oracle"),
)


def order(sig, forced_sm80: bool) -> list[str]:
    return ["triton", "torch"] if sig.device_type == "cuda" else ["torch"]


TABLE = register(OpBackends("swiglu", "width", BACKENDS, order))
