// The cross-entropy statistics in the epilogue of the Hopper logits GEMM (layout 1, z = X W^T):
// EpiCEStats stores z as EpiStore does (TMA, and plain stores for the last N % 8 columns) and
// reduces each row of each 128 x 256 tile to a partial (max, sum of exp, target logit, logit
// sum); ce_stats_combine_kernel merges the partials of a row into lse, zt and zsum. The row
// kernel then only runs its dz pass (MODE_DZ) over the stored z.
//
// The math is the row kernels' (ce_rows_kernel.cuh): per column j, the logit the statistics see
// is apply_cap(float(round(z_j)) + bias_j, softcap), i.e. the stored (rounded, raw) z plus the
// float32 bias, then the softcap; exponentials by ex2. The stored z carries neither bias nor
// softcap, because MODE_DZ applies both to what it reads. Computing the statistics from the
// rounded z (not the float32 accumulator) keeps lse consistent with the softmax MODE_DZ forms
// from the same stored values, as in the cuBLAS path.
//
// Partials: float4 (m, s, zt, zs) per (row, column tile), [M][tiles_n] with tiles_n =
// ceil(N / 256): m the max over the tile's valid columns (< N), s = sum exp(v - m), zt = v at the
// row's target when the target's column lies in the tile (else 0), zs = sum v. A partial with
// no valid column is (-inf, 0, 0, 0), the identity of the combine. Targets outside [0, N)
// (ignore_index) give zt = 0; their rows still get statistics.
//
// Constraints: those of gemm_kernel_sm90 for layout 1, plus: target int64 [M], bias float32 [N]
// or null (8-byte aligned), partials 16-byte aligned. The binding (gemm_sm90_api.cpp) checks them.
#pragma once

#include "ce_rows_kernel.cuh"  // rows::apply_cap, rows::merge_state: the row kernels' math
#include "gemm_sm90.cuh"

namespace fusedops {
namespace lce_gemm {

template <typename T>
struct EpiCEStats {
  struct Params {
    CUtensorMap tm_c;        // z [M, n_tma], boxes 64 x 64, 128-byte swizzle (none if n_tma = 0)
    T* c;                    // z itself: its columns >= n_tma (SlabStager::store_tail)
    int64_t ldc;             // z's row stride in elements
    int n_tma;               // tma_store_cols(n)
    const float* bias;       // [N] or null
    const int64_t* target;   // [M]
    float4* partials;        // [M][ld_part]
    int64_t ld_part;         // float4s per row (tiles_n)
    float softcap;           // 0: none
    int m, n;
  };
  static constexpr int kBoxes = GemmTilesSm90::kBlockN / 64;
  static constexpr int kFrag = GemmTilesSm90::kBlockN / 8;  // 8-column blocks of the fragment

  const Params& p;
  SlabStager st;
  // Per row of the thread (h): the target's column in the tile (0..255), or -1 when the target
  // lies outside the tile or outside [0, N).
  int ttile[2];

  __device__ __forceinline__ EpiCEStats(const Params& params, const SlabStager& stager)
      : p(params), st(stager) {}

  // Before the tile's main loop: the targets of the thread's two rows, and an L1 prefetch of
  // the tile's 256 bias values (eight 128-byte lines, one per lane of the warpgroup's first
  // warp), so that end_tile's bias loads hit L1 without holding 64 registers over the main loop.
  __device__ __forceinline__ void begin_tile(const FragCoord& f) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = f.row0 + 8 * h;
      ttile[h] = -1;
      if (row < p.m) {
        const int64_t t = p.target[row];
        if (t >= f.n0 && t < f.n0 + GemmTilesSm90::kBlockN && t < p.n)
          ttile[h] = static_cast<int>(t - f.n0);
      }
    }
    if (p.bias != nullptr && f.warp == 0 && f.lane < GemmTilesSm90::kBlockN / 32) {
      const int col = f.n0 + 32 * f.lane;
      if (col < p.n)
        asm volatile("prefetch.global.L1 [%0];\n" ::"l"(p.bias + col));
    }
  }

  // bias[col], bias[col + 1] (0 past N); col is even, bias 8-byte aligned (the binding checks).
  __device__ __forceinline__ float2 bias_pair(int col) const {
    if (p.bias == nullptr) return make_float2(0.f, 0.f);
    if (col + 1 < p.n) return __ldg(reinterpret_cast<const float2*>(p.bias + col));
    return make_float2(col < p.n ? __ldg(p.bias + col) : 0.f, 0.f);
  }

  // Max, sum of exp and sum over the thread's 64 logits of row h (offsets 8 j + e from col0;
  // with kMasked only those below lim, the columns < N).
  template <bool kMasked>
  __device__ __forceinline__ void row_stats(const float (&acc)[kFrag][4], int h, int lim,
                                            float& mx, float& s, float& zs) const {
    mx = -INFINITY;
#pragma unroll
    for (int j = 0; j < kFrag; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e)
        if (!kMasked || 8 * j + e < lim) mx = fmaxf(mx, acc[j][2 * h + e]);
    // exp(v - mx) = 2^(v log2e - mx log2e), one FFMA; no valid column: every term is masked.
    const float mx2 = (mx == -INFINITY ? 0.f : mx) * dev::kLog2e;
    s = 0.f;
    zs = 0.f;
#pragma unroll
    for (int j = 0; j < kFrag; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float v = acc[j][2 * h + e];
        if (!kMasked || 8 * j + e < lim) {
          s += dev::ex2(fmaf(v, dev::kLog2e, -mx2));
          zs += v;
        }
      }
  }

