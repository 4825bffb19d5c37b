// The host interface of the Hopper GEMM of the linear cross-entropy (gemm_sm90.cuh): plain
// pointers and sizes, shared by the torch binding (gemm_sm90_api.cpp) and the launcher.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace fusedops {

// The three products of the linear cross-entropy, by the layouts of their row-major operands:
//   1 (logits):   C[M, N] = A B^T, a = A [M, K], b = B [N, K]       (X W^T)
//   2 (d_hidden): C[M, N] = A B,   a = A [M, K], b = B [K, N]       (dz W)
//   3 (d_weight): C[M, N] = A^T B, a = A [K, M], b = B [K, N]       (dz^T X)
// accumulate: C = round(float(C) + product) (one rounding), else C = round(product).
struct LceGemmSm90Args {
  const void* a = nullptr;
  const void* b = nullptr;
  void* c = nullptr;
  int64_t lda = 0, ldb = 0, ldc = 0;  // row strides in elements
  int64_t m = 0, n = 0, k = 0;
  int layout = 1;
  bool accumulate = false;
  bool is_bf16 = true;
  int num_sms = 1;
  int group = 0;  // tiles per group of the tile order; 0: the default
  // Split-K (layout 2 only): k_splits slices of float32 partial sums in `workspace` (at least
  // the floats lce_gemm_sm90_splits asks for), reduced into C by a second kernel.
  int k_splits = 1;
  float* workspace = nullptr;
  cudaStream_t stream = nullptr;
};

// The k-splits for args (1: none) and the float32 workspace they need, in floats: split-K for
// layout 2 when its tiles leave more than a tenth of the SMs' last wave idle (d_hidden at
// Gemma-2's H = 2304: 144 tiles on 132 SMs), or FUSEDOPS_LCE_GEMM_SPLITK=<n> (measurement).
int lce_gemm_sm90_splits(const LceGemmSm90Args& args, int64_t* workspace_floats);

// Launches the GEMM; cudaErrorInvalidValue when the driver refuses a tensor map or the
// arguments break the kernel's constraints (the binding checks them first, with messages), and
// cudaErrorNotSupported for a combination that is not instantiated (accumulate with layouts 1
// and 2). m, n, k must be >= 1.
cudaError_t lce_gemm_sm90(const LceGemmSm90Args& args);

// The logits GEMM with the cross-entropy statistics in its epilogue (gemm_sm90_stats.cuh):
// gemm.c = z = round(X W^T) (layout 1: gemm.a = X [M, K], gemm.b = W [N, K]; gemm.layout,
// accumulate and k_splits are ignored), per row and 256-column tile a float4 partial (max, sum
// of exp, target logit, logit sum) of apply_cap(z + bias) into `partials` [M][ce_stats_tiles(N)],
// then per row lse, zt and zsum (float32 [M]) merged from them by a second kernel.
struct LceCeStatsSm90Args {
  LceGemmSm90Args gemm;
  const float* bias = nullptr;    // [N] float32, or null
  const int64_t* target = nullptr;  // [M]; outside [0, N) (ignore_index): zt = 0
  float* partials = nullptr;      // [M][tiles] float4, 16-byte aligned
  float* lse = nullptr;
  float* zt = nullptr;
  float* zsum = nullptr;
  float softcap = 0.f;  // 0: none
};

// Column tiles of the statistics' partials for N columns (ceil(N / 256)).
int64_t lce_ce_stats_tiles(int64_t n);

// Launches both kernels; the same errors as lce_gemm_sm90.
cudaError_t lce_logits_ce_stats_sm90(const LceCeStatsSm90Args& args);

// Layouts 2 and 3 with A = dz computed from the stored logits z in the operand path (the row
// kernel's MODE_DZ math, gemm_sm90_dz.cuh): gemm.a = z [tokens, V] (raw: no bias, no softcap) in
// both layouts, so layout 2 is C[tokens, N] = dz B (gemm.m = tokens, gemm.k = V) and layout 3 is
// C[V, N] (+)= dz^T B (gemm.m = V, gemm.k = tokens). Split-K as lce_gemm_sm90 (layout 2).
// A first kernel builds the per-token table in `tab` (16 bytes per token, 16-byte aligned).
struct LceDzGemmSm90Args {
  LceGemmSm90Args gemm;
  const float* bias = nullptr;      // [V] float32, 8-byte aligned, or null
  const float* lse = nullptr;       // [tokens] float32
  const float* w = nullptr;         // [tokens] float32, d loss / d per-token loss (0: ignored)
  const int64_t* target = nullptr;  // [tokens]; outside [0, V): no one-hot term
  float* tab = nullptr;             // [tokens][4] float32 scratch
  float eps = 0.f;                  // label smoothing
  float z_loss = 0.f;
  float softcap = 0.f;              // 0: none
  float* dbias = nullptr;  // layout 3 only, or null: [V] float32 = the column sums of dz
};

// Launches both kernels; the same errors as lce_gemm_sm90.
cudaError_t lce_dz_gemm_sm90(const LceDzGemmSm90Args& args);

}  // namespace fusedops
