"""`python -m fusedops.info`: versions, the GPU, and which backends can run a case (and why not).

    python -m fusedops.info [--dtype bfloat16] [--hidden 4096] [--head-dim 128] [--causal]
                            [--width 14336] [--device cuda|cpu]
"""

from __future__ import annotations

import argparse
import os
import platform

import torch

import fusedops
from fusedops import _ext, dispatch
from fusedops._checks import cli_positive_int


def _device(name: str | None) -> tuple[str, int]:
    if name is None:
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        kind = torch.device(name).type
    except (RuntimeError, TypeError):
        kind = None
    if kind not in ("cpu", "cuda") or name.startswith("cpu:"):
        raise SystemExit(f"fusedops.info: --device must be cpu, cuda or cuda:N, got {name!r}")
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise SystemExit("fusedops.info: --device cuda but no CUDA GPU is visible")
        dev = torch.device(name)
        return "cuda", dev.index if dev.index is not None else torch.cuda.current_device()
    return name, -1


def report(dtype: str = "bfloat16", hidden: int = 4096, head_dim: int = 128,
           causal: bool = False, device: str | None = None, width: int = 14336) -> str:
    lines = [f"fusedops {fusedops.__version__}", f"python {platform.python_version()}",
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
    else:
        lines.append("GPU: none visible (the torch backend runs on the CPU)")
    dev_type, dev_index = _device(device)
    for name in ("FUSEDOPS_BACKEND", "FUSEDOPS_CUDA_ARCH", "TRITON_INTERPRET"):
        lines.append(f"{name}={os.environ.get(name, '(unset)')}")
    from fusedops import swiglu  # noqa: F401  (declares its backends)

    sizes = {"linear_ce": hidden, "attention": head_dim, "attention_decode": head_dim,
             "swiglu": width}
    for op, inner in sizes.items():
        table = dispatch.op_backends(op)
        is_attn = op.startswith("attention")
        extra = ", causal" if causal and is_attn else ""
        lines.append(f"{op} on {dtype} {dev_type} inputs, {table.inner_name} {inner}{extra}:")
        sig = dispatch.InputSig(op, dev_type, dev_index, getattr(torch, dtype), inner,
                                causal and is_attn)
        for b in table.backends:
            why = dispatch.why_not(b.name, sig)
            lines.append(f"  {b.name:10} {'available' if why is None else 'no: ' + why}")
            lines.append(f"  {'':10} ({b.summary})")
            by = dispatch.bwd_backend(op, b.name, inner)
            if by != b.name:
                why_by = dispatch.why_not(by, sig)
                lines.append(f"  {'':10} backward at {table.inner_name} {inner}: {by}'s kernels"
                             + ("" if why_by is None else f" (no: {why_by})"))
        try:
            chosen = dispatch.select_name(op, dev_type, dev_index, dtype, inner, None,
                                          causal and is_attn)
            order = " > ".join(dispatch.candidates("auto", sig))
            lines.append(f"  default -> {chosen} (auto tries {order})")
        except (RuntimeError, ValueError) as exc:
            lines.append(f"  default -> error: {exc}")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m fusedops.info", description=__doc__.split(
        "\n")[0])
    parser.add_argument("--dtype", default="bfloat16",
                        choices=["float16", "bfloat16", "float32", "float64"])
    parser.add_argument("--hidden", type=cli_positive_int, default=4096,
                        help="linear_ce hidden size H")
    parser.add_argument("--head-dim", type=cli_positive_int, default=128,
                        help="attention head dim D")
    parser.add_argument("--width", type=cli_positive_int, default=14336,
                        help="swiglu width (the MLP's intermediate size)")
    parser.add_argument("--causal", action="store_true", help="attention with a causal mask")
    parser.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda if "
                        "a GPU is visible)")
    args = parser.parse_args(argv)
    print(report(args.dtype, args.hidden, args.head_dim, args.causal, args.device, args.width))


if __name__ == "__main__":
    main()
