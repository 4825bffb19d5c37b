// Plain parameters of the split-KV decode kernels (attention over a KV cache), shared by the torch
// binding (decode_api.cpp) and the device code; no ATen types.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace fusedops {

struct DecodeParams {
  const void* q;          // (B, Sq, Hq, D), last dim contiguous
  const void* k;          // (B, S_max, Hkv, D) or paged (num_pages, page_size, Hkv, D)
  const void* v;
  void* out;              // (B, Sq, Hq, D), q's dtype
  float* lse;             // (B, Hq, Sq), natural log
  float* out_partial;     // (num_splits, B, Hkv, M, D) when num_splits > 1
  float* lse_partial;     // (num_splits, B, Hkv, M)
  unsigned int* counters; // (B * Hkv,) zeros: splits done per (sequence, KV head), reset after use
  const int* seqlens_k;   // (B,): keys of each sequence after the append
  const int* page_table;  // (B, max_pages) or nullptr (contiguous cache)
  int64_t q_stride_b, q_stride_s, q_stride_h;
  int64_t k_stride_b, k_stride_s, k_stride_h;  // b: batch or page
  int64_t v_stride_b, v_stride_s, v_stride_h;
  int64_t o_stride_b, o_stride_s, o_stride_h;
  int64_t pt_stride;
  int batch, sq, hq, hkv, group, head_dim;
  int capacity, page_size, num_pages, num_splits;
  int stages;        // K/V pipeline depth, kDecodeMinStages to kDecodeMaxStages
  int page_shift;    // log2(page_size) when a power of two, else -1
  float scale_log2;  // softmax scale * log2(e) (no softcap) or softmax scale (softcap)
  float softcap;     // 0: none
  int left, right;   // window; -1 = unlimited (right = 0 when causal)
  bool is_bf16;
};

// K/V pipeline depths the kernel takes (p.stages), and its default: two CTAs of 106 KiB per SM at
// head dim 128.
constexpr int kDecodeMinStages = 2, kDecodeMaxStages = 6, kDecodeDefaultStages = 3;

// One launcher per family, on `stream`; returns the launch error.
cudaError_t decode_fwd_sm80(const DecodeParams& p, cudaStream_t stream);

}  // namespace fusedops
