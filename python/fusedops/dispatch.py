"""The one place that decides which implementation runs an op: cuda-sm90, cuda-sm80, triton, torch.

Dispatch looks only at static facts (device, compute capability, dtype, sizes), never at tensor
values, so torch.compile can treat the choice as a constant. Each backend states what it supports
and, when it cannot run an input, why; when nothing fits, the error lists every backend's reason.

Overrides: the `backend=` argument, else the environment variable FUSEDOPS_BACKEND
(auto | cuda | cuda-sm90 | cuda-sm80 | triton | torch). FUSEDOPS_CUDA_ARCH=sm80 makes "cuda" and
"auto" use the Ampere kernels even on a Hopper GPU (how the sm_80 path is tested on an H200).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from fusedops import _ext

BACKENDS = ("cuda-sm90", "cuda-sm80", "triton", "torch")
REQUESTS = ("auto", "cuda") + BACKENDS
_GPU_DTYPES = (torch.float16, torch.bfloat16)
_TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class InputSig:
    """Static facts about an op's inputs."""

    op: str
    device_type: str
    device_index: int
    dtype: torch.dtype
    inner_dim: int  # linear_ce: hidden size H; attention: head dim D
    causal: bool = False  # attention: a causal mask


def _capability(sig: InputSig) -> tuple[int, int]:
    return torch.cuda.get_device_capability(sig.device_index)


def _triton_import_error() -> str | None:
    try:
        import triton  # noqa: F401
    except ImportError as exc:
        return f"Triton is not importable ({exc}); pip install triton"
    return None


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _why_not_cuda(sig: InputSig, arch: int) -> str | None:
    if sig.op not in ("linear_ce", "attention"):
        return f"no CUDA kernels for {sig.op} yet"
    if not _ext.available():
        return (f"the extension fusedops._C is not built ({_ext.EXT_ERROR}); reinstall with nvcc "
                "and a CUDA-enabled torch: pip install --no-build-isolation .")
    if sig.device_type != "cuda":
        return f"inputs are on {sig.device_type}, the CUDA kernels need CUDA tensors"
    if sig.dtype not in _GPU_DTYPES:
        return f"dtype {sig.dtype} (the CUDA kernels take float16 and bfloat16)"
    if sig.op == "attention":
        if sig.inner_dim not in (64, 128):
            return (f"head dim {sig.inner_dim}: the CUDA attention kernels are built for 64 and "
                    "128 (Triton runs the others)")
        if arch == 90:
            return ("no Hopper (wgmma/TMA) attention kernel yet; cuda-sm80 runs the mma.sync "
                    "kernels on this GPU")
    elif sig.inner_dim % 8 != 0:
        return f"hidden size {sig.inner_dim} is not a multiple of 8 (16-byte rows needed)"
    cap = _capability(sig)
    archs = _ext.built_archs()
    if arch == 90:
        if cap != (9, 0):
            return f"the sm_90a kernels need a Hopper GPU (compute capability 9.0), this is {cap}"
        if "9.0a" not in archs:
            return f"the extension was built without sm_90a (built for {';'.join(archs)})"
    else:
        if cap[0] == 8 and not any(a.startswith("8.") for a in archs):
            return f"the extension was built without sm_8x code (built for {';'.join(archs)})"
        if cap == (9, 0) and not any(a.startswith("9.0") for a in archs):
            return f"the extension was built without sm_90 code (built for {';'.join(archs)})"
        if cap[0] not in (8, 9):
            return f"compute capability {cap} is not 8.x or 9.0"
    return None


def why_not(backend: str, sig: InputSig) -> str | None:
    """None when `backend` can run inputs described by `sig`, else the reason it cannot."""
    if backend == "torch":
        return None
    if backend == "triton":
        err = _triton_import_error()
        if err:
            return err
        if sig.dtype not in _TRITON_DTYPES:
            return f"dtype {sig.dtype} (Triton kernels take float32, float16, bfloat16)"
        if sig.device_type == "cpu":
            if _interpreting():
                return None
            return "inputs are on the CPU (Triton runs there only under TRITON_INTERPRET=1)"
        if sig.device_type != "cuda":
            return f"inputs are on {sig.device_type}"
        cap = _capability(sig)
        if cap < (8, 0):
            return f"compute capability {cap} is below 8.0"
        return None
    if backend == "cuda-sm90":
        return _why_not_cuda(sig, 90)
    if backend == "cuda-sm80":
        return _why_not_cuda(sig, 80)
    raise ValueError(f"backend must be one of {REQUESTS} or None, got {backend!r}")


