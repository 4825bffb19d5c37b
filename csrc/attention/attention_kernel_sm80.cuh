// Device code for exact tiled attention on the Ampere tensor-core path (mma.sync m16n8k16,
// ldmatrix, cp.async double buffering); also compiled for sm_90a and run there when forced.
//
// Layout and visibility rule: attention_params.h. Every warp owns 16 rows of its CTA's block
// (queries in the forward and dQ kernels, keys in the dK/dV kernel), so softmax statistics never
// leave the warp: a row lives in the 4 lanes of a quad. Shared tiles hold R rows of D elements in
// 16-byte chunks XOR-swizzled by (row & 7), so the 8 row addresses of an ldmatrix hit 32 banks.
// Scores are kept in log2 units (x = s * scale * log2(e), or softcap * log2(e) * tanh(s * scale /
// softcap)), so every exponential is one ex2.
//
// Forward: Q fragments are re-read from shared memory; K/V tiles stream through two
// shared-memory stages; online softmax with the rescale folded into the output accumulator;
// output normalised once; lse (natural log) written, -inf with a zero row for queries that see
// no key.
// Backward: delta = rowsum(dO * O); dK/dV per key block (looping over the GQA group's query heads
// and their visible query blocks, accumulators in registers); dQ either per query block by a
// separate kernel (no atomics: gradients bit-identical run to run) or by float32 atomics from
// the 8-warp dK/dV kernel (dkdv_split_kernel) and a convert pass.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>
#include <type_traits>

#include "../mma_sm80.cuh"
#include "attention_params.h"

namespace fusedops {
namespace attn {

using namespace fusedops::dev;   // kLog2e, zero, conversions, ex2 (device_utils.cuh)
using namespace fusedops::sm80;  // PTX wrappers (mma_sm80.cuh)

constexpr float kLn2 = 0.6931471805599453f;
// Forward: how far (log2 units) a tile maximum may exceed the running one before rescaling.
constexpr float kSlack = 8.f;

// Pipelined loops: a step starts by waiting for its own tiles and one barrier, then issues the
// next step's loads into the other stage (every warp has passed the barrier, so the previous
// step's reads of that stage are done). Against issuing first, waiting for all but the newest
// group and closing with a barrier, this is one barrier fewer per step (benchmarks/NOTES v6).

template <int D>
__device__ __forceinline__ int swz(int row, int chunk) {
  return row * D + ((chunk ^ (row & 7)) << 3);
}

// R rows [row0, row0 + R) of a global matrix (row stride `stride`) into a swizzled tile; rows at
// or past n_rows are zero-filled without being read. A tile with every row in range (the common
// case, warp-uniform) takes a copy with no predicates.
template <typename T, int R, int D, int NT>
__device__ __forceinline__ void load_rows(T* tile, const T* base, int64_t stride, int row0,
                                          int n_rows) {
  constexpr int C = D / 8;
  static_assert((R * C) % NT == 0 && NT % C == 0);
  constexpr int RS = NT / C;  // rows per pass (a multiple of 8: the swizzle repeats)
  static_assert(RS % 8 == 0);
  const int r = threadIdx.x / C, c = threadIdx.x % C;
  const T* src = base + static_cast<int64_t>(row0 + r) * stride + c * 8;
  const int64_t step = RS * stride;
  const uint32_t dst = smem_u32(tile + swz<D>(r, c));
  if (row0 + R <= n_rows) {
#pragma unroll
    for (int j = 0; j < R * C / NT; ++j) {
      cp_async_16(dst + j * RS * D * sizeof(T), src, true);
      src += step;
    }
    return;
  }
#pragma unroll
  for (int j = 0; j < R * C / NT; ++j) {
    const bool valid = row0 + r + j * RS < n_rows;
    cp_async_16(dst + j * RS * D * sizeof(T), valid ? src : base, valid);
    src += step;
  }
}

// ldmatrix addresses into a swizzled tile of D 2-byte columns. A 16 x 16 block at rows
// [row0, row0 + 16) and 16-byte chunks {2 kb, 2 kb + 1} is read by each lane from row row0 + lr,
// chunk 2 kb + hi (lr, hi fixed per lane), at byte offset 2D (row0 + lr) + 16 ((2 kb + hi) ^
// (lr & 7)) (row0 % 8 == 0). Since 2 (kb & 3) and hi are disjoint bits and 2D lr is a multiple
// of 128, that is 2D row0 + 128 (kb >> 2) + [(2D lr + 16 (hi ^ (lr & 7))) ^ 32 (kb & 3)].
// x[j] holds the bracket plus the shared-memory base for kb & 3 == j (kb counted from kb0, a
// per-warp column block), so with kb known at compile time each ldmatrix takes one register and
// a constant offset instead of recomputing the swizzle.
template <int D>
struct Lane {
  uint32_t x[4];
  __device__ __forceinline__ Lane(uint32_t base, int lr, int hi, int kb0 = 0) {
    const uint32_t o = 2 * D * lr + 16 * (hi ^ (lr & 7));
#pragma unroll
    for (int j = 0; j < 4; ++j)
      x[j] = base + 128 * ((kb0 + j) >> 2) + (o ^ (32 * ((kb0 + j) & 3)));
  }
  // The block at rows [row0, row0 + 16), chunks 2 (kb0 + kb) + {0, 1} of the tile that starts
  // `tile` bytes after the base.
  __device__ __forceinline__ uint32_t at(int tile, int row0, int kb) const {
    return x[kb & 3] + tile + 2 * D * row0 + 128 * (kb >> 2);
  }
};
// The same addresses from one register: the bracket's XOR is done at each ldmatrix (one more
// instruction per load, three registers fewer; for kernels at the register limit).
template <int D>
struct LaneXor {
  uint32_t base, o;
  __device__ __forceinline__ LaneXor(uint32_t smem_base, int lr, int hi)
      : base(smem_base), o(2 * D * lr + 16 * (hi ^ (lr & 7))) {}
  __device__ __forceinline__ uint32_t at(int tile, int row0, int kb) const {
    return base + tile + 2 * D * row0 + 128 * (kb >> 2) + (o ^ (32 * (kb & 3)));
  }
};
// The three lane patterns. A fragment: rows row0 + (lane & 15), chunk 2 kb + (lane >> 4). B
// fragments of two n8 tiles whose n index is the tile row: b[0], b[1] rows n0 + [0, 8), b[2],
// b[3] rows n0 + [8, 16). B fragments with the k index as the tile row (ldmatrix.trans): rows
// k0 + [0, 16), columns 16 kb + [0, 16).
template <typename L>
__device__ __forceinline__ L lane_a(uint32_t base) {
  const int lane = threadIdx.x & 31;
  return L(base, lane & 15, lane >> 4);
}
template <typename L>
__device__ __forceinline__ L lane_b(uint32_t base) {
  const int lane = threadIdx.x & 31, i = lane >> 3;
  return L(base, (i >> 1) * 8 + (lane & 7), i & 1);
}
template <int D>
__device__ __forceinline__ Lane<D> lane_bt(uint32_t base, int kb0) {
  const int lane = threadIdx.x & 31, i = lane >> 3;
  return Lane<D>(base, (i & 1) * 8 + (lane & 7), i >> 1, kb0);
}
template <typename L>
__device__ __forceinline__ L lane_bt(uint32_t base) {
  const int lane = threadIdx.x & 31, i = lane >> 3;
  return L(base, (i & 1) * 8 + (lane & 7), i >> 1);
}
// The three lane patterns of one kernel's D-column tiles (the ldmatrix.trans one from column
// block 0), as Lane<D> or LaneXor<D>.
template <typename L>
struct Lanes {
  L a, b, bt;
  __device__ __forceinline__ explicit Lanes(uint32_t base)
      : a(lane_a<L>(base)), b(lane_b<L>(base)), bt(lane_bt<L>(base)) {}
};
// Two accumulator tiles (16 x 8 each, adjacent along n) as one 16 x 16 A fragment.
template <typename T>
__device__ __forceinline__ void acc_to_a(uint32_t (&a)[4], const float (&c0)[4],
                                         const float (&c1)[4]) {
  a[0] = pack2<T>(c0[0], c0[1]);
  a[1] = pack2<T>(c0[2], c0[3]);
  a[2] = pack2<T>(c1[0], c1[1]);
  a[3] = pack2<T>(c1[2], c1[3]);
}
// acc[mt] (16 x NB each) += A[mt] B^T over k = 0..D: A rows a_row0 + 16 mt + [0, 16) of the
// tile at byte offset a_tile, B the NB rows of the tile at b_tile (its row is the n index). Each
// B fragment feeds MT row tiles.
template <typename T, int D, int MT, int NB, typename L>
__device__ __forceinline__ void gemm_nt(float (&acc)[MT][NB / 8][4], const Lanes<L>& ln,
                                        int a_tile, int a_row0, int b_tile) {
  static_assert(sizeof(T) == 2, "the lane addresses assume 2-byte elements");
#pragma unroll
  for (int ks = 0; ks < D / 16; ++ks) {
    uint32_t a[MT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) ldmatrix_x4(a[mt], ln.a.at(a_tile, a_row0 + 16 * mt, ks));
#pragma unroll
    for (int pp = 0; pp < NB / 16; ++pp) {
      uint32_t b[4];
      ldmatrix_x4(b, ln.b.at(b_tile, pp * 16, ks));
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        mma_16816<T>(acc[mt][2 * pp], a[mt], b[0], b[1]);
        mma_16816<T>(acc[mt][2 * pp + 1], a[mt], b[2], b[3]);
      }
    }
  }
}
// acc[mt] (16 x D) += P[mt] (16 x KB, accumulator layout) x rows [0, KB) of the tile at byte
// offset `tile`, read through `bt` (an ldmatrix.trans lane pattern).
template <typename T, int D, int MT, int KB, typename L>
__device__ __forceinline__ void gemm_pv(float (&acc)[MT][D / 8][4],
                                        const float (&pm)[MT][KB / 8][4], const L& bt, int tile) {
  static_assert(sizeof(T) == 2, "the lane addresses assume 2-byte elements");
#pragma unroll
  for (int kk = 0; kk < KB / 16; ++kk) {
    uint32_t a[MT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) acc_to_a<T>(a[mt], pm[mt][2 * kk], pm[mt][2 * kk + 1]);
#pragma unroll
    for (int dd = 0; dd < D / 16; ++dd) {
      uint32_t b[4];
      ldmatrix_x4_trans(b, bt.at(tile, kk * 16, dd));
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        mma_16816<T>(acc[mt][2 * dd], a[mt], b[0], b[1]);
        mma_16816<T>(acc[mt][2 * dd + 1], a[mt], b[2], b[3]);
      }
    }
  }
}

