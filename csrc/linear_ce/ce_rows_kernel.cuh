// Row kernels of the linear cross-entropy fast path: per-token statistics and dz, in place, over a
// logits chunk that cuBLAS has materialised (python/fusedops/linear_ce/chunked.py drives them).
//
// Constraints (checked by linear_ce_api.cpp): z [rows, n_cols] contiguous fp16/bf16 (2-byte
// aligned; each row is split into a scalar head up to the first 16-byte boundary, 16-byte vectors,
// and a scalar tail, so any n_cols works); bias, when given, float32 [n_cols]; target int64;
// per-token arrays float32. One CTA per row (kThreads threads); 64-bit indexing.
//
// Modes: 1 MERGE folds this vocab chunk's log-sum-exp into (m, s) and adds to zt, zsum; 2 DZ turns
// z into dz = w((1 + 2 zl lse) softmax - (1 - eps) onehot - eps / V) (times the softcap derivative
// 1 - (z / softcap)^2) using the final lse; 3 FULL_DZ (whole rows) writes lse, zt, zsum and then dz,
// the row's second read mostly hitting L2; 4 FULL writes the statistics only. 5 DZ_GRADS (run as
// mode 2 with stat_grads set) takes any upstream gradients of the statistics instead of the loss's
// weights: dz = w softmax + zt onehot + zsum with w, zt, zsum read as d_lse, d_zt, d_zsum.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>

#include "../device_utils.cuh"
#include "linear_ce_params.h"

namespace fusedops {
namespace rows {

constexpr int kVec = 8;     // elements per 16-byte access
constexpr int kUnroll = 4;  // 16-byte loads in flight per thread

using dev::ex2;  // the shared device helpers (device_utils.cuh)
using dev::from_float;
using dev::kLog2e;
using dev::to_float;

// softcap * tanh(x / softcap) with tanh(a) = 1 - 2 / (e^{2a} + 1): one ex2 and one fast
// reciprocal; absolute error below 1e-6 * softcap (the bf16 logits carry ~4e-3 relative).
// inv_softcap = 1 / softcap, so that no element pays a full-precision division (this extension
// is built without fast math; at Gemma-2's softcap the divisions made the row kernel
// compute-bound).
__device__ __forceinline__ float apply_cap(float x, float softcap, float inv_softcap) {
  if (softcap == 0.f) return x;
  const float a = fminf(fabsf(x) * inv_softcap, 20.f);  // tanh(20) == 1 in float32
  const float t = 1.f - __fdividef(2.f, ex2(2.f * kLog2e * a) + 1.f);
  return copysignf(softcap * t, x);
}
__device__ __forceinline__ float apply_cap(float x, float softcap) {
  return softcap == 0.f ? x : apply_cap(x, softcap, 1.f / softcap);
}

// (m, s) <- the log-sum-exp state of both halves; -inf maxima (no element seen) are neutral.
__device__ __forceinline__ void merge_state(float& m, float& s, float m2, float s2) {
  if (m2 == -INFINITY) return;
  if (m == -INFINITY) {
    m = m2;
    s = s2;
    return;
  }
  const float mn = fmaxf(m, m2);
  s = s * ex2((m - mn) * kLog2e) + s2 * ex2((m2 - mn) * kLog2e);
  m = mn;
}

struct RowCtx {
  const float* bias;
  float softcap, inv_softcap;
  __device__ __forceinline__ float logit(float raw, int64_t j) const {
    if (bias != nullptr) raw += bias[j];
    return apply_cap(raw, softcap, inv_softcap);
  }
};

// Online log-sum-exp over `cnt` logits already converted to float.
template <int kCnt>
__device__ __forceinline__ void accumulate(float (&v)[kCnt], float& m, float& s, float& zs) {
  float vmax = v[0];
#pragma unroll
  for (int k = 1; k < kCnt; ++k) vmax = fmaxf(vmax, v[k]);
  if (vmax > m) {
    s = (m == -INFINITY) ? 0.f : s * ex2((m - vmax) * kLog2e);
    m = vmax;
  }
#pragma unroll
  for (int k = 0; k < kCnt; ++k) {
    s += ex2((v[k] - m) * kLog2e);
    zs += v[k];
  }
}

template <int kThreads>
__device__ __forceinline__ void block_reduce(float& m, float& s, float& zs, float* red_smem) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    const float m2 = __shfl_xor_sync(0xffffffffu, m, off);
    const float s2 = __shfl_xor_sync(0xffffffffu, s, off);
    zs += __shfl_xor_sync(0xffffffffu, zs, off);
    merge_state(m, s, m2, s2);
  }
  constexpr int kWarps = kThreads / 32;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) {
    red_smem[warp] = m;
    red_smem[kWarps + warp] = s;
    red_smem[2 * kWarps + warp] = zs;
  }
  __syncthreads();
  if (warp == 0) {
    m = lane < kWarps ? red_smem[lane] : -INFINITY;
    s = lane < kWarps ? red_smem[kWarps + lane] : 0.f;
    zs = lane < kWarps ? red_smem[2 * kWarps + lane] : 0.f;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
      const float m2 = __shfl_xor_sync(0xffffffffu, m, off);
      const float s2 = __shfl_xor_sync(0xffffffffu, s, off);
      zs += __shfl_xor_sync(0xffffffffu, zs, off);
      merge_state(m, s, m2, s2);
    }
  }
}

