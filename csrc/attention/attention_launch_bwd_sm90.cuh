// Host-side launch of the Hopper attention backward: the preprocess (padded lse2 and delta),
// the dK/dV/dQ kernel with its TMA tensor maps, and the dQ conversion (the sm80 one: same
// float32 accumulator layout; with 80-query steps dq_convert_t_kernel, column-major tiles).
// Tile sizes and shared memory: attention_config_bwd_sm90.h.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "attention_bwd_kernel_sm90.cuh"
#include "attention_config_bwd_sm90.h"
#include "attention_launch_sm80.cuh"  // launch, dq_convert_kernel
#include "attention_launch_sm90.cuh"  // make_tensor_map

namespace fusedops {
namespace attn {

// The consumers' schedule: serial unless FUSEDOPS_ATTN_SM90_BWD_SCHEDULE=overlap (P^T while
// dP^T runs; at D=128 dS^T while dV += P^T dO runs) on a call without softcap (whose calls take
// the serial kernel). Measured slower on the H200 at every shape of check_attention_sm90.py's
// backward timing (2026-12-01, bf16, B*L = 16384, H*D = 2048, TFLOP/s serial / overlap: D=128
// L=4096 535/405, causal 438/355, L=16384 547/439; D=64 L=4096 436/370, L=16384 462/394), when
// the overlap kernel also held the softcap's serial path and ptxas serialised its wgmmas
// (C7512); without it, D=128 compiles with no serialisation (not yet timed). Read at every call.
inline bool sm90_bwd_overlap(const AttnParams& p) {
  const char* s = std::getenv("FUSEDOPS_ATTN_SM90_BWD_SCHEDULE");
  return s != nullptr && std::strcmp(s, "overlap") == 0 && !(p.softcap > 0.f);
}
// The serial schedule's dQ products: a step behind (dQ_part of step i formed during step i + 1
// from the dS^T both warpgroups wrote a step before, so that neither waits for the other's
// current step; attention_bwd_kernel_sm90.cuh's kLag) or in the step itself behind a barrier of
// both consumer warpgroups. On the H200 (bf16, B*L = 16384, H*D = 2048, backward TFLOP/s lagged
// / lockstep; git 4cc5f74, 4 rounds): D=64 L=4096 480/452, causal 425/408,
// L=16384 513/469, causal 499/467; D=128 L=4096 512/512, causal 455/459, L=16384 549/554,
// causal 535/543 (git 2cbfb46, 2 rounds: D=64 484/455, 393/421, 475/477, 513/478; D=128
// 523/494, 446/457, 520/558, 556/556). So lagged at D=64, lockstep at D=128;
// FUSEDOPS_ATTN_SM90_BWD_SCHEDULE=lagged|lockstep forces one (measurement). The deterministic
// mode always runs the lockstep form. Read at every call.
inline bool sm90_bwd_lagged(int head_dim) {
  const char* s = std::getenv("FUSEDOPS_ATTN_SM90_BWD_SCHEDULE");
  if (s != nullptr && std::strcmp(s, "lagged") == 0) return true;
  if (s != nullptr && std::strcmp(s, "lockstep") == 0) return false;
  return head_dim == 64;
}

// The CTAs of the backward's persistent grid (attention_params.h): one per SM, or (as the
// forward's FUSEDOPS_ATTN_SM90_PERSISTENT) FUSEDOPS_ATTN_SM90_BWD_PERSISTENT=0 none (a CTA per
// key block; measurement) and =N (a positive integer) at most N, so that even a small call runs
// many key blocks per CTA (tests). Other values are ignored. Read at every call.
inline int sm90_bwd_persistent_ctas(int sms) {
  const char* s = std::getenv("FUSEDOPS_ATTN_SM90_BWD_PERSISTENT");
  if (s != nullptr && *s != '\0') {
    char* end = nullptr;
    const long n = std::strtol(s, &end, 10);
    if (*end == '\0' && n >= 0) return static_cast<int>(std::min<long>(n, sms));
  }
  return sms;
}

// The deterministic mode's order of dQ reductions (attention_bwd_kernel_sm90.cuh): key blocks
// descending where queries see keys up to a bound (causal or a right window: the key block
// nearest the diagonal reaches a query block first, so its turn comes first and nobody waits in
// the common case), ascending otherwise (non-causal: every key block starts at query block 0).
// Where no mask limits the keys (every key block adds into every query block) and the grid has
// at most half as many key blocks as the GPU has SMs, the rotated order instead (the kernel's
// dq_rotated: no chain of waits when a (KV head, sequence)'s CTAs start together; its waits
// need all of them resident at once, hence the bound).
// FUSEDOPS_ATTN_SM90_BWD_DQ_ORDER=ascending|descending forces one of the first two, for
// measurement; read at every call.
inline void sm90_bwd_dq_order(AttnParams& p, int key_blocks) {
  const char* s = std::getenv("FUSEDOPS_ATTN_SM90_BWD_DQ_ORDER");
  const bool asc = s != nullptr && std::strcmp(s, "ascending") == 0;
  const bool desc = s != nullptr && std::strcmp(s, "descending") == 0;
  p.dq_desc = desc || (!asc && p.right >= 0);
  p.dq_rot = false;
  if (asc || desc || p.left >= 0 || p.right >= 0) return;
  DeviceSm90 dev;
  if (device_sm90(dev) != cudaSuccess) return;
  p.dq_rot = 2 * key_blocks <= dev.sms;
}

// The deterministic mode's map of the dQ accumulator (dq_acc_index's layout, rows rounded up to
// a multiple of 8) as 4-D float32: 256 floats, the 8 D / 256 pieces of an 8-row run, heads, runs;
// boxes of one query block (BM / 8 runs of one head), dense, as the dQ writers stage it.
template <int D, int BM>
inline bool make_dq_acc_map(CUtensorMap* map, float* acc, int hq, int total_q) {
  const PFN_cuTensorMapEncodeTiled_v12000 encode = tensor_map_encoder();
  if (encode == nullptr) return false;
  constexpr int kPieces = 8 * D / 256;
  const cuuint64_t dims[4] = {256, kPieces, static_cast<cuuint64_t>(hq),
                              static_cast<cuuint64_t>((total_q + 7) / 8)};
  const cuuint64_t strides[3] = {256 * 4, 32 * D,  // bytes, dims 1 to 3
                                 static_cast<cuuint64_t>(hq) * 32 * D};
  const cuuint32_t box[4] = {256, kPieces, 1, BM / 8};
  const cuuint32_t elem_strides[4] = {1, 1, 1, 1};
  return encode(map, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4, acc, dims, strides, box, elem_strides,
                CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE,
                CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// Query steps of 80 rows at D=128 (TilesBwdSm90<128, 80>, the transposed dQ product): 25% more
// work per step for about the same fixed cost of a step (barriers, statistics, descriptors), in
// the lockstep serial schedule only, without softcap (its kernel has no softcap path). Taken
// without a sliding window, causal or not (below); FUSEDOPS_ATTN_SM90_BWD_BM=64|80 forces
// either (80 still only in that schedule, without softcap or the deterministic mode). Read at
// every call.
inline bool sm90_bwd_q80(const AttnParams& p) {
  if (p.head_dim != 128 || p.dq_sem != nullptr || p.softcap > 0.f || sm90_bwd_overlap(p) ||
      sm90_bwd_lagged(128))
    return false;
  const char* s = std::getenv("FUSEDOPS_ATTN_SM90_BWD_BM");
  if (s != nullptr && std::strcmp(s, "80") == 0) return true;
  if (s != nullptr && std::strcmp(s, "64") == 0) return false;
  // By default also only without a sliding window, for sequences of at least 1024 queries
  // (4096 under a causal mask), and where 80-row steps add at most 4% rows over 64-row ones for
  // the longest sequence. Against the persistent 64-query kernel at B*L=16384: on the H200 1-6%
  // faster from 4096 in two runs (non-causal L=16384 once 0.9% slower), non-causal 4% faster
  // at 2048 and 1% at 1024, causal 2% slower at 2048 and 1% at 1024 (hence the causal floor);
  // on an H100 (seven rounds) non-causal 4-5% faster at 1024 and 2048, causal 1-3% faster. The
  // fixed cost of a key block's prologue and epilogue weighs more against fewer, longer steps,
  // and the 80-query kernel has no persistent form.
  const int64_t rows80 = (p.max_q + 79) / 80 * 80, rows64 = (p.max_q + 63) / 64 * 64;
  const int min_q = p.right < 0 ? 1024 : 4096;
  return p.left < 0 && p.right <= 0 && p.max_q >= min_q && rows80 * 25 <= rows64 * 26;
}

// Needs p.dq_acc (rows rounded up to a multiple of 8, any contents: the preprocess zeroes the
// rows the kernels add to and read) and p.delta of 2 hq
// stats_rows_sm90(p) floats; p.dq_sem (dq_sem_count_sm90 ints, any contents: the preprocess
// zeroes them) selects the deterministic mode, which runs the serial schedule whatever
// FUSEDOPS_ATTN_SM90_BWD_SCHEDULE says. BM: the query rows of a step (TilesBwdSm90).
template <typename T, int D, int BM>
cudaError_t run_bwd_sm90_bm(const AttnParams& params) {
  AttnParams p = params;
  if (p.dq_sem != nullptr) sm90_bwd_dq_order(p, (p.max_k + TilesBwdSm90<D>::kBlockN - 1) /
                                                     TilesBwdSm90<D>::kBlockN);
  if (const char* probe = std::getenv("FUSEDOPS_ATTN_SM90_BWD_DET_PROBE"))
    p.dq_probe = std::atoi(probe);
  if (const char* epi = std::getenv("FUSEDOPS_ATTN_SM90_BWD_EPILOGUE")) {
    p.dkv_regs = std::strcmp(epi, "regs") == 0;
    if (std::strcmp(epi, "immediate") == 0) p.dkv_defer = false;
  }
  using C = TilesBwdSm90<D, BM>;
  static_assert(sizeof(T) == C::kElem);
  constexpr bool kBf16 = std::is_same_v<T, __nv_bfloat16>;
  if (p.dq_acc == nullptr) return cudaErrorInvalidValue;
  const dim3 grid((p.max_k + C::kBlockN - 1) / C::kBlockN, p.hkv, p.batch);
  // The persistent grid (attention_params.h) where the kernel has one: the deterministic mode
  // and the 80-query steps have none.
  constexpr bool kPersistKernel = C::kPersistFits;
  DeviceSm90 dev;
  const int ctas = kPersistKernel && p.dq_sem == nullptr && p.dq_done != nullptr &&
                           device_sm90(dev) == cudaSuccess
                       ? sm90_bwd_persistent_ctas(dev.sms)
                       : 0;
  p.persist = ctas > 0;
  const int64_t n_tiles = static_cast<int64_t>(grid.x) * grid.y * grid.z;
  // Tile numbers (and the counter past them) are int in the kernel.
  if (n_tiles + dev.sms > INT32_MAX) return cudaErrorInvalidConfiguration;
  const dim3 launch_grid =
      p.persist ? dim3(static_cast<unsigned>(std::min<int64_t>(n_tiles, ctas))) : grid;
  const int64_t padded_q = (static_cast<int64_t>(p.max_q) + BM - 1) / BM * BM;
  constexpr int kPrepRows = kPrepRowsSm90<D>;
  cudaError_t err = launch(bwd_prep_kernel_sm90<T, D, BM>,
                           dim3(static_cast<unsigned>((padded_q + kPrepRows - 1) / kPrepRows),
                                p.hq, p.batch),
                           256, 0, p);
  if (err != cudaSuccess) return err;
  if (grid.x > 0 && grid.y > 0 && grid.z > 0) {
    CUtensorMap tm_q, tm_k, tm_v, tm_do, tm_dk, tm_dv;
    if (!make_tensor_map(&tm_q, p.q, kBf16, D, p.hq, p.total_q, p.q_row, C::kBlockM) ||
        !make_tensor_map(&tm_k, p.k, kBf16, D, p.hkv, p.total_k, p.k_row, C::kBlockN) ||
        !make_tensor_map(&tm_v, p.v, kBf16, D, p.hkv, p.total_k, p.v_row, C::kBlockN) ||
        !make_tensor_map(&tm_do, p.dout, kBf16, D, p.hq, p.total_q, p.do_row, C::kBlockM) ||
        !make_tensor_map(&tm_dk, p.dk, kBf16, D, p.hkv, p.total_k, p.dk_row, 64) ||
        !make_tensor_map(&tm_dv, p.dv, kBf16, D, p.hkv, p.total_k, p.dv_row, 64))
      return cudaErrorInvalidValue;  // the driver refused a tensor map
    CUtensorMap tm_dq{};  // unused by the kernels with unordered reductions
    if (p.dq_sem != nullptr && !make_dq_acc_map<D, BM>(&tm_dq, p.dq_acc, p.hq, p.total_q))
      return cudaErrorInvalidValue;
    auto pick = [&] {
      if constexpr (C::kDqT) {
        return bwd_kernel_sm90<T, D, false, false, false, BM>;  // sm90_bwd_q80's schedule
      } else {
        return p.dq_sem != nullptr ? bwd_kernel_sm90<T, D, false, true>
               : sm90_bwd_overlap(p) ? bwd_kernel_sm90<T, D, true, false>
               : sm90_bwd_lagged(D) ? bwd_kernel_sm90<T, D, false, false, true>
                                    : bwd_kernel_sm90<T, D, false, false>;
      }
    };
    const auto kernel = pick();
    const int smem = static_cast<int>(p.dq_sem != nullptr ? C::kSmemDet
                                      : kPersistKernel  ? C::kSmemPersist
                                                        : C::kSmem);
    err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (err != cudaSuccess) return err;
    kernel<<<launch_grid, C::kThreads, smem, p.stream>>>(p, tm_q, tm_k, tm_v, tm_do, tm_dq, tm_dk,
                                                          tm_dv);
    err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  // The overlapped conversion (attention_params.h), behind a backward that ran.
  if (p.dq_done != nullptr && grid.x > 0 && grid.y > 0 && grid.z > 0) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(static_cast<unsigned>((p.max_q + BM - 1) / BM), p.hq, p.batch);
    cfg.blockDim = dim3(256);
    cfg.stream = p.stream;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    return cudaLaunchKernelEx(&cfg, dq_convert_tail_kernel<T, D, BM>, p);
  }
  if constexpr (C::kDqT) {
    const int64_t n = (static_cast<int64_t>(p.total_q) + 7) / 8 * p.hq * D;
    return launch(dq_convert_t_kernel<T, D>, dim3(static_cast<unsigned>((n + 255) / 256)), 256,
                  0, p);
  }
  const int64_t n = static_cast<int64_t>(p.total_q) * p.hq * (D / 8);
  return launch(dq_convert_kernel<T, D>, dim3(static_cast<unsigned>((n + 255) / 256)), 256, 0, p);
}

template <typename T, int D>
cudaError_t run_bwd_sm90(const AttnParams& p) {
  if constexpr (D == 128)
    if (sm90_bwd_q80(p)) return run_bwd_sm90_bm<T, D, 80>(p);
  return run_bwd_sm90_bm<T, D, TilesBwdSm90<D>::kBlockM>(p);
}

}  // namespace attn
}  // namespace fusedops
