// Torch binding of the Hopper GEMM of the linear cross-entropy (gemm_sm90.cu): the argument
// checks and the op torch.ops.fusedops.lce_gemm_sm90(a, b, out, layout, accumulate), which
// writes out in place (tests, benchmarks and the opt-in FUSEDOPS_LCE_GEMM=sm90 path of
// python/fusedops/linear_ce/chunked.py).
#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstdint>
#include <string>

#include "../torch_utils.h"
#include "build_info.h"
#include "gemm_sm90.h"

namespace fusedops {
namespace {

using at::Tensor;

std::string str(int64_t v) { return std::to_string(v); }

// A row-major matrix TMA can read: unit column stride, a row stride that is a multiple of 8
// elements (16 bytes) and covers the row (any for a single row), a 16-byte-aligned start.
void check_matrix(const Tensor& t, const char* name, const Tensor& ref) {
  TORCH_CHECK_VALUE(t.is_cuda(), "lce_gemm_sm90: ", name, " must be a CUDA tensor");
  TORCH_CHECK_VALUE(t.device() == ref.device(), "lce_gemm_sm90: ", name,
                    " is on another device than out");
  TORCH_CHECK_VALUE(t.dim() == 2, "lce_gemm_sm90: ", name, " must be 2-D, got ", str(t.dim()),
                    " dimensions");
  TORCH_CHECK_TYPE(t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kHalf,
                   "lce_gemm_sm90: ", name, " must be bfloat16 or float16, got ",
                   t.scalar_type());
  TORCH_CHECK_TYPE(t.scalar_type() == ref.scalar_type(), "lce_gemm_sm90: ", name, " dtype ",
                   t.scalar_type(), " differs from out's ", ref.scalar_type());
  TORCH_CHECK_VALUE(t.stride(1) == 1 || t.size(1) <= 1, "lce_gemm_sm90: ", name,
                    " must be row-major with contiguous rows (stride(1) == 1), got strides (",
                    str(t.stride(0)), ", ", str(t.stride(1)), ")");
  TORCH_CHECK_VALUE(t.size(0) <= 1 || (t.stride(0) % 8 == 0 && t.stride(0) >= t.size(1)),
                    "lce_gemm_sm90: ", name, "'s row stride must be a multiple of 8 elements "
                    "(16 bytes) and at least its row length, got ", str(t.stride(0)),
                    " for rows of ", str(t.size(1)));
  TORCH_CHECK_VALUE(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, "lce_gemm_sm90: ",
                    name, " must start 16-byte aligned");
  TORCH_CHECK_VALUE(t.size(0) <= INT32_MAX && t.size(1) <= INT32_MAX, "lce_gemm_sm90: ", name,
                    " has a dimension of 2^31 or more");
}

bool hopper_kernels_for(int dev) {
  int major = 0, minor = 0;
  return std::string(FUSEDOPS_BUILT_ARCHS).find("9.0a") != std::string::npos &&
         cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) == cudaSuccess &&
         cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) == cudaSuccess &&
         major == 9 && minor == 0;
}

// out[M, N] (+)= the product of `layout` (gemm_sm90.h): 1 a [M, K] x b [N, K]^T, 2 a [M, K] x
// b [K, N], 3 a [K, M]^T x b [K, N]. accumulate (layout 3 only): out = round(out + product).
void lce_gemm_sm90_cuda(const Tensor& a, const Tensor& b, const Tensor& out, int64_t layout,
                        bool accumulate) {
  TORCH_CHECK_VALUE(layout >= 1 && layout <= 3,
                    "lce_gemm_sm90: layout must be 1 (a b^T), 2 (a b) or 3 (a^T b), got ",
                    str(layout));
  TORCH_CHECK_VALUE(!accumulate || layout == 3,
                    "lce_gemm_sm90: accumulate is built for layout 3 (d_weight) only");
  check_matrix(out, "out", out);
  check_matrix(a, "a", out);
  check_matrix(b, "b", out);
  const int64_t m = out.size(0), n = out.size(1);
  const int64_t k = layout == 3 ? a.size(0) : a.size(1);
  const int64_t a_m = layout == 3 ? a.size(1) : a.size(0);
  const int64_t b_n = layout == 1 ? b.size(0) : b.size(1);
  const int64_t b_k = layout == 1 ? b.size(1) : b.size(0);
  const char* want = layout == 1   ? "a (M, K), b (N, K), out (M, N)"
                     : layout == 2 ? "a (M, K), b (K, N), out (M, N)"
                                   : "a (K, M), b (K, N), out (M, N)";
  TORCH_CHECK_VALUE(a_m == m && b_n == n && b_k == k, "lce_gemm_sm90: layout ", str(layout),
                    " takes ", want, "; got a (", str(a.size(0)), ", ", str(a.size(1)), "), b (",
                    str(b.size(0)), ", ", str(b.size(1)), "), out (", str(m), ", ", str(n),
                    ")");
  for (const Tensor* t : {&a, &b}) {
    const at::MemOverlapStatus s = at::get_overlap_status(out, *t);
    TORCH_CHECK_VALUE(s != at::MemOverlapStatus::Full && s != at::MemOverlapStatus::Partial,
                      "lce_gemm_sm90: out must not overlap ", t == &a ? "a" : "b");
  }
  const int dev = out.get_device();
  TORCH_CHECK_VALUE(hopper_kernels_for(dev),
                    "lce_gemm_sm90 needs a GPU of compute capability 9.0 and an extension built "
                    "for 9.0a (built: " FUSEDOPS_BUILT_ARCHS ")");
  if (m == 0 || n == 0) return;
  c10::cuda::CUDAGuard guard(out.device());
  if (k == 0) {
    if (!accumulate) const_cast<Tensor&>(out).zero_();
    return;
  }
  LceGemmSm90Args args;
  args.a = a.data_ptr();
  args.b = b.data_ptr();
  args.c = out.data_ptr();
  // A size-1 dimension may carry any stride; TMA wants one that is a multiple of 16 bytes.
  auto ld = [](const Tensor& t) { return t.size(0) <= 1 ? (t.size(1) + 7) / 8 * 8 : t.stride(0); };
  args.lda = ld(a);
  args.ldb = ld(b);
  args.ldc = ld(out);
  args.m = m;
  args.n = n;
  args.k = k;
  args.layout = static_cast<int>(layout);
  args.accumulate = accumulate;
  args.is_bf16 = out.scalar_type() == at::kBFloat16;
  cudaDeviceGetAttribute(&args.num_sms, cudaDevAttrMultiProcessorCount, dev);
  args.stream = c10::cuda::getCurrentCUDAStream(dev).stream();
  int64_t ws_floats = 0;
  args.k_splits = lce_gemm_sm90_splits(args, &ws_floats);
  Tensor workspace;
  if (ws_floats > 0) {
    workspace = at::empty({ws_floats}, out.options().dtype(at::kFloat));
    args.workspace = workspace.data_ptr<float>();
  }
  check_launch(lce_gemm_sm90(args), "lce_gemm_sm90");
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fusedops, m) {
  m.def("lce_gemm_sm90(Tensor a, Tensor b, Tensor(a!) out, int layout, bool accumulate) -> ()");
}

TORCH_LIBRARY_IMPL(fusedops, CUDA, m) { m.impl("lce_gemm_sm90", &lce_gemm_sm90_cuda); }

}  // namespace fusedops