def _forced_sm80() -> bool:
    val = os.environ.get("FUSEDOPS_CUDA_ARCH", "").lower().replace("_", "")
    if val in ("", "auto", "native"):
        return False
    if val in ("sm80", "80", "8.0", "ampere"):
        return True
    if val in ("sm90", "90", "9.0", "sm90a", "hopper"):
        return False
    raise ValueError(f"FUSEDOPS_CUDA_ARCH must be sm80, sm90 or auto, got {val!r}")


def candidates(request: str, sig: InputSig) -> list[str]:
    cuda = ["cuda-sm80"] if _forced_sm80() else ["cuda-sm90", "cuda-sm80"]
    if request == "auto":
        triton = ["triton"] if sig.device_type == "cuda" else []
        if (sig.op == "attention" and triton and not _forced_sm80()
                and _capability(sig) >= (9, 0)
                and not (sig.inner_dim == 128 or (sig.inner_dim == 64 and sig.causal))):
            # Attention has no Hopper CUDA kernel yet. On the H200 a forward + backward step of
            # the Ampere one is faster than Triton's at D=128 (5-6%) and at D=64 causal (4%),
            # 7% slower at D=64 non-causal (runs 753fb837, d21bd3e1, L=4096), and it has no
            # other head dims: auto takes Triton first in those other cases only.
            # FUSEDOPS_CUDA_ARCH=sm80 or backend="cuda" pick it always.
            return triton + cuda + ["torch"]
        return cuda + triton + ["torch"]
    if request == "cuda":
        return cuda
    if request == "cuda-sm90" and _forced_sm80():
        return ["cuda-sm80"]
    return [request]


@torch.compiler.assume_constant_result
def select_name(op: str, device_type: str, device_index: int, dtype_name: str, inner_dim: int,
                backend: str | None, causal: bool = False) -> str:
    """Backend name for these static facts (plain values, so torch.compile can fold the call)."""
    dtype = getattr(torch, dtype_name)
    sig = InputSig(op, device_type, device_index, dtype, inner_dim, causal)
    request = backend if backend is not None else os.environ.get("FUSEDOPS_BACKEND", "auto")
    request = request.lower()
    if request not in REQUESTS:
        source = "backend" if backend is not None else "FUSEDOPS_BACKEND"
        raise ValueError(f"{source} must be one of {REQUESTS}, got {request!r}")
    reasons = []
    for name in candidates(request, sig):
        reason = why_not(name, sig)
        if reason is None:
            return name
        reasons.append(f"  {name}: {reason}")
    raise RuntimeError(
        f"fusedops.{op}: no backend can run backend={request!r} on {dtype_name} {device_type} "
        "inputs:\n" + "\n".join(reasons)
        + "\nPick another backend (backend= or FUSEDOPS_BACKEND) or change the inputs."
    )


_SELECTED: dict = {}  # eager calls: select_name's answer per facts and overriding variables


def select(op: str, x: torch.Tensor, inner_dim: int, backend: str | None = None,
           causal: bool = False) -> str:
    index = x.device.index if x.device.index is not None else (
        torch.cuda.current_device() if x.device.type == "cuda" else -1)
    facts = (op, x.device.type, index, str(x.dtype).removeprefix("torch."), inner_dim, backend,
             causal)
    if torch.compiler.is_compiling():
        return select_name(*facts)
    env = os.environ
    key = (*facts, env.get("FUSEDOPS_BACKEND"), env.get("FUSEDOPS_CUDA_ARCH"),
           env.get("TRITON_INTERPRET"))
    name = _SELECTED.get(key)
    if name is None:  # refusals raise every time and are not kept
        name = _SELECTED[key] = select_name(*facts)
    return name
