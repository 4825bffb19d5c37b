"""Builds the Hopper GEMM of the linear cross-entropy alone (csrc/linear_ce/gemm_sm90_api.cpp +
gemm_sm90.cu, sm_90a only) as a library registering torch.ops.fusedops.lce_gemm_sm90, for a
device check without building all of fusedops._C (about a minute instead of several), then
runs what the arguments ask in this process, the library loaded:

    PYTHONPATH=python python3 benchmarks/lce_gemm_sm90_standalone.py --build DIR \\
        [--pytest "-q -m gpu tests/linear_ce/test_gemm_sm90.py"] [--bench="ARGS"]...

Each --bench runs bench_gemm_sm90.py with ARGS (e.g. --bench=--sanitize-run, --bench="--out
$OUT"; the = keeps ARGS that start with -- an argument). The tests
of chunked.py's switch need fusedops._C and skip here.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIB_ENV = "FUSEDOPS_LCE_GEMM_LIB"  # the built library, for bench_gemm_sm90.py's subprocesses


def build(out_dir: str) -> str:
    """Compiles the op into out_dir; returns the library's path."""
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")
    from torch.utils import cpp_extension

    os.makedirs(out_dir, exist_ok=True)
    info = os.path.join(out_dir, "build_info.h")
    text = '#pragma once\n#define FUSEDOPS_BUILT_ARCHS "9.0a"\n'
    if not os.path.exists(info) or open(info).read() != text:  # unchanged: no rebuild
        with open(info, "w") as f:
            f.write(text)
    includes = [os.path.join(ROOT, "csrc"), out_dir]
    for path in sys.path:  # pip's CUDA wheels carry headers some ATen headers want
        cand = os.path.join(path, "nvidia", "cu13", "include")
        if os.path.isdir(cand):
            includes.append(cand)
            break
    t0 = time.time()
    cpp_extension.load(
        name="fusedops_lce_gemm_sm90",
        sources=[os.path.join(ROOT, "csrc", "linear_ce", "gemm_sm90_api.cpp"),
                 os.path.join(ROOT, "csrc", "linear_ce", "gemm_sm90.cu")],
        extra_include_paths=includes, extra_cflags=["-O3"],
        extra_cuda_cflags=["-O3", "-lineinfo", "--expt-relaxed-constexpr", "-Xptxas", "-v",
                           "-gencode=arch=compute_90a,code=sm_90a"],
        build_directory=out_dir, is_python_module=False, verbose=True)
    lib = os.path.join(out_dir, "fusedops_lce_gemm_sm90.so")
    print(f"built {lib} in {time.time() - t0:.0f} s", flush=True)
    return lib


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", required=True, help="build folder")
    ap.add_argument("--pytest", default="", help="pytest arguments (one string)")
    ap.add_argument("--bench", action="append", default=[],
                    help="bench_gemm_sm90.py arguments (one string; repeatable)")
    args = ap.parse_args()
    lib = build(args.build)
    os.environ[LIB_ENV] = lib  # the library is loaded on import (python/fusedops/linear_ce)
    rc = 0
    if args.pytest:
        import pytest
        rc |= int(pytest.main(shlex.split(args.pytest)))
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    for bench_args in args.bench:
        import bench_gemm_sm90
        sys.argv = ["bench_gemm_sm90.py"] + shlex.split(bench_args)
        t0 = time.time()
        rc |= int(bench_gemm_sm90.main() or 0)
        print(f"bench_gemm_sm90.py {bench_args}: {time.time() - t0:.0f} s", flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
