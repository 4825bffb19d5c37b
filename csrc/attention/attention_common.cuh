// Architecture-free attention device code: sequence bounds and the visibility rule, the score
// transform (scale, softcap), row statistics, and the dQ accumulator layout. No tensor-core,
// ldmatrix or async-copy code here, so that the kernels of any architecture (the sm80 ones, a
// Hopper or a decode kernel) include it alone and share one definition of what a query sees.
//
// Layout and visibility rule: attention_params.h. Scores are kept in log2 units (x = s * scale *
// log2(e), or softcap * log2(e) * tanh(s * scale / softcap)), so every exponential is one ex2.
#pragma once

#include <cstdint>
#include <type_traits>

#include "../device_utils.cuh"
#include "attention_mask.h"
#include "attention_params.h"

namespace fusedops {
namespace attn {

using namespace fusedops::dev;  // kLog2e, zero, conversions, ex2 (device_utils.cuh)

constexpr float kLn2 = 0.6931471805599453f;
// Forward: how far (log2 units) a tile maximum may exceed the running one before rescaling.
constexpr float kSlack = 8.f;

// Sequence b's bounds in the packed tensors (cu_seqlens) and which (query, key) pairs are visible.
struct Seq {
  int q_start, k_start, lq, lk, off;
  Seq() = default;
  __device__ __forceinline__ Seq(const AttnParams& p, int b) {
    q_start = p.cu_q[b];
    k_start = p.cu_k[b];
    lq = p.cu_q[b + 1] - q_start;
    lk = p.cu_k[b + 1] - k_start;
    off = lk - lq;
  }
  // Query i sees key j (attention_mask.h's pair_visible); the bounds are recomputed from the
  // parameters (common to a tile's elements) rather than held in registers.
  __device__ __forceinline__ bool visible(int i, int j, const AttnParams& p) const {
    return pair_visible(i, j, lk, off, p.left, p.right);
  }
  // The keys base + [0, span) that query i sees, as a Band of column offsets (attention_mask.h).
  __device__ __forceinline__ Band keys_band(int i, int base, int span,
                                            const AttnParams& p) const {
    return attn::keys_band(i, base, span, lk, off, p.left, p.right);
  }
  // Every (i, j) in [m0, m1) x [n0, n1) visible (keys past lk are not).
  __device__ __forceinline__ bool all_visible(int m0, int m1, int n0, int n1,
                                              const AttnParams& p) const {
    return n1 <= lk && (p.right < 0 || n1 - 1 <= m0 + off + p.right) &&
           (p.left < 0 || n0 >= m1 - 1 + off - p.left);
  }
  // Key range [lo, hi) that queries [m0, m_end) can see.
  __device__ __forceinline__ void keys_of(int m0, int m_end, const AttnParams& p, int& lo,
                                          int& hi) const {
    lo = p.left >= 0 ? max(0, m0 + off - p.left) : 0;
    hi = p.right >= 0 ? min(lk, m_end - 1 + off + p.right + 1) : lk;
  }
  // The tiles of kBlockN keys [t_lo, t_hi) holding every key that queries [m0, m0 + block_m)
  // (clipped to lq) can see; t_lo == t_hi when they see none.
  template <int kBlockN>
  __device__ __forceinline__ void key_tiles_of(int m0, int block_m, const AttnParams& p,
                                               int& t_lo, int& t_hi) const {
    int n_lo, n_hi;
    keys_of(m0, min(m0 + block_m, lq), p, n_lo, n_hi);
    t_lo = n_lo / kBlockN;
    t_hi = n_hi > n_lo ? (n_hi + kBlockN - 1) / kBlockN : t_lo;
  }
  // Query range [lo, hi) that keys [n0, n_end) are seen by.
  __device__ __forceinline__ void queries_of(int n0, int n_end, const AttnParams& p, int& lo,
                                             int& hi) const {
    lo = p.right >= 0 ? max(0, n0 - off - p.right) : 0;
    hi = p.left >= 0 ? min(lq, n_end - 1 - off + p.left + 1) : lq;
  }
};

// Score of a raw dot product in log2 units; `t` gets tanh(s * scale / softcap) when capped.
// The constants live in the kernel parameters (set by the host), not in registers.
struct Score {
  const AttnParams& p;
  __device__ __forceinline__ explicit Score(const AttnParams& params) : p(params) {}
  __device__ __forceinline__ bool capped() const { return p.softcap > 0.f; }
  __device__ __forceinline__ float scale_log2() const { return p.scale_log2; }
  template <bool kCap>
  __device__ __forceinline__ float at(float s, float& t) const {
    if constexpr (!kCap) return s * p.scale_log2;
    // tanh(a) = 1 - 2 / (e^{2a} + 1): exact at both ends (e^{2a} -> inf gives 1, -> 0 gives -1).
    t = 1.f - __fdividef(2.f, ex2(p.cap_in_log2 * s) + 1.f);
    return p.cap_out_log2 * t;
  }
};

// The element-wise pass of a tile comes in three copies, so that the common ones have no
// branch inside the unrolled loops: Path<0> every (query, key) pair visible and no softcap,
// Path<1> masked, Path<2> masked with the softcap. run_path picks one (warp-uniform).
template <int K>
using Path = std::integral_constant<int, K>;
template <typename F>
__device__ __forceinline__ void run_path(bool full, bool capped, F&& f) {
  if (capped)
    f(Path<2>{});
  else if (full)
    f(Path<0>{});
  else
    f(Path<1>{});
}

// Row reductions over the 4 lanes of a quad: an m16n8 accumulator (mma.sync, and wgmma's per-warp
// layout alike) holds each row in 4 consecutive lanes, so softmax statistics need two shuffles.
__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// Per-row backward statistics: lse in log2 units (+inf for rows past the sequence or seeing no
// key, so that their probabilities are 0) and delta.
__device__ __forceinline__ void row_stats(const AttnParams& p, int h, int q_start, int i, int lq,
                                          float& lse2, float& dl) {
  lse2 = INFINITY;
  dl = 0.f;
  if (i < lq) {
    const int64_t at = static_cast<int64_t>(h) * p.total_q + q_start + i;
    const float l = p.lse[at];
    lse2 = l == -INFINITY ? INFINITY : l * kLog2e;
    dl = p.delta[at];
  }
}

// The float32 dQ accumulator (only the atomic kernel and dq_convert_kernel see it) is stored in
// tiles of 8 rows x 8 columns, each contiguous and row-major: (packed row i, head h, column c) at
// (((i / 8) hq + h) D / 8 + c / 8) 64 + 8 (i % 8) + c % 8, rows rounded up to a multiple of 8.
// A warp's reduction of one half of an m16n8 accumulator (8 rows x 8 columns, two per lane) then
// covers one contiguous 256-byte tile instead of 32-byte pieces of eight rows 8 KiB apart
// (FlashAttention-2 permutes its accumulator for the same reason).
template <int D>
__device__ __forceinline__ int64_t dq_acc_tile(int64_t i, int h, int c, int hq) {
  return (((i >> 3) * hq + h) * (D / 8) + (c >> 3)) << 6;
}
template <int D>
__device__ __forceinline__ int64_t dq_acc_index(int64_t i, int h, int c, int hq) {
  return dq_acc_tile<D>(i, h, c, hq) + ((i & 7) << 3) + (c & 7);
}
// The same tiles column-major (the sm90 backward with 80-query steps, whose dQ^T accumulator
// holds two rows of one column per lane): (i, h, c) at tile + 8 (c % 8) + i % 8.
template <int D>
__device__ __forceinline__ int64_t dq_acc_index_t(int64_t i, int h, int c, int hq) {
  return dq_acc_tile<D>(i, h, c, hq) + ((c & 7) << 3) + (i & 7);
}

// acc + the products of 8 elements of O and dO (one 16-byte load each), summed in element
// order in float32.
template <typename T>
__device__ __forceinline__ float dot8(float acc, const T* o, const T* d) {
  const uint4 ov = *reinterpret_cast<const uint4*>(o);
  const uint4 dv = *reinterpret_cast<const uint4*>(d);
  const T* oe = reinterpret_cast<const T*>(&ov);
  const T* de = reinterpret_cast<const T*>(&dv);
#pragma unroll
  for (int e = 0; e < 8; ++e) acc += to_float(oe[e]) * to_float(de[e]);
  return acc;
}

// rowsum(O * dO) over one row of D elements by one thread (16-byte loads, float32 sums in
// element order): the delta of the sm80 backward's preprocess.
template <typename T, int D>
__device__ __forceinline__ float row_dot(const T* o, const T* d) {
  float acc = 0.f;
#pragma unroll
  for (int c = 0; c < D / 8; ++c) acc = dot8(acc, o + c * 8, d + c * 8);
  return acc;
}

}  // namespace attn
}  // namespace fusedops
