"""Host time per attention call at a small shape (the GPU mostly idle, so the Python and dispatch
cost shows), for the eager path of `attention()` (an autograd.Function over the kernels) against
the same call through the custom op `fusedops::attention_fwd` (what torch.compile sees).

    python benchmarks/overhead_attention.py --backend cuda-sm80

Prints microseconds per call: forward under no_grad, and forward + backward.
"""

from __future__ import annotations

import argparse
import time

import torch

from fusedops.attention import attention


def per_call_us(fn, n):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / n * 1e6


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="cuda-sm80")
    ap.add_argument("--n", type=int, default=2000)
    args = ap.parse_args()
    b, s, h, d = 1, 128, 4, 64
    q, k, v, do = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    packed = (s, s, d**-0.5, True, -1, -1, 0.0, False, args.backend)

    def eager(q, k, v):
        return attention(q, k, v, causal=True, backend=args.backend)

    def custom_op(q, k, v):  # what torch.compile calls: dense cu_seqlens, then the custom op
        steps = torch.arange(b + 1, device="cuda", dtype=torch.int32)
        cu_q = steps * s
        out, _ = torch.ops.fusedops.attention_fwd(q.reshape(s, h, d), k.reshape(s, h, d),
                                                  v.reshape(s, h, d), cu_q, steps * s, *packed)
        return out.view(q.shape)

    print(f"{'path':22} {'fwd us':>8} {'fwd+bwd us':>11}  (B={b} S={s} H={h} D={d}, "
          f"{args.backend}, {torch.cuda.get_device_name()})")
    for name, fn in (("attention() eager", eager), ("custom op", custom_op)):
        with torch.no_grad():
            fwd = per_call_us(lambda fn=fn: fn(q, k, v), args.n)
        qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))

        def step(fn=fn, qg=qg, kg=kg, vg=vg):
            fn(qg, kg, vg).backward(do)
            qg.grad = kg.grad = vg.grad = None

        both = per_call_us(step, args.n // 2)
        print(f"{name:22} {fwd:8.1f} {both:11.1f}")


if __name__ == "__main__":
    main()
