// Device code for fused linear cross-entropy: mma.sync m16n8k16 tiles fed by cp.async pipelines.
//
// Constraints (checked by linear_ce_api.cpp): element type fp16 or bf16; hidden [N, H] and
// weight [V, H] contiguous with H % 8 == 0 and 16-byte aligned base pointers (every global load is
// a 16-byte cp.async of 8 elements, zero-filled past the valid range); any N and V >= 1.
// Index arithmetic on global memory is 64-bit. Launches (linear_ce_launch.cuh): fwd_kernel,
// dz_kernel, dw_kernel and dx_kernel take kThreads threads and Cfg::kSmemBytes of dynamic shared
// memory, and trap when built for an architecture below Cfg::kMinArch (dispatch never launches
// them there); combine_kernel takes one thread per token and no shared memory.
//
// One CTA = 8 warps (256 threads) computing a kBlockM x kBlockN = 128 x 128 tile, the warps laid
// out 4 (M) x 2 (N), each owning 32 x 64 = 2 x 8 mma tiles. K advances kBlockK = 32 at a time
// through kStages shared-memory stages. Shared tiles are XOR-swizzled in 16-byte chunks so that
// ldmatrix reads of 8 rows hit 32 distinct banks.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>

#include "../mma_sm80.cuh"
#include "linear_ce_params.h"

namespace fusedops {
namespace lce {

constexpr int kBlockM = static_cast<int>(kLceTile);
constexpr int kBlockN = static_cast<int>(kLceTile);
constexpr int kBlockK = 32;
constexpr int kThreads = 256;
constexpr int kWarpsN = 2;
constexpr int kWarpM = 32;  // rows of the tile per warp
constexpr int kWarpN = 64;  // cols of the tile per warp
constexpr int kMmaM = kWarpM / 16;
constexpr int kMmaN = kWarpN / 8;

template <int kStages_, int kMinArch_>
struct Config {
  static constexpr int kStages = kStages_;
  static constexpr int kMinArch = kMinArch_;
  static constexpr int kSmemBytes = kStages * (kBlockM + kBlockN) * kBlockK * 2;
};

using namespace fusedops::dev;   // kLog2e, zero, conversions (device_utils.cuh)
using namespace fusedops::sm80;  // PTX wrappers (mma_sm80.cuh)

// ---------------------------------------------------------------------------------------------
// Shared-memory tile layouts (element offsets). A "K-major" tile has 128 rows (M or N) of
// kBlockK = 32 contiguous K elements (4 chunks of 16 bytes); an "MN-major" tile has kBlockK rows
// (K) of 128 contiguous M or N elements (16 chunks).
__device__ __forceinline__ int kmajor_off(int row, int chunk) {
  return row * kBlockK + ((chunk ^ ((row >> 1) & 3)) << 3);
}
__device__ __forceinline__ int mnmajor_off(int k, int chunk) {
  return k * kBlockM + ((chunk ^ (k & 7)) << 3);
}

// Global operand: element (i, k) of the tile sits at base[i * ld + k] (K-major) or
// base[k * ld + i] (MN-major); base already points at the tile origin. Rows i >= i_valid and
// k >= k_valid read as zero. For MN-major operands i_valid is checked per 8-element chunk.
template <typename T, bool kKMajor>
struct Operand {
  const T* base;
  int64_t ld;
  int64_t i_valid;
  int64_t k_valid;
};

template <typename T, bool kKMajor>
__device__ __forceinline__ void load_tile(const Operand<T, kKMajor>& op, int k0, T* smem) {
  const int tid = threadIdx.x;
#pragma unroll
  for (int j = 0; j < (kBlockM * kBlockK / 8) / kThreads; ++j) {
    const int id = tid + j * kThreads;
    if constexpr (kKMajor) {
      const int row = id / (kBlockK / 8), chunk = id % (kBlockK / 8);
      const int64_t k = k0 + chunk * 8;
      const bool valid = row < op.i_valid && k < op.k_valid;
      const T* src = valid ? op.base + row * op.ld + k : op.base;
      cp_async_16(smem_u32(smem + kmajor_off(row, chunk)), src, valid);
    } else {
      const int k = id / (kBlockM / 8), chunk = id % (kBlockM / 8);
      const int64_t kk = k0 + k;
      const bool valid = kk < op.k_valid && chunk * 8 < op.i_valid;
      const T* src = valid ? op.base + kk * op.ld + chunk * 8 : op.base;
      cp_async_16(smem_u32(smem + mnmajor_off(k, chunk)), src, valid);
    }
  }
}

// A fragments (16 x 16) for the warp's kMmaM row tiles at k16 step ks.
template <typename T, bool kKMajor>
__device__ __forceinline__ void load_a_frags(const T* smem, int warp_m, int ks,
                                             uint32_t (&a)[kMmaM][4]) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int mi = 0; mi < kMmaM; ++mi) {
    if constexpr (kKMajor) {
      const int row = warp_m * kWarpM + mi * 16 + (lane & 15);
      ldmatrix_x4(a[mi], smem_u32(smem + kmajor_off(row, ks * 2 + (lane >> 4))));
    } else {
      const int i = lane >> 3, r = lane & 7;
      const int k = ks * 16 + r + (i >> 1) * 8;
      const int m = warp_m * kWarpM + mi * 16 + (i & 1) * 8;
      ldmatrix_x4_trans(a[mi], smem_u32(smem + mnmajor_off(k, m >> 3)));
    }
  }
}

