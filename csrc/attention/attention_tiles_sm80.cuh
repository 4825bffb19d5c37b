// Shared-memory tile helpers of the sm80 attention kernels (also compiled for sm_90a): swizzled
// cp.async row loads, ldmatrix lane addresses, the two mma.sync products and the accumulator store.
//
// Every warp owns 16 rows of its CTA's block (queries in the forward and dQ kernels, keys in the
// dK/dV kernel), so softmax statistics never leave the warp: a row lives in the 4 lanes of a quad.
// Shared tiles hold R rows of D elements in 16-byte chunks XOR-swizzled by (row & 7), so the 8 row
// addresses of an ldmatrix hit 32 banks.
#pragma once

#include <cstdint>

#include "../mma_sm80.cuh"

namespace fusedops {
namespace attn {

using namespace fusedops::dev;   // kLog2e, zero, conversions, ex2 (device_utils.cuh)
using namespace fusedops::sm80;  // PTX wrappers (mma_sm80.cuh)

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

}  // namespace attn
}  // namespace fusedops
