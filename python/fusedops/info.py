"""`python -m fusedops.info`: versions, the GPU, and which backends can run here (and why not)."""

from __future__ import annotations

import os
import platform

import torch

from fusedops import __version__, _ext, dispatch


def report() -> str:
    lines = [f"fusedops {__version__}", f"python {platform.python_version()}",
             f"torch {torch.__version__} (CUDA {torch.version.cuda})"]
    try:
        import triton
        lines.append(f"triton {triton.__version__}")
    except ImportError as exc:
        lines.append(f"triton: not importable ({exc})")
    if _ext.available():
        lines.append(f"extension fusedops._C: built for {';'.join(_ext.built_archs())}")
    else:
        lines.append(f"extension fusedops._C: not available ({_ext.EXT_ERROR})")
    if torch.cuda.is_available():
        idx = torch.cuda.current_device()
        props = torch.cuda.get_device_properties(idx)
        lines.append(f"GPU {idx}: {props.name}, compute capability {props.major}.{props.minor}, "
                     f"{props.multi_processor_count} SMs, {props.total_memory / 2**30:.0f} GiB")
        device = ("cuda", idx)
    else:
        lines.append("GPU: none visible (the torch backend runs on the CPU)")
        device = ("cpu", -1)
    for name, var in (("FUSEDOPS_BACKEND", "auto"), ("FUSEDOPS_CUDA_ARCH", "auto")):
        lines.append(f"{name}={os.environ.get(name, var)}")
    for op, inner in (("linear_ce", 4096), ("attention", 128)):
        what = "hidden size" if op == "linear_ce" else "head dim"
        lines.append(f"{op} backends for bfloat16 inputs on {device[0]} ({what} {inner}):")
        sig = dispatch.InputSig(op, device[0], device[1], torch.bfloat16, inner)
        for name in dispatch.BACKENDS:
            why = dispatch.why_not(name, sig)
            lines.append(f"  {name:10} {'available' if why is None else 'no: ' + why}")
        try:
            chosen = dispatch.select_name(op, device[0], device[1], "bfloat16", inner, None)
            lines.append(f"  default -> {chosen}")
        except (RuntimeError, ValueError) as exc:
            lines.append(f"  default -> error: {exc}")
    if device[0] == "cuda" and torch.cuda.get_device_capability(device[1]) == (9, 0):
        lines.append("note: linear_ce cuda-sm90 = cuBLAS GEMMs + our Hopper-tuned row kernel for "
                     "mean/sum losses; the recompute path (reduction='none', return_lse) uses the "
                     "mma.sync kernels (no wgmma). FUSEDOPS_CUDA_ARCH=sm80 selects the Ampere "
                     "family.")
        lines.append("note: attention has no Hopper kernel yet: on this GPU the CUDA backend is "
                     "cuda-sm80 (the Ampere mma.sync + cp.async kernels, head dims 64 and 128). "
                     "Auto dispatch picks it at head dim 128 and at head dim 64 with a causal "
                     "mask, where it is faster here than Triton, and Triton otherwise; "
                     "backend='cuda' or FUSEDOPS_CUDA_ARCH=sm80 select cuda-sm80.")
    return "\n".join(lines)


if __name__ == "__main__":
    print(report())
