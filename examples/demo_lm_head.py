"""Demo: train a small Llama-style LM head with fusedops and with plain PyTorch, compare.

Runs on whatever device is present (CPU included) with no download: a frozen random "trunk"
turns the previous token into a hidden state (RMS-normalised, as in Llama), and a trainable
LM head learns a synthetic next-token distribution. Both runs start from the same weights and
see the same batches; the script prints the loss curves' agreement, time per step and peak memory.

    python examples/demo_lm_head.py                 # CPU or GPU defaults
    python examples/demo_lm_head.py --steps 50 --vocab 128256 --hidden 4096 --tokens 8192
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

from fusedops import dispatch
from fusedops.linear_ce import linear_cross_entropy


def make_data(vocab: int, hidden: int, tokens: int, steps: int, device, dtype, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    emb = torch.randn(vocab, hidden, generator=g) / hidden**0.5
    # Synthetic language: the next token is (a * prev + noise) mod vocab, learnable from emb.
    batches = []
    for _ in range(steps):
        prev = torch.randint(0, vocab, (tokens,), generator=g)
        noise = torch.randint(0, 4, (tokens,), generator=g)
        nxt = (prev * 7 + noise) % vocab
        h = emb[prev]
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)  # RMSNorm
        batches.append((h.to(device, dtype), nxt.to(device)))
    w0 = (torch.randn(vocab, hidden, generator=g) * 0.02).to(device)  # float32 master weights
    return batches, w0


def train(variant: str, args) -> dict:
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    batches, w0 = make_data(args.vocab, args.hidden, args.tokens, args.steps, device, dtype)
    w = torch.nn.Parameter(w0.clone())
    opt = torch.optim.AdamW([w], lr=args.lr)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if device.type == "cuda" else 0
    losses = []
    t0 = None
    for i, (h, t) in enumerate(batches):
        if i == 1:  # skip the first step (compilation, allocator warm-up)
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
        wc = w.to(dtype)  # compute copy in the training dtype; AdamW updates the float32 master
        if variant == "fusedops":
            loss = linear_cross_entropy(h, wc, t)
        else:
            loss = F.cross_entropy((h @ wc.T).float(), t)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    if device.type == "cuda":
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB -> MiB
    ms = (time.perf_counter() - t0) * 1e3 / max(1, len(batches) - 1)
    backend = dispatch.select("linear_ce", h, h.shape[-1]) if variant == "fusedops" else "-"
    return {"variant": variant, "losses": losses, "ms_per_step": ms, "peak_mib": peak,
            "backend": backend}


def main():
    ap = argparse.ArgumentParser()
    gpu = torch.cuda.is_available()
    ap.add_argument("--device", default="cuda" if gpu else "cpu")
    ap.add_argument("--dtype", default="bfloat16" if gpu else "float32")
    ap.add_argument("--vocab", type=int, default=128256 if gpu else 32000)
    ap.add_argument("--hidden", type=int, default=2048 if gpu else 256)
    ap.add_argument("--tokens", type=int, default=8192 if gpu else 2048)
    ap.add_argument("--steps", type=int, default=30 if gpu else 10)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--variant", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.variant:  # child process: one variant, so CPU peak RSS is its own
        print(json.dumps(train(args.variant, args)))
        return
    results = {}
    for variant in ("fusedops", "pytorch"):
        cmd = [sys.executable, __file__, "--variant", variant] + sys.argv[1:]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        results[variant] = json.loads(out.strip().splitlines()[-1])
    a, b = results["fusedops"]["losses"], results["pytorch"]["losses"]
    where = f"{args.device} ({torch.cuda.get_device_name() if args.device == 'cuda' else 'CPU'})"
    print(f"LM head on {where}: {args.tokens} tokens x hidden {args.hidden} x vocab "
          f"{args.vocab}, {args.dtype}, {args.steps} AdamW steps")
    print(f"fusedops backend: {results['fusedops']['backend']}")
    print(f"{'step':>5} {'fusedops loss':>14} {'PyTorch loss':>13}")
    for i in sorted({0, len(a) // 2, len(a) - 1}):
        print(f"{i:5d} {a[i]:14.5f} {b[i]:13.5f}")
    worst = max(abs(x - y) / max(abs(y), 1e-6) for x, y in zip(a, b, strict=True))
    print(f"largest relative loss difference over all steps: {worst:.2e}")
    mem = "peak GPU memory above start" if args.device == "cuda" else "peak process RSS"
    for k in ("fusedops", "pytorch"):
        r = results[k]
        print(f"{k:9}: {r['ms_per_step']:8.1f} ms/step, {mem}: {r['peak_mib']:8.0f} MiB")
    if a[-1] >= a[0]:
        print("warning: the loss did not decrease", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
