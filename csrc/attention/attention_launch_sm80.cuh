// Host-side launch of the sm80 attention kernels: grids, the launch helper, run_fwd / run_bwd
// (tile sizes and shared memory: the table in attention_config_sm80.h).
#pragma once

#include "attention_bwd_kernel_sm80.cuh"
#include "attention_config_sm80.h"
#include "attention_fwd_kernel_sm80.cuh"

namespace fusedops {
namespace attn {

template <typename Kernel>
cudaError_t launch(Kernel kernel, dim3 grid, int threads, size_t smem, const AttnParams& p) {
  if (grid.x == 0 || grid.y == 0 || grid.z == 0) return cudaSuccess;
  if (smem > 48 * 1024) {
    const cudaError_t err = cudaFuncSetAttribute(
        kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
    if (err != cudaSuccess) return err;
  }
  kernel<<<grid, threads, smem, p.stream>>>(p);
  return cudaGetLastError();
}

template <typename T, int D>
cudaError_t run_fwd(const AttnParams& p) {
  using C = Tiles<D>;
  static_assert(sizeof(T) == C::kElem);
  constexpr int BM = C::kFwdM, BN = C::kFwdN;
  return launch(fwd_kernel<T, D, C::kFwdMT, BN, C::kFwdWarps>,
                dim3((p.max_q + BM - 1) / BM, p.hq, p.batch), C::kFwdWarps * 32, C::kFwdSmem, p);
}

// Whether dkdv_split_kernel's shared memory fits the current device (else dQ takes its own pass).
template <int D>
bool split_fits() {
  int dev = 0, most = 0;
  if (cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&most, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) != cudaSuccess)
    return false;
  return Tiles<D>::kSplitSmem <= static_cast<size_t>(most);
}

template <typename T, int D>
cudaError_t run_bwd(const AttnParams& p) {
  using C = Tiles<D>;
  static_assert(sizeof(T) == C::kElem);
  const int64_t rows = static_cast<int64_t>(p.total_q) * p.hq;
  cudaError_t err = launch(delta_kernel<T, D>, dim3(static_cast<unsigned>((rows + 255) / 256)),
                           256, 0, p);
  if (err != cudaSuccess) return err;
  constexpr int BMk = C::kDkdvM, BNk = C::kDkdvN;
  if (p.dq_acc != nullptr) {  // dQ by float32 atomics from the dK/dV kernel, then scaled
    constexpr int BM = C::kSplitM, BN = 128;
    constexpr size_t smem = C::kSplitSmem;
    err = launch(dkdv_split_kernel<T, D, BM>, dim3((p.max_k + BN - 1) / BN, p.hkv, p.batch), 256,
                 smem, p);
    if (err != cudaSuccess) return err;
    const int64_t n = static_cast<int64_t>(p.total_q) * p.hq * (D / 8);
    return launch(dq_convert_kernel<T, D>, dim3(static_cast<unsigned>((n + 255) / 256)), 256, 0,
                  p);
  }
  err = launch(dkdv_kernel<T, D, BMk, BNk, C::kDkdvWarps>,
               dim3((p.max_k + BNk - 1) / BNk, p.hkv, p.batch), C::kDkdvWarps * 32, C::kDkdvSmem,
               p);
  if (err != cudaSuccess) return err;
  constexpr int BM = C::kDqM, BN = C::kDqN;
  return launch(dq_kernel<T, D, C::kDqMT, BN, C::kDqWarps>,
                dim3((p.max_q + BM - 1) / BM, p.hq, p.batch), C::kDqWarps * 32, C::kDqSmem, p);
}

}  // namespace attn
}  // namespace fusedops
