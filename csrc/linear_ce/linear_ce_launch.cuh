// Host-side launch code for the linear cross-entropy kernels: grids, shared memory, streams.
#pragma once

#include <algorithm>

#include "linear_ce_kernel_sm80.cuh"
#include "linear_ce_params.h"

namespace fusedops {
namespace lce {

inline int64_t cdiv(int64_t a, int64_t b) { return lce_cdiv(a, b); }

template <typename Kernel>
inline cudaError_t allow_smem(Kernel kernel, int bytes) {
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
}

template <class Cfg, typename T>
cudaError_t run_fwd(LinearCeParams& p) {
  if (p.n_tokens == 0) return cudaSuccess;
  auto kernel = fwd_kernel<Cfg, T>;
  cudaError_t err = allow_smem(kernel, Cfg::kSmemBytes);
  if (err != cudaSuccess) return err;
  dim3 grid(static_cast<unsigned>(cdiv(p.n_tokens, kBlockM)), p.n_splits);
  kernel<<<grid, kThreads, Cfg::kSmemBytes, p.stream>>>(p);
  combine_kernel<Cfg><<<static_cast<unsigned>(cdiv(p.n_tokens, 256)), 256, 0, p.stream>>>(p);
  return cudaGetLastError();
}

template <class Cfg, typename T>
cudaError_t run_bwd(LinearCeParams& p) {
  if (p.n_tokens == 0) return cudaSuccess;
  cudaError_t err;
  if ((err = allow_smem(dz_kernel<Cfg, T>, Cfg::kSmemBytes)) != cudaSuccess) return err;
  if ((err = allow_smem(dw_kernel<Cfg, T>, Cfg::kSmemBytes)) != cudaSuccess) return err;
  if ((err = allow_smem(dx_kernel<Cfg, T>, Cfg::kSmemBytes)) != cudaSuccess) return err;
  const unsigned m_blocks = static_cast<unsigned>(cdiv(p.n_tokens, kBlockM));
  const unsigned h_blocks = static_cast<unsigned>(cdiv(p.hidden_size, kBlockN));
  for (int64_t v0 = 0; v0 < p.vocab_size; v0 += p.ld_dz) {
    const int64_t n_cols = std::min(p.ld_dz, p.vocab_size - v0);
    dz_kernel<Cfg, T><<<dim3(m_blocks, static_cast<unsigned>(p.ld_dz / kBlockN)), kThreads,
                        Cfg::kSmemBytes, p.stream>>>(p, v0, n_cols);
    if (p.d_weight != nullptr) {
      dw_kernel<Cfg, T><<<dim3(static_cast<unsigned>(cdiv(n_cols, kBlockM)), h_blocks), kThreads,
                          Cfg::kSmemBytes, p.stream>>>(p, v0, n_cols);
    }
    if (p.d_hidden != nullptr) {
      dx_kernel<Cfg, T><<<dim3(m_blocks, h_blocks), kThreads, Cfg::kSmemBytes, p.stream>>>(
          p, v0, n_cols, v0 == 0, v0 + p.ld_dz >= p.vocab_size);
    }
    if ((err = cudaGetLastError()) != cudaSuccess) return err;
  }
  return cudaSuccess;
}

}  // namespace lce
}  // namespace fusedops
