// The sm80 attention backward kernels (delta, dK/dV with or without atomic dQ, dQ conversion,
// dQ) and their step helpers; also compiled for sm_90a and run there until a Hopper kernel exists.
//
// Backward: delta = rowsum(dO * O); dK/dV per key block (looping over the GQA group's query heads
// and their visible query blocks, accumulators in registers); dQ either per query block by a
// separate kernel (no atomics: gradients bit-identical run to run) or by float32 atomics from
// the 8-warp dK/dV kernel (dkdv_split_kernel) and a convert pass.
#pragma once

#include <cstdint>

#include "attention_common.cuh"
#include "attention_tiles_sm80.cuh"

namespace fusedops {
namespace attn {

// ---------------------------------------------------------------------------------------------
// Backward preprocess: delta[h, i] = sum_d dO[i, h, d] * O[i, h, d] (float32). One thread per
// (row, head).
//
// Constraints: D % 8 == 0 and out/dout rows 16-byte aligned (one 16-byte load per 8 elements);
// 256 threads per CTA, ceil(total_q hq / 256) CTAs, no shared memory; any architecture.
template <typename T, int D>
__global__ void __launch_bounds__(256) delta_kernel(const AttnParams p) {
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * 256 + threadIdx.x;
  if (idx >= static_cast<int64_t>(p.total_q) * p.hq) return;
  const int64_t i = idx / p.hq;
  const int h = static_cast<int>(idx % p.hq);
  const T* o = static_cast<const T*>(p.out) + i * p.o_row + h * D;
  const T* d = static_cast<const T*>(p.dout) + i * p.do_row + h * D;
  p.delta[static_cast<int64_t>(h) * p.total_q + i] = row_dot<T, D>(o, d);
}

// The statistics of row_stats (attention_common.cuh) for rows [m0, m0 + R) of a dK/dV step,
// copied (cp.async, thread r < R takes row m0 + r) into shared memory with the step's tiles, so
// that no warp waits on the loads: the natural-log lse (the reader scales it by log2(e)) and
// delta, zero for rows past the sequence.
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

// dQ accumulation by float32 reductions of 2 consecutive elements (4 per lane, after a swap of
// halves between lanes, was 7% slower: docs/attention.md).
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
//
// Constraints: T is __half or __nv_bfloat16; BN == 16 NW, BM % 16 == 0, BM <= NW * 32 (one row
// statistic per thread), D % 64 == 0 and (D / NW) % 16 == 0 (static_assert); NW * 32 threads and
// Tiles<D>::kDkdvSmem bytes of dynamic shared memory (attention_config_sm80.h); lse from the
// forward and delta from delta_kernel; the packed layout of attention_params.h. The body is empty
// below sm_80.
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
// stages, one step ahead: as fast at D=128 (git a587c42), and it does not fit at D=64, BM=128.)
// Shared memory: K, V (BN x D); Q, dO (2 x BM x D); P^T, dS^T (2 x BN x BM); lse, delta (2 x BM);
// 2 mbarriers: 193 KiB at D=128, BM=64 and 226 KiB at D=64, BM=128 (on a GPU with less than
// that per block, run_bwd takes the dQ pass instead).
//
// Constraints: T is __half or __nv_bfloat16; BM 64 or 128 and D % 64 == 0 (static_assert); 256
// threads and Tiles<D>::kSplitSmem bytes of dynamic shared memory (more than an A100 has per
// block: run_bwd launches this kernel only where split_fits says so); p.dq_acc zeroed, in the
// dq_acc_index layout with rows rounded up to a multiple of 8; lse and delta as for dkdv_kernel.
// The dQ reductions are red.global.add.v2.f32 on sm_90 and two atomicAdds below; the body is
// empty below sm_80.
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
    // with one barrier per step; it was 2% slower with two: docs/attention.md).
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
//
// Constraints: D % 8 == 0; p.dq_acc as dkdv_split_kernel left it (16-byte aligned 8-float runs);
// dq rows 16-byte aligned; 256 threads per CTA, ceil(total_q hq D / 8 / 256) CTAs, no shared
// memory; any architecture.
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
//
// Constraints: T is __half or __nv_bfloat16; D % 64 == 0 and BN % 16 == 0 (static_assert); NW * 32
// threads and Tiles<D>::kDqSmem bytes of dynamic shared memory (attention_config_sm80.h); lse
// and delta as for dkdv_kernel; every sequence no longer than max_q (the grid's x). The body is
// empty below sm_80.
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
  int t_lo, t_hi;
  sq.key_tiles_of<BN>(m0, BM, p, t_lo, t_hi);
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
