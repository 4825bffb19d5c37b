// The plain parameter struct shared by the torch binding and the device code (no at::Tensor here).
#pragma once

#include <cstdint>
#include <cuda_runtime.h>

namespace fusedops {

struct LinearCeParams {
  // Inputs: hidden [n_tokens, hidden_size], weight [vocab_size, hidden_size], both contiguous,
  // of one element type (fp16 or bf16); bias [vocab_size] or null; target [n_tokens] int64.
  const void* hidden = nullptr;
  const void* weight = nullptr;
  const void* bias = nullptr;
  const int64_t* target = nullptr;
  int64_t n_tokens = 0;
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  float softcap = 0.f;  // 0 = no softcap
  bool is_bf16 = true;

  // Forward outputs and scratch: partials [n_splits][4][n_tokens] (max, sumexp, z_target, z_sum).
  float* part = nullptr;
  int tiles_per_split = 0;
  int n_splits = 0;
  float* lse = nullptr;
  float* z_target = nullptr;
  float* z_sum = nullptr;

  // Backward inputs (per token, float32): lse and the upstream gradients of the three statistics.
  const float* lse_in = nullptr;
  const float* d_lse = nullptr;
  const float* d_zt = nullptr;
  const float* d_zsum = nullptr;
  // Backward outputs and scratch.
  void* dz = nullptr;               // [n_tokens, ld_dz] in the input dtype, one vocab chunk
  int64_t ld_dz = 0;                // vocab columns per chunk (multiple of the tile width)
  void* d_weight = nullptr;         // [vocab_size, hidden_size] or null
  void* d_hidden = nullptr;         // [n_tokens, hidden_size] or null
  uint16_t* d_hidden_lo = nullptr;  // bf16: low 16 bits of the float32 d_hidden sums
  float* d_hidden_acc = nullptr;    // fp16: float32 d_hidden sums
  float* d_bias_f32 = nullptr;      // [vocab_size] float32, zeroed, or null

  int num_sms = 1;
  cudaStream_t stream = nullptr;
};

// The fast path's row kernels (ce_rows_kernel.cuh): one materialised logits chunk z [rows, n_cols]
// (contiguous, fp16/bf16, vocab columns [col0, col0 + n_cols)) -> statistics and/or dz in place.
// Modes (same numbers as python/fusedops/linear_ce/chunked.py): 1 MERGE, 2 DZ, 3 FULL_DZ, 4 FULL.
struct CeRowsParams {
  void* z = nullptr;
  const float* bias = nullptr;  // [n_cols] float32 (already offset by col0) or null
  const int64_t* target = nullptr;  // [rows] (int64; int32 converted by the binding)
  const float* w = nullptr;     // [rows] weight of each token in the loss (0 = ignored)
  float* lse = nullptr;         // [rows]: written by FULL modes, read by DZ modes
  float* m = nullptr;           // [rows] running max (MERGE)
  float* s = nullptr;           // [rows] running sum of exp(z - m) (MERGE)
  float* zt = nullptr;          // [rows] target logit (accumulated by MERGE, written by FULL)
  float* zsum = nullptr;        // [rows] sum of logits (likewise)
  int64_t rows = 0;
  int64_t n_cols = 0;
  int64_t col0 = 0;
  int64_t vocab_size = 0;
  float eps = 0.f;      // label smoothing
  float z_loss = 0.f;
  float softcap = 0.f;  // 0 = none
  int mode = 0;
  bool stat_grads = false;  // mode 2 with w, zt, zsum read as d_lse, d_zt, d_zsum (mode 5)
  bool is_bf16 = true;
  cudaStream_t stream = nullptr;
};

// x[i] *= *g for i < n unless *g == 1 (checked on the device: no host synchronisation).
struct ScaleParams {
  void* x = nullptr;
  const float* g = nullptr;
  int64_t n = 0;
  int dtype = 0;  // 0 float32, 1 bfloat16, 2 float16
  cudaStream_t stream = nullptr;
};

// Token and vocab tile of every kernel (kBlockM = kBlockN in linear_ce_kernel_sm80.cuh).
constexpr int64_t kLceTile = 128;
// Bytes of dz one backward chunk may hold: 32 MiB keeps the Llama-3 shape (N=8192) under 1% of
// eager's extra memory together with the N*H*2 bytes of the split d_hidden accumulator.
constexpr int64_t kLceDzChunkBytes = int64_t(32) << 20;

inline int64_t lce_cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Forward: vocab tiles per split and number of splits, so that (token blocks x splits) covers two
// waves of the GPU while every split starts inside the vocabulary.
inline void lce_fwd_splits(int64_t n_tokens, int64_t vocab_size, int num_sms,
                           int* tiles_per_split, int* n_splits) {
  int64_t m_blocks = lce_cdiv(n_tokens, kLceTile);
  if (m_blocks < 1) m_blocks = 1;
  const int64_t v_tiles = lce_cdiv(vocab_size, kLceTile);
  int64_t want = lce_cdiv(2 * int64_t(num_sms), m_blocks);
  if (want > v_tiles) want = v_tiles;
  if (want < 1) want = 1;
  *tiles_per_split = static_cast<int>(lce_cdiv(v_tiles, want));
  *n_splits = static_cast<int>(lce_cdiv(v_tiles, *tiles_per_split));
}

// Backward: vocab columns per chunk, a multiple of the tile, dz [N, cols] within the budget.
inline int64_t lce_bwd_chunk_cols(int64_t n_tokens, int64_t vocab_size, int elem_bytes) {
  int64_t cols = kLceDzChunkBytes / ((n_tokens > 0 ? n_tokens : 1) * elem_bytes);
  cols = cols / kLceTile * kLceTile;
  if (cols < kLceTile) cols = kLceTile;
  const int64_t all = lce_cdiv(vocab_size, kLceTile) * kLceTile;
  return cols < all ? cols : all;
}

// Entry points, one per kernel family (arch 80: mma.sync + cp.async tuned for Ampere; arch 90:
// the Hopper build). Each returns a CUDA error code of its last launch.
cudaError_t linear_ce_fwd_sm80(LinearCeParams& p);
cudaError_t linear_ce_bwd_sm80(LinearCeParams& p);
cudaError_t linear_ce_fwd_sm90(LinearCeParams& p);
cudaError_t linear_ce_bwd_sm90(LinearCeParams& p);
cudaError_t ce_rows_sm80(CeRowsParams& p);
cudaError_t ce_rows_sm90(CeRowsParams& p);
cudaError_t scale_if_not_one(ScaleParams& p);

}  // namespace fusedops