// Stores MT x 16 rows x D of an accumulator, scaled per row by mul[mt][r], to a global matrix:
// row tile mt holds rows row + 16 mt (+ 8 for r = 1), where `row` is the lane's first row; rows at
// or past n_rows are skipped.
template <int D, int MT, typename T>
__device__ __forceinline__ void store_rows(T* base, int64_t stride, int row, int n_rows,
                                           const float (&acc)[MT][D / 8][4],
                                           const float (&mul)[MT][2]) {
  const int tq = threadIdx.x & 3;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int i = row + 16 * mt + r * 8;
      if (i >= n_rows) continue;
      T* dst = base + static_cast<int64_t>(i) * stride + 2 * tq;
#pragma unroll
      for (int d8 = 0; d8 < D / 8; ++d8)
        *reinterpret_cast<uint32_t*>(dst + d8 * 8) =
            pack2<T>(acc[mt][d8][2 * r] * mul[mt][r], acc[mt][d8][2 * r + 1] * mul[mt][r]);
    }
}

struct Seq {
  int q_start, k_start, lq, lk, off;
  __device__ __forceinline__ Seq(const AttnParams& p, int b) {
    q_start = p.cu_q[b];
    k_start = p.cu_k[b];
    lq = p.cu_q[b + 1] - q_start;
    lk = p.cu_k[b + 1] - k_start;
    off = lk - lq;
  }
  // Query i sees key j < lk iff lo <= j - i <= hi (+-2^30: no bound). Without branches
  // (bitwise ands), so that the masked element loops stay straight-line code; the bounds are
  // recomputed from the parameters (common to a tile's elements) rather than held in registers.
  __device__ __forceinline__ bool visible(int i, int j, const AttnParams& p) const {
    const int d = j - i;
    const int lo = p.left >= 0 ? off - p.left : -(1 << 30);
    const int hi = p.right >= 0 ? off + p.right : 1 << 30;
    return (j < lk) & (d <= hi) & (d >= lo);
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

__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// ---------------------------------------------------------------------------------------------
// Forward. Grid (ceil(max_q / BM), hq, batch); each of the NW warps owns MT row tiles of 16
// queries (BM = 16 MT NW); BN keys per tile. Shared memory: Q (BM x D), then K and V in two stages
// each (BN x D). Fragments of Q are re-read from shared memory at every tile (registers go to
// the MT x D output rows instead).
template <typename T, int D, int MT, int BN, int NW>
__global__ void __launch_bounds__(NW * 32) fwd_kernel(const AttnParams p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  constexpr int BM = 16 * MT * NW, NT = NW * 32;
  static_assert(BN % 16 == 0 && D % 64 == 0);
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);
  T* sK = sQ + BM * D;
  T* sV = sK + 2 * BN * D;
  // Query blocks run last to first: under a causal mask (or a window to the left) the last blocks
  // see the most keys, and starting them first leaves the light ones for the tail of the grid.
  const int b = blockIdx.z, h = blockIdx.y, m0 = (gridDim.x - 1 - blockIdx.x) * BM;
  const Seq sq(p, b);
  if (m0 >= sq.lq) return;
  const int hk = h / (p.hq / p.hkv);
  const T* Q = static_cast<const T*>(p.q) + sq.q_start * p.q_row + static_cast<int64_t>(h) * D;
  const T* K = static_cast<const T*>(p.k) + sq.k_start * p.k_row + static_cast<int64_t>(hk) * D;
  const T* V = static_cast<const T*>(p.v) + sq.k_start * p.v_row + static_cast<int64_t>(hk) * D;
  int n_lo, n_hi;
  sq.keys_of(m0, min(m0 + BM, sq.lq), p, n_lo, n_hi);
  const int t_lo = n_lo / BN, t_hi = n_hi > n_lo ? (n_hi + BN - 1) / BN : t_lo;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3;
  const int row0 = warp * 16 * MT;  // the warp's first row in the block
  const int i0 = m0 + row0 + g;     // the lane's first query (row tile mt adds 16 mt, r adds 8)
  // Tiles as byte offsets from the start of shared memory, for the ldmatrix lanes.
  constexpr int oK = BM * D * 2, oV = oK + 2 * BN * D * 2;
  // At D=128 the kernel is at the register limit: the one-register lanes keep it from spilling
  // inside the loop (-Xptxas -v).
  const Lanes<std::conditional_t<(D > 64), LaneXor<D>, Lane<D>>> ln(smem_u32(smem_raw));

  load_rows<T, BM, D, NT>(sQ, Q, p.q_row, m0, sq.lq);
  if (t_lo < t_hi) {
    load_rows<T, BN, D, NT>(sK, K, p.k_row, t_lo * BN, sq.lk);
    load_rows<T, BN, D, NT>(sV, V, p.v_row, t_lo * BN, sq.lk);
  }
  cp_async_commit();

  const Score score(p);
  float o[MT][D / 8][4];
  zero(o);
  float m_run[MT][2], l_run[MT][2], alpha_run[MT][2];  // alpha: pending output rescale
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int r = 0; r < 2; ++r) m_run[mt][r] = -INFINITY, l_run[mt][r] = 0.f, alpha_run[mt][r] = 1.f;
  for (int t = t_lo; t < t_hi; ++t) {
    const int st = (t - t_lo) & 1;
    cp_async_wait<0>();
    __syncthreads();
    if (t + 1 < t_hi) {
      load_rows<T, BN, D, NT>(sK + (st ^ 1) * BN * D, K, p.k_row, (t + 1) * BN, sq.lk);
      load_rows<T, BN, D, NT>(sV + (st ^ 1) * BN * D, V, p.v_row, (t + 1) * BN, sq.lk);
    }
    cp_async_commit();
    float s[MT][BN / 8][4];
    zero(s);
    gemm_nt<T, D, MT, BN>(s, ln, 0, row0, oK + st * BN * D * 2);

    const int n0 = t * BN;
    const bool full = sq.all_visible(m0 + row0, m0 + row0 + 16 * MT, n0, n0 + BN, p);
    // Path<0> (see run_path; here also a positive scale) takes the row maximum of the raw
    // scores and folds the scale into one FFMA per exponential.
    bool rescale = false;
    auto softmax_tile = [&](auto path) {
      constexpr int kPath = decltype(path)::value;
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
        for (int ni = 0; ni < BN / 8; ++ni)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            if constexpr (kPath > 0) {
              float unused;
              const float x = score.at<kPath == 2>(s[mt][ni][e], unused);
              s[mt][ni][e] =
                  sq.visible(i0 + 16 * mt + (e >> 1) * 8, n0 + ni * 8 + 2 * tq + (e & 1), p)
                      ? x
                      : -INFINITY;
            }
            mx[e >> 1] = fmaxf(mx[e >> 1], s[mt][ni][e]);
          }
        float mu[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          mx[r] = quad_max(mx[r]);
          if constexpr (kPath == 0) mx[r] *= score.scale_log2();
          // The running maximum only moves when the tile's exceeds it by more than kSlack, so
          // most tiles skip rescaling the output; p = 2^(x - m) then stays below 2^kSlack.
          if (mx[r] > m_run[mt][r] + kSlack) {
            const float alpha = ex2(m_run[mt][r] - mx[r]);
            m_run[mt][r] = mx[r];
            l_run[mt][r] *= alpha;
            alpha_run[mt][r] = alpha;
            rescale = true;
          }
          mu[r] = m_run[mt][r] == -INFINITY ? 0.f : m_run[mt][r];  // nothing visible yet: p = 0
        }
#pragma unroll
        for (int ni = 0; ni < BN / 8; ++ni)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const float pv = kPath > 0
                                 ? ex2(s[mt][ni][e] - mu[e >> 1])
                                 : ex2(fmaf(s[mt][ni][e], score.scale_log2(), -mu[e >> 1]));
            s[mt][ni][e] = pv;
            l_run[mt][e >> 1] += pv;
          }
      }
    };
    run_path(full && score.scale_log2() > 0.f, score.capped(), softmax_tile);
    if (__any_sync(0xffffffffu, rescale)) {  // warp-uniform
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
#pragma unroll
          for (int d8 = 0; d8 < D / 8; ++d8) {
            o[mt][d8][2 * r] *= alpha_run[mt][r];
            o[mt][d8][2 * r + 1] *= alpha_run[mt][r];
          }
          alpha_run[mt][r] = 1.f;
        }
    }
    gemm_pv<T, D, MT, BN>(o, s, ln.bt, oV + st * BN * D * 2);
  }
  cp_async_wait<0>();

  float inv[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float l = quad_sum(l_run[mt][r]);
      inv[mt][r] = l > 0.f ? 1.f / l : 0.f;
      const int i = i0 + 16 * mt + r * 8;
      if (tq == 0 && i < sq.lq)
        p.lse[static_cast<int64_t>(h) * p.total_q + sq.q_start + i] =
            l > 0.f ? (m_run[mt][r] + __log2f(l)) * kLn2 : -INFINITY;
    }
  T* O = static_cast<T*>(p.out) + sq.q_start * p.o_row + static_cast<int64_t>(h) * D;
  store_rows<D, MT>(O, p.o_row, i0, sq.lq, o, inv);
