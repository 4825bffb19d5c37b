// dz from z in the operand path of the Hopper d_hidden and d_weight GEMMs (gemm_sm90.cuh): the
// A operand of both products is dz, which the consumer warpgroups compute from the stored logits z
// (raw: no bias, no softcap) as the row kernel's MODE_DZ does, so that no pass over z writes dz:
//   dz = w (p (1 + 2 zl lse) - eps / V - (1 - eps) [col == target]) (1 - (z' / softcap)^2),
//   z' = apply_cap(float(z) + bias), p = 2^(z' log2e - lse log2e),
// with the float32 bias, per-token lse, w (d loss / d per-token loss; 0 for ignore_index) and
// target. The softcap factor applies only when softcap != 0.
//
// The A fragments come from registers (wgmma's RS form, Wgmma<T, 256>::rs_mn with B from shared
// memory MN-major, which both products have): per k-step of 16 the producer's TMA tile of z is
// read by one ldmatrix.x4 per warp (layout 2, z [tokens, V] K-major: plain; layout 3, z read as
// A^T [K = tokens, M = V], M-major: .trans), transformed in registers and packed back into the
// m16n8k16 A-fragment layout. Per warp w of the warpgroup and lane = 4 g + tq, register a[i]
// (i < 4) holds the element pair (lo, hi) at
//   m = 16 w + g + 8 (i & 1),  k = 2 tq + 8 (i >> 1) + {0, 1}
// of the warpgroup's 64 x 16 slab (tests/linear_ce/test_gemm_sm90_dz_map.py models the TMA
// swizzle, the ldmatrix lane addresses and deliveries, and checks this mapping and that every
// element of a k-block is taken exactly once).
//
// Per-token values come from a float4 table built per call (dz_table_kernel, gemm_sm90.cu):
// {lse log2e, w (1 + 2 zl lse), w, target as int bits (-1 outside [0, V))}. For layout 2 the tokens
// are the tile's M rows (two per thread, read once per tile); for layout 3 they are the K index
// (four per thread and k-step, read by plain loads, L1/L2-resident: 16 bytes per token). The bias
// is per vocab column: the K index for layout 2 (four per k-step), M for layout 3 (two per tile).
// Columns >= V and tokens past the end give dz = 0 (the zero-filled tile edges must add nothing).
// Layout 3 can also write d_bias's chunk sums (Params::dbias, end_tile), as the dz pass's
// dz.sum(0) did, from the float32 dz.
#pragma once

#include <cstdint>

#include "../device_utils.cuh"
#include "ce_rows_kernel.cuh"  // rows::apply_cap: the row kernels' softcap
#include "gemm_sm90.cuh"

