// Split-KV decode attention for the sm80 family (cp.async double buffering, SIMT dot products;
// also runs on Hopper). Device code only; the launch is decode_sm80.cu's.
//
// One CTA of 4 warps per (split, KV head, sequence). Its rows are the GQA group of the KV head for
// every query: row r = query r / G of head kvh * G + r % G, M = G * Sq <= kMaxRows. Key tiles of
// 64 keys (K and V, rows padded by 16 bytes so that the 16-byte reads of 8 consecutive rows hit
// distinct banks) come in by cp.async, two stages. Warp w owns keys [16w, 16w + 16) of a tile:
// lane l takes key 16w + l % 16 and half l / 16 of the head dim for QK^T (one shuffle adds the
// halves), then the warp runs its own online softmax per row and accumulates P V with lane l
// owning D / 32 consecutive output columns. The four warps are merged through shared memory at the
// end, like splits. The split's key range is computed from seqlens_k on the device (no host
// synchronisation); page numbers and lengths are clamped into range so bad values cannot fault.
// Constraints (checked by decode_api.cpp): fp16/bf16, head dim 64 or 128, M <= 16, last dims
// contiguous, k/v rows 16-byte aligned.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "../mma_sm80.cuh"
#include "decode_params.h"

namespace fusedops {
namespace decode {

constexpr int kThreads = 128;
constexpr int kWarps = 4;
constexpr int kBlockN = 64;  // keys per tile
constexpr int kKeysPerWarp = kBlockN / kWarps;
constexpr int kStages = 2;
constexpr float kLog2e = 1.4426950408889634f;

template <int kHeadDim>
struct Smem {
  static constexpr int kRow = kHeadDim + 8;  // elements per padded K/V row (and Q row)
  static constexpr int kTile = kBlockN * kRow;
};

template <typename T>
__device__ __forceinline__ float to_f(T x);
template <>
__device__ __forceinline__ float to_f<__half>(__half x) { return __half2float(x); }
template <>
__device__ __forceinline__ float to_f<__nv_bfloat16>(__nv_bfloat16 x) {
  return __bfloat162float(x);
}
template <typename T>
__device__ __forceinline__ T from_f(float x);
template <>
__device__ __forceinline__ __half from_f<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// Eight 16-bit values of a 16-byte word as floats (bit operations: no local-memory copies).
__device__ __forceinline__ void unpack8(const uint4& w, float (&f)[8], __nv_bfloat16) {
  const uint32_t x[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = __uint_as_float(x[i] << 16);
    f[2 * i + 1] = __uint_as_float(x[i] & 0xffff0000u);
  }
}
__device__ __forceinline__ void unpack8(const uint4& w, float (&f)[8], __half) {
  const uint32_t x[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = __half2float(__ushort_as_half(static_cast<unsigned short>(x[i] & 0xffffu)));
    f[2 * i + 1] = __half2float(__ushort_as_half(static_cast<unsigned short>(x[i] >> 16)));
  }
}

// kCols (2 or 4) consecutive 16-bit values from shared memory as floats, in one 4- or 8-byte read.
template <int kCols, typename T>
__device__ __forceinline__ void unpack_cols(const T* src, float (&f)[kCols], T tag) {
  static_assert(kCols == 2 || kCols == 4, "2 or 4 columns per lane");
  uint4 w{0u, 0u, 0u, 0u};
  if constexpr (kCols == 4) {
    const uint2 x = *reinterpret_cast<const uint2*>(src);
    w.x = x.x;
    w.y = x.y;
  } else {
    w.x = *reinterpret_cast<const uint32_t*>(src);
  }
  float all[8];
  unpack8(w, all, tag);
#pragma unroll
  for (int c = 0; c < kCols; ++c) f[c] = all[c];
}

// Offset (elements) of logical key `key` of sequence b in a cache (through the page table).
__device__ __forceinline__ int64_t key_offset(const DecodeParams& p, int b, int key,
                                              int64_t stride_b, int64_t stride_s) {
  if (p.page_table != nullptr) {
    int page = __ldg(p.page_table + b * p.pt_stride + key / p.page_size);
    page = min(max(page, 0), p.num_pages - 1);
    return page * stride_b + static_cast<int64_t>(key % p.page_size) * stride_s;
  }
  return b * stride_b + static_cast<int64_t>(key) * stride_s;
}

// cp.async of key tile [key0, key0 + 64) of K and V into one stage; keys >= hi are zero-filled.
template <typename T, int kHeadDim>
__device__ __forceinline__ void load_tile(const DecodeParams& p, int b, int kvh, int key0, int hi,
                                          T* k_tile, T* v_tile) {
  constexpr int kChunks = kHeadDim / 8;  // 16-byte chunks per row
  const T* kbase = static_cast<const T*>(p.k) + kvh * p.k_stride_h;
  const T* vbase = static_cast<const T*>(p.v) + kvh * p.v_stride_h;
#pragma unroll
  for (int i = threadIdx.x; i < kBlockN * kChunks; i += kThreads) {
    const int row = i / kChunks, chunk = i % kChunks;
    const int key = key0 + row;
    const bool valid = key < hi;
    const int safe = valid ? key : 0;
    const T* ksrc = kbase + key_offset(p, b, safe, p.k_stride_b, p.k_stride_s) + chunk * 8;
    const T* vsrc = vbase + key_offset(p, b, safe, p.v_stride_b, p.v_stride_s) + chunk * 8;
    const int dst = row * Smem<kHeadDim>::kRow + chunk * 8;
    sm80::cp_async_16(sm80::smem_u32(k_tile + dst), ksrc, valid);
    sm80::cp_async_16(sm80::smem_u32(v_tile + dst), vsrc, valid);
  }
}

template <typename T, int kHeadDim, int kMaxRows>
__global__ void __launch_bounds__(kThreads, 1)
    decode_partial_kernel(const DecodeParams p) {
  using S = Smem<kHeadDim>;
  constexpr int kHalf = kHeadDim / 2;
  constexpr int kCols = kHeadDim / 32;  // output columns per lane
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* q_smem = reinterpret_cast<T*>(smem_raw);  // [kMaxRows][kRow], second half shifted by 8
  T* kv_smem = q_smem + kMaxRows * S::kRow;     // [kStages][2][kTile]

  const int split = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int m_rows = p.group * p.sq;

  // Q tile, zero rows past M; columns of the second half start 8 elements later (their 16-byte
  // reads by lanes 16-31 then fall on other banks than the first half's).
  for (int i = threadIdx.x; i < kMaxRows * kHeadDim; i += kThreads) {
    const int r = i / kHeadDim, d = i % kHeadDim;
    T val = from_f<T>(0.f);
    if (r < m_rows) {
      const int qi = r / p.group, h = kvh * p.group + r % p.group;
      val = static_cast<const T*>(p.q)[b * p.q_stride_b + qi * p.q_stride_s + h * p.q_stride_h +
                                       d];
    }
    q_smem[r * S::kRow + d + (d >= kHalf ? 8 : 0)] = val;
  }

  const int lk = min(max(p.seqlens_k[b], 0), p.capacity);
  const int off = lk - p.sq;  // query i sits at position i + off
  int lo = 0;
  if (p.left >= 0) lo = (max(0, off - p.left) / kBlockN) * kBlockN;
  const int span = max(lk - lo, 0);
  const int per_split = (span + p.num_splits - 1) / p.num_splits;
  const int chunk = ((per_split + kBlockN - 1) / kBlockN) * kBlockN;
  const int s_lo = lo + split * chunk;
  const int s_hi = min(lk, s_lo + chunk);
  const int n_tiles = s_hi > s_lo ? (s_hi - s_lo + kBlockN - 1) / kBlockN : 0;

  float m_i[kMaxRows], l_i[kMaxRows], acc[kMaxRows][kCols];
#pragma unroll
  for (int r = 0; r < kMaxRows; ++r) {
    m_i[r] = -INFINITY;
    l_i[r] = 0.f;
#pragma unroll
    for (int c = 0; c < kCols; ++c) acc[r][c] = 0.f;
  }

  if (n_tiles > 0) load_tile<T, kHeadDim>(p, b, kvh, s_lo, s_hi, kv_smem, kv_smem + S::kTile);
  sm80::cp_async_commit();
  const int key_local = warp * kKeysPerWarp + lane % 16;
  const int half = lane / 16;
  for (int t = 0; t < n_tiles; ++t) {
    if (t + 1 < n_tiles) {
      T* next = kv_smem + ((t + 1) % kStages) * 2 * S::kTile;
      load_tile<T, kHeadDim>(p, b, kvh, s_lo + (t + 1) * kBlockN, s_hi, next, next + S::kTile);
    }
    sm80::cp_async_commit();
    sm80::cp_async_wait<1>();
    __syncthreads();
    const T* k_tile = kv_smem + (t % kStages) * 2 * S::kTile;
    const T* v_tile = k_tile + S::kTile;

    // s[r] = q_r . k_key over this lane's half of the head dim.
    float s[kMaxRows];
#pragma unroll
    for (int r = 0; r < kMaxRows; ++r) s[r] = 0.f;
    const T* krow = k_tile + key_local * S::kRow + half * kHalf;
#pragma unroll
    for (int d = 0; d < kHalf; d += 8) {
      float kf[8], qf[8];
      unpack8(*reinterpret_cast<const uint4*>(krow + d), kf, T());
#pragma unroll
      for (int r = 0; r < kMaxRows; ++r) {
        unpack8(*reinterpret_cast<const uint4*>(q_smem + r * S::kRow + half * (kHalf + 8) + d),
                qf, T());
#pragma unroll
        for (int e = 0; e < 8; ++e) s[r] = fmaf(qf[e], kf[e], s[r]);
      }
    }
    const int key = s_lo + t * kBlockN + key_local;
#pragma unroll
    for (int r = 0; r < kMaxRows; ++r) {
      float x = s[r] + __shfl_xor_sync(0xffffffffu, s[r], 16);
      if (p.softcap > 0.f) x = p.softcap * tanhf(x * p.scale_log2 / p.softcap) * kLog2e;
      else x *= p.scale_log2;
      const int pos = r / p.group + off;
      bool ok = r < m_rows && key < s_hi;
      if (p.right >= 0) ok = ok && key <= pos + p.right;
      if (p.left >= 0) ok = ok && key >= pos - p.left;
      x = ok ? x : -INFINITY;
      // online softmax of this warp's 16 keys (lanes 16-31 hold the same values as 0-15)
      float mx = x;
#pragma unroll
      for (int o = 8; o >= 1; o /= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
      const float m_new = fmaxf(m_i[r], mx);
      const float m_use = m_new == -INFINITY ? 0.f : m_new;
      const float pr = exp2f(x - m_use);
      const float alpha = exp2f(m_i[r] - m_use);
      float sum = pr;
#pragma unroll
      for (int o = 8; o >= 1; o /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, o);
      l_i[r] = l_i[r] * alpha + sum;
      m_i[r] = m_new;
#pragma unroll
      for (int c = 0; c < kCols; ++c) acc[r][c] *= alpha;
      s[r] = pr;
    }
    // acc[r][c] += sum over this warp's keys j of p[r][j] * v[j][lane * kCols + c]
#pragma unroll 4
    for (int j = 0; j < kKeysPerWarp; ++j) {
      const T* vrow = v_tile + (warp * kKeysPerWarp + j) * S::kRow + lane * kCols;
      float vf[kCols];
      unpack_cols<kCols>(vrow, vf, T());
#pragma unroll
      for (int r = 0; r < kMaxRows; ++r) {
        const float pj = __shfl_sync(0xffffffffu, s[r], j);
#pragma unroll
        for (int c = 0; c < kCols; ++c) acc[r][c] = fmaf(pj, vf[c], acc[r][c]);
      }
    }
    __syncthreads();  // the stage is refilled by the next iteration's load
  }
  sm80::cp_async_wait<0>();
  __syncthreads();

  // Merge the four warps (each like a split) through shared memory, reusing the tiles.
  float* o_red = reinterpret_cast<float*>(kv_smem);       // [kWarps][kMaxRows][kHeadDim]
  float* m_red = o_red + kWarps * kMaxRows * kHeadDim;    // [kWarps][kMaxRows]
  float* l_red = m_red + kWarps * kMaxRows;
#pragma unroll
  for (int r = 0; r < kMaxRows; ++r) {
#pragma unroll
    for (int c = 0; c < kCols; ++c)
      o_red[(warp * kMaxRows + r) * kHeadDim + lane * kCols + c] = acc[r][c];
    if (lane == 0) {
      m_red[warp * kMaxRows + r] = m_i[r];
      l_red[warp * kMaxRows + r] = l_i[r];
    }
  }
  __syncthreads();
  const bool final_out = p.num_splits == 1;
  for (int i = threadIdx.x; i < m_rows * kHeadDim; i += kThreads) {
    const int r = i / kHeadDim, d = i % kHeadDim;
    float mx = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) mx = fmaxf(mx, m_red[w * kMaxRows + r]);
    const float m_use = mx == -INFINITY ? 0.f : mx;
    float l = 0.f, o = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const float wt = exp2f(m_red[w * kMaxRows + r] - m_use);
      l += l_red[w * kMaxRows + r] * wt;
      o += o_red[(w * kMaxRows + r) * kHeadDim + d] * wt;
    }
    const float out = l > 0.f ? o / l : 0.f;
    const float lse = l > 0.f ? (m_use + log2f(l)) / kLog2e : -INFINITY;
    const int qi = r / p.group, h = kvh * p.group + r % p.group;
    if (final_out) {
      static_cast<T*>(p.out)[b * p.o_stride_b + qi * p.o_stride_s + h * p.o_stride_h + d] =
          from_f<T>(out);
      if (d == 0) p.lse[(static_cast<int64_t>(b) * p.hq + h) * p.sq + qi] = lse;
    } else {
      const int64_t row = ((static_cast<int64_t>(split) * p.batch + b) * p.hkv + kvh) * m_rows + r;
      p.out_partial[row * kHeadDim + d] = out;
      if (d == 0) p.lse_partial[row] = lse;
    }
  }
}

// out = sum_s exp(lse_s - lse) out_s; one CTA per (KV head, sequence).
template <typename T, int kHeadDim>
__global__ void __launch_bounds__(kThreads) decode_combine_kernel(const DecodeParams p) {
  const int kvh = blockIdx.x, b = blockIdx.y;
  const int m_rows = p.group * p.sq;
  for (int i = threadIdx.x; i < m_rows * kHeadDim; i += kThreads) {
    const int r = i / kHeadDim, d = i % kHeadDim;
    float mx = -INFINITY;
    for (int s = 0; s < p.num_splits; ++s) {
      const int64_t row = ((static_cast<int64_t>(s) * p.batch + b) * p.hkv + kvh) * m_rows + r;
      mx = fmaxf(mx, p.lse_partial[row]);
    }
    const float m_use = mx == -INFINITY ? 0.f : mx;
    float l = 0.f, o = 0.f;
    for (int s = 0; s < p.num_splits; ++s) {
      const int64_t row = ((static_cast<int64_t>(s) * p.batch + b) * p.hkv + kvh) * m_rows + r;
      const float wt = __expf(p.lse_partial[row] - m_use);
      l += wt;
      o += wt * p.out_partial[row * kHeadDim + d];
    }
    const int qi = r / p.group, h = kvh * p.group + r % p.group;
    static_cast<T*>(p.out)[b * p.o_stride_b + qi * p.o_stride_s + h * p.o_stride_h + d] =
        from_f<T>(l > 0.f ? o / l : 0.f);
    if (d == 0)
      p.lse[(static_cast<int64_t>(b) * p.hq + h) * p.sq + qi] =
          l > 0.f ? m_use + __logf(l) : -INFINITY;
  }
}

}  // namespace decode
}  // namespace fusedops