#endif
}

// ---------------------------------------------------------------------------------------------
// Backward preprocess: delta[h, i] = sum_d dO[i, h, d] * O[i, h, d] (float32). One thread per
// (row, head).
template <typename T, int D>
__global__ void __launch_bounds__(256) delta_kernel(const AttnParams p) {
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * 256 + threadIdx.x;
  if (idx >= static_cast<int64_t>(p.total_q) * p.hq) return;
  const int64_t i = idx / p.hq;
  const int h = static_cast<int>(idx % p.hq);
  const T* o = static_cast<const T*>(p.out) + i * p.o_row + h * D;
  const T* d = static_cast<const T*>(p.dout) + i * p.do_row + h * D;
  float acc = 0.f;
#pragma unroll
  for (int c = 0; c < D / 8; ++c) {
    const uint4 ov = *reinterpret_cast<const uint4*>(o + c * 8);
    const uint4 dv = *reinterpret_cast<const uint4*>(d + c * 8);
    const T* oe = reinterpret_cast<const T*>(&ov);
    const T* de = reinterpret_cast<const T*>(&dv);
#pragma unroll
    for (int e = 0; e < 8; ++e) acc += to_float(oe[e]) * to_float(de[e]);
  }
  p.delta[static_cast<int64_t>(h) * p.total_q + i] = acc;
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

// The same for rows [m0, m0 + R) of a dK/dV step, copied (cp.async, thread r < R takes row
// m0 + r) into shared memory with the step's tiles, so that no warp waits on the loads: the
// natural-log lse (the reader scales it by log2(e)) and delta, zero for rows past the sequence.
// Those rows have zero Q and dO, so their P (2^0 = 1) meets only zeros in dV += P^T dO, and
// their dS = P (dP - delta) is 0. A row seeing no key (lse = -inf) has no visible (row, key)
// pair, and the readers mask every invisible pair to P = 0.
template <int R>
__device__ __forceinline__ void load_stats(const AttnParams& p, int h, int q_start, int m0,
                                           int lq, float* s_lse, float* s_delta) {
  const int r = threadIdx.x;
  if (r >= R) return;
  const bool valid = m0 + r < lq;
  const int64_t at = static_cast<int64_t>(h) * p.total_q + q_start + (valid ? m0 + r : 0);
  cp_async_4(smem_u32(s_lse + r), p.lse + at, valid);
  cp_async_4(smem_u32(s_delta + r), p.delta + at, valid);
}

// The query steps of a dK/dV CTA (keys [n0, n0 + BN)): the GQA group's query heads times the
// query blocks [t_lo, t_lo + n_tiles) of BM rows that see those keys.
template <int BM, int BN>
struct KeySteps {
  int group, t_lo, n_tiles, n_it;
  __device__ __forceinline__ KeySteps(const AttnParams& p, const Seq& sq, int n0) {
    group = p.hq / p.hkv;
    int i_lo, i_hi;
    sq.queries_of(n0, min(n0 + BN, sq.lk), p, i_lo, i_hi);
    t_lo = i_lo / BM;
    n_tiles = i_hi > i_lo ? (i_hi + BM - 1) / BM - t_lo : 0;
    n_it = group * n_tiles;
  }
};

// The query steps of a dK/dV CTA: step `it` works on query head h and block [m, m + BM), with
// it = (h - h0) n_tiles + (m / BM - t_lo), advanced incrementally (no division per step).
template <int BM>
__device__ __forceinline__ void next_step(int& h, int& m, int t_lo, int n_tiles) {
  m += BM;
  if (m == (t_lo + n_tiles) * BM) m = t_lo * BM, ++h;
}
// A step's Q and dO rows [m0, m0 + BM) of head h (Qb, Ob: the sequence's first rows) and their
// row statistics, copied into one stage.
template <typename T, int BM, int D, int NT>
__device__ __forceinline__ void load_step_tiles(const AttnParams& p, const Seq& sq, const T* Qb,
                                                const T* Ob, int h, int m0, T* s_q, T* s_o,
                                                float* s_lse, float* s_delta) {
  load_rows<T, BM, D, NT>(s_q, Qb + static_cast<int64_t>(h) * D, p.q_row, m0, sq.lq);
  load_rows<T, BM, D, NT>(s_o, Ob + static_cast<int64_t>(h) * D, p.do_row, m0, sq.lq);
  load_stats<BM>(p, h, sq.q_start, m0, sq.lq, s_lse, s_delta);
}

// The float32 dQ accumulator (only the atomic kernel and dq_convert_kernel see it) is stored in
// tiles of 8 rows x 8 columns, each contiguous and row-major: (packed row i, head h, column c) at
// (((i / 8) hq + h) D / 8 + c / 8) 64 + 8 (i % 8) + c % 8, rows rounded up to a multiple of 8.
// A warp's reduction of one half of an m16n8 accumulator (8 rows x 8 columns, two per lane) then
// covers one contiguous 256-byte tile instead of 32-byte pieces of eight rows 8 KiB apart
// (FlashAttention-2 permutes its accumulator for the same reason).
template <int D>
__device__ __forceinline__ int64_t dq_acc_index(int64_t i, int h, int c, int hq) {
  return ((((i >> 3) * hq + h) * (D / 8) + (c >> 3)) << 6) + ((i & 7) << 3) + (c & 7);
}

// dQ accumulation by float32 reductions of 2 consecutive elements (4 per lane, after a swap of
// halves between lanes, was 7% slower: benchmarks/NOTES_attention.md v7).
__device__ __forceinline__ void red_add2(float* dst, float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(dst), "f"(a), "f"(b) : "memory");
#else
  atomicAdd(dst, a);
  atomicAdd(dst + 1, b);
#endif
}
// ---------------------------------------------------------------------------------------------
// dK/dV. Grid (ceil(max_k / BN), hkv, batch); each warp owns 16 keys (BN = 16 NW), BM queries
// per step. Shared memory: K, V (BN x D); Q, dO in two stages (BM x D); lse, delta in two
// stages (BM). dQ comes from dq_kernel (the deterministic path); dQ by atomics is
// dkdv_split_kernel's.
template <typename T, int D, int BM, int BN, int NW>
__global__ void __launch_bounds__(NW * 32) dkdv_kernel(const AttnParams p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  static_assert(BN == 16 * NW && BM % 16 == 0 && D % 64 == 0 && (D / NW) % 16 == 0);
  static_assert(BM <= NW * 32);  // one row statistic per thread
  constexpr int NT = NW * 32;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* sK = reinterpret_cast<T*>(smem_raw);
  T* sV = sK + BN * D;
  T* sQ = sV + BN * D;
  T* sO = sQ + 2 * BM * D;  // dO
  float* sL = reinterpret_cast<float*>(sO + 2 * BM * D);
  float* sD = sL + 2 * BM;
  const int b = blockIdx.z, hk = blockIdx.y, n0 = blockIdx.x * BN;
  const Seq sq(p, b);
  if (n0 >= sq.lk) return;
  const KeySteps<BM, BN> ks(p, sq, n0);
  const int group = ks.group, t_lo = ks.t_lo, n_tiles = ks.n_tiles, n_it = ks.n_it;
  const T* Qb = static_cast<const T*>(p.q) + sq.q_start * p.q_row;
  const T* Ob = static_cast<const T*>(p.dout) + sq.q_start * p.do_row;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3;
  const int row0 = warp * 16, j0 = n0 + row0 + g;
  // Byte offsets of the tiles, and the ldmatrix lanes.
  constexpr int oV = BN * D * 2, oQ = 2 * BN * D * 2, oO = oQ + 2 * BM * D * 2;
  const Lanes<Lane<D>> ln(smem_u32(smem_raw));

  auto advance = [&](int& h, int& m) { next_step<BM>(h, m, t_lo, n_tiles); };
  auto load_step = [&](int h, int m0, int st) {
    load_step_tiles<T, BM, D, NT>(p, sq, Qb, Ob, h, m0, sQ + st * BM * D, sO + st * BM * D,
                                  sL + st * BM, sD + st * BM);
  };
  load_rows<T, BN, D, NT>(sK, static_cast<const T*>(p.k) + sq.k_start * p.k_row + hk * D,
                          p.k_row, n0, sq.lk);
  load_rows<T, BN, D, NT>(sV, static_cast<const T*>(p.v) + sq.k_start * p.v_row + hk * D,
                          p.v_row, n0, sq.lk);
  int h_cur = hk * group, m_cur = t_lo * BM;
  if (n_it > 0) load_step(h_cur, m_cur, 0);
  cp_async_commit();

  const Score score(p);
  float dk[1][D / 8][4], dv[1][D / 8][4];
  zero(dk);
  zero(dv);
  for (int it = 0; it < n_it; ++it) {
    const int st = it & 1;
    cp_async_wait<0>();
    __syncthreads();
    int h_nxt = h_cur, m_nxt = m_cur;
    advance(h_nxt, m_nxt);
    if (it + 1 < n_it) load_step(h_nxt, m_nxt, st ^ 1);
    cp_async_commit();
    const int q_s = oQ + st * BM * D * 2, o_s = oO + st * BM * D * 2;
    const float* l_s = sL + st * BM;
    const float* d_s = sD + st * BM;
    // S^T = K Q^T and dP^T = V dO^T: this warp's 16 keys x BM queries.
    float s[1][BM / 8][4], dp[1][BM / 8][4];
    zero(s);
    zero(dp);
    gemm_nt<T, D, 1, BM>(s, ln, 0, row0, q_s);
    gemm_nt<T, D, 1, BM>(dp, ln, oV, row0, o_s);
    const int m0 = m_cur;
    const bool full = sq.all_visible(m0, m0 + BM, n0 + row0, n0 + row0 + 16, p);
    auto grad_tile = [&](auto path) {  // three copies: see run_path
      constexpr int kPath = decltype(path)::value;
#pragma unroll
      for (int ni = 0; ni < BM / 8; ++ni)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int c = ni * 8 + 2 * tq + (e & 1);
          float pv, ds;
          if constexpr (kPath > 0) {
            float t = 0.f;
            const float x = score.at<kPath == 2>(s[0][ni][e], t);
            pv = sq.visible(m0 + c, j0 + (e >> 1) * 8, p) ? ex2(x - l_s[c] * kLog2e) : 0.f;
            ds = pv * (dp[0][ni][e] - d_s[c]);
            if constexpr (kPath == 2) ds *= 1.f - t * t;
          } else {
            pv = ex2(s[0][ni][e] * score.scale_log2() - l_s[c] * kLog2e);
            ds = pv * (dp[0][ni][e] - d_s[c]);
          }
          s[0][ni][e] = pv;
          dp[0][ni][e] = ds;
        }
    };
    run_path(full, score.capped(), grad_tile);
    gemm_pv<T, D, 1, BM>(dv, s, ln.bt, o_s);   // dV += P^T dO
    gemm_pv<T, D, 1, BM>(dk, dp, ln.bt, q_s);  // dK += dS^T Q
    h_cur = h_nxt;
    m_cur = m_nxt;
  }
  cp_async_wait<0>();
  const float scale[1][2] = {{p.scale, p.scale}}, one[1][2] = {{1.f, 1.f}};
  store_rows<D, 1>(static_cast<T*>(p.dk) + sq.k_start * p.dk_row + hk * D, p.dk_row, j0, sq.lk,
                   dk, scale);
  store_rows<D, 1>(static_cast<T*>(p.dv) + sq.k_start * p.dv_row + hk * D, p.dv_row, j0, sq.lk,
                   dv, one);
