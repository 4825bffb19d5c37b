"""Gradient filtering: the d_hidden and d_weight products of a dz chunk over its large blocks only.

With `filter_eps` set, a block of BLOCK x BLOCK entries of a dz chunk (BLOCK tokens x BLOCK
vocab columns, counted from the chunk's first row and column) whose every entry satisfies
|dz[i, v]| <= filter_eps * |w_i| (w_i the token's weight in the loss: 1/N for the mean, 1 for the
sum, 0 when ignored; d_lse on the statistics path) counts as zero in both products. On a trained
model's outputs most of a row's softmax lies far below 2^-12 outside a few entries, so most blocks
drop out and the two gradient GEMMs shrink to the blocks that hold a target or a likely token; on
spread-out (untrained) logits nearly every block stays, and the products run at the block-sparse
kernels' dense rate (below cuBLAS's). The loss and d_bias are always exact.

Three pieces per chunk: `block_mask` (which blocks stay), then `d_hidden` and `d_weight`. On a
GPU with float16/bfloat16 dz they are Triton kernels that loop over each output tile's list of
kept blocks, where fewer than DENSE_SHARE of the first chunk's blocks stay (`Route`); elsewhere
(denser masks, CPU, float32/float64) the dropped blocks are zeroed in dz and the dense products
run, which is also the definition the GPU kernels are tested against.
"""

from __future__ import annotations

import importlib.util
import os

import torch
from torch import Tensor

BLOCK = 128  # rows and columns of a filter block (and of the sparse kernels' output tiles)
# Share of kept blocks from which cuBLAS on the zeroed chunk beats the block-sparse kernels:
# these run at about half its rate on a full mask (H100: d_hidden 416 / 750 TFLOP/s, d_weight
# 290 / 661; benchmarks/results/linear_ce.jsonl, method fusedops-filter on dense data).
DENSE_SHARE = 0.5
_HAS_TRITON = importlib.util.find_spec("triton") is not None


def _triton_on(t: Tensor) -> bool:
    """Whether Triton's compiled kernels can run on t (a GPU tensor, not the interpreter)."""
    return t.is_cuda and _HAS_TRITON and os.environ.get("TRITON_INTERPRET", "0") != "1"


def blocks(n: int) -> int:
    return -(-n // BLOCK)


def block_mask(dz: Tensor, thr: Tensor) -> Tensor:
    """(blocks(rows), blocks(cols)) int8: 1 where the block of dz holds an entry with
    |dz[i, v]| > thr[i] (a NaN counts as large). dz (rows, cols) with unit column stride; thr
    (rows,) float32/float64."""
    rows, cols = dz.shape
    if sparse_ok(dz):
        from fusedops.linear_ce import triton as tk
        return tk.filter_mask(dz, thr, BLOCK)
    nk = blocks(cols)
    t = thr.to(torch.float64 if dz.dtype == torch.float64 else torch.float32)
    mask = torch.zeros(blocks(rows), nk, dtype=torch.int8, device=dz.device)
    for rb in range(mask.shape[0]):  # one block row at a time: temporaries of BLOCK rows
        r0, r1 = rb * BLOCK, min(rows, (rb + 1) * BLOCK)
        big = ~(dz[r0:r1].to(t.dtype).abs() <= t[r0:r1, None])  # NaN: large
        per_col = big.any(0)
        pad = per_col.new_zeros(nk * BLOCK)
        pad[:cols] = per_col
        mask[rb] = pad.view(nk, BLOCK).any(1).to(torch.int8)
    return mask


def zero_dropped_(dz: Tensor, mask: Tensor) -> None:
    """Zeroes the blocks of dz whose mask entry is 0 (filtering where the block-sparse kernels do
    not run: the dense products of the result are then the filtered ones). No temporaries larger
    than a block row of mask."""
    if _triton_on(dz):
        from fusedops.linear_ce import triton as tk
        tk.zero_blocks(dz, mask, BLOCK)
        return
    rows, cols = dz.shape
    full = cols // BLOCK
    keep = mask.to(dz.dtype)
    for rb in range(blocks(rows)):
        seg = dz[rb * BLOCK: (rb + 1) * BLOCK]
        if full:
            seg[:, : full * BLOCK].view(seg.shape[0], full, BLOCK).mul_(keep[rb, :full, None])
        if full * BLOCK < cols:
            seg[:, full * BLOCK:].mul_(keep[rb, full])


def sparse_ok(dz: Tensor) -> bool:
    """Whether the block-sparse Triton kernels take this chunk (a GPU, float16/bfloat16)."""
    return _triton_on(dz) and dz.dtype in (torch.float16, torch.bfloat16)


class Route:
    """The products' route for one call's sweep over its chunks: chosen at the first chunk the
    sparse kernels could take (`sparse_pays`, one host synchronisation per call: one per chunk
    exposed the launch overhead of every chunk, 1.3-1.9x the time at the 64 MiB setting) and
    kept for the rest."""

    def __init__(self):
        self._sparse = None

    def sparse(self, dz: Tensor, mask: Tensor) -> bool:
        if not sparse_ok(dz):
            return False
        if self._sparse is None:
            self._sparse = sparse_pays(mask)
        return self._sparse


def sparse_pays(mask: Tensor) -> bool:
    """Whether the block-sparse kernels should take chunks like this mask's: fewer than
    DENSE_SHARE of its blocks kept. Reading the share synchronises with the device; during CUDA
    graph capture (no synchronisation allowed) the answer is yes.
    FUSEDOPS_LCE_FILTER_ROUTE (read at each call; for measurement and tests): sparse or dense
    forces the route."""
    route = os.environ.get("FUSEDOPS_LCE_FILTER_ROUTE", "auto")
    if route not in ("auto", "sparse", "dense"):
        raise ValueError(f"FUSEDOPS_LCE_FILTER_ROUTE must be auto, sparse or dense, got {route!r}")
    if route != "auto":
        return route == "sparse"
    if mask.numel() == 0 or (mask.is_cuda and torch.cuda.is_current_stream_capturing()):
        return True
    return int(mask.sum(dtype=torch.int64)) < DENSE_SHARE * mask.numel()


def d_hidden(dz: Tensor, w_chunk: Tensor, out: Tensor, accumulate: bool, mask: Tensor) -> None:
    """out (+)= dz @ w_chunk over the kept blocks (sparse_ok(dz)). out (rows, H) contiguous,
    of dz's dtype or float32; w_chunk (cols, H) contiguous rows of the weight."""
    from fusedops.linear_ce import triton as tk
    tk.sparse_dh(dz, w_chunk, out, accumulate, mask, BLOCK)


def d_weight(dz: Tensor, x: Tensor, out: Tensor, accumulate: bool, mask: Tensor) -> None:
    """out (+)= dz^T @ x over the kept blocks (sparse_ok(dz)). out (cols, H) contiguous rows of
    d_weight, of dz's dtype or float32; x (rows, H) contiguous."""
    from fusedops.linear_ce import triton as tk
    tk.sparse_dw(dz, x, out, accumulate, mask, BLOCK)
