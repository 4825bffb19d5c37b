// The sm80 attention forward kernel (mma.sync m16n8k16, ldmatrix, cp.async double buffering);
// also compiled for sm_90a and run there until a Hopper kernel exists.
//
// Forward: Q fragments are re-read from shared memory; K/V tiles stream through two
// shared-memory stages; online softmax with the rescale folded into the output accumulator;
// output normalised once; lse (natural log) written, -inf with a zero row for queries that see
// no key.
#pragma once

#include <cstdint>
#include <type_traits>

#include "attention_common.cuh"
#include "attention_tiles_sm80.cuh"

namespace fusedops {
namespace attn {

// ---------------------------------------------------------------------------------------------
// Forward. Grid (ceil(max_q / BM), hq, batch); each of the NW warps owns MT row tiles of 16
// queries (BM = 16 MT NW); BN keys per tile. Shared memory: Q (BM x D), then K and V in two stages
// each (BN x D). Fragments of Q are re-read from shared memory at every tile (registers go to
// the MT x D output rows instead).
//
// Constraints: T is __half or __nv_bfloat16 (the lane addresses assume 2-byte elements);
// D % 64 == 0 and BN % 16 == 0 (static_assert); NW * 32 threads and Tiles<D>::kFwdSmem bytes of
// dynamic shared memory (attention_config_sm80.h); the packed layout of attention_params.h
// (16-byte aligned rows, contiguous heads, hq a multiple of hkv: attention_api.cpp checks it) and
// every sequence no longer than max_q (the grid's x). The body is empty below sm_80.
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
  int t_lo, t_hi;
  sq.key_tiles_of<BN>(m0, BM, p, t_lo, t_hi);
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

}  // namespace attn
}  // namespace fusedops
