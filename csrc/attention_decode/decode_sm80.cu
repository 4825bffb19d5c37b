// Launch of the sm80-family split-KV decode kernel (decode_kernel_sm80.cuh): instantiations per
// dtype and head dim (64, 128), shared memory, grid.
#include <cuda_runtime.h>

#include "decode_kernel_sm80.cuh"

namespace fusedops {
namespace {

template <typename T, int kHeadDim>
cudaError_t launch(const DecodeParams& p, cudaStream_t stream) {
  using S = decode::Smem<kHeadDim>;
  // The pipeline depth that fits the device's shared memory per block (three stages at D=128 need
  // 106 KiB: more than the 99 KiB of compute capability 8.6 and 8.9, which run two).
  int device = 0, optin = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess)
    err = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  if (err != cudaSuccess) return err;
  DecodeParams q = p;
  while (q.stages > kDecodeMinStages && S::bytes(q.stages, sizeof(T)) > size_t(optin)) --q.stages;
  const size_t smem = S::bytes(q.stages, sizeof(T));
  static_assert(size_t(decode::kWarps) * decode::kRows * (kHeadDim + 2) * sizeof(float) <=
                    size_t(2) * 2 * S::kTile * sizeof(T),
                "the warp merge reuses the tile buffers (two stages or more)");
  static_assert(256 * decode::kRows * sizeof(float) <= size_t(2) * 2 * S::kTile * sizeof(T),
                "the split merge's lse of up to 256 splits fit the tile buffers");
  auto kernel = decode::decode_kernel<T, kHeadDim>;
  err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
  if (err != cudaSuccess) return err;
  // Two CTAs per SM: the largest shared-memory carveout.
  err = cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                             cudaSharedmemCarveoutMaxShared);
  if (err != cudaSuccess) return err;
  kernel<<<dim3(p.num_splits, p.hkv, p.batch), decode::kThreads, smem, stream>>>(q);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_dtype(const DecodeParams& p, cudaStream_t s) {
  return p.head_dim == 64 ? launch<T, 64>(p, s) : launch<T, 128>(p, s);
}

}  // namespace

cudaError_t decode_fwd_sm80(const DecodeParams& p, cudaStream_t stream) {
  return p.is_bf16 ? launch_dtype<__nv_bfloat16>(p, stream) : launch_dtype<__half>(p, stream);
}

}  // namespace fusedops
