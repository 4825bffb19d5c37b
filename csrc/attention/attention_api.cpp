// Torch binding for the CUDA attention: ATen tensors -> AttnParams, input checks, allocation,
// and the op registrations torch.ops.fusedops.attention_{fwd,bwd}_cuda (packed layout, as the
// Python ops in python/fusedops/attention/ops.py).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "../stream_counters.h"
#include "../torch_utils.h"
#include "build_info.h"
#include "attention_params.h"

// Integers in check messages go through std::to_string (why: torch_utils.h).

namespace fusedops {
namespace {

using at::Tensor;

void check_rows(const Tensor& t, const char* name, const Tensor& q) {
  TORCH_CHECK_VALUE(t.is_cuda() && t.device() == q.device(), name,
                    " must be a CUDA tensor on q's device");
  TORCH_CHECK_TYPE(t.scalar_type() == q.scalar_type(), name, " dtype ", t.scalar_type(),
                   " differs from q dtype ", q.scalar_type());
  TORCH_CHECK_VALUE(t.dim() == 3 && t.size(2) == q.size(2), name,
                    " must be (total, heads, head_dim) with q's head_dim");
  TORCH_CHECK_VALUE(t.stride(2) == 1 && t.stride(1) == t.size(2) && t.stride(0) % 8 == 0, name,
                    " must have contiguous heads and rows of a multiple of 8 elements");
  TORCH_CHECK_VALUE(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, name,
                    " must be 16-byte aligned");
}

// `sm90_fwd`: the call is arch 90's forward, the one kernel built for head dim 256 too.
AttnParams make_params(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& cu_q,
                       const Tensor& cu_k, int64_t max_q, int64_t max_k, double scale,
                       bool causal, int64_t left, int64_t right, double softcap,
                       bool sm90_fwd = false) {
  TORCH_CHECK_TYPE(q.scalar_type() == at::kHalf || q.scalar_type() == at::kBFloat16,
                   "q must be float16 or bfloat16, got ", q.scalar_type());
  TORCH_CHECK_VALUE(q.dim() == 3, "q must be (total_q, Hq, D)");
  TORCH_CHECK_VALUE(q.size(2) == 64 || q.size(2) == 128 || q.size(2) == 256,
                    "the CUDA attention kernels take head dim 64 or 128 (the sm90 forward also "
                    "256), got ", std::to_string(q.size(2)));
  TORCH_CHECK_VALUE(q.size(2) != 256 || sm90_fwd,
                    "head dim 256: only the sm90 forward (arch 90) is built for it; the sm80 "
                    "kernels and the CUDA backward take head dim 64 or 128 (fusedops.attention "
                    "runs Triton's backward after a cuda-sm90 forward at 256)");
  check_rows(q, "q", q);
  check_rows(k, "k", q);
  check_rows(v, "v", q);
  TORCH_CHECK_VALUE(k.sizes() == v.sizes(), "k and v must have one shape");
  TORCH_CHECK_VALUE(k.size(1) >= 1 && q.size(1) % k.size(1) == 0,
                    "Hq must be a multiple of Hkv, got ", std::to_string(q.size(1)), " and ",
                    std::to_string(k.size(1)));
  for (const Tensor* cu : {&cu_q, &cu_k}) {
    TORCH_CHECK_VALUE(cu->is_cuda() && cu->device() == q.device(),
                      "cu_seqlens must be on q's device");
    TORCH_CHECK_TYPE(cu->scalar_type() == at::kInt, "cu_seqlens must be int32");
    TORCH_CHECK_VALUE(cu->dim() == 1 && cu->size(0) >= 1 && cu->is_contiguous(),
                      "cu_seqlens must be 1-D contiguous of length batch + 1");
  }
  TORCH_CHECK_VALUE(cu_q.size(0) == cu_k.size(0), "cu_seqlens_q and cu_seqlens_k lengths differ");
  TORCH_CHECK_VALUE(cu_q.size(0) - 1 <= 65535 && q.size(1) <= 65535,
                    "batch and heads must be at most 65535");
  TORCH_CHECK_VALUE(q.size(0) < (int64_t{1} << 31) && k.size(0) < (int64_t{1} << 31) &&
                        max_q >= 0 && max_k >= 0 && max_q < (int64_t{1} << 31) &&
                        max_k < (int64_t{1} << 31),
                    "sequence lengths must fit in int32");
  AttnParams p;
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.cu_q = cu_q.data_ptr<int>();
  p.cu_k = cu_k.data_ptr<int>();
  p.q_row = q.stride(0);
  p.k_row = k.stride(0);
  p.v_row = v.stride(0);
  p.total_q = static_cast<int>(q.size(0));
  p.total_k = static_cast<int>(k.size(0));
  p.hq = static_cast<int>(q.size(1));
  p.hkv = static_cast<int>(k.size(1));
  p.head_dim = static_cast<int>(q.size(2));
  p.batch = static_cast<int>(cu_q.size(0) - 1);
  p.max_q = static_cast<int>(max_q);
  p.max_k = static_cast<int>(max_k);
  p.scale = static_cast<float>(scale);
  p.softcap = static_cast<float>(softcap);
  constexpr double kLog2e = 1.4426950408889634;
  p.scale_log2 = static_cast<float>(scale * kLog2e);
  p.cap_in_log2 = softcap > 0 ? static_cast<float>(2.0 * kLog2e * scale / softcap) : 0.f;
  p.cap_out_log2 = static_cast<float>(softcap * kLog2e);
  p.left = left < 0 ? -1 : static_cast<int>(std::min<int64_t>(left, INT32_MAX / 2));
  p.right = causal ? 0 : (right < 0 ? -1 : static_cast<int>(std::min<int64_t>(right, INT32_MAX / 2)));
  p.is_bf16 = q.scalar_type() == at::kBFloat16;
  p.stream = c10::cuda::getCurrentCUDAStream(q.get_device()).stream();
  return p;
}

// One kernel family's entry points (attention_params.h).
struct AttnFamily {
  cudaError_t (*fwd)(AttnParams&);
  cudaError_t (*bwd)(AttnParams&);
  bool (*bwd_atomic_fits)(int head_dim);
};

// The kernel family that the op's `arch` argument names, as for linear_ce (80 or 90), picked
// before anything is allocated. The Hopper family has its own forward and backward (wgmma +
// TMA); both backwards read the (Hq, total_q) natural-log lse that both forwards write.
AttnFamily family(int64_t arch) {
  check_arch(arch);
  if (arch == 80) return {attention_fwd_sm80, attention_bwd_sm80, attention_bwd_atomic_fits_sm80};
  return {attention_fwd_sm90, attention_bwd_sm90, attention_bwd_atomic_fits_sm80};
}

// Whether the sm_90a machine code is built and device `dev` is compute capability 9.0.
bool sm90_runs_on(int dev) {
  int major = 0, minor = 0;
  return std::string(FUSEDOPS_BUILT_ARCHS).find("9.0a") != std::string::npos &&
         cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) == cudaSuccess &&
         cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) == cudaSuccess &&
         major == 9 && minor == 0;
}

