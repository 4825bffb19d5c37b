// Which (query, key) pairs a sequence's mask leaves visible, per pair and as a band of a tile's
// columns. Host and device code, no CUDA headers (tests/attention/test_attention_mask.py builds it
// on the CPU and checks the bands against the pairs).
#pragma once

#include <cstdint>

#include "../host_device.h"

namespace fusedops {
namespace attn {

// A sequence of lq queries and lk keys, off = lk - lq (bottom-right alignment): query i sees key
// j < lk iff lo <= j - i <= hi, lo = off - left and hi = off + right, a negative left or right
// meaning no bound (+-2^30).
__host__ __device__ __forceinline__ int diag_lo(int off, int left) {
  return left >= 0 ? off - left : -(1 << 30);
}
__host__ __device__ __forceinline__ int diag_hi(int off, int right) {
  return right >= 0 ? off + right : 1 << 30;
}
// Without branches (bitwise ands), so that the masked element loops stay straight-line code.
__host__ __device__ __forceinline__ bool pair_visible(int i, int j, int lk, int off, int left,
                                                      int right) {
  const int d = j - i;
  return (j < lk) & (d <= diag_hi(off, right)) & (d >= diag_lo(off, left));
}

// The visible columns c in [0, span) of one row of a tile, as one interval: has(c) is one
// subtraction and one unsigned comparison (against two compares per bound and a subtraction per
// pair from pair_visible), so a masked tile's elements cost a select and two instructions each.
// Empty rows have a = span, w = 0 (c - a < 0 wraps to a large unsigned).
struct Band {
  int a, w;
  __host__ __device__ __forceinline__ bool has(int c) const {
    return static_cast<unsigned>(c - a) <= static_cast<unsigned>(w);
  }
};

// The band of [lo, hi] (inclusive, 64-bit) over columns base + [0, span).
__host__ __device__ __forceinline__ Band band_of(int64_t lo, int64_t hi, int base, int span) {
  const int64_t l = lo > base ? lo : static_cast<int64_t>(base);
  const int64_t last = static_cast<int64_t>(base) + span - 1;
  const int64_t h = hi < last ? hi : last;
  Band b;
  if (h < l) {
    b.a = span;
    b.w = 0;
  } else {
    b.a = static_cast<int>(l - base);
    b.w = static_cast<int>(h - l);
  }
  return b;
}

// Query i's visible keys among base + [0, span): pair_visible(i, base + c, ...) == has(c) for
// every c in [0, span), for any i (rows before the sequence's start included).
__host__ __device__ __forceinline__ Band keys_band(int i, int base, int span, int lk, int off,
                                                   int left, int right) {
  const int64_t lo = static_cast<int64_t>(i) + diag_lo(off, left);
  int64_t hi = static_cast<int64_t>(i) + diag_hi(off, right);
  if (hi > lk - 1) hi = lk - 1;
  return band_of(lo, hi, base, span);
}

}  // namespace attn
}  // namespace fusedops
