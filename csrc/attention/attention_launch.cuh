// Host-side launch of the attention kernels: tile configurations, grids, shared memory.
#pragma once

#include "attention_kernel_sm80.cuh"

namespace fusedops {
namespace attn {

// Tile configurations per head dim, each measured against its neighbours on the H200
// (benchmarks/NOTES_attention.md). Forward and dQ: NW warps of MT row tiles (BM = 16 MT NW
// queries), BN keys per step; dK/dV (deterministic path): BN = 16 NW keys, BM queries per step.
// Registers stay <= 255 per thread without spills in the loops (the D=128 forward spills at
// BN=64; at D=64 the forward, 96 keys per tile, takes 128 registers).
template <int D>
struct Tiles {
  static constexpr int kFwdMT = D == 128 ? 2 : 1, kFwdN = D == 128 ? 48 : 96, kFwdWarps = 4;
  static constexpr int kDkdvM = D == 128 ? 48 : 96, kDkdvWarps = 4;
  // dQ by atomics: dkdv_split_kernel, 128 keys x kSplitM queries, 8 warps; its shared memory
  // (K, V; two stages of Q, dO and their row statistics; two P^T/dS^T buffers; two mbarriers)
  // fits Hopper's 227 KiB per block, not an A100's 163: with less, run_bwd takes the dQ pass.
  static constexpr int kSplitM = D == 128 ? 64 : 128;
  static constexpr size_t kSplitSmem =
      (2 * 128 * D + 2 * 2 * kSplitM * D + 2 * 2 * 128 * kSplitM) * 2 + 2 * 2 * kSplitM * 4 + 16;
  // dQ (deterministic path): at D=64, MT=2 with 32-key tiles (MT=2 x 64 keys spills 68 bytes
  // since the masked tiles have their own copy; MT=1 was 3% slower at L=4096).
  static constexpr int kDqMT = D == 128 ? 1 : 2, kDqN = D == 128 ? 64 : 32, kDqWarps = 4;
};

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
  constexpr int BM = 16 * C::kFwdMT * C::kFwdWarps, BN = C::kFwdN;
  const size_t smem = (BM + 4 * BN) * D * sizeof(T);
  return launch(fwd_kernel<T, D, C::kFwdMT, BN, C::kFwdWarps>,
                dim3((p.max_q + BM - 1) / BM, p.hq, p.batch), C::kFwdWarps * 32, smem, p);
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
  const int64_t rows = static_cast<int64_t>(p.total_q) * p.hq;
  cudaError_t err = launch(delta_kernel<T, D>, dim3(static_cast<unsigned>((rows + 255) / 256)),
                           256, 0, p);
  if (err != cudaSuccess) return err;
  constexpr int BMk = C::kDkdvM, BNk = 16 * C::kDkdvWarps;
  const size_t smem_kv = (2 * BNk + 4 * BMk) * D * sizeof(T) + 4 * BMk * sizeof(float);
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
               dim3((p.max_k + BNk - 1) / BNk, p.hkv, p.batch), C::kDkdvWarps * 32, smem_kv, p);
  if (err != cudaSuccess) return err;
  constexpr int BM = 16 * C::kDqMT * C::kDqWarps, BN = C::kDqN;
  const size_t smem = (2 * BM + 4 * BN) * D * sizeof(T);
  return launch(dq_kernel<T, D, C::kDqMT, BN, C::kDqWarps>,
                dim3((p.max_q + BM - 1) / BM, p.hq, p.batch), C::kDqWarps * 32, smem, p);
}

}  // namespace attn
}  // namespace fusedops
