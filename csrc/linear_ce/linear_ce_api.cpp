// Torch binding for the CUDA linear cross-entropy: ATen tensors -> LinearCeParams, input checks,
// allocation, and the op registrations torch.ops.fusedops.linear_ce_{fwd,bwd}_cuda.
#include <Python.h>

#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <string>

#include "../torch_utils.h"
#include "build_info.h"
#include "linear_ce_params.h"

namespace fusedops {
namespace {

using at::Tensor;

void check_inputs(const Tensor& hidden, const Tensor& weight, const std::optional<Tensor>& bias,
                  const Tensor& target) {
  TORCH_CHECK_VALUE(hidden.is_cuda(), "hidden must be a CUDA tensor");
  TORCH_CHECK_TYPE(hidden.scalar_type() == at::kHalf || hidden.scalar_type() == at::kBFloat16,
                   "hidden must be float16 or bfloat16, got ", hidden.scalar_type());
  TORCH_CHECK_VALUE(hidden.dim() == 2, "hidden must be 2-D (N, H)");
  TORCH_CHECK_VALUE(weight.dim() == 2 && weight.size(1) == hidden.size(1),
                    "weight must be (V, H) with H = hidden.size(1)");
  TORCH_CHECK_VALUE(weight.size(0) >= 1, "weight must have at least one row");
  TORCH_CHECK_TYPE(weight.scalar_type() == hidden.scalar_type(), "weight dtype ",
                   weight.scalar_type(), " differs from hidden dtype ", hidden.scalar_type());
  TORCH_CHECK_VALUE(hidden.is_contiguous() && weight.is_contiguous(),
                    "hidden and weight must be contiguous");
  TORCH_CHECK_VALUE(hidden.size(1) % 8 == 0, "hidden size must be a multiple of 8, got ",
                    std::to_string(hidden.size(1)));
  TORCH_CHECK_VALUE(reinterpret_cast<uintptr_t>(hidden.data_ptr()) % 16 == 0 &&
                        reinterpret_cast<uintptr_t>(weight.data_ptr()) % 16 == 0,
                    "hidden and weight must be 16-byte aligned");
  TORCH_CHECK_VALUE(weight.device() == hidden.device(), "weight is on another device");
  TORCH_CHECK_VALUE(target.device() == hidden.device(), "target is on another device");
  TORCH_CHECK_VALUE(target.dim() == 1 && target.size(0) == hidden.size(0),
                    "target must be (N,) with N = hidden.size(0)");
  TORCH_CHECK_TYPE(target.scalar_type() == at::kLong || target.scalar_type() == at::kInt,
                   "target must be int64 or int32");
  if (bias.has_value()) {
    TORCH_CHECK_VALUE(bias->dim() == 1 && bias->size(0) == weight.size(0),
                      "bias must be (V,) with V = weight.size(0)");
    TORCH_CHECK_TYPE(bias->scalar_type() == hidden.scalar_type(), "bias dtype differs");
    TORCH_CHECK_VALUE(bias->device() == hidden.device(), "bias is on another device");
  }
}

LinearCeParams make_params(const Tensor& hidden, const Tensor& weight,
                           const std::optional<Tensor>& bias, const Tensor& target_long,
                           double softcap) {
  LinearCeParams p;
  p.hidden = hidden.data_ptr();
  p.weight = weight.data_ptr();
  p.bias = bias.has_value() ? bias->data_ptr() : nullptr;
  p.target = target_long.data_ptr<int64_t>();
  p.n_tokens = hidden.size(0);
  p.vocab_size = weight.size(0);
  p.hidden_size = hidden.size(1);
  p.softcap = static_cast<float>(softcap);
  p.is_bf16 = hidden.scalar_type() == at::kBFloat16;
  int dev = hidden.get_device();
  cudaDeviceGetAttribute(&p.num_sms, cudaDevAttrMultiProcessorCount, dev);
  p.stream = c10::cuda::getCurrentCUDAStream(dev).stream();
  return p;
}

std::tuple<Tensor, Tensor, Tensor> linear_ce_fwd_cuda(const Tensor& hidden, const Tensor& weight,
                                                      const std::optional<Tensor>& bias_in,
                                                      const Tensor& target, double softcap,
                                                      int64_t arch) {
  check_inputs(hidden, weight, bias_in, target);
  check_arch(arch);  // 80: the sm80 family, 90: the sm90 one
  c10::cuda::CUDAGuard guard(hidden.device());
  std::optional<Tensor> bias =
      bias_in.has_value() ? std::optional<Tensor>(bias_in->contiguous()) : std::nullopt;
  Tensor target_long = target.to(at::kLong).contiguous();
  auto f32 = hidden.options().dtype(at::kFloat);
  const int64_t n = hidden.size(0);
  Tensor lse = at::empty({n}, f32), zt = at::empty({n}, f32), zs = at::empty({n}, f32);
  if (n == 0) return {lse, zt, zs};
  LinearCeParams p = make_params(hidden, weight, bias, target_long, softcap);
  lce_fwd_splits(p.n_tokens, p.vocab_size, p.num_sms, &p.tiles_per_split, &p.n_splits);
  Tensor part = at::empty({p.n_splits, 4, n}, f32);
  p.part = part.data_ptr<float>();
  p.lse = lse.data_ptr<float>();
  p.z_target = zt.data_ptr<float>();
  p.z_sum = zs.data_ptr<float>();
  check_launch(arch == 90 ? linear_ce_fwd_sm90(p) : linear_ce_fwd_sm80(p), "linear_ce forward");
  return {lse, zt, zs};
}

std::tuple<Tensor, Tensor, Tensor> linear_ce_bwd_cuda(
    const Tensor& hidden, const Tensor& weight, const std::optional<Tensor>& bias_in,
    const Tensor& target, const Tensor& lse, const Tensor& d_lse, const Tensor& d_zt,
    const Tensor& d_zsum, double softcap, bool need_dh, bool need_dw, bool need_db, int64_t arch) {
  check_inputs(hidden, weight, bias_in, target);
  check_arch(arch);  // 80: the sm80 family, 90: the sm90 one
  c10::cuda::CUDAGuard guard(hidden.device());
  const int64_t n = hidden.size(0), vocab = weight.size(0);
  for (const Tensor* t : {&lse, &d_lse, &d_zt, &d_zsum}) {
    TORCH_CHECK_VALUE(t->dim() == 1 && t->size(0) == n, "per-token statistics must be (N,)");
  }
  std::optional<Tensor> bias =
      bias_in.has_value() ? std::optional<Tensor>(bias_in->contiguous()) : std::nullopt;
  need_db = need_db && bias.has_value();
  // Gradients not asked for are distinct empty tensors (op outputs must not alias).
  auto empty = [&] { return at::empty({0}, hidden.options()); };
  Tensor d_hidden = need_dh ? at::empty_like(hidden) : empty();
  Tensor d_weight = need_dw ? at::empty_like(weight) : empty();
  Tensor d_bias32 = need_db ? at::zeros({vocab}, hidden.options().dtype(at::kFloat)) : Tensor();
  if (n == 0 || !(need_dh || need_dw || need_db)) {
    if (need_dw) d_weight.zero_();
    return {d_hidden, d_weight, need_db ? d_bias32.to(hidden.scalar_type()) : empty()};
  }
  auto as_f32 = [](const Tensor& t) { return t.to(at::kFloat).contiguous(); };
  Tensor lse_f = as_f32(lse), a = as_f32(d_lse), b = as_f32(d_zt), c = as_f32(d_zsum);
  Tensor target_long = target.to(at::kLong).contiguous();
  LinearCeParams p = make_params(hidden, weight, bias, target_long, softcap);
  p.lse_in = lse_f.data_ptr<float>();
  p.d_lse = a.data_ptr<float>();
  p.d_zt = b.data_ptr<float>();
  p.d_zsum = c.data_ptr<float>();
  p.ld_dz = lce_bwd_chunk_cols(n, vocab, static_cast<int>(hidden.element_size()));
  Tensor dz = at::empty({n, p.ld_dz}, hidden.options());
  p.dz = dz.data_ptr();
  Tensor scratch;
  if (need_dh) {
    p.d_hidden = d_hidden.data_ptr();
    if (p.is_bf16) {
      scratch = at::empty({n, hidden.size(1)}, hidden.options().dtype(at::kShort));
      p.d_hidden_lo = reinterpret_cast<uint16_t*>(scratch.data_ptr<int16_t>());
    } else {
      scratch = at::empty({n, hidden.size(1)}, hidden.options().dtype(at::kFloat));
      p.d_hidden_acc = scratch.data_ptr<float>();
    }
  }
  p.d_weight = need_dw ? d_weight.data_ptr() : nullptr;
  p.d_bias_f32 = need_db ? d_bias32.data_ptr<float>() : nullptr;
  check_launch(arch == 90 ? linear_ce_bwd_sm90(p) : linear_ce_bwd_sm80(p), "linear_ce backward");
  return {d_hidden, d_weight, need_db ? d_bias32.to(hidden.scalar_type()) : empty()};
}

void check_f32_rows(const Tensor& t, int64_t rows, const char* name, const Tensor& z) {
  TORCH_CHECK_TYPE(t.scalar_type() == at::kFloat, name, " must be float32, got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.device() == z.device(), name, " is on another device than z");
  TORCH_CHECK_VALUE(t.dim() == 1 && t.size(0) >= rows && t.is_contiguous(), name,
                    " must be a contiguous 1-D tensor of at least ", std::to_string(rows),
                    " elements");
}

// The fast path's row kernel (see ce_rows_kernel.cuh for the modes); mutates z and the statistics.
void ce_rows_cuda(const Tensor& z, const std::optional<Tensor>& bias, const Tensor& target,
                  int64_t col0, int64_t vocab, const Tensor& w, const Tensor& lse, const Tensor& m,
                  const Tensor& s, const Tensor& zt, const Tensor& zsum, double eps, double zl,
                  double softcap, int64_t mode, int64_t arch) {
  TORCH_CHECK_VALUE(z.is_cuda() && z.dim() == 2 && z.is_contiguous(),
                    "z must be a contiguous 2-D CUDA tensor");
  TORCH_CHECK_TYPE(z.scalar_type() == at::kHalf || z.scalar_type() == at::kBFloat16,
                   "z must be float16 or bfloat16, got ", z.scalar_type());
  check_arch(arch);  // 80: the sm80 family, 90: the sm90 one
  TORCH_CHECK_VALUE(mode >= 1 && mode <= 5, "mode must be 1..5, got ", std::to_string(mode));
  const int64_t rows = z.size(0), n_cols = z.size(1);
  TORCH_CHECK_VALUE(col0 >= 0 && col0 + n_cols <= vocab, "columns [", std::to_string(col0), ", ",
                    std::to_string(col0 + n_cols), ") are outside the vocabulary of ",
                    std::to_string(vocab));
  // Mode 3's dz uses the row's own lse, so it needs the whole vocabulary; mode 4's statistics
  // are those of the given columns (a whole vocab shard's rows in the vocab-parallel loss).
  TORCH_CHECK_VALUE(mode != 3 || (col0 == 0 && n_cols == vocab),
                    "mode 3 takes whole rows (col0 = 0, n_cols = vocab)");
  TORCH_CHECK_TYPE(target.scalar_type() == at::kLong, "target must be int64");
  TORCH_CHECK_VALUE(target.dim() == 1 && target.size(0) == rows && target.is_contiguous() &&
                        target.device() == z.device(),
                    "target must be a contiguous (rows,) tensor on z's device");
  for (auto [t, name] : {std::pair{&w, "w"}, {&lse, "lse"}, {&m, "m"}, {&s, "s"}, {&zt, "zt"},
                         {&zsum, "zsum"}}) {
    check_f32_rows(*t, rows, name, z);
  }
  if (bias.has_value()) {
    TORCH_CHECK_TYPE(bias->scalar_type() == at::kFloat, "bias must be float32 here");
    TORCH_CHECK_VALUE(bias->dim() == 1 && bias->size(0) == n_cols && bias->is_contiguous() &&
                          bias->device() == z.device(),
                      "bias must be a contiguous (n_cols,) tensor on z's device");
  }
  c10::cuda::CUDAGuard guard(z.device());
  CeRowsParams p;
  p.z = z.data_ptr();
  p.bias = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  p.target = target.data_ptr<int64_t>();
  p.w = w.data_ptr<float>();
  p.lse = lse.data_ptr<float>();
  p.m = m.data_ptr<float>();
  p.s = s.data_ptr<float>();
  p.zt = zt.data_ptr<float>();
  p.zsum = zsum.data_ptr<float>();
  p.rows = rows;
  p.n_cols = n_cols;
  p.col0 = col0;
  p.vocab_size = vocab;
  p.eps = static_cast<float>(eps);
  p.z_loss = static_cast<float>(zl);
  p.softcap = static_cast<float>(softcap);
  p.mode = mode == 5 ? 2 : static_cast<int>(mode);  // mode 5 is the dz pass of mode 2
  p.stat_grads = mode == 5;
  p.is_bf16 = z.scalar_type() == at::kBFloat16;
  p.stream = c10::cuda::getCurrentCUDAStream(z.get_device()).stream();
  check_launch(arch == 90 ? ce_rows_sm90(p) : ce_rows_sm80(p), "ce_rows");
}

// x *= g in place unless g == 1, decided on the device (no host synchronisation).
void scale_if_not_one_cuda(const Tensor& x, const Tensor& g) {
  TORCH_CHECK_VALUE(x.is_cuda() && x.is_contiguous(), "x must be a contiguous CUDA tensor");
  TORCH_CHECK_VALUE(g.numel() == 1 && g.device() == x.device(),
                    "g must be a one-element tensor on x's device");
  int dtype;
  switch (x.scalar_type()) {
    case at::kFloat: dtype = 0; break;
    case at::kBFloat16: dtype = 1; break;
    case at::kHalf: dtype = 2; break;
    default: TORCH_CHECK_TYPE(false, "x must be float32, bfloat16 or float16");
  }
  c10::cuda::CUDAGuard guard(x.device());
  Tensor g32 = g.to(at::kFloat).contiguous();
  ScaleParams p;
  p.x = x.data_ptr();
  p.g = g32.data_ptr<float>();
  p.n = x.numel();
  p.dtype = dtype;
  p.stream = c10::cuda::getCurrentCUDAStream(x.get_device()).stream();
  check_launch(scale_if_not_one(p), "scale_if_not_one");
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fusedops, m) {
  m.def(
      "ce_rows_cuda(Tensor(a!) z, Tensor? bias, Tensor target, int col0, int vocab, Tensor w, "
      "Tensor(b!) lse, Tensor(c!) m, Tensor(d!) s, Tensor(e!) zt, Tensor(f!) zsum, float eps, "
      "float zl, float softcap, int mode, int arch) -> ()");
  m.def("scale_if_not_one_cuda(Tensor(a!) x, Tensor g) -> ()");
  m.def(
      "linear_ce_fwd_cuda(Tensor hidden, Tensor weight, Tensor? bias, Tensor target, "
      "float softcap, int arch) -> (Tensor, Tensor, Tensor)");
  m.def(
      "linear_ce_bwd_cuda(Tensor hidden, Tensor weight, Tensor? bias, Tensor target, Tensor lse, "
      "Tensor d_lse, Tensor d_zt, Tensor d_zsum, float softcap, bool need_dh, bool need_dw, "
      "bool need_db, int arch) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(fusedops, CUDA, m) {
  m.impl("linear_ce_fwd_cuda", &linear_ce_fwd_cuda);
  m.impl("linear_ce_bwd_cuda", &linear_ce_bwd_cuda);
  m.impl("ce_rows_cuda", &ce_rows_cuda);
  m.impl("scale_if_not_one_cuda", &scale_if_not_one_cuda);
}

}  // namespace fusedops

// A plain Python module, so `import fusedops._C` loads the library and its op registrations.
static struct PyModuleDef fusedops_c_module = {PyModuleDef_HEAD_INIT, "_C",
                                               "fusedops CUDA kernels", -1, nullptr};

PyMODINIT_FUNC PyInit__C(void) {
  PyObject* m = PyModule_Create(&fusedops_c_module);
  if (m != nullptr) PyModule_AddStringConstant(m, "built_archs", FUSEDOPS_BUILT_ARCHS);
  return m;
}
