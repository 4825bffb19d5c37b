"""Small runs of the linear cross-entropy row kernels in every mode (whole rows and vocab chunks,
the mean path's dz and the statistics path's dz from given gradients), for compute-sanitizer.

    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck \
        python benchmarks/sanitize_linear_ce.py
    compute-sanitizer --tool racecheck python benchmarks/sanitize_linear_ce.py

Cases: float16 and bfloat16 on the cuda-sm90 and cuda-sm80 row kernels; 37 tokens, H = 64,
V = 5003 (rows of an odd length, so each row has a scalar head, 16-byte vectors and a scalar
tail); bias, softcap, label smoothing, z-loss and ignored tokens; reduction mean (the fast path:
FULL_DZ, MERGE and DZ) and "none" with lse (the statistics path: FULL, MERGE and DZ_GRADS), each
at the default budget (whole rows) and at 2.05 MiB (vocab chunks of 2560 columns, 8 tokens).
Each result is compared with the torch backend's.
"""

from __future__ import annotations

import torch

from fusedops.linear_ce import linear_cross_entropy


def run(backend, dt, reduction, budget, gen):
    n, h, v = 37, 64, 5003
    x = torch.randn(n, h, generator=gen).to("cuda", dt).requires_grad_()
    w = (torch.randn(v, h, generator=gen) * 0.3).to("cuda", dt).requires_grad_()
    b = torch.randn(v, generator=gen).to("cuda", dt).requires_grad_()
    t = torch.randint(0, v, (n,), generator=gen).cuda()
    t[::5] = -100
    up = torch.randn(n, generator=gen).cuda()

    def step(be):
        leaves = [p.detach().clone().requires_grad_() for p in (x, w, b)]
        out = linear_cross_entropy(*leaves[:2], t, leaves[2], backend=be, reduction=reduction,
                                   return_lse=reduction == "none", softcap=20.0,
                                   label_smoothing=0.1, z_loss=1e-3, memory_budget_mib=budget)
        if reduction == "none":
            loss, lse = out
            total = (loss * up).sum() + 1e-2 * lse.square().sum()
        else:
            total = out
        grads = torch.autograd.grad(total, leaves)
        return [total.detach().float(), *(g.float() for g in grads)]

    got, ref = step(backend), step("torch")
    for a, r in zip(got, ref, strict=True):
        err = float((a - r).norm() / r.norm().clamp(min=1e-30))
        assert err < 3e-2, (backend, dt, reduction, budget, err)


def main():
    gen = torch.Generator().manual_seed(0)
    for backend in ("cuda-sm90", "cuda-sm80"):
        for dt in (torch.bfloat16, torch.float16):
            for reduction in ("mean", "none"):
                for budget in (None, 2.05):
                    run(backend, dt, reduction, budget, gen)
                    print(f"ok {backend} {str(dt)[6:]} {reduction} budget={budget}")
    torch.cuda.synchronize()
    print("sanitize cases done")


if __name__ == "__main__":
    main()
