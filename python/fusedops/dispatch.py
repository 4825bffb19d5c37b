"""Which implementation runs an op call: the part common to every op.

Each op declares its backends beside it (python/fusedops/<op>/backends.py): what each supports,
why it cannot run an input, and the measured preference order. This module parses the request,
checks what is common to every backend of a kind (the extension is built, the device, the dtype,
the compute capability), keeps the answers, logs new ones, and raises one error that lists every
backend's reason when nothing fits.

Dispatch looks only at static facts (device, compute capability, dtype, sizes), never at tensor
values, so torch.compile can treat the choice as a constant.

Overrides: the `backend=` argument, else the environment variable FUSEDOPS_BACKEND
(auto | cuda | cuda-sm90 | cuda-sm80 | triton | torch). FUSEDOPS_CUDA_ARCH=sm80 makes "cuda" and
"auto" use the Ampere kernels even on a Hopper GPU (how the sm_80 path is tested on an H200).
FUSEDOPS_LOG=1 logs each new decision once through the `fusedops` logger.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from fusedops import _ext

BACKENDS = ("cuda-sm90", "cuda-sm80", "triton", "torch")
REQUESTS = ("auto", "cuda") + BACKENDS
log = logging.getLogger("fusedops")


@dataclass(frozen=True)
class InputSig:
    """Static facts about an op's inputs."""

    op: str
    device_type: str
    device_index: int
    dtype: torch.dtype
    inner_dim: int  # linear_ce: hidden size H; attention: head dim D
    causal: bool = False  # attention: a causal mask


@dataclass(frozen=True)
class Backend:
    """What one backend of an op supports. `kind` is "cuda" (the extension), "triton" or
    "torch"; `arch` the CUDA kernel family (80, 90) the C++ entry points take; `cc_range` the
    compute capabilities it runs on, (lowest, highest) inclusive; `limits` the op-specific check
    (head dims, alignment), returning the reason it cannot run `sig` or None; `unbuilt` a reason
    that holds whatever the input (kernels not written yet); `summary` one line for
    `python -m fusedops.info`; `bwd_by` the backend whose kernels run this one's backward at an
    inner size where it has none of its own (None: its own everywhere)."""

    name: str
    kind: str
    dtypes: tuple[torch.dtype, ...]
    summary: str
    arch: int | None = None
    cc_range: tuple[tuple[int, int], tuple[int, int]] = ((8, 0), (9, 0))
    limits: Callable[[InputSig], str | None] | None = None
    unbuilt: str | None = None
    bwd_by: Callable[[int], str | None] | None = None


@dataclass(frozen=True)
class OpBackends:
    """An op's backends and its measured preference order (`order(sig, forced_sm80)` -> names
    from most to least preferred for request "auto")."""

    op: str
    inner_name: str  # what InputSig.inner_dim is for this op ("hidden size", "head dim")
    backends: Sequence[Backend]
    order: Callable[[InputSig, bool], list[str]]
    by_name: dict = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "by_name", {b.name: b for b in self.backends})


_OPS: dict[str, OpBackends] = {}


def register(table: OpBackends) -> OpBackends:
    """Called by each op's backends.py at import."""
    _OPS[table.op] = table
    return table


def op_backends(op: str) -> OpBackends:
    if op not in _OPS:
        raise ValueError(f"unknown op {op!r}; ops: {sorted(_OPS)}")
    return _OPS[op]


def capability(sig: InputSig) -> tuple[int, int]:
    """The compute capability of the GPU the inputs are on."""
    return torch.cuda.get_device_capability(sig.device_index)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _names(dtypes) -> str:
    return ", ".join(str(d).removeprefix("torch.") for d in dtypes)


def _why_not_cuda(b: Backend, sig: InputSig) -> str | None:
    if not _ext.available():
        return (f"the extension fusedops._C is not built ({_ext.EXT_ERROR}); reinstall with nvcc "
                "and a CUDA-enabled torch: pip install --no-build-isolation .")
    if sig.device_type != "cuda":
        return f"inputs are on {sig.device_type}, the CUDA kernels need CUDA tensors"
    cap = capability(sig)
    lo, hi = b.cc_range
    if not lo <= cap <= hi:
        return (f"these kernels need compute capability {lo[0]}.{lo[1]} to {hi[0]}.{hi[1]}, this "
                f"GPU is {cap[0]}.{cap[1]}")
    archs = _ext.built_archs()
    if b.arch == 90 and "9.0a" not in archs:
        return f"the extension was built without sm_90a (built for {';'.join(archs)})"
    if b.arch == 80:
        family = f"{cap[0]}." if cap[0] == 8 else f"{cap[0]}.{cap[1]}"
        if not any(a.startswith(family) for a in archs):
            return (f"the extension was built without code for compute capability "
                    f"{cap[0]}.{cap[1]} (built for {';'.join(archs)})")
    return None


