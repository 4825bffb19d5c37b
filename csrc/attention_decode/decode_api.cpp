// Torch binding of the split-KV decode kernels: ATen tensors -> DecodeParams, input checks,
// allocation, and the op torch.ops.fusedops.attention_decode_cuda (the Python side is
// python/fusedops/attention/kvcache.py; the append of new keys happens there, before this op).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <optional>
#include <string>
#include <tuple>
#include <utility>

#include "../stream_counters.h"
#include "../torch_utils.h"
#include "decode_params.h"

namespace fusedops {
namespace {

using at::Tensor;

constexpr int kMaxRows = 16;  // G * Sq of the instantiated kernels

void check_cache(const Tensor& t, const char* name, const Tensor& q) {
  TORCH_CHECK_VALUE(t.is_cuda() && t.device() == q.device(), name,
                    " must be a CUDA tensor on q's device");
  TORCH_CHECK_TYPE(t.scalar_type() == q.scalar_type(), name, " dtype ", t.scalar_type(),
                   " differs from q dtype ", q.scalar_type());
  TORCH_CHECK_VALUE(t.dim() == 4 && t.size(3) == q.size(3), name,
                    " must be 4-D with q's head dim");
  TORCH_CHECK_VALUE(t.stride(3) == 1 && t.stride(0) % 8 == 0 && t.stride(1) % 8 == 0 &&
                        t.stride(2) % 8 == 0,
                    name, " must have a contiguous last dim and other strides multiples of 8 "
                    "elements (16-byte rows)");
  TORCH_CHECK_VALUE(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, name,
                    " must be 16-byte aligned");
}

// K/V pipeline stages: kDecodeDefaultStages, or FUSEDOPS_ATTN_DECODE_STAGES (2 to 6; read at each
// call, a tuning switch for the benchmarks).
int decode_stages() {
  const char* env = std::getenv("FUSEDOPS_ATTN_DECODE_STAGES");
  const int n = env != nullptr ? std::atoi(env) : kDecodeDefaultStages;
  return n >= kDecodeMinStages && n <= kDecodeMaxStages ? n : kDecodeDefaultStages;
}

std::tuple<Tensor, Tensor> attention_decode_cuda(const Tensor& q_in, const Tensor& k_cache,
                                                 const Tensor& v_cache, const Tensor& seqlens_k,
                                                 const std::optional<Tensor>& page_table,
                                                 double scale, bool causal, int64_t left,
                                                 int64_t right, double softcap,
                                                 int64_t num_splits, int64_t arch) {
  Tensor q = q_in;
  // arch 80 (cuda-sm80) and 90 (cuda-sm90) run one kernel: its sm_80 or sm_90a build, whichever
  // the device loads (decode is bandwidth-bound; cp.async suits both families).
  check_arch(arch);
  TORCH_CHECK_VALUE(q.is_cuda(), "q must be a CUDA tensor");
  TORCH_CHECK_TYPE(q.scalar_type() == at::kHalf || q.scalar_type() == at::kBFloat16,
                   "q must be float16 or bfloat16, got ", q.scalar_type());
  TORCH_CHECK_VALUE(q.dim() == 4 && q.stride(3) == 1, "q must be (B, Sq, Hq, D) with a "
                    "contiguous last dim");
  const int64_t batch = q.size(0), sq = q.size(1), hq = q.size(2), d = q.size(3);
  TORCH_CHECK_VALUE(d == 64 || d == 128, "the CUDA decode kernels take head dim 64 or 128, got ",
                    std::to_string(d));
  check_cache(k_cache, "k_cache", q);
  check_cache(v_cache, "v_cache", q);
  TORCH_CHECK_VALUE(k_cache.sizes() == v_cache.sizes(), "k_cache and v_cache must have one shape");
  const int64_t hkv = k_cache.size(2);
  TORCH_CHECK_VALUE(hkv >= 1 && hq % hkv == 0, "Hq must be a multiple of Hkv, got ",
                    std::to_string(hq), " and ", std::to_string(hkv));
  TORCH_CHECK_VALUE((hq / hkv) * sq <= kMaxRows, "the CUDA decode kernels take (Hq / Hkv) * Sq "
                    "<= 16 query rows per KV head, got ", std::to_string((hq / hkv) * sq),
                    " (the Triton backend takes more)");
  TORCH_CHECK_VALUE(seqlens_k.is_cuda() && seqlens_k.device() == q.device(),
                    "seqlens_k must be on q's device");
  TORCH_CHECK_TYPE(seqlens_k.scalar_type() == at::kInt, "seqlens_k must be int32");
  TORCH_CHECK_VALUE(seqlens_k.dim() == 1 && seqlens_k.size(0) == batch &&
                        seqlens_k.is_contiguous(),
                    "seqlens_k must be a contiguous (B,) tensor");
  TORCH_CHECK_VALUE(num_splits >= 1 && num_splits <= 256, "num_splits must be in [1, 256], got ",
                    std::to_string(num_splits));
  const bool paged = page_table.has_value();
  int64_t capacity = k_cache.size(1);
  if (paged) {
    const Tensor& pt = *page_table;
    TORCH_CHECK_VALUE(pt.is_cuda() && pt.device() == q.device(),
                      "page_table must be on q's device");
    TORCH_CHECK_TYPE(pt.scalar_type() == at::kInt, "page_table must be int32");
    TORCH_CHECK_VALUE(pt.dim() == 2 && pt.size(0) == batch && pt.stride(1) == 1,
                      "page_table must be (B, max_pages) with a contiguous last dim");
    TORCH_CHECK_VALUE(k_cache.size(0) >= 1 && k_cache.size(1) >= 1,
                      "a paged k_cache needs at least one page of at least one slot");
    capacity = pt.size(1) * k_cache.size(1);
  } else {
    TORCH_CHECK_VALUE(k_cache.size(0) == batch, "k_cache must have q's batch without page_table");
  }
  // Key indices are int: a split's end (its start + one split of up to 256) stays below 2^31.
  TORCH_CHECK_VALUE(capacity <= (int64_t(1) << 31) - (int64_t(1) << 15),
                    "the cache capacity must be at most 2^31 - 2^15 keys per sequence, got ",
                    std::to_string(capacity));
  const at::cuda::OptionalCUDAGuard guard(q.device());
  // The kernel reads q rows as 16-byte vectors: a q whose rows are not 16-byte aligned (a view
  // into a wider or offset tensor) is copied into a fresh contiguous tensor first.
  if (reinterpret_cast<uintptr_t>(q.data_ptr()) % 16 != 0 || q.stride(0) % 8 != 0 ||
      q.stride(1) % 8 != 0 || q.stride(2) % 8 != 0)
    q = at::empty(q_in.sizes(), q_in.options()).copy_(q_in);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  Tensor out = at::empty(q.sizes(), q.options());
  Tensor lse = at::empty({batch, hq, sq}, q.options().dtype(at::kFloat));
  if (batch == 0 || sq == 0) return {out, lse};
  const int64_t m = (hq / hkv) * sq;
  Tensor out_p, lse_p, counters;
  if (num_splits > 1) {
    out_p = at::empty({num_splits, batch, hkv, m, d}, q.options().dtype(at::kFloat));
    lse_p = at::empty({num_splits, batch, hkv, m}, q.options().dtype(at::kFloat));
    // Split counters, one per (sequence, KV head), reset by the kernel's merging CTAs.
    counters = stream_counters(q, stream, std::max<int64_t>(batch * hkv, 4096),
                               CounterUser::kDecodeSplits, "attention decode (split counters)");
  }
  DecodeParams p{};
  p.q = q.data_ptr();
  p.k = k_cache.data_ptr();
  p.v = v_cache.data_ptr();
  p.out = out.data_ptr();
  p.lse = lse.data_ptr<float>();
  p.out_partial = num_splits > 1 ? out_p.data_ptr<float>() : nullptr;
  p.lse_partial = num_splits > 1 ? lse_p.data_ptr<float>() : nullptr;
  p.counters = num_splits > 1 ? reinterpret_cast<unsigned int*>(counters.data_ptr<int>()) : nullptr;
  p.seqlens_k = seqlens_k.data_ptr<int>();
  p.page_table = paged ? page_table->data_ptr<int>() : nullptr;
  p.q_stride_b = q.stride(0);
  p.q_stride_s = q.stride(1);
  p.q_stride_h = q.stride(2);
  p.k_stride_b = k_cache.stride(0);
  p.k_stride_s = k_cache.stride(1);
  p.k_stride_h = k_cache.stride(2);
  p.v_stride_b = v_cache.stride(0);
  p.v_stride_s = v_cache.stride(1);
  p.v_stride_h = v_cache.stride(2);
  p.o_stride_b = out.stride(0);
  p.o_stride_s = out.stride(1);
  p.o_stride_h = out.stride(2);
  p.pt_stride = paged ? page_table->stride(0) : 0;
  p.batch = static_cast<int>(batch);
  p.sq = static_cast<int>(sq);
  p.hq = static_cast<int>(hq);
  p.hkv = static_cast<int>(hkv);
  p.group = static_cast<int>(hq / hkv);
  p.head_dim = static_cast<int>(d);
  p.capacity = static_cast<int>(capacity);
  p.page_size = static_cast<int>(k_cache.size(1));
  p.num_pages = static_cast<int>(k_cache.size(0));
  p.num_splits = static_cast<int>(num_splits);
  p.stages = decode_stages();
  p.page_shift = -1;
  for (int sh = 0; sh < 31; ++sh)
    if ((int64_t(1) << sh) == k_cache.size(1)) p.page_shift = sh;
  // Scores in log2 units: without softcap scale * log2(e) at once; with it the kernel applies
  // softcap * tanh(s * scale / softcap) * log2(e).
  p.softcap = static_cast<float>(softcap);
  p.scale_log2 = static_cast<float>(softcap > 0 ? scale : scale * 1.4426950408889634);
  // A window side of capacity + Sq keys or more sees every key: unlimited (-1), which also keeps
  // the kernel's int position arithmetic in range.
  const int64_t wide = capacity + sq;
  p.left = left >= wide ? -1 : static_cast<int>(left);
  p.right = causal ? 0 : (right >= wide ? -1 : static_cast<int>(right));
  p.is_bf16 = q.scalar_type() == at::kBFloat16;
  check_launch(decode_fwd_sm80(p, stream), "attention decode");
  return {out, lse};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fusedops, m) {
  m.def(
      "attention_decode_cuda(Tensor q, Tensor k_cache, Tensor v_cache, Tensor seqlens_k, "
      "Tensor? page_table, float scale, bool causal, int window_left, int window_right, "
      "float softcap, int num_splits, int arch) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(fusedops, CUDA, m) { m.impl("attention_decode_cuda", &attention_decode_cuda); }

}  // namespace fusedops
