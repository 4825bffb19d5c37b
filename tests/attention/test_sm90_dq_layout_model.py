"""Model of the sm90 backward's column-major dQ accumulator (80-query steps): the preprocess's
zeroing and the overlapped conversion's reads and writes, as attention_bwd_kernel_sm90.cuh
indexes them, checked on packed batches whose sequences start anywhere in an 8-row tile group."""

from __future__ import annotations

import random

import pytest

D, BM, HQ = 128, 80, 2


def tile(i, h, c):  # dq_acc_tile<D>
    return (((i >> 3) * HQ + h) * (D // 8) + (c >> 3)) << 6


def index_t(i, h, c):  # dq_acc_index_t<D>
    return tile(i, h, c) + ((c & 7) << 3) + (i & 7)


def prep_zeroed(starts, lens, total_q):
    """Positions bwd_prep_kernel_sm90<T, 128, 80> zeroes (every thread of the padded rows)."""
    zeroed = set()
    for q_start, lq in zip(starts, lens, strict=True):
        for i in range((lq + BM - 1) // BM * BM):
            if i >= lq:
                continue  # past the sequence: statistics only
            row = q_start + i
            for h in range(HQ):
                for c in range(D // 8):
                    r0 = row & 7
                    r1 = 7 if row == total_q - 1 else r0
                    base = tile(row, h, 8 * c) + 8 * r0
                    for r in range(r0, r1 + 1):
                        zeroed.update(base + 8 * (r - r0) + e for e in range(8))
    return zeroed


def tail_writes(starts, lens):
    """(row, head, column) -> accumulator position, as dq_convert_tail_kernel<T, 128, 80>
    writes dQ, with each element's writer count."""
    writes = {}
    for q_start, lq in zip(starts, lens, strict=True):
        for m in range(0, lq, BM):
            rows = min(BM, lq - m)
            r_lo, r_hi = q_start + m, q_start + m + rows
            g0 = r_lo // 8
            n = ((r_hi - 1) // 8 - g0 + 1) * D
            for h in range(HQ):
                for j in range(n):
                    g, col = g0 + j // D, j % D
                    src = tile(8 * g, h, col) + 8 * (col & 7)
                    for r in range(8):
                        if r_lo <= 8 * g + r < r_hi:
                            key = (8 * g + r, h, col)
                            pos, count = writes.get(key, (src + r, 0))
                            writes[key] = (pos, count + 1)
    return writes


def random_batch(rng):
    lens = [rng.choice([0, 1, 7, 8, 9, 79, 80, 81, 161, rng.randint(0, 300)])
            for _ in range(rng.randint(1, 5))]
    starts = [sum(lens[:b]) for b in range(len(lens))]
    return starts, lens, sum(lens)


@pytest.mark.parametrize("seed", range(40))
def test_zeroing_covers_every_row_and_stays_inside(seed):
    starts, lens, total_q = random_batch(random.Random(seed))
    zeroed = prep_zeroed(starts, lens, total_q)
    need = {index_t(i, h, c) for i in range(total_q) for h in range(HQ) for c in range(D)}
    assert need <= zeroed
    rows8 = (total_q + 7) // 8 * 8  # the accumulator's rows
    assert all(0 <= z < rows8 * HQ * D for z in zeroed)


@pytest.mark.parametrize("seed", range(40))
def test_conversion_writes_each_element_once_from_its_position(seed):
    starts, lens, total_q = random_batch(random.Random(seed))
    writes = tail_writes(starts, lens)
    assert set(writes) == {(i, h, c) for i in range(total_q) for h in range(HQ) for c in range(D)}
    for (i, h, c), (pos, count) in writes.items():
        assert count == 1 and pos == index_t(i, h, c)


def test_model_catches_a_zeroing_without_the_last_rows_columns():
    """Without the tensor's last row zeroing the columns of the rows past it, a batch whose
    length is not a multiple of 8 leaves valid rows' elements unzeroed (the check can fail)."""
    starts, lens, total_q = [0, 5], [5, 78], 83
    zeroed = set()
    for q_start, lq in zip(starts, lens, strict=True):
        for i in range(lq):
            row = q_start + i
            for h in range(HQ):
                for c in range(D // 8):
                    base = tile(row, h, 8 * c) + 8 * (row & 7)
                    zeroed.update(base + e for e in range(8))
    need = {index_t(i, h, c) for i in range(total_q) for h in range(HQ) for c in range(D)}
    assert not need <= zeroed