template <int kThreads, int kMinArch, typename T, int kMode>
__global__ void __launch_bounds__(kThreads) ce_rows_kernel(const CeRowsParams p) {
#if defined(__CUDA_ARCH__)
  if constexpr (kMinArch > __CUDA_ARCH__) {
    __trap();  // this family is built for newer GPUs; dispatch never launches it here
  } else
#endif
  {
    __shared__ float red_smem[3 * (kThreads / 32)];
    __shared__ float lse_smem;
    const int64_t row = blockIdx.x;
    const int64_t n = p.n_cols;
    T* z = static_cast<T*>(p.z) + row * n;
    const int64_t mis = static_cast<int64_t>(reinterpret_cast<uintptr_t>(z) / sizeof(T)) % kVec;
    const int64_t head = min(n, mis == 0 ? int64_t(0) : int64_t(kVec) - mis);
    const int64_t n_vec = (n - head) / kVec;
    const int64_t tail0 = head + n_vec * kVec;
    const RowCtx ctx{p.bias, p.softcap, p.softcap != 0.f ? 1.f / p.softcap : 0.f};
    const int64_t t = p.target[row] - p.col0;
    const uint4* zv = reinterpret_cast<const uint4*>(z + head);

    float lse = 0.f;
    if constexpr (kMode != 2) {
      float m = -INFINITY, s = 0.f, zs = 0.f;
      for (int64_t j = threadIdx.x; j < head; j += kThreads) {
        float v[1] = {ctx.logit(to_float(z[j]), j)};
        accumulate<1>(v, m, s, zs);
      }
      for (int64_t j = tail0 + threadIdx.x; j < n; j += kThreads) {
        float v[1] = {ctx.logit(to_float(z[j]), j)};
        accumulate<1>(v, m, s, zs);
      }
      for (int64_t i0 = threadIdx.x; i0 < n_vec; i0 += int64_t(kThreads) * kUnroll) {
        uint4 raw[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const int64_t i = i0 + int64_t(u) * kThreads;
          if (i < n_vec) raw[u] = zv[i];
        }
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const int64_t i = i0 + int64_t(u) * kThreads;
          if (i >= n_vec) break;
          const T* e = reinterpret_cast<const T*>(&raw[u]);
          float v[kVec];
#pragma unroll
          for (int k = 0; k < kVec; ++k) v[k] = ctx.logit(to_float(e[k]), head + i * kVec + k);
          accumulate<kVec>(v, m, s, zs);
        }
      }
      block_reduce<kThreads>(m, s, zs, red_smem);
      if (threadIdx.x == 0) {
        const float zt = (t >= 0 && t < n) ? ctx.logit(to_float(z[t]), t) : 0.f;
        if constexpr (kMode == 1) {
          float m_tot = p.m[row], s_tot = p.s[row];
          merge_state(m_tot, s_tot, m, s);
          p.m[row] = m_tot;
          p.s[row] = s_tot;
          p.zt[row] += zt;
          p.zsum[row] += zs;
        } else {
          lse = m + logf(s);
          p.lse[row] = lse;
          p.zt[row] = zt;
          p.zsum[row] = zs;
          lse_smem = lse;
        }
      }
      if constexpr (kMode == 3) {
        __syncthreads();
        lse = lse_smem;
      }
    }
    if constexpr (kMode == 2 || kMode == 3) {
      if constexpr (kMode == 2) lse = p.lse[row];
      // The loss's per-token weight w, or (stat_grads) the gradients of lse, zt and zsum given.
      const float w = p.w[row];
      const float d_lse = p.stat_grads ? w : w * (1.f + 2.f * p.z_loss * lse);
      const float d_zt = p.stat_grads ? p.zt[row] : -w * (1.f - p.eps);
      const float d_zs = p.stat_grads ? p.zsum[row] : -w * p.eps / static_cast<float>(p.vocab_size);
      const float softcap = p.softcap;
      const float lse2 = lse * kLog2e;
      auto grad = [&](float zj, int64_t j) {
        float d = d_lse * ex2(zj * kLog2e - lse2) + d_zs + (j == t ? d_zt : 0.f);
        if (softcap != 0.f) {
          const float c = zj * ctx.inv_softcap;
          d *= 1.f - c * c;
        }
        return d;
      };
      for (int64_t j = threadIdx.x; j < head; j += kThreads) {
        z[j] = from_float<T>(grad(ctx.logit(to_float(z[j]), j), j));
      }
      for (int64_t j = tail0 + threadIdx.x; j < n; j += kThreads) {
        z[j] = from_float<T>(grad(ctx.logit(to_float(z[j]), j), j));
      }
      uint4* zw = reinterpret_cast<uint4*>(z + head);
      for (int64_t i0 = threadIdx.x; i0 < n_vec; i0 += int64_t(kThreads) * kUnroll) {
        uint4 raw[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const int64_t i = i0 + int64_t(u) * kThreads;
          if (i < n_vec) raw[u] = zw[i];
        }
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const int64_t i = i0 + int64_t(u) * kThreads;
          if (i >= n_vec) break;
          T* e = reinterpret_cast<T*>(&raw[u]);
#pragma unroll
          for (int k = 0; k < kVec; ++k) {
            const int64_t j = head + i * kVec + k;
            e[k] = from_float<T>(grad(ctx.logit(to_float(e[k]), j), j));
          }
          zw[i] = raw[u];
        }
      }
    }
  }
}

template <int kThreads, int kMinArch, typename T, int kMode>
inline cudaError_t launch_rows(const CeRowsParams& p) {
  ce_rows_kernel<kThreads, kMinArch, T, kMode>
      <<<static_cast<unsigned>(p.rows), kThreads, 0, p.stream>>>(p);
  return cudaGetLastError();
}

// Whole-row modes run kFullThreads threads per row; chunk modes (rows of a few thousand columns)
// run 256 threads, several CTAs per SM (H200, Llama-3 64 MiB setting: 67.6 -> 62.9 ms).
template <int kFullThreads, int kMinArch, typename T>
inline cudaError_t run_rows(const CeRowsParams& p) {
  if (p.rows == 0 || p.n_cols == 0) return cudaSuccess;
  switch (p.mode) {
    case 1: return launch_rows<256, kMinArch, T, 1>(p);
    case 2: return launch_rows<256, kMinArch, T, 2>(p);
    case 3: return launch_rows<kFullThreads, kMinArch, T, 3>(p);
    case 4: return launch_rows<kFullThreads, kMinArch, T, 4>(p);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace rows
}  // namespace fusedops
