"""The Hopper attention kernels' work order (csrc/attention/attention_order_sm90.h), compiled
from the header itself with the host C++ compiler and checked on the CPU: over a grid of shapes,
for the forward's form (sections of whole KV-head groups, query blocks) and the backward's (one
(sequence, KV head) pair per unit, key blocks), item t -> (b, h, block) is a bijection onto
[0, batch) x [0, heads) x [0, blocks); inside a section the block index moves one step at a time
over all its pairs, in ascending or (reverse) descending order; sections are whole units, of
sizes that differ by one unit at most, the smaller first, and within half the L2 unless one unit
alone is larger; the 32-bit decoding equals the 64-bit one. A broken decoding would lose or
repeat a work tile (the forward) or a key block (the backward's dK and dV); on the GPU that shows
only as wrong gradients for some shapes.
"""
from host_cxx import run_program

PROGRAM = r"""
#include "attention_order_sm90.h"
#include <cstdio>
#include <cstdlib>
#include <vector>
using fusedops::attn::TileOrderSm90;
using fusedops::attn::tile_order_sections;

static int fail(const char* what, long a, long b, long c) {
  std::printf("FAIL %s %ld %ld %ld\n", what, a, b, c);
  return 1;
}

// One case: batch, heads, blocks, unit_pairs (a divisor of heads), unit_bytes, l2, reverse.
static int check(int batch, int heads, int blocks, int unit, long unit_bytes, long l2, int rev) {
  TileOrderSm90 o{};
  o.n_mb = blocks;
  o.hq = heads;
  o.n_bh = static_cast<int64_t>(batch) * heads;
  o.reverse = rev;
  o.align_end = 0;
  o.dynamic = 0;
  tile_order_sections(o, unit, unit_bytes, l2);
  if (o.n_work != o.n_bh * blocks) return fail("n_work", o.n_work, o.n_bh, blocks);
  // Sections: whole units, sizes differing by one unit, the smaller first, covering every pair.
  const int step = unit_bytes > 0 ? unit : 1;  // plain: sections of one pair
  if (o.sec % step || o.sec_big % step) return fail("units", o.sec, o.sec_big, step);
  if (o.sec_big != o.sec && o.sec_big != o.sec + step) return fail("sizes", o.sec, o.sec_big, step);
  const int64_t rest = o.n_bh - o.n_small * o.sec;
  if (rest < 0 || rest % o.sec_big) return fail("cover", o.n_small, o.sec, o.sec_big);
  if (unit_bytes > 0 && o.sec > unit && (o.sec / unit) * unit_bytes > l2 / 2)
    return fail("l2", o.sec, unit_bytes, l2);
  if (unit_bytes <= 0 && (o.sec != 1 || o.sec_big != 1)) return fail("plain", o.sec, o.sec_big, 0);
  std::vector<char> seen(static_cast<size_t>(o.n_work), 0);
  int64_t prev_sec = -1, prev_k = -1, sec_start = 0;
  for (int64_t t = 0; t < o.n_work; ++t) {
    int b, h, mb, b2, h2, mb2;
    o.decode<false>(t, b, h, mb);
    o.decode<true>(t, b2, h2, mb2);
    if (b != b2 || h != h2 || mb != mb2) return fail("narrow", t, mb, mb2);
    if (b < 0 || b >= batch || h < 0 || h >= heads || mb < 0 || mb >= blocks)
      return fail("range", b, h, mb);
    const int64_t idx = (static_cast<int64_t>(b) * heads + h) * blocks + mb;
    if (seen[idx]) return fail("repeat", b, h, mb);
    seen[idx] = 1;
    // The section of pair (b, h) and the block's position k in the walk.
    const int64_t pair = static_cast<int64_t>(b) * heads + h;
    const int64_t small_pairs = o.n_small * o.sec;
    const int64_t sec = pair < small_pairs ? pair / o.sec
                                           : o.n_small + (pair - small_pairs) / o.sec_big;
    const int64_t k = rev ? blocks - 1 - mb : mb;
    if (sec != prev_sec) {
      if (sec != prev_sec + 1) return fail("section order", t, sec, prev_sec);
      prev_sec = sec, prev_k = k, sec_start = t;
      if (k != 0) return fail("section start", t, k, 0);
    } else {
      if (k != prev_k && k != prev_k + 1) return fail("block order", t, k, prev_k);
      prev_k = k;
    }
    (void)sec_start;
  }
  return 0;
}

int main() {
  int bad = 0, cases = 0;
  const long l2 = 50L << 20;
  for (int batch : {1, 2, 3, 5, 16})
    for (int heads : {1, 2, 4, 6, 16})
      for (int blocks : {1, 2, 7, 8, 32})
        for (int rev : {0, 1}) {
          for (int unit = 1; unit <= heads; ++unit) {
            if (heads % unit) continue;
            for (long ub : {0L, 1L, 4L << 20, 10L << 20, 30L << 20, 200L << 20}) {
              bad += check(batch, heads, blocks, unit, ub, l2, rev);
              ++cases;
            }
          }
        }
  // The shapes of the benchmark grid: forward (query heads in KV-head groups of 4) and
  // backward (KV-head pairs; Q and dO of max_q rows, 4 bytes a column, per query head).
  for (int d : {64, 128})
    for (int l : {1024, 4096, 16384}) {
      const int batch = 16384 / l, hq = 2048 / d, hkv = hq / 4;
      bad += check(batch, hq, (l + 127) / 128, 4, static_cast<long>(l) * d * 4, l2, 1);
      bad += check(batch, hkv, (l + 127) / 128, 1, static_cast<long>(l) * d * 4 * 4, l2, 0);
      cases += 2;
    }
  std::printf("cases %d failed %d\n", cases, bad);
  return bad != 0;
}
"""


def test_tile_order_is_a_bijection_in_sections(tmp_path):
    assert "failed 0" in run_program(tmp_path, PROGRAM)