def _why_not_triton(b: Backend, sig: InputSig) -> str | None:
    try:
        import triton  # noqa: F401
    except ImportError as exc:
        return f"Triton is not importable ({exc}); pip install triton"
    if _interpreting() and sig.dtype == torch.bfloat16:
        return "the Triton interpreter (TRITON_INTERPRET=1) has no bfloat16"
    if sig.device_type == "cpu":
        if _interpreting():
            return None
        return "inputs are on the CPU (Triton runs there only under TRITON_INTERPRET=1)"
    if sig.device_type != "cuda":
        return f"inputs are on {sig.device_type}"
    cap = capability(sig)
    if cap < b.cc_range[0]:
        return f"compute capability {cap} is below {b.cc_range[0]}"
    return None


def why_not(backend: str, sig: InputSig) -> str | None:
    """None when `backend` can run inputs described by `sig`, else the reason it cannot."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {REQUESTS} or None, got {backend!r}")
    b = op_backends(sig.op).by_name.get(backend)
    if b is None:
        return f"{sig.op} has no {backend} backend"
    if b.unbuilt:
        return b.unbuilt
    if sig.dtype not in b.dtypes:
        return f"dtype {sig.dtype} (the {backend} kernels take {_names(b.dtypes)})"
    if b.limits is not None:  # static limits first: they hold on any machine
        reason = b.limits(sig)
        if reason is not None:
            return reason
    if sig.device_type == "cuda" and b.kind != "torch" and not torch.cuda.is_available():
        return "no CUDA GPU is visible"
    if b.kind == "cuda":
        return _why_not_cuda(b, sig)
    if b.kind == "triton":
        return _why_not_triton(b, sig)
    return None


def forced_sm80() -> bool:
    """FUSEDOPS_CUDA_ARCH=sm80: the Ampere kernels even where newer ones exist."""
    val = os.environ.get("FUSEDOPS_CUDA_ARCH", "").lower().replace("_", "")
    if val in ("", "auto", "native"):
        return False
    if val in ("sm80", "80", "8.0", "ampere"):
        return True
    if val in ("sm90", "90", "9.0", "sm90a", "hopper"):
        return False
    raise ValueError(f"FUSEDOPS_CUDA_ARCH must be sm80, sm90 or auto, got {val!r}")


def candidates(request: str, sig: InputSig) -> list[str]:
    """Backends to try for `request`, in order."""
    forced = forced_sm80()
    cuda = ["cuda-sm80"] if forced else ["cuda-sm90", "cuda-sm80"]
    if request == "auto":
        return op_backends(sig.op).order(sig, forced)
    if request == "cuda":
        return cuda
    if request == "cuda-sm90" and forced:
        return ["cuda-sm80"]
    return [request]


def check_backend(request, source: str = "backend") -> str:
    """`request` (a backend= argument, or the FUSEDOPS_BACKEND value) lowercased, after checking
    that it is one of REQUESTS; the errors name `source`."""
    if not isinstance(request, str):
        raise TypeError(f"{source} must be a str or None, got {type(request).__name__}")
    request = request.lower()
    if request not in REQUESTS:
        raise ValueError(f"{source} must be one of {REQUESTS}, got {request!r}")
    return request


@torch.compiler.assume_constant_result
def select_name(op: str, device_type: str, device_index: int, dtype_name: str, inner_dim: int,
                backend: str | None, causal: bool = False) -> str:
    """Backend name for these static facts (plain values, so torch.compile can fold the call)."""
    dtype = getattr(torch, dtype_name)
    sig = InputSig(op, device_type, device_index, dtype, inner_dim, causal)
    if backend is not None:
        request = check_backend(backend)
    else:
        request = check_backend(os.environ.get("FUSEDOPS_BACKEND", "auto"), "FUSEDOPS_BACKEND")
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


def _log_enabled() -> bool:
    if os.environ.get("FUSEDOPS_LOG", "0") in ("", "0"):
        return False
    if not log.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
        log.addHandler(handler)
    if log.getEffectiveLevel() > logging.INFO:
        log.setLevel(logging.INFO)
    return True


def select(op: str, x: torch.Tensor, inner_dim: int, backend: str | None = None,
           causal: bool = False) -> str:
    """The backend that runs `op` on inputs like `x` (device, dtype) with this inner size."""
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
        if _log_enabled():
            what = op_backends(op).inner_name
            where = f"cuda:{index}" if x.device.type == "cuda" else x.device.type
            log.info("%s on %s %s, %s %d%s, request %s -> %s", op, facts[3], where, what,
                     inner_dim, ", causal" if causal else "",
                     backend or env.get("FUSEDOPS_BACKEND", "auto"), name)
    return name


def bwd_backend(op: str, backend: str, inner_dim: int) -> str:
    """The backend whose kernels run the backward of `backend`'s forward at this inner size."""
    b = op_backends(op).by_name.get(backend)
    other = b.bwd_by(inner_dim) if b is not None and b.bwd_by is not None else None
    return other or backend


def cuda_arch(op: str, backend: str) -> int:
    """The kernel family (80, 90) the C++ entry points take for a CUDA backend name."""
    arch = op_backends(op).by_name[backend].arch
    if arch is None:
        raise ValueError(f"{backend} is not a CUDA backend of {op}")
    return arch
