"""benchmarks/table_attention.py: the README's Hopper table from result rows (medians, shares
of the faster anchor, the step ratio, '-' for a missing method), run as a script on a CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def row(method, L, causal, fwd, bwd, fwd_ms=1.0, bwd_ms=2.0, run="r1"):
    return {"op": "attention", "method": method, "D": 128, "L": L, "causal": causal,
            "fwd_tflops": fwd, "bwd_tflops": bwd, "fwd_ms": fwd_ms, "bwd_ms": bwd_ms, "run": run}


def test_table_from_rows(tmp_path):
    rows = [row("cuda-sm90", 4096, False, 600, 500, 1.0, 2.0),
            row("cuda-sm90", 4096, False, 610, 504, 1.0, 2.0, run="r2"),  # medians of two runs
            row("cuda-sm90-deterministic", 4096, False, 600, 480),
            row("sdpa_cudnn", 4096, False, 550, 450),
            row("fa4", 4096, False, 620, 520, 0.9, 1.9),
            row("cuda-sm90", 1024, True, 300, 200),  # no anchors in this shape
            row("fa4", 1024, True, 310, 210, run="other")]  # not selected
    path = tmp_path / "attention.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "table_attention.py"),
                          "--run", "r1,r2", "--results", str(path)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert lines[0].startswith("| D | L | causal | fwd cuda-sm90 |") and len(lines) == 4
    assert lines[2] == "| 128 | 1024 | yes | **300** | - | - | - | **200** | - | - | - | - | - |"
    assert lines[3] == ("| 128 | 4096 | no | **605** | 550 | 620 | 98% | **502** | 480 | 450 | 520 "
                        "| 97% | 1.07x |")
