"""Small forward + backward runs of every CUDA attention kernel, for compute-sanitizer.

    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck \
        python benchmarks/sanitize_attention.py
    compute-sanitizer --tool racecheck python benchmarks/sanitize_attention.py

Cases: head dims 64 and 128; dense (lengths not multiples of the tiles, Sq != Sk, GQA 2),
packed varlen with causal + window + softcap, and an empty-key sequence; each with dQ by the
separate kernel and by atomics (FUSEDOPS_ATTN_DQ=atomic).
"""

from __future__ import annotations

import os

import torch

from fusedops.attention import attention


def main():
    torch.manual_seed(0)
    for mode in ("separate", "atomic"):
        os.environ["FUSEDOPS_ATTN_DQ"] = mode
        run_cases()
    torch.cuda.synchronize()
    print("sanitize_attention: all cases ran")


def run_cases():
    dev, dt = "cuda", torch.bfloat16
    for d in (64, 128):
        q = torch.randn(2, 77, 4, d, device=dev, dtype=dt, requires_grad=True)
        k = torch.randn(2, 93, 2, d, device=dev, dtype=dt, requires_grad=True)
        v = torch.randn(2, 93, 2, d, device=dev, dtype=dt, requires_grad=True)
        attention(q, k, v, backend="cuda-sm80").sum().backward()
        attention(q, k, v, causal=True, backend="cuda-sm80").sum().backward()
        lq, lk = [70, 1, 33], [90, 0, 40]  # the middle sequence has no keys
        cu_q = torch.tensor([0, 70, 71, 104], dtype=torch.int32, device=dev)
        cu_k = torch.tensor([0, 90, 90, 130], dtype=torch.int32, device=dev)
        qp = torch.randn(sum(lq), 4, d, device=dev, dtype=dt, requires_grad=True)
        kp = torch.randn(sum(lk), 1, d, device=dev, dtype=dt, requires_grad=True)
        vp = torch.randn(sum(lk), 1, d, device=dev, dtype=dt, requires_grad=True)
        out = attention(qp, kp, vp, causal=True, window_size=(20, -1), softcap=10.0,
                        cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(lq),
                        max_seqlen_k=max(lk), backend="cuda-sm80")
        out.float().square().sum().backward()
        assert torch.isfinite(qp.grad).all() and torch.isfinite(kp.grad).all()


if __name__ == "__main__":
    main()