// B fragments for the warp's kMmaN column tiles (two n8 tiles per ldmatrix.x4).
template <typename T, bool kKMajor>
__device__ __forceinline__ void load_b_frags(const T* smem, int warp_n, int ks,
                                             uint32_t (&b)[kMmaN][2]) {
  const int lane = threadIdx.x & 31;
  const int i = lane >> 3, r = lane & 7;
#pragma unroll
  for (int p = 0; p < kMmaN / 2; ++p) {
    uint32_t t[4];
    if constexpr (kKMajor) {
      const int n = warp_n * kWarpN + p * 16 + (i >> 1) * 8 + r;
      ldmatrix_x4(t, smem_u32(smem + kmajor_off(n, ks * 2 + (i & 1))));
    } else {
      const int k = ks * 16 + (i & 1) * 8 + r;
      const int n = warp_n * kWarpN + p * 16 + (i >> 1) * 8;
      ldmatrix_x4_trans(t, smem_u32(smem + mnmajor_off(k, n >> 3)));
    }
    b[2 * p][0] = t[0];
    b[2 * p][1] = t[1];
    b[2 * p + 1][0] = t[2];
    b[2 * p + 1][1] = t[3];
  }
}

// acc[mi][ni][e] += sum_k A(m, k) * B(n, k) over k in [0, k_len). Leaves shared memory free.
template <class Cfg, typename T, bool kAKMajor, bool kBKMajor>
__device__ __forceinline__ void gemm_mainloop(const Operand<T, kAKMajor>& a_op,
                                              const Operand<T, kBKMajor>& b_op, int64_t k_len,
                                              T* smem, float (&acc)[kMmaM][kMmaN][4]) {
  const int warp = threadIdx.x >> 5;
  const int warp_m = warp / kWarpsN, warp_n = warp % kWarpsN;
  T* a_smem = smem;
  T* b_smem = smem + Cfg::kStages * kBlockM * kBlockK;
  constexpr int kTileElems = kBlockM * kBlockK;
  const int k_tiles = static_cast<int>((k_len + kBlockK - 1) / kBlockK);
#pragma unroll
  for (int s = 0; s < Cfg::kStages - 1; ++s) {
    if (s < k_tiles) {
      load_tile(a_op, s * kBlockK, a_smem + s * kTileElems);
      load_tile(b_op, s * kBlockK, b_smem + s * kTileElems);
    }
    cp_async_commit();
  }
  for (int kt = 0; kt < k_tiles; ++kt) {
    cp_async_wait<Cfg::kStages - 2>();
    __syncthreads();
    const int pf = kt + Cfg::kStages - 1;
    if (pf < k_tiles) {
      const int st = pf % Cfg::kStages;
      load_tile(a_op, pf * kBlockK, a_smem + st * kTileElems);
      load_tile(b_op, pf * kBlockK, b_smem + st * kTileElems);
    }
    cp_async_commit();
    const int st = kt % Cfg::kStages;
#pragma unroll
    for (int ks = 0; ks < kBlockK / 16; ++ks) {
      uint32_t a[kMmaM][4];
      uint32_t b[kMmaN][2];
      load_a_frags<T, kAKMajor>(a_smem + st * kTileElems, warp_m, ks, a);
      load_b_frags<T, kBKMajor>(b_smem + st * kTileElems, warp_n, ks, b);
#pragma unroll
      for (int mi = 0; mi < kMmaM; ++mi)
#pragma unroll
        for (int ni = 0; ni < kMmaN; ++ni) mma_16816<T>(acc[mi][ni], a[mi], b[ni][0], b[ni][1]);
    }
  }
  cp_async_wait<0>();
  __syncthreads();
}