namespace fusedops {
namespace lce_gemm {

// ldmatrix.x4 (plain / .trans) of four 8 x 8 matrices of 16-bit elements: lane l gives the
// address of row l % 8 of matrix l / 8; register i gets matrix i. Plain: thread t holds row t / 4,
// columns 2 (t % 4), + 1 of each. .trans: row 2 (t % 4) (lo) and + 1 (hi) of column t / 4.
__device__ __forceinline__ void ldsm_x4(uint32_t addr, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_trans(uint32_t addr, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// kATrans = 0: layout 2 (d_hidden = dz W; A = z [tokens = M, V = K]);
// kATrans = 1: layout 3 (d_weight = dz^T X; A^T = z [tokens = K, V = M]).
template <typename T, bool kATrans>
struct DzPrologue {
  static constexpr bool kOn = true;
  struct Params {
    const float4* tab;  // [tokens] {lse log2e, w (1 + 2 zl lse), w, target bits}
    const float* bias;  // [V] float32, or null
    float c_zs;         // -eps / V
    float c_zt;         // -(1 - eps)
    float softcap;      // 0: none
    int vocab;          // V
    int tokens;
    float* dbias;       // layout 3 only, or null: dbias[v] = sum over the tokens of dz[., v]
  };

  const Params& p;
  int warp, g, tq;
  // Per tile: layout 2 the thread's two token rows' table entries, layout 3 its two vocab rows'
  // biases.
  float4 row_tab[2];
  float row_bias[2];
  int row_ok[2];
  float row_sum[2];  // layout 3 with dbias: the thread's share of its two vocab rows' dz sums

  __device__ __forceinline__ DzPrologue(const Params& params, int warp_, int lane)
      : p(params), warp(warp_), g(lane >> 2), tq(lane & 3) {}

  // r0: the thread's first fragment row in the product (slab_m0 + 16 warp + g).
  __device__ __forceinline__ void begin_tile(int r0) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = r0 + 8 * h;
      row_sum[h] = 0.f;
      if constexpr (!kATrans) {
        row_ok[h] = r < p.tokens;
        row_tab[h] = row_ok[h] ? __ldg(p.tab + r) : make_float4(0.f, 0.f, 0.f, 0.f);
        row_tab[h].w = row_ok[h] ? row_tab[h].w : __int_as_float(-1);
      } else {
        row_ok[h] = r < p.vocab;
        row_bias[h] = (row_ok[h] && p.bias != nullptr) ? __ldg(p.bias + r) : 0.f;
      }
    }
  }

  __device__ __forceinline__ float dz(float raw, float b, const float4& tb, int col,
                                      bool ok) const {
    const float zj = rows::apply_cap(raw + b, p.softcap);
    float d = tb.y * dev::ex2(zj * dev::kLog2e - tb.x) + tb.z * p.c_zs;
    if (col == __float_as_int(tb.w)) d += tb.z * p.c_zt;
    if (p.softcap != 0.f) {
      const float c = zj / p.softcap;
      d *= 1.f - c * c;
    }
    return ok ? d : 0.f;
  }

  __device__ __forceinline__ static float lo_f(uint32_t v) {
    if constexpr (std::is_same_v<T, __nv_bfloat16>)
      return __uint_as_float(v << 16);
    else
      return __half2float(__ushort_as_half(static_cast<unsigned short>(v & 0xffffu)));
  }
  __device__ __forceinline__ static float hi_f(uint32_t v) {
    if constexpr (std::is_same_v<T, __nv_bfloat16>)
      return __uint_as_float(v & 0xffff0000u);
    else
      return __half2float(__ushort_as_half(static_cast<unsigned short>(v >> 16)));
  }

  // The A fragment of k-step kk (16 K-elements) of the stage at `a_stage` (the stage's A tile),
  // for consumer warpgroup cw; k0: the k-block's first K index; m_slab: the warpgroup's first M
  // index (slab_m0).
  __device__ __forceinline__ void fragment(uint32_t a_stage, int cw, int kk, int k0, int m_slab,
                                           int lane, uint32_t (&a)[4]) {
    const int mi = lane >> 3, r8 = lane & 7;
    uint32_t raw[4];
    if constexpr (!kATrans) {
      // 128 rows (M) of 128 bytes (64 K), 128-byte swizzle: row R's chunk c at c ^ (R % 8).
      const int row = 64 * cw + 16 * warp + r8 + 8 * (mi & 1);
      const int chunk = 2 * kk + (mi >> 1);
      ldsm_x4(a_stage + row * 128 + ((chunk ^ (row & 7)) << 4), raw);
    } else {
      // Box cw: 64 K-rows of 128 bytes (64 M), 128-byte swizzle.
      const int krow = 16 * kk + r8 + 8 * (mi >> 1);
      const int chunk = 2 * warp + (mi & 1);
      ldsm_x4_trans(a_stage + cw * 64 * 128 + krow * 128 + ((chunk ^ (krow & 7)) << 4), raw);
    }
    if constexpr (!kATrans) {
      // Rows: tokens (row_tab[i & 1]); columns (vocab): k0 + 16 kk + 2 tq + 8 (i >> 1) + {0, 1}.
#pragma unroll
      for (int hk = 0; hk < 2; ++hk) {
        const int col = k0 + 16 * kk + 2 * tq + 8 * hk;
        float b0 = 0.f, b1 = 0.f;
        if (p.bias != nullptr) {
          if (col + 1 < p.vocab) {
            const float2 bb = __ldg(reinterpret_cast<const float2*>(p.bias + col));
            b0 = bb.x;
            b1 = bb.y;
          } else if (col < p.vocab) {
            b0 = __ldg(p.bias + col);
          }
        }
        const bool ok0 = col < p.vocab, ok1 = col + 1 < p.vocab;
#pragma unroll
        for (int hm = 0; hm < 2; ++hm) {
          const int i = 2 * hk + hm;
          const float4& tb = row_tab[hm];
          a[i] = dev::pack2<T>(dz(lo_f(raw[i]), b0, tb, col, ok0 && row_ok[hm]),
                               dz(hi_f(raw[i]), b1, tb, col + 1, ok1 && row_ok[hm]));
        }
      }
    } else {
      // Rows (M): vocab, m_slab + 16 warp + g + 8 (i & 1); columns (K): tokens
      // k0 + 16 kk + 2 tq + 8 (i >> 1) + {0, 1}.
      const int col0 = m_slab + 16 * warp + g;
#pragma unroll
      for (int hk = 0; hk < 2; ++hk) {
        const int tok = k0 + 16 * kk + 2 * tq + 8 * hk;
        float4 t0 = make_float4(0.f, 0.f, 0.f, __int_as_float(-1)), t1 = t0;
        if (tok < p.tokens) t0 = __ldg(p.tab + tok);
        if (tok + 1 < p.tokens) t1 = __ldg(p.tab + tok + 1);
        const bool ok0 = tok < p.tokens, ok1 = tok + 1 < p.tokens;
#pragma unroll
        for (int hm = 0; hm < 2; ++hm) {
          const int i = 2 * hk + hm;
          const int col = col0 + 8 * hm;
          const float d0 = dz(lo_f(raw[i]), row_bias[hm], t0, col, ok0 && row_ok[hm]);
          const float d1 = dz(hi_f(raw[i]), row_bias[hm], t1, col, ok1 && row_ok[hm]);
          if (p.dbias != nullptr) row_sum[hm] += d0 + d1;
          a[i] = dev::pack2<T>(d0, d1);
        }
      }
    }
  }

  // After a tile's main loop (r0 as begin_tile, n0 the tile's first column): layout 3 with
  // dbias, the tiles of the first column block write the column sums of dz (float32, before
  // the operand's rounding) of their vocab rows; a row's 64-token shares lie in the four lanes
  // of a quad.
  __device__ __forceinline__ void end_tile(int r0, int n0) {
    if constexpr (kATrans) {
      if (p.dbias == nullptr || n0 != 0) return;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float v = row_sum[h];
        v += __shfl_xor_sync(0xffffffffu, v, 1);
        v += __shfl_xor_sync(0xffffffffu, v, 2);
        const int r = r0 + 8 * h;
        if (tq == 0 && r < p.vocab) p.dbias[r] = v;
      }
    }
  }
};

}  // namespace lce_gemm
}  // namespace fusedops