// Whether a tensor's rows do not overlap (the TMA tensor maps of the sm90 kernels read rows as
// (heads, D) boxes).
bool rows_disjoint(const Tensor& t) {
  return (t.size(0) <= 1 && t.stride(0) > 0) || t.stride(0) >= t.size(1) * t.size(2);
}

// What the Hopper forward needs beyond make_params' checks: its sm_90a machine code (built only
// when setup.py's arch list has 9.0a) runs on compute capability 9.0 alone, and its TMA tensor
// maps read rows of q, k and v as (rows, heads, D) boxes, so a row must not overlap the next.
void check_fwd_sm90(const Tensor& q, const Tensor& k, const Tensor& v) {
  TORCH_CHECK_VALUE(std::string(FUSEDOPS_BUILT_ARCHS).find("9.0a") != std::string::npos,
                    "the sm90 attention forward is not built (built archs ", FUSEDOPS_BUILT_ARCHS,
                    "; rebuild with FUSEDOPS_CUDA_ARCHS including 9.0a)");
  int major = 0, minor = 0;
  const int dev = q.get_device();
  TORCH_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) ==
                      cudaSuccess &&
                  cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) ==
                      cudaSuccess,
              "could not read the GPU's compute capability");
  TORCH_CHECK_VALUE(major == 9 && minor == 0,
                    "the sm90 attention forward needs a compute capability 9.0 GPU (got ",
                    std::to_string(major), ".", std::to_string(minor), "); use arch 80");
  for (const Tensor* t : {&q, &k, &v})
    TORCH_CHECK_VALUE((t->size(0) <= 1 && t->stride(0) > 0) ||
                          t->stride(0) >= t->size(1) * t->size(2),
                      "the sm90 attention forward needs rows of q, k and v that do not overlap");
}