// Position of accumulator element (mi, ni, e) inside the CTA tile.
__device__ __forceinline__ int acc_row(int mi, int e) {
  const int warp_m = (threadIdx.x >> 5) / kWarpsN, lane = threadIdx.x & 31;
  return warp_m * kWarpM + mi * 16 + (lane >> 2) + (e >> 1) * 8;
}
__device__ __forceinline__ int acc_col(int ni, int e) {
  const int warp_n = (threadIdx.x >> 5) % kWarpsN, lane = threadIdx.x & 31;
  return warp_n * kWarpN + ni * 8 + (lane & 3) * 2 + (e & 1);
}

// Logit epilogue shared by forward and backward: bias and softcap, in float32.
__device__ __forceinline__ float cap_logit(float raw, float softcap) {
  return softcap > 0.f ? softcap * tanhf(raw / softcap) : raw;
}

// ---------------------------------------------------------------------------------------------
// Forward: grid (ceil(N / 128), n_splits). Each CTA streams tiles_per_split vocab tiles of its
// split, keeping per-row running max / sum of exp / target logit / logit sum in registers, then
// merges the 4 lanes of a quad and the 2 warps along N and writes one partial per row.
template <class Cfg, typename T>
__global__ void __launch_bounds__(kThreads, 2) fwd_kernel(const LinearCeParams p) {
#if defined(__CUDA_ARCH__)
  if constexpr (Cfg::kMinArch > __CUDA_ARCH__) {
    __trap();
  } else {
    extern __shared__ __align__(128) unsigned char smem_raw[];
    T* smem = reinterpret_cast<T*>(smem_raw);
    const int64_t m0 = static_cast<int64_t>(blockIdx.x) * kBlockM;
    const T* x = static_cast<const T*>(p.hidden);
    const T* w = static_cast<const T*>(p.weight);
    const T* bias = static_cast<const T*>(p.bias);
    Operand<T, true> a_op{x + m0 * p.hidden_size, p.hidden_size, p.n_tokens - m0, p.hidden_size};

    float run_max[kMmaM][2], run_sum[kMmaM][2], run_zt[kMmaM][2], run_zs[kMmaM][2];
    int64_t tgt[kMmaM][2];
#pragma unroll
    for (int mi = 0; mi < kMmaM; ++mi)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        run_max[mi][h] = -INFINITY;
        run_sum[mi][h] = 0.f;
        run_zt[mi][h] = 0.f;
        run_zs[mi][h] = 0.f;
        const int64_t row = m0 + acc_row(mi, h * 2);
        tgt[mi][h] = row < p.n_tokens ? p.target[row] : -1;
      }

    float acc[kMmaM][kMmaN][4];
    for (int t = 0; t < p.tiles_per_split; ++t) {
      const int64_t v0 = (static_cast<int64_t>(blockIdx.y) * p.tiles_per_split + t) * kBlockN;
      if (v0 >= p.vocab_size) break;
      Operand<T, true> b_op{w + v0 * p.hidden_size, p.hidden_size, p.vocab_size - v0,
                            p.hidden_size};
      zero(acc);
      gemm_mainloop<Cfg, T, true, true>(a_op, b_op, p.hidden_size, smem, acc);
#pragma unroll
      for (int mi = 0; mi < kMmaM; ++mi) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          float tile_max = -INFINITY;
#pragma unroll
          for (int ni = 0; ni < kMmaN; ++ni)
#pragma unroll
            for (int c = 0; c < 2; ++c) {
              const int e = h * 2 + c;
              const int64_t col = v0 + acc_col(ni, e);
              float z = -INFINITY;
              if (col < p.vocab_size) {
                float raw = acc[mi][ni][e];
                if (bias != nullptr) raw += to_float<T>(bias[col]);
                z = cap_logit(raw, p.softcap);
                run_zs[mi][h] += z;
                if (col == tgt[mi][h]) run_zt[mi][h] = z;
              }
              acc[mi][ni][e] = z;
              tile_max = fmaxf(tile_max, z);
            }
          const float new_max = fmaxf(run_max[mi][h], tile_max);
          if (new_max != -INFINITY) {
            float s = run_sum[mi][h] * exp2f((run_max[mi][h] - new_max) * kLog2e);
#pragma unroll
            for (int ni = 0; ni < kMmaN; ++ni)
#pragma unroll
              for (int c = 0; c < 2; ++c) s += exp2f((acc[mi][ni][h * 2 + c] - new_max) * kLog2e);
            run_sum[mi][h] = s;
            run_max[mi][h] = new_max;
          }
        }
      }
    }

    // Merge the 4 lanes of each quad (same rows, different columns).
