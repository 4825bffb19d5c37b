// Split-KV decode attention for the sm80 family (cp.async multistage loads, mma.sync m16n8k16;
// also runs on Hopper). Device code only; the launch is decode_sm80.cu's.
//
// One CTA of 4 warps per (split, KV head, sequence). Its query tile is the GQA group of the KV
// head for every query: row r = query r / G of head kvh * G + r % G, M = G * Sq <= 16 rows (the
// mma's 16; rows past M are zeros and never written). Key tiles of 64 keys (K and V, rows padded
// by 16 bytes so that ldmatrix's eight 16-byte row reads hit distinct banks) come in by cp.async,
// p.stages deep (3 by default), zero-filled past the split's end. Warp w owns keys
// [16w, 16w + 16) of each tile: S = Q K^T by mma (Q's fragments stay in registers), its own
// online softmax (exp2, the scale folded in), and O += P V with P from registers and V through
// ldmatrix.trans. The four warps
// are merged through shared memory at the end. The split's key range is computed from
// seqlens_k on the device (no host synchronisation); page numbers and lengths are clamped into
// range so bad values cannot fault.
//
// With more than one split, each CTA writes its normalised partial output and lse to float32
// workspaces, then counts itself done on its (sequence, KV head)'s counter; the CTA that counts
// last merges the splits (weights exp(lse_s - max)) and resets the counter to zero for the next
// call (the binding keeps one zeroed counter buffer per stream). No second kernel, so no second
// launch and no tail between them.
// Constraints (checked by decode_api.cpp): fp16/bf16, head dim 64 or 128, M <= 16, last dims
// contiguous, k/v rows 16-byte aligned (q rows too: the binding copies a q whose rows are not).
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
constexpr int kRows = 16;    // query rows of the mma tile
constexpr int kBlockN = 64;  // keys per tile, 16 per warp

template <int kHeadDim>
struct Smem {
  static constexpr int kRow = kHeadDim + 8;  // elements per padded K/V/Q row
  static constexpr int kTile = kBlockN * kRow;
  static constexpr int kQ = kRows * kRow;
  static size_t bytes(int stages, size_t elem) { return (size_t(kQ) + stages * 2 * kTile) * elem; }
};

// Element offsets of logical key `key` of sequence b in the K and V caches (through the page
// table).
struct KeyAddr {
  int64_t k, v;
};
__device__ __forceinline__ KeyAddr key_addr(const DecodeParams& p, int b, int key) {
  int64_t page = b, slot = key;
  if (p.page_table != nullptr) {
    const int pi = p.page_shift >= 0 ? key >> p.page_shift : key / p.page_size;
    slot = p.page_shift >= 0 ? key & (p.page_size - 1) : key - pi * p.page_size;
    page = min(max(__ldg(p.page_table + b * p.pt_stride + pi), 0), p.num_pages - 1);
  }
  return {page * p.k_stride_b + slot * p.k_stride_s, page * p.v_stride_b + slot * p.v_stride_s};
}

