"""Static issue schedule of a kernel's main loop, from its SASS (no GPU needed).

    python benchmarks/sass_steps.py k.cubin --kernel 'fwd_kernel_sm90I13__nv_bfloat16Li128ELi2E' \
        --wgmma 16

Reads a cubin (disassembled by cuobjdump, from --cuobjdump, $CUDA_HOME/bin or PATH) or a saved
`cuobjdump -sass` listing. In the first function whose name matches --kernel it takes the
smallest loop (a backward branch) holding exactly --wgmma HGMMA instructions -- one key step of
an attention kernel -- and prints its basic blocks: address range, instructions, the sum of
the stall counts that ptxas wrote into their control words (the cycles one warp alone needs to
issue the block, not counting waits on variable-latency results), and the commonest opcodes.
Follow the blocks of one path (for example the unmasked one) and add their two columns to
compare two builds' steps, or ours with another kernel's.

Control word (the high 64 bits of each 128-bit Volta+ instruction): stall count in bits 41-44,
yield flag 45, write barrier 46-48, read barrier 49-51, wait mask 52-57, reuse 58-61.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys

_INSTR = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;?\s*/\* 0x([0-9a-f]{16}) \*/")
_HIGH = re.compile(r"^\s+/\* 0x([0-9a-f]{16}) \*/")
_BRANCH = re.compile(r"\bBRA(?:\.\w+)*\s+(?:[!U]?P\d+, |UR\d+, )?0x([0-9a-f]+)")


def parse(text: str, kernel: str) -> list[tuple[int, int, str]]:
    """(address, stall cycles, instruction) of the first function whose name matches `kernel`."""
    out: list[tuple[int, int, str]] = []
    inside = False
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if "Function : " in line:
            if inside:
                break
            inside = re.search(kernel, line.split("Function : ", 1)[1]) is not None
            continue
        m = _INSTR.match(line) if inside else None
        if m and i + 1 < len(lines):
            hi = _HIGH.match(lines[i + 1])
            if hi:
                stall = (int(hi.group(1), 16) >> 41) & 0xF
                out.append((int(m.group(1), 16), stall, m.group(2).strip().rstrip(";").strip()))
    return out


def opcode(instr: str) -> str:
    """The opcode without modifiers or guard predicate ('@!P0 BRA 0x10' -> 'BRA')."""
    word = instr.split()[1] if instr.startswith("@") else instr.split()[0]
    return word.split(".")[0]


def step_loop(instrs: list[tuple[int, int, str]], wgmma: int) -> list[tuple[int, int, str]]:
    """The smallest backward-branch loop holding exactly `wgmma` HGMMA instructions."""
    at = {a: i for i, (a, _, _) in enumerate(instrs)}
    best = None
    for i, (a, _, ins) in enumerate(instrs):
        m = _BRANCH.search(ins)
        if not m:
            continue
        target = int(m.group(1), 16)
        if target >= a or target not in at:
            continue
        body = instrs[at[target]:i + 1]
        if sum(opcode(x) == "HGMMA" for _, _, x in body) == wgmma and (
                best is None or len(body) < len(best)):
            best = body
    if best is None:
        raise SystemExit(f"no loop with exactly {wgmma} HGMMA instructions")
    return best


def blocks(body: list[tuple[int, int, str]]) -> list[list[tuple[int, int, str]]]:
    """Basic blocks: split before each branch target and after each branch or BSYNC."""
    targets = {int(m.group(1), 16) for _, _, ins in body if (m := _BRANCH.search(ins))}
    out: list[list] = []
    cur: list = []
    for entry in body:
        if entry[0] in targets and cur:
            out.append(cur)
            cur = []
        cur.append(entry)
        if opcode(entry[2]) in ("BRA", "BSYNC", "EXIT"):
            out.append(cur)
            cur = []
    if cur:
        out.append(cur)
    return out


def report(body: list[tuple[int, int, str]]) -> list[str]:
    lines = []
    for blk in blocks(body):
        ops = collections.Counter(opcode(x) for _, _, x in blk)
        top = " ".join(f"{k}{n}" for k, n in ops.most_common(6))
        stall = sum(s for _, s, _ in blk)
        lines.append(f"{blk[0][0]:06x}-{blk[-1][0]:06x} {len(blk):5d} {stall:6d}"
                     f"  {top}  | {blk[-1][2][:40]}")
    lines.append(f"loop: {len(body)} instructions, {sum(s for _, s, _ in body)} stall cycles")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("path", help="a cubin, or a saved cuobjdump -sass listing")
    ap.add_argument("--kernel", required=True, help="regular expression on the mangled name")
    ap.add_argument("--wgmma", type=int, required=True, help="HGMMA instructions per step")
    ap.add_argument("--cuobjdump", default=None)
    args = ap.parse_args()
    if args.path.endswith(".cubin"):
        tool = args.cuobjdump or shutil.which("cuobjdump") or os.path.join(
            os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "cuobjdump")
        text = subprocess.run([tool, "-sass", args.path], check=True, capture_output=True,
                              text=True).stdout
    else:
        with open(args.path) as f:
            text = f.read()
    instrs = parse(text, args.kernel)
    if not instrs:
        sys.exit(f"no function matches {args.kernel!r}")
    print("block            instrs  stall  opcodes  | last")
    print("\n".join(report(step_loop(instrs, args.wgmma))))


if __name__ == "__main__":
    main()