  __device__ __forceinline__ void end_tile(float (&acc)[kFrag][4], const FragCoord& f) {
    if (f.slab_m0 >= p.m) return;  // warpgroup-uniform: the slab lies below C
    const int g = f.lane >> 2, tq = f.lane & 3;
    const float cap = p.softcap;
    // z: rounded to T and stored as EpiStore<T, false> does; acc keeps the rounded values plus
    // the bias. The target logit: lane 0 of the row's quad reads the rounded z at the target
    // from the box's staging buffer once the warpgroup's barrier in end() has made every
    // thread's part visible (the buffer is rewritten only after two more boxes' barriers).
    float zt[2] = {0.f, 0.f};
#pragma unroll
    for (int j = 0; j < kBoxes; ++j) {
      const int box_col = f.n0 + 64 * j;
      if (box_col >= p.n) break;  // uniform: the box lies right of C
      float2 b[8];
#pragma unroll
      for (int c = 0; c < 8; ++c) b[c] = bias_pair(f.col0 + 64 * j + 8 * c);
      st.begin();
      const uint32_t box_buf = st.current();
#pragma unroll
      for (int c = 0; c < 8; ++c)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          float& x0 = acc[8 * j + c][2 * h];
          float& x1 = acc[8 * j + c][2 * h + 1];
          const uint32_t v = dev::pack2<T>(x0, x1);
          st.put(16 * f.warp + g + 8 * h, c, tq, v);
          x0 = EpiStore<T, false>::lo_f(v) + b[c].x;
          x1 = EpiStore<T, false>::hi_f(v) + b[c].y;
        }
      st.end(&p.tm_c, box_col, f.slab_m0, box_col < p.n_tma);
      if (p.n_tma < p.n && p.n_tma < box_col + 64)  // uniform: the box holds z's last columns
        st.store_tail(p.c, p.ldc, f.slab_m0, p.m, box_col, p.n_tma, p.n, 32 * f.warp + f.lane);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int col = ttile[h] - 64 * j;  // the target's column in this box
        if (tq == 0 && col >= 0 && col < 64) {
          const int r = 16 * f.warp + g + 8 * h;
          unsigned short bits;
          asm volatile("ld.shared.u16 %0, [%1];\n"
                       : "=h"(bits)
                       : "r"(box_buf + r * 128 + (((col >> 3) ^ (r & 7)) << 4) + 2 * (col & 7)));
          const int t = f.n0 + ttile[h];
          const float raw = EpiStore<T, false>::lo_f(bits);
          zt[h] = rows::apply_cap(raw + (p.bias != nullptr ? __ldg(p.bias + t) : 0.f), cap);
        }
      }
    }
    // The logits under the softcap, then per row max, sum of exp and sum over the thread's
    // columns, then over the quad's four lanes (all columns valid but in the last tile column).
    if (cap != 0.f) {
#pragma unroll
      for (int j = 0; j < kFrag; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[j][e] = rows::apply_cap(acc[j][e], cap);
    }
    const int lim = p.n - f.col0;
    const bool full = f.n0 + GemmTilesSm90::kBlockN <= p.n;  // tile-uniform
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float mx, s, zs;
      if (full)
        row_stats<false>(acc, h, lim, mx, s, zs);
      else
        row_stats<true>(acc, h, lim, mx, s, zs);
#pragma unroll
      for (int off = 1; off <= 2; off <<= 1) {
        const float m2 = __shfl_xor_sync(0xffffffffu, mx, off);
        const float s2 = __shfl_xor_sync(0xffffffffu, s, off);
        zs += __shfl_xor_sync(0xffffffffu, zs, off);
        rows::merge_state(mx, s, m2, s2);
      }
      const int row = f.row0 + 8 * h;
      if (tq == 0 && row < p.m)
        p.partials[static_cast<int64_t>(row) * p.ld_part + f.n0 / GemmTilesSm90::kBlockN] =
            make_float4(mx, s, zt[h], zs);
    }
  }

  __device__ __forceinline__ void finish() { st.finish(); }
};

// Per row: m = max m_t, s = sum s_t exp(m_t - m) (merge_state, as the row kernels merge their
// threads), lse = m + log s, zt = sum zt_t, zsum = sum zs_t. One warp per row, kWarps rows per
// CTA of 32 kWarps threads; any architecture.
template <int kWarps>
__global__ void __launch_bounds__(32 * kWarps)
    ce_stats_combine_kernel(const float4* partials, int64_t ld_part, int tiles, int rows,
                            float* lse, float* zt, float* zsum) {
  const int row = blockIdx.x * kWarps + threadIdx.x / 32, lane = threadIdx.x % 32;
  if (row >= rows) return;  // warp-uniform
  const float4* src = partials + static_cast<int64_t>(row) * ld_part;
  float m = -INFINITY, s = 0.f, a = 0.f, b = 0.f;
  for (int t = lane; t < tiles; t += 32) {
    const float4 v = src[t];
    rows::merge_state(m, s, v.x, v.y);
    a += v.z;
    b += v.w;
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    const float m2 = __shfl_xor_sync(0xffffffffu, m, off);
    const float s2 = __shfl_xor_sync(0xffffffffu, s, off);
    a += __shfl_xor_sync(0xffffffffu, a, off);
    b += __shfl_xor_sync(0xffffffffu, b, off);
    rows::merge_state(m, s, m2, s2);
  }
  if (lane == 0) {
    lse[row] = m + logf(s);
    zt[row] = a;
    zsum[row] = b;
  }
}

}  // namespace lce_gemm
}  // namespace fusedops