std::tuple<Tensor, Tensor> attention_fwd_cuda(const Tensor& q, const Tensor& k, const Tensor& v,
                                              const Tensor& cu_q, const Tensor& cu_k,
                                              int64_t max_q, int64_t max_k, double scale,
                                              bool causal, int64_t left, int64_t right,
                                              double softcap, int64_t arch) {
  const AttnFamily fam = family(arch);
  c10::cuda::CUDAGuard guard(q.device());
  AttnParams p = make_params(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, left, right,
                             softcap, /*sm90_fwd=*/arch == 90);
  if (arch == 90) check_fwd_sm90(q, k, v);
  Tensor out = at::empty(q.sizes(), q.options());
  Tensor lse = at::empty({q.size(1), q.size(0)}, q.options().dtype(at::kFloat));
  if (p.total_q == 0 || p.batch == 0 || p.max_q == 0) return {out, lse.fill_(-INFINITY)};
  p.out = out.data_ptr();
  p.o_row = out.stride(0);
  p.lse = lse.data_ptr<float>();
  if (arch == 90) {
    // The Hopper forward's dynamic tile scheduler (two counters; attention_params.h).
    const Tensor tiles = stream_counters(q, p.stream, 2, CounterUser::kAttentionTiles,
                                         "attention forward (tile counters)");
    p.tile_counter = reinterpret_cast<unsigned int*>(tiles.data_ptr<int>());
  }
  check_launch(fam.fwd(p), "attention forward");
  return {out, lse};
}