#pragma unroll
    for (int mi = 0; mi < kMmaM; ++mi)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
#pragma unroll
        for (int off = 1; off <= 2; off <<= 1) {
          const float om = __shfl_xor_sync(0xffffffff, run_max[mi][h], off);
          const float os = __shfl_xor_sync(0xffffffff, run_sum[mi][h], off);
          const float nm = fmaxf(run_max[mi][h], om);
          if (nm != -INFINITY) {
            run_sum[mi][h] = run_sum[mi][h] * exp2f((run_max[mi][h] - nm) * kLog2e) +
                             os * exp2f((om - nm) * kLog2e);
          }
          run_max[mi][h] = nm;
          run_zt[mi][h] += __shfl_xor_sync(0xffffffff, run_zt[mi][h], off);
          run_zs[mi][h] += __shfl_xor_sync(0xffffffff, run_zs[mi][h], off);
        }
      }
    // Merge the warps along N through shared memory: stats[warp_n][row][4].
    float* stats = reinterpret_cast<float*>(smem_raw);
    const int warp_n = (threadIdx.x >> 5) % kWarpsN, lane = threadIdx.x & 31;
    if ((lane & 3) == 0) {
#pragma unroll
      for (int mi = 0; mi < kMmaM; ++mi)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          float* s = stats + (warp_n * kBlockM + acc_row(mi, h * 2)) * 4;
          s[0] = run_max[mi][h];
          s[1] = run_sum[mi][h];
          s[2] = run_zt[mi][h];
          s[3] = run_zs[mi][h];
        }
    }
    __syncthreads();
    if (threadIdx.x < kBlockM) {
      const int r = threadIdx.x;
      const int64_t row = m0 + r;
      if (row < p.n_tokens) {
        float m = -INFINITY, s = 0.f, zt = 0.f, zs = 0.f;
        for (int wn = 0; wn < kWarpsN; ++wn) {
          const float* st = stats + (wn * kBlockM + r) * 4;
          const float nm = fmaxf(m, st[0]);
          if (nm != -INFINITY) s = s * exp2f((m - nm) * kLog2e) + st[1] * exp2f((st[0] - nm) * kLog2e);
          m = nm;
          zt += st[2];
          zs += st[3];
        }
        float* out = p.part + static_cast<int64_t>(blockIdx.y) * 4 * p.n_tokens;
        out[row] = m;
        out[p.n_tokens + row] = s;
        out[2 * p.n_tokens + row] = zt;
        out[3 * p.n_tokens + row] = zs;
      }
    }
  }
