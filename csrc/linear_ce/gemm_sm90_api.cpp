// Torch binding of the Hopper GEMM of the linear cross-entropy (gemm_sm90.cu): the argument
// checks and the op torch.ops.fusedops.lce_gemm_sm90(a, b, out, layout, accumulate), which
// writes out in place (tests, benchmarks and the opt-in FUSEDOPS_LCE_GEMM=sm90 path of
// python/fusedops/linear_ce/chunked.py), and lce_logits_ce_stats_sm90, the logits GEMM with the
// cross-entropy statistics in its epilogue (FUSEDOPS_LCE_GEMM=sm90-fused), and lce_dz_gemm_sm90,
// d_hidden / d_weight with dz computed from z in the operand path (FUSEDOPS_LCE_GEMM=sm90-fused2).
#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>

#include "../torch_utils.h"
#include "build_info.h"
#include "gemm_sm90.h"

namespace fusedops {
namespace {

using at::Tensor;

// Every value in a check message goes in as a std::string (why: torch_utils.h; an int64_t
// argument crashed the H200 process instead of raising, and so did the test process here once
// messages streamed shapes (IntArrayRef, int64_t elements) and doubles).
std::string str(int64_t v) { return std::to_string(v); }
std::string str(double v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%g", v);
  return buf;
}
std::string shape_str(const Tensor& t) {
  std::string s = "(";
  for (int64_t d = 0; d < t.dim(); ++d) s += (d ? ", " : "") + std::to_string(t.size(d));
  return s + ")";
}

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

void check_f32_vector(const Tensor& t, const char* name, int64_t size, const Tensor& ref) {
  TORCH_CHECK_VALUE(t.device() == ref.device(), "lce_logits_ce_stats_sm90: ", name,
                    " is on another device than z");
  TORCH_CHECK_TYPE(t.scalar_type() == at::kFloat, "lce_logits_ce_stats_sm90: ", name,
                   " must be float32, got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.dim() == 1 && t.size(0) == size && t.is_contiguous(),
                    "lce_logits_ce_stats_sm90: ", name, " must be a contiguous 1-D tensor of ",
                    str(size), " elements, got shape ", shape_str(t));
}

// z = round(x w^T) (layout 1) and the cross-entropy statistics of its rows from the GEMM's
// epilogue: partials (M, ceil(V / 256), 4) float32 per row and 256-column tile (max, sum of exp,
// target logit, logit sum of softcap(z + bias)), then lse, zt, zsum (M,) float32 merged from them.
void lce_logits_ce_stats_sm90_cuda(const Tensor& x, const Tensor& w, const Tensor& z,
                                   const std::optional<Tensor>& bias, const Tensor& target,
                                   double softcap, const Tensor& partials, const Tensor& lse,
                                   const Tensor& zt, const Tensor& zsum) {
  check_matrix(z, "z", z);
  check_matrix(x, "x", z);
  check_matrix(w, "w", z);
  const int64_t m = z.size(0), n = z.size(1), k = x.size(1);
  TORCH_CHECK_VALUE(x.size(0) == m && w.size(0) == n && w.size(1) == k,
                    "lce_logits_ce_stats_sm90 takes x (M, K), w (V, K), z (M, V); got x (",
                    str(x.size(0)), ", ", str(x.size(1)), "), w (", str(w.size(0)), ", ",
                    str(w.size(1)), "), z (", str(m), ", ", str(n), ")");
  TORCH_CHECK_VALUE(k >= 1, "lce_logits_ce_stats_sm90: the inner size K must be at least 1");
  for (const Tensor* t : {&x, &w}) {
    const at::MemOverlapStatus s = at::get_overlap_status(z, *t);
    TORCH_CHECK_VALUE(s != at::MemOverlapStatus::Full && s != at::MemOverlapStatus::Partial,
                      "lce_logits_ce_stats_sm90: z must not overlap ", t == &x ? "x" : "w");
  }
  TORCH_CHECK_VALUE(target.device() == z.device(),
                    "lce_logits_ce_stats_sm90: target is on another device than z");
  TORCH_CHECK_TYPE(target.scalar_type() == at::kLong,
                   "lce_logits_ce_stats_sm90: target must be int64, got ", target.scalar_type());
  TORCH_CHECK_VALUE(target.dim() == 1 && target.size(0) == m && target.is_contiguous(),
                    "lce_logits_ce_stats_sm90: target must be a contiguous (M,) tensor");
  if (bias.has_value()) {
    check_f32_vector(*bias, "bias", n, z);
    TORCH_CHECK_VALUE(reinterpret_cast<uintptr_t>(bias->data_ptr()) % 8 == 0,
                      "lce_logits_ce_stats_sm90: bias must start 8-byte aligned");
  }
  const int64_t tiles = lce_ce_stats_tiles(n);
  TORCH_CHECK_VALUE(partials.device() == z.device(),
                    "lce_logits_ce_stats_sm90: partials is on another device than z");
  TORCH_CHECK_TYPE(partials.scalar_type() == at::kFloat,
                   "lce_logits_ce_stats_sm90: partials must be float32, got ",
                   partials.scalar_type());
  TORCH_CHECK_VALUE(partials.dim() == 3 && partials.size(0) == m && partials.size(1) == tiles &&
                        partials.size(2) == 4 && partials.is_contiguous() &&
                        reinterpret_cast<uintptr_t>(partials.data_ptr()) % 16 == 0,
                    "lce_logits_ce_stats_sm90: partials must be a contiguous, 16-byte aligned (",
                    str(m), ", ", str(tiles), ", 4) tensor (M, ceil(V / 256), 4), got shape ",
                    shape_str(partials));
  check_f32_vector(lse, "lse", m, z);
  check_f32_vector(zt, "zt", m, z);
  check_f32_vector(zsum, "zsum", m, z);
  TORCH_CHECK_VALUE(softcap >= 0.0 && std::isfinite(softcap),
                    "lce_logits_ce_stats_sm90: softcap must be finite and >= 0 (0: none), got ",
                    str(softcap));
  const int dev = z.get_device();
  TORCH_CHECK_VALUE(hopper_kernels_for(dev),
                    "lce_logits_ce_stats_sm90 needs a GPU of compute capability 9.0 and an "
                    "extension built for 9.0a (built: " FUSEDOPS_BUILT_ARCHS ")");
  if (m == 0) return;
  c10::cuda::CUDAGuard guard(z.device());
  LceCeStatsSm90Args args;
  args.gemm.a = x.data_ptr();
  args.gemm.b = w.data_ptr();
  args.gemm.c = z.data_ptr();
  auto ld = [](const Tensor& t) { return t.size(0) <= 1 ? (t.size(1) + 7) / 8 * 8 : t.stride(0); };
  args.gemm.lda = ld(x);
  args.gemm.ldb = ld(w);
  args.gemm.ldc = ld(z);
  args.gemm.m = m;
  args.gemm.n = n;
  args.gemm.k = k;
  args.gemm.layout = 1;
  args.gemm.is_bf16 = z.scalar_type() == at::kBFloat16;
  cudaDeviceGetAttribute(&args.gemm.num_sms, cudaDevAttrMultiProcessorCount, dev);
  args.gemm.stream = c10::cuda::getCurrentCUDAStream(dev).stream();
  args.bias = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  args.target = target.data_ptr<int64_t>();
  args.partials = partials.data_ptr<float>();
  args.lse = lse.data_ptr<float>();
  args.zt = zt.data_ptr<float>();
  args.zsum = zsum.data_ptr<float>();
  args.softcap = static_cast<float>(softcap);
  check_launch(lce_logits_ce_stats_sm90(args), "lce_logits_ce_stats_sm90");
}

void check_dz_vector(const Tensor& t, const char* name, int64_t size, const Tensor& ref,
                     at::ScalarType dtype) {
  TORCH_CHECK_VALUE(t.device() == ref.device(), "lce_dz_gemm_sm90: ", name,
                    " is on another device than out");
  TORCH_CHECK_TYPE(t.scalar_type() == dtype, "lce_dz_gemm_sm90: ", name, " must be ", dtype,
                   ", got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.dim() == 1 && t.size(0) == size && t.is_contiguous(), "lce_dz_gemm_sm90: ",
                    name, " must be a contiguous 1-D tensor of ", str(size),
                    " elements, got shape ", shape_str(t));
}

// out (+)= the product of `layout` with A = dz computed from z [tokens, V] (the stored logits,
// no bias or softcap) as the row kernel's MODE_DZ does: layout 2 out [tokens, H] = dz b [V, H];
// layout 3 out [V, H] (+)= dz^T b [tokens, H] (accumulate: out = round(out + product)), and with
// dbias (layout 3) dbias [V] float32 = the column sums of dz.
void lce_dz_gemm_sm90_cuda(const Tensor& z, const Tensor& b, const Tensor& out, int64_t layout,
                           bool accumulate, const std::optional<Tensor>& bias, const Tensor& lse,
                           const Tensor& w, const Tensor& target, double eps, double z_loss,
                           double softcap, const std::optional<Tensor>& dbias) {
  TORCH_CHECK_VALUE(layout == 2 || layout == 3,
                    "lce_dz_gemm_sm90: layout must be 2 (dz b) or 3 (dz^T b), got ", str(layout));
  TORCH_CHECK_VALUE(!accumulate || layout == 3,
                    "lce_dz_gemm_sm90: accumulate is built for layout 3 (d_weight) only");
  check_matrix(out, "out", out);
  check_matrix(z, "z", out);
  check_matrix(b, "b", out);
  const int64_t tokens = z.size(0), vocab = z.size(1);
  const int64_t m = out.size(0), n = out.size(1);
  const bool l3 = layout == 3;
  TORCH_CHECK_VALUE(b.size(0) == (l3 ? tokens : vocab) && b.size(1) == n &&
                        m == (l3 ? vocab : tokens),
                    "lce_dz_gemm_sm90: layout ", str(layout), " takes z (tokens, V), ",
                    l3 ? "b (tokens, H), out (V, H)" : "b (V, H), out (tokens, H)", "; got z (",
                    str(tokens), ", ", str(vocab), "), b (", str(b.size(0)), ", ",
                    str(b.size(1)), "), out (", str(m), ", ", str(n), ")");
  for (const Tensor* t : {&z, &b}) {
    const at::MemOverlapStatus st = at::get_overlap_status(out, *t);
    TORCH_CHECK_VALUE(st != at::MemOverlapStatus::Full && st != at::MemOverlapStatus::Partial,
                      "lce_dz_gemm_sm90: out must not overlap ", t == &z ? "z" : "b");
  }
  check_dz_vector(lse, "lse", tokens, out, at::kFloat);
  check_dz_vector(w, "w", tokens, out, at::kFloat);
  check_dz_vector(target, "target", tokens, out, at::kLong);
  if (bias.has_value()) {
    check_dz_vector(*bias, "bias", vocab, out, at::kFloat);
    TORCH_CHECK_VALUE(reinterpret_cast<uintptr_t>(bias->data_ptr()) % 8 == 0,
                      "lce_dz_gemm_sm90: bias must start 8-byte aligned");
  }
  if (dbias.has_value()) {
    TORCH_CHECK_VALUE(l3, "lce_dz_gemm_sm90: dbias is written by layout 3 only");
    TORCH_CHECK_VALUE(n >= 1, "lce_dz_gemm_sm90: dbias needs b with at least one column");
    check_dz_vector(*dbias, "dbias", vocab, out, at::kFloat);
    for (const Tensor* t : {&z, &b, &out, &lse, &w}) {
      const at::MemOverlapStatus st = at::get_overlap_status(*dbias, *t);
      TORCH_CHECK_VALUE(st != at::MemOverlapStatus::Full && st != at::MemOverlapStatus::Partial,
                        "lce_dz_gemm_sm90: dbias must not overlap the other arguments");
    }
  }
  TORCH_CHECK_VALUE(std::isfinite(eps) && eps >= 0.0 && eps <= 1.0,
                    "lce_dz_gemm_sm90: eps (label smoothing) must be in [0, 1], got ", str(eps));
  TORCH_CHECK_VALUE(std::isfinite(z_loss), "lce_dz_gemm_sm90: z_loss must be finite, got ",
                    str(z_loss));
  TORCH_CHECK_VALUE(softcap >= 0.0 && std::isfinite(softcap),
                    "lce_dz_gemm_sm90: softcap must be finite and >= 0 (0: none), got ",
                    str(softcap));
  const int dev = out.get_device();
  TORCH_CHECK_VALUE(hopper_kernels_for(dev),
                    "lce_dz_gemm_sm90 needs a GPU of compute capability 9.0 and an extension "
                    "built for 9.0a (built: " FUSEDOPS_BUILT_ARCHS ")");
  if (m == 0 || n == 0) return;
  c10::cuda::CUDAGuard guard(out.device());
  const int64_t k = l3 ? tokens : vocab;
  if (k == 0) {
    if (!accumulate) const_cast<Tensor&>(out).zero_();
    if (dbias.has_value()) const_cast<Tensor&>(*dbias).zero_();
    return;
  }
  Tensor tab = at::empty({tokens, 4}, out.options().dtype(at::kFloat));
  LceDzGemmSm90Args args;
  LceGemmSm90Args& g = args.gemm;
  g.a = z.data_ptr();
  g.b = b.data_ptr();
  g.c = out.data_ptr();
  auto ld = [](const Tensor& t) { return t.size(0) <= 1 ? (t.size(1) + 7) / 8 * 8 : t.stride(0); };
  g.lda = ld(z);
  g.ldb = ld(b);
  g.ldc = ld(out);
  g.m = m;
  g.n = n;
  g.k = k;
  g.layout = static_cast<int>(layout);
  g.accumulate = accumulate;
  g.is_bf16 = out.scalar_type() == at::kBFloat16;
  cudaDeviceGetAttribute(&g.num_sms, cudaDevAttrMultiProcessorCount, dev);
  g.stream = c10::cuda::getCurrentCUDAStream(dev).stream();
  int64_t ws_floats = 0;
  g.k_splits = lce_gemm_sm90_splits(g, &ws_floats);
  Tensor workspace;
  if (ws_floats > 0) {
    workspace = at::empty({ws_floats}, out.options().dtype(at::kFloat));
    g.workspace = workspace.data_ptr<float>();
  }
  args.bias = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  args.lse = lse.data_ptr<float>();
  args.w = w.data_ptr<float>();
  args.target = target.data_ptr<int64_t>();
  args.tab = tab.data_ptr<float>();
  args.eps = static_cast<float>(eps);
  args.z_loss = static_cast<float>(z_loss);
  args.softcap = static_cast<float>(softcap);
  args.dbias = dbias.has_value() ? dbias->data_ptr<float>() : nullptr;
  check_launch(lce_dz_gemm_sm90(args), "lce_dz_gemm_sm90");
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fusedops, m) {
  m.def(
      "lce_dz_gemm_sm90(Tensor z, Tensor b, Tensor(a!) out, int layout, bool accumulate, "
      "Tensor? bias, Tensor lse, Tensor w, Tensor target, float eps, float z_loss, "
      "float softcap, Tensor(b!)? dbias) -> ()");
  m.def("lce_gemm_sm90(Tensor a, Tensor b, Tensor(a!) out, int layout, bool accumulate) -> ()");
  m.def(
      "lce_logits_ce_stats_sm90(Tensor x, Tensor w, Tensor(a!) z, Tensor? bias, Tensor target, "
      "float softcap, Tensor(b!) partials, Tensor(c!) lse, Tensor(d!) zt, Tensor(e!) zsum) -> ()");
}

TORCH_LIBRARY_IMPL(fusedops, CUDA, m) {
  m.impl("lce_gemm_sm90", &lce_gemm_sm90_cuda);
  m.impl("lce_logits_ce_stats_sm90", &lce_logits_ce_stats_sm90_cuda);
  m.impl("lce_dz_gemm_sm90", &lce_dz_gemm_sm90_cuda);
}

}  // namespace fusedops
