// The order in which the Hopper attention kernels take their work items: (block, head,
// sequence) triples, a block being BM queries in the forward (TileOrderSm90 as its work tiles)
// and BN keys in the backward (hq then counts KV heads). Shared by attention_fwd_kernel_sm90.cuh,
// attention_bwd_kernel_sm90.cuh and their launchers; host and device code, no CUDA headers.
#pragma once

#include <algorithm>
#include <cstdint>

#include "../host_device.h"

namespace fusedops {
namespace attn {

// The (sequence, head) pairs, head fastest, are cut into sections: n_small of `sec` pairs, then
// the rest of `sec_big`; inside a section the blocks go one block index at a time over all its
// pairs (block k of every pair of the section, then k + 1), in descending index with `reverse`.
// Item t of [0, n_work) decodes to (b, h, block).
struct TileOrderSm90 {
  int64_t n_work;  // n_mb * n_bh
  // The tiles of this launch: [t_begin, t_end) of [0, n_work) (several launches only when one
  // CTA per tile needs more than 2^31 - 1 CTAs).
  int64_t t_begin, t_end;
  int64_t n_bh;    // batch * hq
  int n_mb;        // q-blocks per sequence: ceil(max_q / BM)
  int hq;
  int sec;         // pairs per section of the first n_small sections, >= 1
  int sec_big;     // pairs per later section; sec_big * n_mb < 2^31
  int64_t n_small;  // sections of sec pairs: n_small * sec + k * sec_big = n_bh
  // For the 32-bit decoding (n_work < 2^31; set by the host with the above): sec * n_mb,
  // sec_big * n_mb, the first tile and the first pair after the small sections.
  int per, per_big, small_end, small_pairs;
  int reverse;     // 1: block n_mb - 1 first
  // 1: q-block mb holds queries [lq - (n_mb - mb) BM, lq - (n_mb - mb - 1) BM) of its sequence,
  // counted from the end, so that a partial block is the first, not the last (rows before the
  // sequence's start are computed on whatever Q rows the load brings, never stored); 0: [mb BM,
  // mb BM + BM). Under a causal mask the first block sees the fewest keys and the last the
  // most: aligned to the start, a partial last block (L = 4096 in 192-query tiles) did a whole
  // row of key tiles for a third of its rows.
  int align_end;
  int dynamic;     // 1: tiles after the first from the tile counter (persistent launches only)
  // kNarrow: n_work < 2^31 is known (persistent launches), so the 64-bit path is not compiled
  // at all (its loop-invariant products would stay live in the producer thread's registers).
  template <bool kNarrow = false>
  __host__ __device__ void decode(int64_t t, int& b, int& h, int& mb) const {
    int k;
    if (kNarrow || n_work <= 0x7fffffff) {  // 32-bit divisions (uniform over the grid)
      // Selects rather than branches, and the products precomputed: the producer thread runs
      // this within its 24 (one-tile tables) or 40 registers.
      const int ti = static_cast<int>(t);
      const bool big = ti >= small_end;
      const int t2 = big ? ti - small_end : ti, pr = big ? per_big : per, w = big ? sec_big : sec;
      const int s = t2 / pr, r = t2 - s * pr;
      k = r / w;
      const int bh = (big ? small_pairs : 0) + s * w + (r - k * w);
      b = bh / hq;
      h = bh - b * hq;
    } else {
      const int64_t per64 = static_cast<int64_t>(sec) * n_mb, small = n_small * per64;
      const bool big = t >= small;
      const int64_t pr = big ? static_cast<int64_t>(sec_big) * n_mb : per64;
      const int64_t t2 = big ? t - small : t, s = t2 / pr;
      const int r = static_cast<int>(t2 - s * pr), w = big ? sec_big : sec;
      k = r / w;
      const int64_t bh = (big ? n_small * sec : 0) + s * w + (r - k * w);
      b = static_cast<int>(bh / hq);
      h = static_cast<int>(bh - static_cast<int64_t>(b) * hq);
    }
    mb = reverse ? n_mb - 1 - k : k;
  }
};

// Cuts o's n_bh pairs (n_mb and n_bh set) into sections of whole units of unit_pairs adjacent
// pairs, as many units as keep their unit_bytes within half of l2_bytes (at least one; at most
// 2^30 / n_mb pairs, for the 32-bit decoding), in sizes that differ by one unit at most, the
// smaller first (a short last section would put its longest blocks at the very end). With
// unit_bytes <= 0 every pair is a section of its own (the blocks of a pair together, the order
// of a plain grid). Then the 32-bit decoding's products, where n_work < 2^31.
inline void tile_order_sections(TileOrderSm90& o, int64_t unit_pairs, int64_t unit_bytes,
                                int64_t l2_bytes) {
  o.n_work = o.n_bh * o.n_mb;
  o.sec = o.sec_big = 1;
  o.n_small = o.n_bh;
  if (unit_bytes > 0 && unit_pairs > 0 && o.n_bh > 0) {
    const int64_t units = o.n_bh / unit_pairs;
    int64_t cap = std::max<int64_t>(1, (l2_bytes / 2) / unit_bytes);
    cap = std::max<int64_t>(
        1, std::min(cap, ((int64_t{1} << 30) / std::max(1, o.n_mb)) / unit_pairs));
    const int64_t n_sec = (units + cap - 1) / cap;
    const int64_t small = units / n_sec, n_big = units - small * n_sec;
    o.sec = static_cast<int>(small * unit_pairs);
    o.sec_big = static_cast<int>((small + 1) * unit_pairs);
    o.n_small = n_sec - n_big;
  }
  if (o.n_work <= 0x7fffffff) {
    o.per = o.sec * o.n_mb;
    o.per_big = o.sec_big * o.n_mb;
    o.small_end = static_cast<int>(o.n_small * o.per);
    o.small_pairs = static_cast<int>(o.n_small * o.sec);
  }
}

}  // namespace attn
}  // namespace fusedops