#endif
}

// Combines the splits' partials into lse, z_target, z_sum (templated so that each family's
// translation unit owns its copy).
template <class Cfg>
__global__ void combine_kernel(const LinearCeParams p) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (row >= p.n_tokens) return;
  float m = -INFINITY;
  for (int s = 0; s < p.n_splits; ++s) m = fmaxf(m, p.part[s * 4 * p.n_tokens + row]);
  float tot = 0.f, zt = 0.f, zs = 0.f;
  for (int s = 0; s < p.n_splits; ++s) {
    const float* part = p.part + s * 4 * p.n_tokens;
    const float ms = part[row];
    if (ms != -INFINITY) tot += part[p.n_tokens + row] * exp2f((ms - m) * kLog2e);
    zt += part[2 * p.n_tokens + row];
    zs += part[3 * p.n_tokens + row];
  }
  p.lse[row] = m + logf(tot);
  p.z_target[row] = zt;
  p.z_sum[row] = zs;
}

// ---------------------------------------------------------------------------------------------
// Backward step 1, for the vocab chunk starting at v0: grid (ceil(N / 128), ld_dz / 128).
// Recomputes a logit tile, turns it into dz in registers and writes it in the input dtype
// (zero outside [0, V) and past the chunk), adding column sums to d_bias_f32 by atomics.
// One CTA per SM: the dz epilogue (exp, bias, target compare, column sums) needs more than the 128
// registers that two CTAs per SM allow (ptxas spilled ~450 bytes at 128).
template <class Cfg, typename T>
__global__ void __launch_bounds__(kThreads, 1) dz_kernel(const LinearCeParams p, int64_t v0,
                                                         int64_t n_cols) {
#if defined(__CUDA_ARCH__)
  if constexpr (Cfg::kMinArch > __CUDA_ARCH__) {
    __trap();
  } else {
    extern __shared__ __align__(128) unsigned char smem_raw[];
    T* smem = reinterpret_cast<T*>(smem_raw);
    const int64_t m0 = static_cast<int64_t>(blockIdx.x) * kBlockM;
    const int64_t c0 = static_cast<int64_t>(blockIdx.y) * kBlockN;  // column inside the chunk
    const T* x = static_cast<const T*>(p.hidden);
    const T* w = static_cast<const T*>(p.weight);
    const T* bias = static_cast<const T*>(p.bias);
    float acc[kMmaM][kMmaN][4];
    zero(acc);
    const int64_t col_valid = n_cols - c0 < p.vocab_size - v0 - c0 ? n_cols - c0
                                                                   : p.vocab_size - v0 - c0;
    if (col_valid > 0) {
      Operand<T, true> a_op{x + m0 * p.hidden_size, p.hidden_size, p.n_tokens - m0,
                            p.hidden_size};
      Operand<T, true> b_op{w + (v0 + c0) * p.hidden_size, p.hidden_size, col_valid,
                            p.hidden_size};
      gemm_mainloop<Cfg, T, true, true>(a_op, b_op, p.hidden_size, smem, acc);
    }
    T* dz = static_cast<T*>(p.dz);
#pragma unroll
    for (int mi = 0; mi < kMmaM; ++mi)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int64_t row = m0 + acc_row(mi, h * 2);
        const bool row_ok = row < p.n_tokens;
        float lse = 0.f, a = 0.f, b = 0.f, c = 0.f;
        int64_t tgt = -1;
        if (row_ok) {
          lse = p.lse_in[row];
          a = p.d_lse[row];
          b = p.d_zt[row];
          c = p.d_zsum[row];
          tgt = p.target[row];
        }
#pragma unroll
        for (int ni = 0; ni < kMmaN; ++ni) {
          float g[2];
#pragma unroll
          for (int cc = 0; cc < 2; ++cc) {
            const int64_t local = c0 + acc_col(ni, h * 2 + cc);
            const int64_t col = v0 + local;
            g[cc] = 0.f;
            if (row_ok && local < n_cols && col < p.vocab_size) {
              float raw = acc[mi][ni][h * 2 + cc];
              if (bias != nullptr) raw += to_float<T>(bias[col]);
              const float z = cap_logit(raw, p.softcap);
              float d = a * exp2f((z - lse) * kLog2e) + c + (col == tgt ? b : 0.f);
              if (p.softcap > 0.f) {
                const float zc = z / p.softcap;
                d *= 1.f - zc * zc;
              }
              g[cc] = d;
            }
            acc[mi][ni][h * 2 + cc] = g[cc];  // kept for the d_bias column sums below
          }
          if (row_ok) {
            const int64_t local = c0 + acc_col(ni, h * 2);
            *reinterpret_cast<uint32_t*>(dz + row * p.ld_dz + local) = pack2<T>(g[0], g[1]);
          }
        }
      }
    if (p.d_bias_f32 != nullptr) {
      const int lane = threadIdx.x & 31;
#pragma unroll
      for (int ni = 0; ni < kMmaN; ++ni)
#pragma unroll
        for (int cc = 0; cc < 2; ++cc) {
          float s = 0.f;
#pragma unroll
          for (int mi = 0; mi < kMmaM; ++mi) s += acc[mi][ni][cc] + acc[mi][ni][2 + cc];
          s += __shfl_xor_sync(0xffffffff, s, 4);
          s += __shfl_xor_sync(0xffffffff, s, 8);
          s += __shfl_xor_sync(0xffffffff, s, 16);
          const int64_t local = c0 + acc_col(ni, cc);
          if (lane < 4 && local < n_cols && v0 + local < p.vocab_size)
            atomicAdd(p.d_bias_f32 + v0 + local, s);
        }
    }
  }
