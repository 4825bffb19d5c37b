// The plain parameter struct shared by the attention torch binding and the device code.
#pragma once

#include <cstdint>
#include <cuda_runtime.h>

namespace fusedops {

// Packed ("varlen") layout: q/out/dout/dq (total_q, hq, D), k/v/dk/dv (total_k, hkv, D), the
// last dimension contiguous, every row 16-byte aligned; cu_q / cu_k int32 (batch + 1).
// lse and delta are float32 (hq, total_q). Query i of a sequence sees key j when
// j <= i + (lk - lq) + right (right >= 0) and j >= i + (lk - lq) - left (left >= 0).
struct AttnParams {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  void* out = nullptr;
  const void* dout = nullptr;
  void* dq = nullptr;
  void* dk = nullptr;
  void* dv = nullptr;
  float* lse = nullptr;
  float* delta = nullptr;
  // float32 dQ in 8 x 8 tiles (dq_acc_index; the sm90 backward's 80-query steps use
  // dq_acc_index_t), zeroed; null: dQ pass
  float* dq_acc = nullptr;
  // The sm90 backward's deterministic mode (with dq_acc): int32 counters that order the dQ
  // reductions (attention_bwd_kernel_sm90.cuh), at least dq_sem_count_sm90 of them, zeroed by
  // the backward's preprocess; null: unordered reductions. dq_desc: the order (set by the
  // launcher).
  int* dq_sem = nullptr;
  bool dq_desc = false;
  bool dq_rot = false;  // the rotated order where it applies (attention_bwd_kernel_sm90.cuh)
  // The sm90 backward's overlapped dQ conversion (the default; FUSEDOPS_ATTN_SM90_BWD_CONVERT=
  // after converts after the backward instead): int32 counters of the key blocks done with each
  // (query head, query block), dq_sem's layout; in the deterministic mode dq_sem itself. The
  // conversion kernel, launched as a programmatic dependent, converts each block once its count
  // is complete. null: the conversion after.
  int* dq_done = nullptr;
  // The sm90 backward's persistent grid (with dq_done, whose element 1 is its tile counter,
  // zeroed by the preprocess): at most one CTA per SM, each taking key blocks until none is
  // left; false (FUSEDOPS_ATTN_SM90_BWD_PERSISTENT=0, the conversion after the backward, or the
  // kernels without it: the deterministic mode, 80-query steps): a CTA per key block.
  bool persist = false;
  // Measurement only (FUSEDOPS_ATTN_SM90_BWD_DET_PROBE): parts of the ordered reductions left
  // out to time them (bit 0: the dQ writer's wait for a turn; results then not ordered, and
  // wrong where a block's first turn stores), or changed (bit 1: every turn adds, onto an
  // accumulator the preprocess zeroed whole; bit 2, any sm90 backward kernel: every key step
  // takes the masked path, as if some pair were masked).
  int dq_probe = 0;
  // The sm90 backward's dK/dV stores: false, through shared memory by TMA where a warpgroup's
  // keys lie inside the sequence; true (FUSEDOPS_ATTN_SM90_BWD_EPILOGUE=regs, measurement and
  // debugging), 4-byte stores from registers everywhere.
  bool dkv_regs = false;
  // The persistent sm90 backward's TMA store of dK/dV at D=128: true, its thread waits for the
  // store to have read the K/V buffer, and releases the buffer, after issuing the next tile's
  // first products; false (FUSEDOPS_ATTN_SM90_BWD_EPILOGUE=immediate, measurement and
  // debugging), before going on.
  bool dkv_defer = true;
  // The sm90 forward's tile scheduler: two counters (next tile, CTAs done) on the launch's
  // stream, zero before the launch and left at zero by its last CTA
  // (attention_fwd_kernel_sm90.cuh); null: the static order only.
  unsigned int* tile_counter = nullptr;
  const int* cu_q = nullptr;
  const int* cu_k = nullptr;
  // Row strides (elements) of each tensor; the head stride is head_dim everywhere.
  int64_t q_row = 0, k_row = 0, v_row = 0, o_row = 0, do_row = 0, dq_row = 0, dk_row = 0,
          dv_row = 0;
  int total_q = 0, total_k = 0, hq = 1, hkv = 1, head_dim = 0, batch = 0, max_q = 0, max_k = 0;
  float scale = 1.f;
  float softcap = 0.f;  // 0 = none
  // Derived by the host: scale * log2(e); 2 log2(e) scale / softcap; softcap * log2(e).
  float scale_log2 = 0.f, cap_in_log2 = 0.f, cap_out_log2 = 0.f;
  int left = -1, right = -1;  // -1 = unlimited
  bool is_bf16 = true;
  cudaStream_t stream = nullptr;
};

// Entry points, one set per kernel family, picked by the ops' `arch` argument (attention_api.cpp):
// arch 80, the sm80 kernels (mma.sync + cp.async, attention_{fwd,bwd}_sm80.cu, also built for
// sm_90a); arch 90, the Hopper kernels (wgmma + TMA, attention_{fwd,bwd}_sm90.cu, cc 9.0 only;
// forward head dims 64, 128 and 256, backward 64 and 128; the backward reads the lse either
// forward writes). The sm90 backward's deterministic mode is p.dq_sem set (with p.dq_acc); it
// runs the sm80 backward when p.dq_acc is null or under FUSEDOPS_ATTN_SM90_BWD=sm80
// (attention_bwd_sm90_enabled). Each returns the CUDA error code of its last launch.
cudaError_t attention_fwd_sm80(AttnParams& p);
cudaError_t attention_fwd_sm90(AttnParams& p);
cudaError_t attention_bwd_sm80(AttnParams& p);
cudaError_t attention_bwd_sm90(AttnParams& p);
// False under FUSEDOPS_ATTN_SM90_BWD=sm80 (read at every call).
bool attention_bwd_sm90_enabled();
// Counters the sm90 backward's deterministic mode needs in p.dq_sem: one ticket (padded to 32)
// and one per (query head, 64-row block of the padded statistics layout).
constexpr int kDqSemPiecesSm90 = 1;  // counters per query block and head
inline int64_t dq_sem_count_sm90(int64_t total_q, int64_t hq, int64_t batch) {
  const int64_t stats_rows = (total_q + 128 * batch + 127) / 128 * 128;
  return 32 + kDqSemPiecesSm90 * hq * (stats_rows / 64);
}
// Whether the kernel of the sm80 atomic-dQ backward fits the current device's shared memory
// (Hopper: yes; Ampere: no, and the backward computes dQ in its own pass instead).
bool attention_bwd_atomic_fits_sm80(int head_dim);

}  // namespace fusedops
