"""benchmarks/sass_steps.py: control-word stall counts, the step loop's choice and its basic
blocks, on a synthetic cuobjdump listing (no GPU or CUDA toolkit needed)."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import sass_steps  # noqa: E402


def listing(functions: dict[str, list[tuple[str, int]]]) -> str:
    """cuobjdump -sass text: per function, (instruction, stall count) at 16-byte addresses."""
    out = []
    for name, body in functions.items():
        out.append(f"\t\tFunction : {name}")
        out.append("\t.headerflags\t@\"EF_CUDA_SM90\"")
        for k, (ins, stall) in enumerate(body):
            # Other control fields set too (yield, barriers, reuse), which must not leak in.
            hi = (stall << 41) | (1 << 45) | (0x7 << 46) | (0x3F << 52) | (0xF << 58) | 0x800
            out.append(f"        /*{16 * k:04x}*/                   {ins} ;"
                       f"                   /* 0x000000ff00017b82 */")
            out.append(f"                                                      /* 0x{hi:016x} */")
    return "\n".join(out) + "\n"


# A step loop (0x20-0x90, two HGMMAs, a forward branch over one block) inside an outer loop
# (0x10-0xa0, three HGMMAs); the function before it has a loop of two HGMMAs too.
STEP = [
    ("MOV R1, R2", 1),                                     # 0x00
    ("UIADD3 UR4, UR4, 0x1, URZ", 2),                      # 0x10 outer loop head
    ("HGMMA.64x128x16.F32.BF16 R24, gdesc[UR8], RZ", 1),   # 0x20 step loop head
    ("HGMMA.64x128x16.F32.BF16 R24, gdesc[UR12], R24", 3),  # 0x30
    ("@!P0 BRA 0x60", 5),                                  # 0x40
    ("FMNMX R3, R4, R5, !PT", 4),                          # 0x50
    ("MUFU.EX2 R6, R6", 8),                                # 0x60 branch target
    ("FADD R7, R7, R6", 7),                                # 0x70
    ("FADD R8, R8, R6", 2),                                # 0x80
    ("@P1 BRA 0x20", 5),                                   # 0x90 step loop back edge
    ("HGMMA.64x128x16.F32.BF16 R24, gdesc[UR8], R24", 1),  # 0xa0
    ("@P2 BRA 0x10", 5),                                   # 0xb0 outer back edge
    ("EXIT", 5),
]
OTHER = [("HGMMA.64x64x16.F32.BF16 R24, gdesc[UR8], RZ", 1),
         ("HGMMA.64x64x16.F32.BF16 R24, gdesc[UR8], R24", 1),
         ("@P0 BRA 0x0", 5)]


def test_stall_counts_and_kernel_choice():
    text = listing({"_Z5otherv": OTHER, "_Z6kernelv": STEP})
    instrs = sass_steps.parse(text, "kernel")
    assert [a for a, _, _ in instrs] == [16 * k for k in range(len(STEP))]
    assert [s for _, s, _ in instrs] == [s for _, s in STEP]
    assert instrs[4][2] == "@!P0 BRA 0x60"
    assert sass_steps.opcode(instrs[4][2]) == "BRA"
    assert sass_steps.opcode("MUFU.EX2 R6, R6") == "MUFU"
    assert sass_steps.parse(text, "nothing_like_it") == []


def test_step_loop_and_blocks():
    instrs = sass_steps.parse(listing({"_Z6kernelv": STEP}), "kernel")
    body = sass_steps.step_loop(instrs, 2)
    assert (body[0][0], body[-1][0]) == (0x20, 0x90)  # not the outer loop (three HGMMAs)
    assert (sass_steps.step_loop(instrs, 3)[0][0]) == 0x10
    spans = [(b[0][0], b[-1][0], sum(s for _, s, _ in b)) for b in sass_steps.blocks(body)]
    assert spans == [(0x20, 0x40, 9), (0x50, 0x50, 4), (0x60, 0x90, 22)]
    lines = sass_steps.report(body)
    assert lines[-1] == "loop: 8 instructions, 35 stall cycles"


def test_script_on_a_listing(tmp_path):
    path = tmp_path / "k.sass"
    path.write_text(listing({"_Z5otherv": OTHER, "_Z6kernelv": STEP}))
    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "sass_steps.py"),
                          str(path), "--kernel", "kernel", "--wgmma", "2"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-1] == "loop: 8 instructions, 35 stall cycles"
    bad = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "sass_steps.py"),
                          str(path), "--kernel", "kernel", "--wgmma", "5"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "no loop with exactly 5 HGMMA" in bad.stderr