#endif
}

// ---------------------------------------------------------------------------------------------
// dK/dV and (by float32 atomics) dQ with the work split over 8 warps differently for each
// product (FlashAttention-2's layout), so that a fragment read from shared memory feeds two MMA
// rows everywhere. Grid (ceil(max_k / BN), hkv, batch), BN = 128 keys, BM queries per step, and
// QH = BM / 2:
//   S^T = K Q^T and dP^T = V dO^T: warp (wk = w % 4, wq = w / 4) computes keys 32 wk + [0, 32) x
//     queries QH wq + [0, QH); P^T and dS^T go to shared memory ([key][query], 16-byte chunks
//     swizzled like the D-column tiles: conflict-free for the stores and for ldmatrix);
//   dV += P^T dO and dK += dS^T Q: warp (wk, wd = w / 4) owns keys 32 wk + [0, 32) x columns
//     D/2 wd + [0, D/2) of dK and dV, in registers;
//   dQ += dS K: warp (w % NQ, w / NQ), NQ = BM / 32, computes queries 32 (w % NQ) + [0, 32) x
//     columns DQ (w / NQ) + [0, DQ), DQ = D NQ / 8 (32 x 32 at both head dims), and adds them to
//     the float32 accumulator.
// One barrier per step. Q/dO (and their row statistics) stream through two stages and P^T/dS^T
// alternate between two buffers. Step `it` waits for its Q/dO copies (an mbarrier per stage
// that counts every thread's cp.async copies), computes S/dP from stage it % 2 and writes P/dS
// buffer it & 1, then takes the barrier, issues the copies of step it + 1 into the other stage
// and runs the dV/dK/dQ products of step it. Every buffer written after the barrier was last read
// before it: the other stage by step it - 1, P/dS buffer (it + 1) & 1 (written by the next step's
// S/dP) by step it - 1's products. A warp done with its products may thus start the next step's
// S/dP while others still run theirs. (Publishing the copies by the barrier instead needs three
// stages, one step ahead: as fast at D=128, run b9d0c8b6, and it does not fit at D=64, BM=128.)
// Shared memory: K, V (BN x D); Q, dO (2 x BM x D); P^T, dS^T (2 x BN x BM); lse, delta (2 x BM);
// 2 mbarriers: 193 KiB at D=128, BM=64 and 226 KiB at D=64, BM=128 (on a GPU with less than
// that per block, run_bwd takes the dQ pass instead).
template <typename T, int D, int BM>
__global__ void __launch_bounds__(256) dkdv_split_kernel(const AttnParams p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  constexpr int BN = 128, NT = 256, DH = D / 2, QH = BM / 2, kStages = 2;
  // dQ: NQ query groups of 32 x NC column groups of DQ (32 x 32 per warp at both head dims).
  constexpr int NQ = BM / 32, NC = 8 / NQ, DQ = D / NC;
  static_assert(D % 64 == 0 && (BM == 64 || BM == 128));
  extern __shared__ __align__(16) unsigned char smem_raw[];
  // Tiles as byte offsets from the start of shared memory (the ldmatrix lanes take those).
  constexpr int oV = BN * D * 2, oQ = 2 * BN * D * 2, oO = oQ + kStages * BM * D * 2;
  constexpr int oP = oO + kStages * BM * D * 2, oS = oP + 2 * BN * BM * 2;
  constexpr int oL = oS + 2 * BN * BM * 2;  // oP: P^T, oS: dS^T
  T* sK = reinterpret_cast<T*>(smem_raw);
  T* sV = reinterpret_cast<T*>(smem_raw + oV);
  T* sQ = reinterpret_cast<T*>(smem_raw + oQ);
  T* sO = reinterpret_cast<T*>(smem_raw + oO);  // dO
  float* sL = reinterpret_cast<float*>(smem_raw + oL);
  float* sD = sL + kStages * BM;
  const uint32_t bar0 = smem_u32(sD + kStages * BM);  // the stages' mbarriers, 8 bytes each
  const int b = blockIdx.z, hk = blockIdx.y, n0 = blockIdx.x * BN;
  const Seq sq(p, b);
  if (n0 >= sq.lk) return;
  const KeySteps<BM, BN> ks(p, sq, n0);
  const int group = ks.group, t_lo = ks.t_lo, n_tiles = ks.n_tiles, n_it = ks.n_it;
  const T* Qb = static_cast<const T*>(p.q) + sq.q_start * p.q_row;
  const T* Ob = static_cast<const T*>(p.dout) + sq.q_start * p.do_row;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3;
  const int wk = warp & 3, wh = warp >> 2;  // key group; query half (S, dP) or column half (dK, dV)
  const int k0 = 32 * wk;                   // the warp's first key in the block
  const int wm = warp % NQ, wc = warp / NQ;  // dQ: query group, column group
  // The ldmatrix lanes: K/V and Q/dO rows (S, dP); dO/Q columns DH wh + [0, DH) (dV, dK); K
  // columns DQ wc + [0, DQ) (dQ); P^T/dS^T rows (dV, dK); dS^T columns 32 wm + [0, 32) read
  // transposed (dQ: the lane_b pattern of a BM-column tile from column block 2 wm).
  const uint32_t sbase = smem_u32(smem_raw);
  const Lanes<Lane<D>> ln(sbase);
  const Lane<D> ln_kv = lane_bt<D>(sbase, DH / 16 * wh), ln_dq = lane_bt<D>(sbase, DQ / 16 * wc);
  const LaneXor<BM> ln_pa = lane_a<LaneXor<BM>>(sbase);
  const Lane<BM> ln_st = Lane<BM>(sbase, ((lane >> 4) << 3) + (lane & 7), (lane >> 3) & 1,
                                  2 * wm);

  auto load_step = [&](int h, int m0, int st) {
    load_step_tiles<T, BM, D, NT>(p, sq, Qb, Ob, h, m0, sQ + st * BM * D, sO + st * BM * D,
                                  sL + st * BM, sD + st * BM);
  };
  load_rows<T, BN, D, NT>(sK, static_cast<const T*>(p.k) + sq.k_start * p.k_row + hk * D,
                          p.k_row, n0, sq.lk);
  load_rows<T, BN, D, NT>(sV, static_cast<const T*>(p.v) + sq.k_start * p.v_row + hk * D,
                          p.v_row, n0, sq.lk);
  auto advance = [&](int& h, int& m) { next_step<BM>(h, m, t_lo, n_tiles); };
  if (threadIdx.x == 0) {
    mbar_init(bar0, NT);
    mbar_init(bar0 + 8, NT);
  }
  // Step 0 (with K, V) by a copy group and the barrier; (h_ld, m_ld) is then the step that the
  // loop loads next.
  int h_cur = hk * group, m_cur = t_lo * BM, h_ld = h_cur, m_ld = m_cur;
  if (n_it > 0) load_step(h_ld, m_ld, 0);
  cp_async_commit();
  advance(h_ld, m_ld);
  cp_async_wait<0>();
  __syncthreads();

  const Score score(p);
  float dk[2][DH / 8][4], dv[2][DH / 8][4];
  zero(dk);
  zero(dv);
  for (int it = 0; it < n_it; ++it) {
    const int st = it & 1;  // the Q/dO stage and the P^T/dS^T buffer
    const int q_s = oQ + st * BM * D * 2, o_s = oO + st * BM * D * 2;
    const int pb = st * BN * BM * 2;  // byte offset of this step's P^T/dS^T buffer
    const int m0 = m_cur;
    // Step it >= 1 was the ((it - 1) / 2)-th copy into its stage: mbarrier phase of that parity.
    if (it > 0) mbar_wait(bar0 + 8 * st, ((it - 1) >> 1) & 1);
    {
      const float* l_s = sL + st * BM + QH * wh;
      const float* d_s = sD + st * BM + QH * wh;
      // S^T and dP^T: keys k0 + [0, 32) x queries QH wh + [0, QH) (rows QH wh of the Q/dO tile;
      // QH is a multiple of the swizzle period, so the sub-tile keeps its layout).
      float s[2][QH / 8][4], dp[2][QH / 8][4];
      zero(s);
      zero(dp);
      gemm_nt<T, D, 2, QH>(s, ln, 0, k0, q_s + QH * wh * D * 2);
      gemm_nt<T, D, 2, QH>(dp, ln, oV, k0, o_s + QH * wh * D * 2);
      const int qa = m0 + QH * wh, ka = n0 + k0;  // first query and key of the warp's tile
      const bool full = sq.all_visible(qa, qa + QH, ka, ka + 32, p);
      auto grad_tile = [&](auto path) {  // three copies: see run_path
        constexpr int kPath = decltype(path)::value;
#pragma unroll
        for (int mt = 0; mt < 2; ++mt)
#pragma unroll
          for (int ni = 0; ni < QH / 8; ++ni)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const int c = ni * 8 + 2 * tq + (e & 1);
              float pv, ds;
              if constexpr (kPath > 0) {
                float t = 0.f;
                const float x = score.at<kPath == 2>(s[mt][ni][e], t);
                pv = sq.visible(qa + c, ka + 16 * mt + g + (e >> 1) * 8, p)
                         ? ex2(x - l_s[c] * kLog2e)
                         : 0.f;
                ds = pv * (dp[mt][ni][e] - d_s[c]);
                if constexpr (kPath == 2) ds *= 1.f - t * t;
              } else {
                pv = ex2(s[mt][ni][e] * score.scale_log2() - l_s[c] * kLog2e);
                ds = pv * (dp[mt][ni][e] - d_s[c]);
              }
              s[mt][ni][e] = pv;
              dp[mt][ni][e] = ds;
            }
      };
      run_path(full, score.capped(), grad_tile);
      // Row k0 + 16 mt + g + 8 r of the [key][query] tiles, 16-byte chunk QH wh / 8 + ni.
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int ni = 0; ni < QH / 8; ++ni)
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            const int at = swz<BM>(k0 + 16 * mt + g + 8 * r, QH / 8 * wh + ni) + 2 * tq;
            *reinterpret_cast<uint32_t*>(smem_raw + oP + pb + 2 * at) =
                pack2<T>(s[mt][ni][2 * r], s[mt][ni][2 * r + 1]);
            *reinterpret_cast<uint32_t*>(smem_raw + oS + pb + 2 * at) =
                pack2<T>(dp[mt][ni][2 * r], dp[mt][ni][2 * r + 1]);
          }
    }
    __syncthreads();
    if (it + 1 < n_it) {
      load_step(h_ld, m_ld, st ^ 1);
      cp_async_mbar_arrive(bar0 + 8 * (st ^ 1));
    }
    advance(h_ld, m_ld);
    // dV += P^T dO and dK += dS^T Q over the BM queries: A fragments from the [key][query]
    // tiles, B fragments from the dO / Q tiles (k index = query row), columns DH wh + [0, DH).
    auto grad_product = [&](float (&acc)[2][DH / 8][4], int a_tile, int b_tile) {
#pragma unroll
      for (int kk = 0; kk < BM / 16; ++kk) {
        uint32_t a[2][4];
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) ldmatrix_x4(a[mt], ln_pa.at(a_tile, k0 + 16 * mt, kk));
#pragma unroll
        for (int j = 0; j < DH / 16; ++j) {
          uint32_t bf[4];
          ldmatrix_x4_trans(bf, ln_kv.at(b_tile, kk * 16, j));
#pragma unroll
          for (int mt = 0; mt < 2; ++mt) {
            mma_16816<T>(acc[mt][2 * j], a[mt], bf[0], bf[1]);
            mma_16816<T>(acc[mt][2 * j + 1], a[mt], bf[2], bf[3]);
          }
        }
      }
    };
    auto dq_atomic = [&] {
      // dQ[queries 32 wm + [0, 32), columns DQ wc + [0, DQ)] = dS K over the BN keys;
      // dS (query x key) from dS^T by ldmatrix.trans.
      constexpr int MQ = 2;
      float acc[MQ][DQ / 8][4];
      zero(acc);
#pragma unroll
      for (int kk = 0; kk < BN / 16; ++kk) {
        uint32_t a[MQ][4];
#pragma unroll
        for (int mt = 0; mt < MQ; ++mt) ldmatrix_x4_trans(a[mt], ln_st.at(oS + pb, kk * 16, mt));
#pragma unroll
        for (int j = 0; j < DQ / 16; ++j) {
          uint32_t bf[4];
          ldmatrix_x4_trans(bf, ln_dq.at(0, kk * 16, j));
#pragma unroll
          for (int mt = 0; mt < MQ; ++mt) {
            mma_16816<T>(acc[mt][2 * j], a[mt], bf[0], bf[1]);
            mma_16816<T>(acc[mt][2 * j + 1], a[mt], bf[2], bf[3]);
          }
        }
      }
      const int h = h_cur;
#pragma unroll
      for (int mt = 0; mt < MQ; ++mt)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int i = m0 + 32 * wm + 16 * mt + g + 8 * r;
          if (i >= sq.lq) continue;
          float* dst = p.dq_acc + dq_acc_index<D>(sq.q_start + i, h, DQ * wc + 2 * tq, p.hq);
#pragma unroll
          for (int n8 = 0; n8 < DQ / 8; ++n8)
            red_add2(dst + n8 * 64, acc[mt][n8][2 * r], acc[mt][n8][2 * r + 1]);
        }
    };
    // dV, dQ, then dK: dQ's reductions drain while dK's products run (1% faster than dQ last
    // with one barrier per step; it was 2% slower with two: benchmarks/NOTES_attention.md).
    grad_product(dv, oP + pb, o_s);
    dq_atomic();
    grad_product(dk, oS + pb, q_s);
    advance(h_cur, m_cur);
  }
  cp_async_commit();  // nothing is left in flight: every step's copies were waited for
  cp_async_wait<0>();
  const float scale[2][2] = {{p.scale, p.scale}, {p.scale, p.scale}};
  const float one[2][2] = {{1.f, 1.f}, {1.f, 1.f}};
  const int j0 = n0 + k0 + g;  // the lane's first key
  store_rows<DH, 2>(static_cast<T*>(p.dk) + sq.k_start * p.dk_row + hk * D + DH * wh, p.dk_row,
                    j0, sq.lk, dk, scale);
  store_rows<DH, 2>(static_cast<T*>(p.dv) + sq.k_start * p.dv_row + hk * D + DH * wh, p.dv_row,
                    j0, sq.lk, dv, one);