// cp.async of key tile [key0, key0 + 64) of K and V into one stage; keys >= hi are zero-filled.
// Thread i copies 16-byte chunk i % (D / 8) of rows i / (D / 8) + j * kRowStep, K rows first,
// then V rows. key0 is a multiple of 64 (split starts are), so on a contiguous cache, and on a
// paged one with pages of a power of two >= 64 keys, the tile is one run of rows at a fixed
// stride: one page-table read per tile and a pointer step per row. Smaller pages take one
// page-table read per row.
template <typename T, int kHeadDim>
__device__ __forceinline__ void load_tile(const DecodeParams& p, int b, int kvh, int key0, int hi,
                                          T* k_tile, T* v_tile) {
  constexpr int kChunks = kHeadDim / 8;  // 16-byte chunks per row
  constexpr int kRowStep = kThreads / kChunks;
  constexpr int kPerThread = kBlockN / kRowStep;
  constexpr uint32_t kDstStep = kRowStep * Smem<kHeadDim>::kRow * sizeof(T);
  const int chunk = threadIdx.x % kChunks, row0 = threadIdx.x / kChunks;
  const T* kbase = static_cast<const T*>(p.k) + kvh * p.k_stride_h + chunk * 8;
  const T* vbase = static_cast<const T*>(p.v) + kvh * p.v_stride_h + chunk * 8;
  const uint32_t kdst = sm80::smem_u32(k_tile + row0 * Smem<kHeadDim>::kRow + chunk * 8);
  const uint32_t vdst = sm80::smem_u32(v_tile + row0 * Smem<kHeadDim>::kRow + chunk * 8);
  const int key = key0 + row0;
  if (p.page_table == nullptr || (p.page_shift >= 0 && p.page_size >= kBlockN)) {
    int64_t page = b, slot = key;
    if (p.page_table != nullptr) {
      page = min(max(__ldg(p.page_table + b * p.pt_stride + (key0 >> p.page_shift)), 0),
                 p.num_pages - 1);
      slot = key & (p.page_size - 1);
    }
    const T* ksrc = kbase + page * p.k_stride_b + slot * p.k_stride_s;
    const T* vsrc = vbase + page * p.v_stride_b + slot * p.v_stride_s;
    const int64_t kstep = kRowStep * p.k_stride_s, vstep = kRowStep * p.v_stride_s;
#pragma unroll
    for (int i = 0; i < kPerThread; ++i) {
      const bool valid = key + i * kRowStep < hi;
      sm80::cp_async_16(kdst + i * kDstStep, valid ? ksrc + i * kstep : kbase, valid);
    }
#pragma unroll
    for (int i = 0; i < kPerThread; ++i) {
      const bool valid = key + i * kRowStep < hi;
      sm80::cp_async_16(vdst + i * kDstStep, valid ? vsrc + i * vstep : vbase, valid);
    }
    return;
  }
  int64_t voff[kPerThread];
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) {
    const bool valid = key + i * kRowStep < hi;
    const KeyAddr a = key_addr(p, b, valid ? key + i * kRowStep : 0);
    voff[i] = valid ? a.v : -1;
    sm80::cp_async_16(kdst + i * kDstStep, kbase + a.k, valid);
  }
#pragma unroll
  for (int i = 0; i < kPerThread; ++i)
    sm80::cp_async_16(vdst + i * kDstStep, vbase + (voff[i] >= 0 ? voff[i] : 0), voff[i] >= 0);
}

// Tile row r of KV head kvh: query r / G of head kvh * G + r % G.
struct RowQH {
  int qi, h;
};
__device__ __forceinline__ RowQH row_qh(const DecodeParams& p, int kvh, int r) {
  return {r / p.group, kvh * p.group + r % p.group};
}
__device__ __forceinline__ int64_t out_offset(const DecodeParams& p, int b, int kvh, int r) {
  const RowQH x = row_qh(p, kvh, r);
  return b * p.o_stride_b + x.qi * p.o_stride_s + x.h * p.o_stride_h;
}
__device__ __forceinline__ int64_t lse_offset(const DecodeParams& p, int b, int kvh, int r) {
  const RowQH x = row_qh(p, kvh, r);
  return (static_cast<int64_t>(b) * p.hq + x.h) * p.sq + x.qi;
}

template <typename T>
__device__ __forceinline__ void store4(T* dst, float4 v) {
  uint2 w;
  w.x = dev::pack2<T>(v.x, v.y);
  w.y = dev::pack2<T>(v.z, v.w);
  *reinterpret_cast<uint2*>(dst) = w;
}

