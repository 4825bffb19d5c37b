// Launch of the sm80-family split-KV decode kernels (decode_kernel_sm80.cuh): instantiations per
// dtype, head dim (64, 128) and row count (M = G * Sq <= 8 or <= 16), shared memory, grid.
#include <cuda_runtime.h>

#include "decode_kernel_sm80.cuh"

namespace fusedops {
namespace {

template <typename T, int kHeadDim, int kMaxRows>
cudaError_t launch(const DecodeParams& p, cudaStream_t stream) {
  using S = decode::Smem<kHeadDim>;
  constexpr size_t kTiles = size_t(decode::kStages) * 2 * S::kTile * sizeof(T);
  constexpr size_t kMerge = size_t(decode::kWarps) * kMaxRows * (kHeadDim + 2) * sizeof(float);
  static_assert(kMerge <= kTiles, "the warp merge reuses the tile buffers");
  constexpr size_t smem = size_t(kMaxRows) * S::kRow * sizeof(T) + kTiles;
  auto kernel = decode::decode_partial_kernel<T, kHeadDim, kMaxRows>;
  cudaError_t err =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
  if (err != cudaSuccess) return err;
  kernel<<<dim3(p.num_splits, p.hkv, p.batch), decode::kThreads, smem, stream>>>(p);
  err = cudaGetLastError();
  if (err != cudaSuccess || p.num_splits == 1) return err;
  decode::decode_combine_kernel<T, kHeadDim>
      <<<dim3(p.hkv, p.batch), decode::kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_dtype(const DecodeParams& p, cudaStream_t s) {
  const int m = p.group * p.sq;
  if (p.head_dim == 64) return m <= 8 ? launch<T, 64, 8>(p, s) : launch<T, 64, 16>(p, s);
  return m <= 8 ? launch<T, 128, 8>(p, s) : launch<T, 128, 16>(p, s);
}

}  // namespace

cudaError_t decode_fwd_sm80(const DecodeParams& p, cudaStream_t stream) {
  return p.is_bf16 ? launch_dtype<__nv_bfloat16>(p, stream) : launch_dtype<__half>(p, stream);
}

}  // namespace fusedops
