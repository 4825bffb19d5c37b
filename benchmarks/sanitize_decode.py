"""Small runs of every CUDA decode kernel instantiation (attention_with_kvcache), for
compute-sanitizer.

    FUSEDOPS_ATTN_DECODE_CUDA=1 PYTORCH_NO_CUDA_MEMORY_CACHING=1 \
        compute-sanitizer --tool memcheck python benchmarks/sanitize_decode.py
    FUSEDOPS_ATTN_DECODE_CUDA=1 compute-sanitizer --tool racecheck \
        python benchmarks/sanitize_decode.py --quick

Cases: float16 and bfloat16, head dims 64 and 128, 8, 12 and 16 query rows per KV head (MQA 8:1
with one query, GQA 4:1 with three, 16:1 with one); contiguous caches whose capacity (200) is no
multiple of the 64-key tile and paged ones (pages of 16: a page-table read per key row; pages of
64: one per tile) whose table rows hold out-of-range page numbers
past each sequence's pages (never read); lengths 0, 1 and the full capacity after the append;
1, 3 and 64 splits (more splits than tiles: empty ones); a window with softcap and a
non-causal window. Every tensor is allocated at its exact size (with
PYTORCH_NO_CUDA_MEMORY_CACHING=1 each is its own allocation), so a read past a cache, a page
table row or the lengths is an error, and each result is compared with the torch reference.
"""

from __future__ import annotations

import argparse

import torch

from fusedops.attention import attention_with_kvcache
from fusedops.attention.kvcache_backends import CUDA_ENABLED

CAP = 200


def make(dt, d, hq, hkv, sq, page, gen):
    b = 3
    q = torch.randn(b, sq, hq, d, generator=gen).to("cuda", dt)
    kn = torch.randn(b, sq, hkv, d, generator=gen).to("cuda", dt)
    vn = torch.randn(b, sq, hkv, d, generator=gen).to("cuda", dt)
    lens = torch.tensor([0, 1, CAP - sq], dtype=torch.int32)
    if page:
        max_pages = -(-CAP // page)  # 13 pages of 16 (capacity 208) or 4 of 64 (256)
        num_pages = b * max_pages + 1
        table = torch.randperm(num_pages, generator=gen)[:b * max_pages].view(b, max_pages)
        table = table.to(torch.int32)
        for row, n in enumerate(lens.tolist()):
            used = -(-(n + sq) // page)
            table[row, used:] = torch.tensor([num_pages + 5, -7] * max_pages)[:max_pages - used]
        shape, pt = (num_pages, page, hkv, d), table.cuda()
    else:
        shape, pt = (b, CAP, hkv, d), None
    kc = torch.randn(shape, generator=gen).to("cuda", dt)
    vc = torch.randn(shape, generator=gen).to("cuda", dt)
    return q, kc, vc, lens.cuda(), kn, vn, pt


def run(quick: bool) -> int:
    gen = torch.Generator().manual_seed(0)
    n = 0
    shapes = ((8, 1, 1), (8, 2, 3), (16, 1, 1))  # rows 8, 12 and 16
    options = [dict(), dict(window_size=(40, 0), softcap=20.0),
               dict(causal=False, window_size=(30, 2))]
    for dt in (torch.float16, torch.bfloat16):
        for d in (64, 128):
            for hq, hkv, sq in (shapes[:1] + shapes[2:] if quick else shapes):
                for page in (None, 16, 64):
                    for splits in ((3,) if quick else (1, 3, 64)):
                        for opt in (options[:1] if quick else options):
                            q, kc, vc, lens, kn, vn, pt = make(dt, d, hq, hkv, sq, page, gen)
                            kr, vr = kc.clone(), vc.clone()
                            out, lse = attention_with_kvcache(
                                q, kc, vc, lens, k_new=kn, v_new=vn, page_table=pt,
                                num_splits=splits, return_lse=True, backend="cuda",
                                check=False, **opt)
                            want, wlse = attention_with_kvcache(
                                q.float(), kr.float(), vr.float(), lens, k_new=kn.float(),
                                v_new=vn.float(), page_table=pt, return_lse=True,
                                backend="torch", **opt)
                            torch.testing.assert_close(out.float(), want, rtol=2e-2,
                                                       atol=2e-2)
                            torch.testing.assert_close(lse, wlse, rtol=1e-3, atol=1e-3)
                            n += 1
    torch.cuda.synchronize()
    return n


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="3 splits and no window per instantiation and layout (for racecheck)")
    args = ap.parse_args()
    if not CUDA_ENABLED:
        raise SystemExit("set FUSEDOPS_ATTN_DECODE_CUDA=1 (the CUDA decode kernel is opt-in)")
    n = run(args.quick)
    print(f"sanitize_decode: {n} cases ran")


if __name__ == "__main__":
    main()