#endif
}

// dQ = scale * the float32 accumulator (tiled: dq_acc_index), one thread per 8 elements of a
// (row, head), which are 32 contiguous bytes of the accumulator.
template <typename T, int D>
__global__ void __launch_bounds__(256) dq_convert_kernel(const AttnParams p) {
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * 256 + threadIdx.x;
  if (idx >= static_cast<int64_t>(p.total_q) * p.hq * (D / 8)) return;
  const int64_t row = idx / (p.hq * (D / 8));
  const int c = static_cast<int>(idx % (p.hq * (D / 8)));  // head * D / 8 + chunk
  const float4* src = reinterpret_cast<const float4*>(
      p.dq_acc + dq_acc_index<D>(row, c / (D / 8), (c % (D / 8)) * 8, p.hq));
  const float4 x = src[0], y = src[1];
  uint4 out;
  out.x = pack2<T>(x.x * p.scale, x.y * p.scale);
  out.y = pack2<T>(x.z * p.scale, x.w * p.scale);
  out.z = pack2<T>(y.x * p.scale, y.y * p.scale);
  out.w = pack2<T>(y.z * p.scale, y.w * p.scale);
  *reinterpret_cast<uint4*>(static_cast<T*>(p.dq) + row * p.dq_row + c * 8) = out;
}