#endif
}

// Backward step 2: d_weight[v0 + i, j] = sum_n dz[n, i] * hidden[n, j]; grid
// (ceil(n_cols / 128), ceil(H / 128)), reduction over all N in float32 registers.
template <class Cfg, typename T>
__global__ void __launch_bounds__(kThreads, 2) dw_kernel(const LinearCeParams p, int64_t v0,
                                                         int64_t n_cols) {
#if defined(__CUDA_ARCH__)
  if constexpr (Cfg::kMinArch > __CUDA_ARCH__) {
    __trap();
  } else {
    extern __shared__ __align__(128) unsigned char smem_raw[];
    T* smem = reinterpret_cast<T*>(smem_raw);
    const int64_t i0 = static_cast<int64_t>(blockIdx.x) * kBlockM;
    const int64_t j0 = static_cast<int64_t>(blockIdx.y) * kBlockN;
    const T* dz = static_cast<const T*>(p.dz);
    const T* x = static_cast<const T*>(p.hidden);
    Operand<T, false> a_op{dz + i0, p.ld_dz, p.ld_dz - i0, p.n_tokens};
    Operand<T, false> b_op{x + j0, p.hidden_size, p.hidden_size - j0, p.n_tokens};
    float acc[kMmaM][kMmaN][4];
    zero(acc);
    gemm_mainloop<Cfg, T, false, false>(a_op, b_op, p.n_tokens, smem, acc);
    T* dw = static_cast<T*>(p.d_weight);
#pragma unroll
    for (int mi = 0; mi < kMmaM; ++mi)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int64_t i = i0 + acc_row(mi, h * 2);
        if (i >= n_cols || v0 + i >= p.vocab_size) continue;
#pragma unroll
        for (int ni = 0; ni < kMmaN; ++ni) {
          const int64_t j = j0 + acc_col(ni, h * 2);
          if (j < p.hidden_size)
            *reinterpret_cast<uint32_t*>(dw + (v0 + i) * p.hidden_size + j) =
                pack2<T>(acc[mi][ni][h * 2], acc[mi][ni][h * 2 + 1]);
        }
      }
  }