std::tuple<Tensor, Tensor, Tensor> attention_bwd_cuda(
    const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
    const Tensor& dout, const Tensor& cu_q, const Tensor& cu_k, int64_t max_q, int64_t max_k,
    double scale, bool causal, int64_t left, int64_t right, double softcap,
    bool deterministic, int64_t arch) {
  const AttnFamily fam = family(arch);
  c10::cuda::CUDAGuard guard(q.device());
  AttnParams p = make_params(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, left, right,
                             softcap);
  check_rows(out, "out", q);
  check_rows(dout, "dout", q);
  TORCH_CHECK_VALUE(out.sizes() == q.sizes() && dout.sizes() == q.sizes(),
                    "out and dout must have q's shape");
  TORCH_CHECK_VALUE(lse.scalar_type() == at::kFloat && lse.is_contiguous() && lse.dim() == 2 &&
                        lse.size(0) == q.size(1) && lse.size(1) == q.size(0),
                    "lse must be contiguous float32 (Hq, total_q)");
  TORCH_CHECK_VALUE(lse.device() == q.device(), "lse must be on q's device (", q.device(),
                    "), got ", lse.device());
  Tensor dq = at::empty(q.sizes(), q.options());
  Tensor dk = at::empty(k.sizes(), k.options());
  Tensor dv = at::empty(v.sizes(), v.options());
  if (p.total_q == 0 || p.batch == 0 || p.max_q == 0 || p.total_k == 0)
    return {dq.zero_(), dk.zero_(), dv.zero_()};
  p.out = const_cast<void*>(out.data_ptr());
  p.o_row = out.stride(0);
  p.dout = dout.data_ptr();
  p.do_row = dout.stride(0);
  p.lse = const_cast<float*>(lse.data_ptr<float>());
  p.dq = dq.data_ptr();
  p.dk = dk.data_ptr();
  p.dv = dv.data_ptr();
  p.dq_row = dq.stride(0);
  p.dk_row = dk.stride(0);
  p.dv_row = dv.stride(0);
  // Every row is written by the kernels (cu_seqlens cover the packed tensors, checked in Python
  // for user-given ones); keys that no query sees get zero gradients. Arch 90's backward is the
  // sm90 one where it can run -- its machine code built, a compute capability 9.0 GPU (the
  // forward refuses the others; the backward op can be called alone), rows that do not overlap
  // (its TMA tensor maps), not switched off by FUSEDOPS_ATTN_SM90_BWD=sm80 -- and the sm80
  // backward elsewhere.
  const bool sm90_bwd = arch == 90 && sm90_runs_on(q.get_device()) && rows_disjoint(q) &&
                        rows_disjoint(k) && rows_disjoint(v) && rows_disjoint(dout);
  // The switch is read once, here: arch 90 calls attention_bwd_sm90 only to run the sm90
  // kernel, whose delta is the padded buffer below and whose preprocess zeroes the dQ
  // accumulator.
  const bool sm90_enabled = sm90_bwd && attention_bwd_sm90_enabled();
  const bool sm90_kernel = sm90_enabled && (deterministic || fam.bwd_atomic_fits(p.head_dim));
  auto bwd = arch == 90 && !sm90_kernel ? attention_bwd_sm80 : fam.bwd;
  // delta: (Hq, total_q) for the sm80 backward; the sm90 one keeps lse2 and delta there in its
  // padded layout (stats_rows_sm90, attention_bwd_kernel_sm90.cuh), 2 Hq x (total_q + 128 batch
  // rounded up to 128) floats: up to 256x the sm80 size for one-token sequences.
  const int64_t stats_rows = (q.size(0) + 128 * (cu_q.size(0) - 1) + 127) / 128 * 128;
  Tensor delta = at::empty({sm90_kernel ? 2 * q.size(1) * stats_rows : q.size(1) * q.size(0)},
                           q.options().dtype(at::kFloat));
  p.delta = delta.data_ptr<float>();
  // Not deterministic: dQ accumulates in float32 by atomics from the dK/dV kernel. Deterministic:
  // the sm90 backward orders those reductions by counters (p.dq_sem; bit-identical run to run),
  // the sm80 one computes dQ in a separate kernel that recomputes the scores. The sm80 atomic
  // kernel needs Hopper's shared memory; elsewhere the separate pass is taken (same results,
  // within rounding).
  const bool sm90_ordered = deterministic && sm90_enabled;
  Tensor dq_acc, dq_sem;
  if ((!deterministic && fam.bwd_atomic_fits(p.head_dim)) || sm90_ordered) {
    // Rows rounded up to a multiple of 8 for the accumulator's 8 x 8 tiles (dq_acc_index).
    // The sm90 backward's preprocess zeroes it as it computes delta (one kernel less); the sm80
    // kernels need it zeroed here.
    const std::vector<int64_t> size = {(q.size(0) + 7) / 8 * 8, q.size(1), q.size(2)};
    const auto opts = q.options().dtype(at::kFloat);
    dq_acc = sm90_kernel ? at::empty(size, opts) : at::zeros(size, opts);
    p.dq_acc = dq_acc.data_ptr<float>();
  }
  if (sm90_ordered) {
    // Zeroed by the backward's preprocess on the stream (no memset, no host sync).
    dq_sem = at::empty({dq_sem_count_sm90(q.size(0), q.size(1), cu_q.size(0) - 1)},
                       q.options().dtype(at::kInt));
    p.dq_sem = dq_sem.data_ptr<int>();
  }
  Tensor dq_done;
  const char* convert = std::getenv("FUSEDOPS_ATTN_SM90_BWD_CONVERT");
  // The dQ conversion overlapped with the backward's last wave (attention_params.h), unless
  // FUSEDOPS_ATTN_SM90_BWD_CONVERT=after (measurement: the conversion after the backward).
  if (sm90_kernel && (convert == nullptr || std::string(convert) != "after")) {
    if (sm90_ordered) {
      p.dq_done = p.dq_sem;
    } else {
      dq_done = at::empty({dq_sem_count_sm90(q.size(0), q.size(1), cu_q.size(0) - 1)},
                          q.options().dtype(at::kInt));
      p.dq_done = dq_done.data_ptr<int>();
    }
  }
  check_launch(bwd(p), "attention backward");
  return {dq, dk, dv};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fusedops, m) {
  m.def(
      "attention_fwd_cuda(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, "
      "int max_seqlen_q, int max_seqlen_k, float scale, bool causal, int window_left, "
      "int window_right, float softcap, int arch) -> (Tensor, Tensor)");
  m.def(
      "attention_bwd_cuda(Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor dout, "
      "Tensor cu_seqlens_q, Tensor cu_seqlens_k, int max_seqlen_q, int max_seqlen_k, float scale, "
      "bool causal, int window_left, int window_right, float softcap, bool deterministic, "
      "int arch) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(fusedops, CUDA, m) {
  m.impl("attention_fwd_cuda", &attention_fwd_cuda);
  m.impl("attention_bwd_cuda", &attention_bwd_cuda);
}

}  // namespace fusedops