template <typename T, int kHeadDim>
__global__ void __launch_bounds__(kThreads, 2) decode_kernel(const DecodeParams p) {
  using S = Smem<kHeadDim>;
  constexpr int kKSteps = kHeadDim / 16;  // k-steps of S = Q K^T
  constexpr int kNB = kHeadDim / 8;       // n-blocks of O
  constexpr int kC4 = kHeadDim / 4;       // float4 columns of an output row
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* q_smem = reinterpret_cast<T*>(smem_raw);  // [kRows][kRow]
  T* kv_smem = q_smem + S::kQ;                 // [kStages][K, V][kTile]

  const int split = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int m_rows = p.group * p.sq;

  const int lk = min(max(__ldg(p.seqlens_k + b), 0), p.capacity);
  const int off = lk - p.sq;  // query i sits at position i + off
  int lo = 0;
  if (p.left >= 0) lo = (max(0, off - p.left) / kBlockN) * kBlockN;
  const int span = max(lk - lo, 0);
  const int per_split = (span + p.num_splits - 1) / p.num_splits;
  const int chunk = ((per_split + kBlockN - 1) / kBlockN) * kBlockN;
  const int s_lo = lo + split * chunk;
  const int s_hi = min(lk, s_lo + chunk);
  const int n_tiles = s_hi > s_lo ? (s_hi - s_lo + kBlockN - 1) / kBlockN : 0;

  // The first stages - 1 tiles in flight before anything else.
  const int stages = p.stages;
  for (int s = 0; s < stages - 1; ++s) {
    if (s < n_tiles) {
      T* st = kv_smem + s * 2 * S::kTile;
      load_tile<T, kHeadDim>(p, b, kvh, s_lo + s * kBlockN, s_hi, st, st + S::kTile);
    }
    sm80::cp_async_commit();
  }

  // Q tile, rows past M zero.
  for (int i = tid; i < kRows * (kHeadDim / 8); i += kThreads) {
    const int r = i / (kHeadDim / 8), c = i % (kHeadDim / 8);
    uint4 val{0u, 0u, 0u, 0u};
    if (r < m_rows) {
      const RowQH x = row_qh(p, kvh, r);
      val = __ldg(reinterpret_cast<const uint4*>(static_cast<const T*>(p.q) + b * p.q_stride_b +
                                                 x.qi * p.q_stride_s + x.h * p.q_stride_h) + c);
    }
    *reinterpret_cast<uint4*>(q_smem + r * S::kRow + c * 8) = val;
  }
  __syncthreads();
  // A fragments of Q: matrix lane / 8 = (rows 0-7 | 8-15) x (columns 0-7 | 8-15) of a k-step.
  uint32_t qa[kKSteps][4];
  {
    const int mi = lane / 8;
    const T* base = q_smem + ((mi % 2) * 8 + lane % 8) * S::kRow + (mi / 2) * 8;
#pragma unroll
    for (int kk = 0; kk < kKSteps; ++kk) sm80::ldmatrix_x4(qa[kk], sm80::smem_u32(base + kk * 16));
  }

  // Per thread: rows g = lane / 4 and g + 8 of the tile, keys / columns 2 * (lane % 4) + {0, 1}.
  const int g = lane / 4, t4 = lane % 4;
  float m_i[2] = {-INFINITY, -INFINITY}, l_i[2] = {0.f, 0.f};
  float o[kNB][4];
#pragma unroll
  for (int nb = 0; nb < kNB; ++nb)
#pragma unroll
    for (int e = 0; e < 4; ++e) o[nb][e] = 0.f;
  const int pos[2] = {g < m_rows ? g / p.group + off : 0,
                      g + 8 < m_rows ? (g + 8) / p.group + off : 0};
  const bool windowed = p.left >= 0 || p.right >= 0;
  // ldmatrix row addresses of this lane: K (non-transposed: keys x columns, matrix lane / 8 =
  // (keys 0-7 | 8-15) x (columns 0-7 | 8-15)), V (transposed: matrix lane / 8 = (keys 0-7 |
  // 8-15) x (columns 0-7 | 8-15) of a 16-column pair of n-blocks).
  const int mi = lane / 8;
  const int k_ld = (warp * 16 + (mi / 2) * 8 + lane % 8) * S::kRow + (mi % 2) * 8;
  const int v_ld = (warp * 16 + (mi % 2) * 8 + lane % 8) * S::kRow + (mi / 2) * 8;

  int stage = 0;  // t % stages
  for (int t = 0; t < n_tiles; ++t) {
    switch (stages) {  // tile t landed: at most stages - 2 younger groups pending
      case 2: sm80::cp_async_wait<0>(); break;
      case 3: sm80::cp_async_wait<1>(); break;
      case 4: sm80::cp_async_wait<2>(); break;
      case 5: sm80::cp_async_wait<3>(); break;
      default: sm80::cp_async_wait<4>(); break;
    }
    __syncthreads();  // tile t has landed; every warp is done with tile t - 1's stage
    if (t + stages - 1 < n_tiles) {
      const int refill = stage == 0 ? stages - 1 : stage - 1;  // (t + stages - 1) % stages
      T* st = kv_smem + refill * 2 * S::kTile;
      load_tile<T, kHeadDim>(p, b, kvh, s_lo + (t + stages - 1) * kBlockN, s_hi, st,
                             st + S::kTile);
    }
    sm80::cp_async_commit();
    const T* k_tile = kv_smem + stage * 2 * S::kTile;
    stage = stage + 1 == stages ? 0 : stage + 1;
    const T* v_tile = k_tile + S::kTile;

    // Even and odd k-steps into separate accumulators: two chains of kKSteps / 2 dependent mma
    // per key block instead of one of kKSteps.
    float s[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
    float s_odd[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
    for (int kk = 0; kk < kKSteps; ++kk) {
      uint32_t kf[4];
      sm80::ldmatrix_x4(kf, sm80::smem_u32(k_tile + k_ld + kk * 16));
      float (&acc)[2][4] = kk % 2 == 0 ? s : s_odd;
      sm80::mma_16816<T>(acc[0], qa[kk], kf[0], kf[1]);
      sm80::mma_16816<T>(acc[1], qa[kk], kf[2], kf[3]);
    }
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[j][e] += s_odd[j][e];
    const int key_base = s_lo + t * kBlockN + warp * 16 + 2 * t4;
    const bool mask = windowed || s_lo + (t + 1) * kBlockN > s_hi;
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float x = s[j][e];
        if (p.softcap > 0.f) x = p.softcap * tanhf(x * p.scale_log2 / p.softcap) * dev::kLog2e;
        else x *= p.scale_log2;
        if (mask) {
          const int key = key_base + 8 * j + (e & 1), ps = pos[e / 2];
          bool ok = key < s_hi;
          if (p.right >= 0) ok = ok && key <= ps + p.right;
          if (p.left >= 0) ok = ok && key >= ps - p.left;
          x = ok ? x : -INFINITY;
        }
        s[j][e] = x;
      }
    float alpha[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {  // row g (h = 0) and g + 8 (h = 1): elements 2h, 2h + 1
      float mx = fmaxf(fmaxf(s[0][2 * h], s[0][2 * h + 1]), fmaxf(s[1][2 * h], s[1][2 * h + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float m_new = fmaxf(m_i[h], mx);
      const float m_use = m_new == -INFINITY ? 0.f : m_new;
      alpha[h] = dev::ex2(m_i[h] - m_use);
      m_i[h] = m_new;
      float sum = 0.f;
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int e = 2 * h; e < 2 * h + 2; ++e) {
          s[j][e] = dev::ex2(s[j][e] - m_use);
          sum += s[j][e];
        }
      l_i[h] = l_i[h] * alpha[h] + sum;  // this thread's keys only; the quad is summed at the end
    }
#pragma unroll
    for (int nb = 0; nb < kNB; ++nb) {
      o[nb][0] *= alpha[0];
      o[nb][1] *= alpha[0];
      o[nb][2] *= alpha[1];
      o[nb][3] *= alpha[1];
    }
    // P as the A operand (16 rows x 16 keys): the S accumulators' layout, packed to 16 bits.
    const uint32_t pa[4] = {dev::pack2<T>(s[0][0], s[0][1]), dev::pack2<T>(s[0][2], s[0][3]),
                            dev::pack2<T>(s[1][0], s[1][1]), dev::pack2<T>(s[1][2], s[1][3])};
#pragma unroll
    for (int n2 = 0; n2 < kNB / 2; ++n2) {
      uint32_t vf[4];
      sm80::ldmatrix_x4_trans(vf, sm80::smem_u32(v_tile + v_ld + n2 * 16));
      sm80::mma_16816<T>(o[2 * n2], pa, vf[0], vf[1]);
      sm80::mma_16816<T>(o[2 * n2 + 1], pa, vf[2], vf[3]);
    }
  }
  sm80::cp_async_wait<0>();
  __syncthreads();  // every warp is done with the tiles: their space holds the merge

  // Merge the four warps (each like a split) through shared memory.
  float* o_red = reinterpret_cast<float*>(kv_smem);  // [kWarps][kRows][kHeadDim]
  float* m_red = o_red + kWarps * kRows * kHeadDim;  // [kWarps][kRows]
  float* l_red = m_red + kWarps * kRows;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l_i[h] += __shfl_xor_sync(0xffffffffu, l_i[h], 1);
    l_i[h] += __shfl_xor_sync(0xffffffffu, l_i[h], 2);
    const int r = g + 8 * h;
#pragma unroll
    for (int nb = 0; nb < kNB; ++nb)
      *reinterpret_cast<float2*>(o_red + (warp * kRows + r) * kHeadDim + nb * 8 + 2 * t4) =
          make_float2(o[nb][2 * h], o[nb][2 * h + 1]);
    if (t4 == 0) {
      m_red[warp * kRows + r] = m_i[h];
      l_red[warp * kRows + r] = l_i[h];
    }
  }
  __syncthreads();
  const bool single = p.num_splits == 1;
  const int64_t part_row0 = ((static_cast<int64_t>(split) * p.batch + b) * p.hkv + kvh) * m_rows;
  for (int i = tid; i < m_rows * kC4; i += kThreads) {
    const int r = i / kC4, c = (i % kC4) * 4;
    float mx = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) mx = fmaxf(mx, m_red[w * kRows + r]);
    const float m_use = mx == -INFINITY ? 0.f : mx;
    float l = 0.f;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const float wt = dev::ex2(m_red[w * kRows + r] - m_use);
      l += l_red[w * kRows + r] * wt;
      const float4 x = *reinterpret_cast<const float4*>(o_red + (w * kRows + r) * kHeadDim + c);
      acc.x += x.x * wt;
      acc.y += x.y * wt;
      acc.z += x.z * wt;
      acc.w += x.w * wt;
    }
    const float inv = l > 0.f ? 1.f / l : 0.f;
    acc = make_float4(acc.x * inv, acc.y * inv, acc.z * inv, acc.w * inv);
    const float lse = l > 0.f ? (m_use + __log2f(l)) / dev::kLog2e : -INFINITY;
    if (single) {
      store4(static_cast<T*>(p.out) + out_offset(p, b, kvh, r) + c, acc);
      if (c == 0) p.lse[lse_offset(p, b, kvh, r)] = lse;
    } else {
      *reinterpret_cast<float4*>(p.out_partial + (part_row0 + r) * kHeadDim + c) = acc;
      if (c == 0) p.lse_partial[part_row0 + r] = lse;
    }
  }
  if (single) return;

  // Count this split done; the last one of (b, kvh) merges them all.
  __shared__ int last;
  __threadfence();  // this CTA's partial is visible before its count
  __syncthreads();
  unsigned int* counter = p.counters + static_cast<int64_t>(b) * p.hkv + kvh;
  if (tid == 0) last = atomicAdd(counter, 1u) == static_cast<unsigned>(p.num_splits - 1);
  __syncthreads();
  if (!last) return;
  __threadfence();  // the other splits' partials, counted before ours, are visible now
  // The splits' lse (natural log) into shared memory (the merge buffers are free again), then per
  // (row, 4 columns) the weighted sum over the splits, loads issued 8 splits at a time.
  float* lse_s = reinterpret_cast<float*>(kv_smem);  // [num_splits][m_rows]
  const int64_t stride = static_cast<int64_t>(p.batch) * p.hkv * m_rows;  // one split's rows
  const int64_t row0 = (static_cast<int64_t>(b) * p.hkv + kvh) * m_rows;
  for (int i = tid; i < p.num_splits * m_rows; i += kThreads)
    lse_s[i] = __ldcg(p.lse_partial + (i / m_rows) * stride + row0 + i % m_rows);
  __syncthreads();
  if (tid == 0) *counter = 0u;  // every split has counted: ready for the next call
  for (int i = tid; i < m_rows * kC4; i += kThreads) {
    const int r = i / kC4, c = (i % kC4) * 4;
    float mx = -INFINITY;
    for (int s = 0; s < p.num_splits; ++s) mx = fmaxf(mx, lse_s[s * m_rows + r]);
    const float m_use = mx == -INFINITY ? 0.f : mx;
    float l = 0.f;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    const float* src = p.out_partial + (row0 + r) * kHeadDim + c;
#pragma unroll 8
    for (int s = 0; s < p.num_splits; ++s) {
      const float wt = __expf(lse_s[s * m_rows + r] - m_use);
      const float4 x = __ldcg(reinterpret_cast<const float4*>(src + s * stride * kHeadDim));
      l += wt;
      acc.x += x.x * wt;
      acc.y += x.y * wt;
      acc.z += x.z * wt;
      acc.w += x.w * wt;
    }
    const float inv = l > 0.f ? 1.f / l : 0.f;
    store4(static_cast<T*>(p.out) + out_offset(p, b, kvh, r) + c,
           make_float4(acc.x * inv, acc.y * inv, acc.z * inv, acc.w * inv));
    if (c == 0) p.lse[lse_offset(p, b, kvh, r)] = l > 0.f ? m_use + __logf(l) : -INFINITY;
  }
}

}  // namespace decode
}  // namespace fusedops