#endif
}

// Backward step 3: d_hidden[n, j] += sum_i dz[n, i] * weight[v0 + i, j]; grid
// (ceil(N / 128), ceil(H / 128)). The float32 sums live across chunks either split in two
// 16-bit halves (bf16: high half in d_hidden itself, low half in d_hidden_lo) or in d_hidden_acc
// (fp16). The last chunk rounds to the output dtype.
template <class Cfg, typename T>
__global__ void __launch_bounds__(kThreads, 2) dx_kernel(const LinearCeParams p, int64_t v0,
                                                         int64_t n_cols, bool first, bool last) {
#if defined(__CUDA_ARCH__)
  if constexpr (Cfg::kMinArch > __CUDA_ARCH__) {
    __trap();
  } else {
    extern __shared__ __align__(128) unsigned char smem_raw[];
    T* smem = reinterpret_cast<T*>(smem_raw);
    const int64_t m0 = static_cast<int64_t>(blockIdx.x) * kBlockM;
    const int64_t j0 = static_cast<int64_t>(blockIdx.y) * kBlockN;
    const T* dz = static_cast<const T*>(p.dz);
    const T* w = static_cast<const T*>(p.weight);
    const int64_t k_valid = n_cols < p.vocab_size - v0 ? n_cols : p.vocab_size - v0;
    Operand<T, true> a_op{dz + m0 * p.ld_dz, p.ld_dz, p.n_tokens - m0, p.ld_dz};
    Operand<T, false> b_op{w + v0 * p.hidden_size + j0, p.hidden_size, p.hidden_size - j0,
                           k_valid};
    float acc[kMmaM][kMmaN][4];
    zero(acc);
    gemm_mainloop<Cfg, T, true, false>(a_op, b_op, k_valid, smem, acc);
#pragma unroll
    for (int mi = 0; mi < kMmaM; ++mi)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int64_t row = m0 + acc_row(mi, h * 2);
        if (row >= p.n_tokens) continue;
#pragma unroll
        for (int ni = 0; ni < kMmaN; ++ni) {
          const int64_t j = j0 + acc_col(ni, h * 2);
          if (j >= p.hidden_size) continue;
          const int64_t off = row * p.hidden_size + j;
          float v0f = acc[mi][ni][h * 2], v1f = acc[mi][ni][h * 2 + 1];
          if (p.d_hidden_lo != nullptr) {  // bf16, split float32 accumulator
            uint32_t* hi_ptr = reinterpret_cast<uint32_t*>(static_cast<T*>(p.d_hidden) + off);
            uint32_t* lo_ptr = reinterpret_cast<uint32_t*>(p.d_hidden_lo + off);
            if (!first) {
              const uint32_t hi = *hi_ptr, lo = *lo_ptr;
              v0f += __uint_as_float((hi << 16) | (lo & 0xffffu));
              v1f += __uint_as_float((hi & 0xffff0000u) | (lo >> 16));
            }
            if (last) {
              *hi_ptr = pack2<T>(v0f, v1f);
            } else {
              const uint32_t b0 = __float_as_uint(v0f), b1 = __float_as_uint(v1f);
              *hi_ptr = (b0 >> 16) | (b1 & 0xffff0000u);
              *lo_ptr = (b0 & 0xffffu) | (b1 << 16);
            }
          } else {  // fp16: float32 accumulator buffer
            float2* accp = reinterpret_cast<float2*>(p.d_hidden_acc + off);
            if (!first) {
              const float2 prev = *accp;
              v0f += prev.x;
              v1f += prev.y;
            }
            if (last) {
              *reinterpret_cast<uint32_t*>(static_cast<T*>(p.d_hidden) + off) = pack2<T>(v0f, v1f);
            } else {
              *accp = make_float2(v0f, v1f);
            }
          }
        }
      }
  }
#endif
}

}  // namespace lce
}  // namespace fusedops