// ---------------------------------------------------------------------------------------------
// dQ. Grid (ceil(max_q / BM), hq, batch); each warp owns MT row tiles of 16 queries
// (BM = 16 MT NW), BN keys per tile. Shared memory: Q, dO (BM x D); K, V in two stages (BN x D).
template <typename T, int D, int MT, int BN, int NW>
__global__ void __launch_bounds__(NW * 32) dq_kernel(const AttnParams p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  constexpr int BM = 16 * MT * NW, NT = NW * 32;
  static_assert(BN % 16 == 0 && D % 64 == 0);
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);
  T* sO = sQ + BM * D;  // dO
  T* sK = sO + BM * D;
  T* sV = sK + 2 * BN * D;
  // Query blocks run last to first, as in the forward.
  const int b = blockIdx.z, h = blockIdx.y, m0 = (gridDim.x - 1 - blockIdx.x) * BM;
  const Seq sq(p, b);
  if (m0 >= sq.lq) return;
  const int hk = h / (p.hq / p.hkv);
  const T* K = static_cast<const T*>(p.k) + sq.k_start * p.k_row + static_cast<int64_t>(hk) * D;
  const T* V = static_cast<const T*>(p.v) + sq.k_start * p.v_row + static_cast<int64_t>(hk) * D;
  int n_lo, n_hi;
  sq.keys_of(m0, min(m0 + BM, sq.lq), p, n_lo, n_hi);
  const int t_lo = n_lo / BN, t_hi = n_hi > n_lo ? (n_hi + BN - 1) / BN : t_lo;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3;
  const int row0 = warp * 16 * MT, i0 = m0 + row0 + g;
  constexpr int oO = BM * D * 2, oK = 2 * BM * D * 2, oV = oK + 2 * BN * D * 2;  // byte offsets
  const Lanes<Lane<D>> ln(smem_u32(smem_raw));

  load_rows<T, BM, D, NT>(sQ, static_cast<const T*>(p.q) + sq.q_start * p.q_row + h * D, p.q_row,
                          m0, sq.lq);
  load_rows<T, BM, D, NT>(sO, static_cast<const T*>(p.dout) + sq.q_start * p.do_row + h * D,
                          p.do_row, m0, sq.lq);
  if (t_lo < t_hi) {
    load_rows<T, BN, D, NT>(sK, K, p.k_row, t_lo * BN, sq.lk);
    load_rows<T, BN, D, NT>(sV, V, p.v_row, t_lo * BN, sq.lk);
  }
  cp_async_commit();
  float lse2[MT][2], dl[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int r = 0; r < 2; ++r)
      row_stats(p, h, sq.q_start, i0 + 16 * mt + r * 8, sq.lq, lse2[mt][r], dl[mt][r]);

  const Score score(p);
  float dq[MT][D / 8][4];
  zero(dq);
  for (int t = t_lo; t < t_hi; ++t) {
    const int st = (t - t_lo) & 1;
    cp_async_wait<0>();
    __syncthreads();
    if (t + 1 < t_hi) {
      load_rows<T, BN, D, NT>(sK + (st ^ 1) * BN * D, K, p.k_row, (t + 1) * BN, sq.lk);
      load_rows<T, BN, D, NT>(sV + (st ^ 1) * BN * D, V, p.v_row, (t + 1) * BN, sq.lk);
    }
    cp_async_commit();
    float s[MT][BN / 8][4], dp[MT][BN / 8][4];
    zero(s);
    zero(dp);
    gemm_nt<T, D, MT, BN>(s, ln, 0, row0, oK + st * BN * D * 2);
    gemm_nt<T, D, MT, BN>(dp, ln, oO, row0, oV + st * BN * D * 2);
    const int n0 = t * BN;
    const bool full = sq.all_visible(m0 + row0, m0 + row0 + 16 * MT, n0, n0 + BN, p);
    auto grad_tile = [&](auto path) {  // three copies: see run_path
      constexpr int kPath = decltype(path)::value;
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int ni = 0; ni < BN / 8; ++ni)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int r = e >> 1;
            float ds;
            if constexpr (kPath > 0) {
              float t = 0.f;
              const float x = score.at<kPath == 2>(s[mt][ni][e], t);
              const bool vis =
                  sq.visible(i0 + 16 * mt + r * 8, n0 + ni * 8 + 2 * tq + (e & 1), p);
              const float pv = vis ? ex2(x - lse2[mt][r]) : 0.f;
              ds = pv * (dp[mt][ni][e] - dl[mt][r]);
              if constexpr (kPath == 2) ds *= 1.f - t * t;
            } else {
              ds = ex2(s[mt][ni][e] * score.scale_log2() - lse2[mt][r]) *
                   (dp[mt][ni][e] - dl[mt][r]);
            }
            dp[mt][ni][e] = ds;
          }
    };
    run_path(full, score.capped(), grad_tile);
    gemm_pv<T, D, MT, BN>(dq, dp, ln.bt, oK + st * BN * D * 2);  // dQ += dS K
  }
  cp_async_wait<0>();
  float scale[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) scale[mt][0] = scale[mt][1] = p.scale;
  store_rows<D, MT>(static_cast<T*>(p.dq) + sq.q_start * p.dq_row + h * D, p.dq_row, i0, sq.lq,
                    dq, scale);
#endif
}

}  // namespace attn
}  // namespace fusedops
