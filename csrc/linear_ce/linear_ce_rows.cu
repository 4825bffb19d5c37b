// Entry points of the fast path's row kernels (ce_rows_kernel.cuh), one per kernel family, and the
// device-side gradient scaling. Whole-row modes: sm80 family 512 threads per row, sm90 family
// (built only into sm_90 code, traps below) 1024 threads, so fewer 256 KB rows are in flight and
// more of the dz pass's second read hits L2. (Caching up to 200 KB of the row in shared memory
// for the second read was tried and measured ~0.7 ms slower per Llama-3 step on the H200.)
#include "../static_switch.h"
#include "ce_rows_kernel.cuh"

namespace fusedops {

cudaError_t ce_rows_sm80(CeRowsParams& p) {
  return FP16_BF16_SWITCH(p.is_bf16, [&] { return rows::run_rows<512, 800, elem_t>(p); });
}

cudaError_t ce_rows_sm90(CeRowsParams& p) {
  return FP16_BF16_SWITCH(p.is_bf16, [&] { return rows::run_rows<1024, 900, elem_t>(p); });
}

namespace {

// Grid-stride x *= g; every CTA reads g first and leaves at once when g == 1 (the usual
// loss.backward()), so the common case costs a launch and no memory traffic.
// Constraints: T float, __nv_bfloat16 or __half; x contiguous; g one float32 on the device;
// 256 threads per CTA, any grid; any architecture.
template <typename T>
__global__ void __launch_bounds__(256) scale_kernel(T* x, const float* g_ptr, int64_t n) {
  const float g = *g_ptr;
  if (g == 1.f) return;
  for (int64_t i = blockIdx.x * int64_t(256) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * 256) {
    x[i] = dev::from_float<T>(dev::to_float(x[i]) * g);
  }
}

}  // namespace

cudaError_t scale_if_not_one(ScaleParams& p) {
  if (p.n == 0) return cudaSuccess;
  int64_t blocks64 = (p.n + 255) / 256;
  // Few CTAs with a grid-stride loop: when g == 1 the whole launch is ~1k CTAs that exit at once.
  const unsigned blocks = static_cast<unsigned>(blocks64 < 1056 ? blocks64 : 1056);
  switch (p.dtype) {
    case 0:
      scale_kernel<<<blocks, 256, 0, p.stream>>>(static_cast<float*>(p.x), p.g, p.n);
      break;
    case 1:
      scale_kernel<<<blocks, 256, 0, p.stream>>>(static_cast<__nv_bfloat16*>(p.x), p.g, p.n);
      break;
    case 2:
      scale_kernel<<<blocks, 256, 0, p.stream>>>(static_cast<__half*>(p.x), p.g, p.n);
      break;
    default:
      return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace fusedops
