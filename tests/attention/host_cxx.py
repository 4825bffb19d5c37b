"""Builds and runs a small C++ program against the kernels' host-and-device headers with the host
compiler, for the CPU tests of index arithmetic that the GPU kernels share (test_sm90_order.py,
test_attention_mask.py)."""
import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ATTENTION_HEADERS = os.path.join(ROOT, "csrc", "attention")


def run_program(tmp_path, source: str, include_dir: str = ATTENTION_HEADERS) -> str:
    """Compiles `source` (C++17, -O2) with c++, g++ or clang++ and runs it; skips the test when
    no host compiler is on PATH. Asserts that both steps succeed and returns the output."""
    cxx = next((p for p in map(shutil.which, ("c++", "g++", "clang++")) if p), None)
    if cxx is None:
        pytest.skip("no host C++ compiler (c++, g++ or clang++) on PATH")
    src, exe = tmp_path / "prog.cpp", tmp_path / "prog"
    src.write_text(source)
    build = subprocess.run([cxx, "-std=c++17", "-O2", "-I", include_dir, str(src), "-o", str(exe)],
                           capture_output=True, text=True)
    assert build.returncode == 0, build.stderr
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    return run.stdout
