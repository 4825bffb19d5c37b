"""A CPU model of how the dz prologue of the Hopper d_hidden / d_weight GEMMs
(csrc/linear_ce/gemm_sm90_dz.cuh, DzPrologue::fragment) finds its A fragments: the TMA tile
layout with the 128-byte swizzle, the ldmatrix lane addresses the kernel computes, what ldmatrix
(plain and .trans) hands each thread, and the coordinates the kernel then uses for each element
(token, vocab column). The tests check that every fragment element is the element wgmma's
register A operand expects at that place, that the kernel's coordinates name the same element,
and that one k-block's fragments cover each element of the 128 x 64 A tile exactly once.

wgmma's A from registers (m64nNk16, .f16/.bf16; PTX ISA, "Register fragment" of wgmma): warp w
of the warpgroup holds rows 16 w .. 16 w + 15 in the m16n8k16 A layout of mma.sync: lane
4 g + tq, register i, half h (lo = 0) holds row 16 w + g + 8 (i & 1), column 2 tq + 8 (i >> 1)
+ h of the 64 x 16 k-step.
"""

import itertools

import pytest

BM, BK = 128, 64  # the CTA tile's A: 128 M x 64 K per stage


def tma_byte(row, col):
    """Byte of element (row, col) of a box of 64-element (128-byte) rows written by TMA with
    CU_TENSOR_MAP_SWIZZLE_128B into a 1024-byte aligned buffer."""
    return row * 128 + (((col // 8) ^ (row % 8)) * 16) + (col % 8) * 2


def stage_map(layout):
    """byte -> (m, k) of the stage's A tile (tile-local), as the producer loads it."""
    out = {}
    for m, k in itertools.product(range(BM), range(BK)):
        if layout == 2:  # one box: 128 rows (M) of 64 K
            b = tma_byte(m, k)
        else:  # two boxes of 64 K-rows x 64 M, 8 KB apart
            b = (m // 64) * 8192 + tma_byte(k, m % 64)
        assert b not in out
        out[b] = (m, k)
    return out


def lane_address(layout, cw, warp, kk, lane):
    """DzPrologue::fragment's ldmatrix address (relative to the stage's A tile)."""
    mi, r8 = lane >> 3, lane & 7
    if layout == 2:
        row = 64 * cw + 16 * warp + r8 + 8 * (mi & 1)
        chunk = 2 * kk + (mi >> 1)
        return row * 128 + ((chunk ^ (row & 7)) << 4)
    krow = 16 * kk + r8 + 8 * (mi >> 1)
    chunk = 2 * warp + (mi & 1)
    return cw * 64 * 128 + krow * 128 + ((chunk ^ (krow & 7)) << 4)


def ldmatrix_x4(addrs, trans):
    """What ldmatrix.x4 (.trans) hands each thread: out[t][i] = (byte of lo, byte of hi).
    Matrix i's row r is the 16 bytes at addrs[8 i + r]. Plain: thread t gets row t / 4, columns
    2 (t % 4), + 1. .trans: rows 2 (t % 4) and + 1 of column t / 4."""
    out = []
    for t in range(32):
        regs = []
        for i in range(4):
            if not trans:
                a = addrs[8 * i + t // 4] + 4 * (t % 4)
                regs.append((a, a + 2))
            else:
                c = 2 * (t // 4)
                regs.append((addrs[8 * i + 2 * (t % 4)] + c, addrs[8 * i + 2 * (t % 4) + 1] + c))
        out.append(regs)
    return out


def kernel_coords(layout, cw, warp, lane, kk, i, h, m0=0, k0=0):
    """(token, vocab) that DzPrologue::fragment uses for register i, half h."""
    g, tq = lane >> 2, lane & 3
    hk, hm = i >> 1, i & 1
    slab = m0 + 64 * cw
    if layout == 2:
        row = slab + 16 * warp + g + 8 * hm  # begin_tile's r0 + 8 h
        col = k0 + 16 * kk + 2 * tq + 8 * hk + h
        return row, col
    tok = k0 + 16 * kk + 2 * tq + 8 * hk + h
    col = slab + 16 * warp + g + 8 * hm
    return tok, col


def expected_element(cw, warp, lane, kk, i, h):
    """(m, k) of the tile that wgmma's register A expects there."""
    g, tq = lane >> 2, lane & 3
    return 64 * cw + 16 * warp + g + 8 * (i & 1), 16 * kk + 2 * tq + 8 * (i >> 1) + h


@pytest.mark.parametrize("layout", [2, 3])
def test_fragments_are_wgmma_a_and_cover_the_tile_once(layout):
    smap = stage_map(layout)
    seen = {}
    for cw, warp, kk in itertools.product(range(2), range(4), range(BK // 16)):
        addrs = [lane_address(layout, cw, warp, kk, lane) for lane in range(32)]
        for a in addrs:
            assert a % 16 == 0, "ldmatrix rows must be 16-byte aligned"
        # A row of each 8 x 8 matrix: 8 elements contiguous along what ldmatrix calls a row.
        for a in addrs:
            m, k = smap[a]
            run = [smap[a + 2 * e] for e in range(8)]
            if layout == 2:
                assert run == [(m, k + e) for e in range(8)]
            else:
                assert run == [(m + e, k) for e in range(8)]
        # One 8-lane phase per matrix: its rows in 8 distinct 16-byte bank groups.
        for i in range(4):
            assert len({(addrs[8 * i + r] // 16) % 8 for r in range(8)}) == 8
        got = ldmatrix_x4(addrs, trans=(layout == 3))
        for lane, i, h in itertools.product(range(32), range(4), range(2)):
            el = smap[got[lane][i][h]]
            want = expected_element(cw, warp, lane, kk, i, h)
            assert el == want, (layout, cw, warp, kk, lane, i, h, el, want)
            tok, col = kernel_coords(layout, cw, warp, lane, kk, i, h)
            assert (tok, col) == ((el[0], el[1]) if layout == 2 else (el[1], el[0]))
            assert el not in seen, f"element {el} taken twice"
            seen[el] = (cw, warp, lane, kk, i, h)
    assert len(seen) == BM * BK


@pytest.mark.parametrize("layout", [2, 3])
def test_coords_follow_the_tile_origin(layout):
    """The kernel's coordinates shift with the tile's m0 and the k-block's k0."""
    for args in [(0, 1, 5, 2, 3, 1), (1, 3, 30, 3, 0, 0)]:
        base = kernel_coords(layout, *args)
        moved = kernel_coords(layout, *args, m0=256, k0=128)
        if layout == 2:
            assert moved == (base[0] + 256, base[1] + 128)
        else:
            assert moved == (base[0] + 128, base[1] + 256)


def test_model_rejects_a_wrong_mapping():
    """The checks can fail: the plain ldmatrix on layout 3's M-major tile (no .trans) or a
    swapped matrix order gives other elements."""
    smap = stage_map(3)
    addrs = [lane_address(3, 0, 0, 0, lane) for lane in range(32)]
    got = ldmatrix_x4(addrs, trans=False)
    assert any(smap[got[lane][i][h]] != expected_element(0, 0, lane, 0, i, h)
               for lane in range(32) for i in range(4) for h in range(2))
    smap2 = stage_map(2)
    swapped = [lane_address(2, 0, 0, 0, lane ^ 8) for lane in range(32)]
    got2 = ldmatrix_x4(swapped, trans=False)
    assert any(smap2[got2[lane][i][h]] != expected_element(0, 0, lane, 0, i, h)
               for lane in range(32) for i in range(4) for h in range(2))
