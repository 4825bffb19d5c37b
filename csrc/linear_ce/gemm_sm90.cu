// Launcher and instantiations of the Hopper GEMM of the linear cross-entropy (gemm_sm90.cuh):
// the TMA tensor maps (made per call through the driver entry point the CUDA runtime hands
// out, so nothing links against libcuda), the tile order and the grid. Instantiated for fp16 /
// bf16 x the three layouts, plus accumulation for layout 3 (d_weight, the only product the
// linear cross-entropy accumulates). The kernel bodies exist only in the sm_90a build (setup.py
// also compiles this file for sm_80, where they trap; the binding launches them only on compute
// capability 9.0 with a 9.0a build).
#include <cuda.h>
#include <cudaTypedefs.h>  // PFN_cuTensorMapEncodeTiled

#include <cstdlib>
#include <type_traits>

#include "../static_switch.h"
#include "gemm_sm90.cuh"
#include "gemm_sm90.h"

namespace fusedops {
namespace lce_gemm {
namespace {

// cuTensorMapEncodeTiled from the driver (the ABI of CUDA 12.0, which later drivers keep), or
// null when the driver does not have it.
PFN_cuTensorMapEncodeTiled_v12000 encoder() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* ptr = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000, cudaEnableDefault,
                                         &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess)
      ptr = nullptr;
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(ptr);
  }();
  return fn;
}

// A 2-D map over a row-major matrix of 2-byte elements (`cols` contiguous per row, rows
// `row_stride` elements apart), boxes of box_cols (64: one 128-byte swizzle row) x box_rows;
// out-of-range elements load as zeros and are not stored.
bool make_map(CUtensorMap* map, const void* ptr, bool bf16, int64_t cols, int64_t rows,
              int64_t row_stride, int box_cols, int box_rows) {
  const PFN_cuTensorMapEncodeTiled_v12000 encode = encoder();
  if (encode == nullptr) return false;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(row_stride) * 2};  // bytes
  const cuuint32_t box[2] = {static_cast<cuuint32_t>(box_cols), static_cast<cuuint32_t>(box_rows)};
  const cuuint32_t elem_strides[2] = {1, 1};
  const CUresult res = encode(
      map, bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 2,
      const_cast<void*>(ptr), dims, strides, box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
      CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return res == CUDA_SUCCESS;
}

// The tile order's group size: FUSEDOPS_LCE_GEMM_GROUP (for measurement) else args.group else
// 16 (at the Llama-3 shapes one group covers the 16 tile rows of a 2048-token logits chunk or
// the 16 tile columns of H = 4096; not tuned).
int group_size(const LceGemmSm90Args& args) {
  if (const char* s = std::getenv("FUSEDOPS_LCE_GEMM_GROUP")) {
    const int g = std::atoi(s);
    if (g >= 1) return g;
  }
  return args.group >= 1 ? args.group : 16;
}

template <typename T, bool kATrans, bool kBTrans, bool kAccumulate>
cudaError_t launch(const LceGemmSm90Args& args) {
  using C = GemmTilesSm90;
  using Epi = EpiStore<T, kAccumulate>;
  constexpr bool kBf16 = std::is_same_v<T, __nv_bfloat16>;
  GemmParamsSm90 p;
  p.m = static_cast<int>(args.m);
  p.n = static_cast<int>(args.n);
  p.k = static_cast<int>(args.k);
  p.tiles_m = (p.m + C::kBlockM - 1) / C::kBlockM;
  p.tiles_n = (p.n + C::kBlockN - 1) / C::kBlockN;
  p.k_blocks = (p.k + C::kBlockK - 1) / C::kBlockK;
  const int64_t tiles = static_cast<int64_t>(p.tiles_m) * p.tiles_n;
  if (tiles > INT32_MAX) return cudaErrorInvalidValue;
  p.n_tiles = static_cast<int>(tiles);
  p.m_fast = p.tiles_m <= p.tiles_n ? 1 : 0;
  p.group = group_size(args);

  CUtensorMap tm_a, tm_b;
  typename Epi::Params ep;
  // A: [M, K] read in 64 (K) x 128 (M) boxes, or stored [K, M] and read in 64 x 64 boxes.
  const bool ok_a = kATrans ? make_map(&tm_a, args.a, kBf16, args.m, args.k, args.lda, 64, 64)
                            : make_map(&tm_a, args.a, kBf16, args.k, args.m, args.lda, 64,
                                       C::kBlockM);
  // B: stored [N, K] and read in 64 (K) x 256 (N) boxes, or [K, N] in 64 x 64 boxes.
  const bool ok_b = kBTrans ? make_map(&tm_b, args.b, kBf16, args.n, args.k, args.ldb, 64, 64)
                            : make_map(&tm_b, args.b, kBf16, args.k, args.n, args.ldb, 64,
                                       C::kBlockN);
  const bool ok_c = make_map(&ep.tm_c, args.c, kBf16, args.n, args.m, args.ldc, 64, 64);
  if (!ok_a || !ok_b || !ok_c) return cudaErrorInvalidValue;
  ep.c_old = static_cast<const T*>(args.c);
  ep.ldc = args.ldc;
  ep.m = p.m;
  ep.n = p.n;

  auto kernel = gemm_kernel_sm90<T, kATrans, kBTrans, Epi>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         C::kSmem);
  if (err != cudaSuccess) return err;
  const int grid = p.n_tiles < args.num_sms ? p.n_tiles : args.num_sms;
  kernel<<<grid, C::kThreads, C::kSmem, args.stream>>>(p, tm_a, tm_b, ep);
  return cudaGetLastError();
}

}  // namespace
}  // namespace lce_gemm

cudaError_t lce_gemm_sm90(const LceGemmSm90Args& args) {
  if (args.m < 1 || args.n < 1 || args.k < 1 || args.m > INT32_MAX || args.n > INT32_MAX ||
      args.k > INT32_MAX || args.num_sms < 1)
    return cudaErrorInvalidValue;
  return FP16_BF16_SWITCH(args.is_bf16, [&]() -> cudaError_t {
    switch (args.layout) {
      case 1:
        if (args.accumulate) return cudaErrorNotSupported;
        return lce_gemm::launch<elem_t, false, false, false>(args);
      case 2:
        if (args.accumulate) return cudaErrorNotSupported;
        return lce_gemm::launch<elem_t, false, true, false>(args);
      case 3:
        return args.accumulate ? lce_gemm::launch<elem_t, true, true, true>(args)
                               : lce_gemm::launch<elem_t, true, true, false>(args);
      default:
        return cudaErrorInvalidValue;
    }
  });
}

}  // namespace fusedops
