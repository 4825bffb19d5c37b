// The Hopper (sm_90a) attention backward kernel: dK, dV and (by float32 reductions into the dQ
// accumulator) dQ per block of keys, wgmma for all five products, TMA loads through an mbarrier
// pipeline (FlashAttention-3's scheme, keys as wgmma's M).
//
// A tile is keys [n0, n0 + BN) of one KV head and sequence; its CTA loops over the steps of
// KeySteps (attention_bwd_kernel_sm80.cuh): the GQA group's query heads times the query blocks
// of BM rows that see those keys, so that dK and dV of the whole group accumulate in registers
// and are stored once. Grid (ceil(max_k / BN), hkv, batch), a tile per CTA -- or, persistent
// (kPersist: every kernel but the deterministic mode's and the 80-query steps', with p.persist),
// at most one CTA per SM, each running its own tile blockIdx.x first and then those a counter
// (p.dq_done[1], zeroed by the preprocess) hands out, in the same order as the hardware starts
// a grid's CTAs (key blocks fastest: CTAs running together share a head's Q and dO in L2). The
// persistent kernels have two K/V buffers: the TMA thread loads tile j's K and V into buffer
// j % 2 once the consumers have released it after tile j - 2's epilogue (its "empty" barrier,
// every consumer thread, the dK/dV store's thread after its store has read the rows, and with
// p.dq_done the counting thread of the overlapped conversion), writes the
// tile's number into the buffer's slot (a past-the-end number ends the CTA), and goes on into
// its steps. So tile j + 1's K and V load while tile j's last steps run, and the Q/dO stages run
// on across tiles (global step counts): a CTA per tile spent 8-12% of its time at L=1024 in
// this prologue (the first K/V and Q/dO loads) and its launch.
// Roles: warpgroup 0 produces -- one thread issues every load: K and V once per tile (TMA), then
// per step Q and dO (TMA tiles) and the rows' statistics (lse in log2 units and delta, 1-D bulk
// copies from the padded layout bwd_prep_kernel_sm90 writes) into one of kStages stages; a
// stage's "full" barrier counts those bytes, its "empty" barrier one arrival per consumer
// thread.
// Warpgroups 1 and 2 each own 64 keys (rows 64 w of the block) and per step:
//   S^T = K Q^T, dP^T = V dO^T      (ss: K/V and Q/dO K-major in shared memory)
//   P^T = 2^(S^T scale log2(e) - lse2), dS^T = P^T (dP^T - delta) [(1 - tanh^2) with softcap],
//     masked by index, in registers;
//   dS^T -> shared memory (bf16/fp16, the 128-byte swizzle), both warpgroups' halves;
//   dV += P^T dO, dK += dS^T Q      (rs: A from registers, dO/Q MN-major);
//   dQ_part = dS K                  (ss, both operands MN-major: dS^T and K as stored), a
//     64 x 64 piece per warpgroup (D=128: all queries x head-dim half w; D=64: query half w x
//     all columns), added to p.dq_acc (dq_acc_index layout) by red.global.add.v2.f32; with
//     80-query steps (kDqT, D=128) dQ^T = K^T dS^T instead, from dS stored queries x keys,
//     64 head-dim rows x 80 queries per warpgroup, into dq_acc_index_t's column-major tiles
//     (the comments at add_dq and attention_config_bwd_sm90.h say why).
// Schedule (kOverlap false, the default): S^T and dP^T waited for together; dV's products
// run while dS^T is stored and the two warpgroups meet at the named barrier, dK's while
// dQ_part is added to the accumulator; the other consumer warpgroup's work fills the tensor
// cores meanwhile. kOverlap (FUSEDOPS_ATTN_SM90_BWD_SCHEDULE=overlap, measured slower) also
// computes P^T while dP^T runs. dS^T alternates between two buffers: the buffer a step writes
// was last read by step - 2's dQ products, which both warpgroups finished before the named
// barrier of step - 1.
// kLag (the default at D=64; attention_launch_bwd_sm90.cuh's sm90_bwd_lagged): dQ_part of step
// i is formed in step i + 1, from the dS^T buffer both warpgroups filled a step before, so that
// no barrier joins them every step: warpgroup w arrives on "ready" (w, buffer) after writing its
// half and syncs on the other's "ready" of the step before; before refilling a buffer it syncs on
// the other's "free" (w, buffer), which that one arrives on once its dQ products have read it.
// Each barrier's next arrival comes only after the other warpgroup's sync of the last (the
// chain of the other barrier), so no phase is overtaken. The first step forms a product from a
// buffer nobody wrote and drops it (no conditional wgmma); the last is formed after the loop.
// dK is scaled by p.scale here, dQ by dq_convert_kernel (kDqT: dq_convert_t_kernel). dK and
// dV leave through the K and V buffers by TMA stores (the epilogue at the end says where).
// At the end of a tile both consumer warpgroups meet (named barrier 1) before the epilogue
// writes dK/dV into the K/V buffer (the other warpgroup's dQ products read all of K) and before
// either starts the next tile's steps (which write the dS^T buffers). The overlapped dQ
// conversion's counts (p.dq_done) are made by the TMA thread after its loads, or in a
// persistent kernel by warp 1 of the producer warpgroup per tile, off the loads' path.
// Deterministic mode (kDet, p.dq_sem set; serial schedule): each step's dQ block (BM queries of
// one query head, all D columns) is added by the contributing CTAs in one fixed order, key
// blocks ascending, (p.dq_desc) descending or (p.dq_rot, unmasked calls: dq_rotated below) in
// the rotated order, through a counter per block. The consumers do not
// add it themselves: they stage their pieces in shared memory (two buffers, dq_stage) and go on;
// warps 1 and 2 of the producer warpgroup, the dQ writers (even and odd steps), wait for the
// block's turn (relaxed polls, then fence.acq_rel.gpu), add the block to p.dq_acc (one
// tensor-map reduction, tm_dq, or on its first turn a tensor-map store; per-run bulk reductions
// for a partial last block; red.global where a sequence's rows do not start on an 8-row tile),
// wait for the additions to complete and increment the counter (red.release.gpu). The
// consumers wait only for a staging buffer that its writer has not read yet, two steps back.
// Float addition in a fixed order is bit-identical run to run. The
// contributors of a query block are the key blocks that see any of its queries, a contiguous
// range [klo / BN, (khi - 1) / BN] of Seq::keys_of (the same relation KeySteps walks from the
// keys' side), so a turn is an offset in that range and a key block that sees none of the
// block's queries neither waits nor holds a turn (causal, windows, varlen). Deadlock freedom:
// a CTA takes a ticket (an atomic counter) on entry and works on the (key block, KV head,
// sequence) that the ticket names, key blocks in adding order, so that in the linear orders
// every CTA its writer waits for holds a smaller ticket, which it took while running -- it is
// resident or done, whatever order the hardware starts CTAs in, however few fit at once; the
// running CTA with the smallest ticket waits on nobody unfinished, so it always progresses.
// (GQA: a CTA's steps run head by head; each (block, head) has its own counter and the same
// order, so the argument holds per step.) In the rotated order every wait is for an earlier
// step (no cycle), but key block 0 waits for later tickets of its own (KV head, sequence), so
// those must fit at once (the launcher's bound, dq_rotated). A counter that never reaches a
// turn (a bug, or fewer SMs left to the kernel than that bound assumes) traps after about 2^25
// polls instead of hanging. The order, and so the bits of dQ (and of dK and dV, whose steps
// it reorders), depends on the GPU's SM count through that bound: bit-identical run to run on
// one GPU model.
//
// Constraints: T is __half or __nv_bfloat16; D is 64 or 128 (TilesBwdSm90); the packed layout
// of attention_params.h with row strides that are multiples of 8 elements, rows that do not
// overlap and 16-byte aligned tensors (TMA's rules; attention_api.cpp checks the strides and
// alignment and takes the sm80 backward for overlapping rows), hq a multiple of hkv; p.delta
// holding the statistics bwd_prep_kernel_sm90 wrote (stats_rows_sm90), p.dq_acc with rows
// rounded up to a multiple of 8, zeroed by bwd_prep_kernel_sm90. Tensor maps
// (attention_launch_bwd_sm90.cuh): 3-D (D, heads, rows), boxes of 64 x 1 x BN (K, V), BM (Q,
// dO) or 64 (dK, dV: a consumer warpgroup's keys), 128-byte swizzle. A tile that crosses a
// sequence's end reads the next sequence's rows (TMA zero-fills only past the tensor's end):
// keys >= lk and queries >= lq are masked by index (P = dS = 0), their gradients never stored.
// Launch: TilesBwdSm90<D, kBM>::kThreads threads, kSmemPersist bytes of dynamic shared memory
// (the persistent kernels, with either grid), kSmemDet (the deterministic mode's) or kSmem (kBM
// = 80); p.persist only with p.dq_done (its counter). kBM = 80
// (kDqT) has no softcap path (a call with softcap traps) and runs only the lockstep serial
// schedule without the deterministic mode (static_assert). The body is
// empty (a trap) unless compiled for sm_90a.
#pragma once

#include <cuda.h>  // CUtensorMap (a type only)

#include <cstdint>

#include "../hopper_ptx.cuh"
#include "attention_bwd_kernel_sm80.cuh"  // KeySteps, next_step, red_add2
#include "attention_common.cuh"
#include "attention_config_bwd_sm90.h"

namespace fusedops {
namespace attn {

// The backward's row statistics in shared-memory-ready form: p.delta holds two float32 arrays
// (lse2 = lse log2(e), +inf where lse is -inf or past the sequence; then delta), each
// (hq, stats_rows_sm90(p)), sequence b's rows from stats_start_sm90(b) on and padded with
// (+inf, 0) up to a multiple of BM, so that every step's BM rows are one 16-byte-aligned run
// (the 1-D bulk copy's rule). The starts, floor((q_start + b BM) / BM) BM, leave every
// sequence room for its rounded-up rows; the rows per head, total_q + 128 batch rounded up to
// 128, bound them for BM <= 128.
__host__ __device__ __forceinline__ int64_t stats_rows_sm90(const AttnParams& p) {
  return (static_cast<int64_t>(p.total_q) + 128 * static_cast<int64_t>(p.batch) + 127) / 128 *
         128;
}
template <int BM>
__device__ __forceinline__ int64_t stats_start_sm90(int q_start, int b) {
  return (static_cast<int64_t>(q_start) + static_cast<int64_t>(b) * BM) / BM * BM;
}

// The deterministic mode's counters (attention_params.h: dq_sem_count_sm90): p.dq_sem[0] the
// ticket, then one per (query head, BM-row block of the stats layout).
template <int BM>
__device__ __forceinline__ int64_t dq_sem_index_sm90(const AttnParams& p, int q_start, int b,
                                                     int h, int m, int piece) {
  const int64_t tiles = stats_rows_sm90(p) / BM;
  const int64_t t = stats_start_sm90<BM>(q_start, b) / BM + m / BM;
  return 32 + (static_cast<int64_t>(h) * tiles + t) * kDqSemPiecesSm90 + piece;
}

// The deterministic mode's rotated order (p.dq_rot, set by the launcher only where no mask
// limits the keys -- no causality, no window -- so that every key block of a sequence adds into
// every query block of it): with nkb key blocks and n_it steps per CTA (n_it >= nkb), key block
// nb runs its flat steps t (query head, then query block) from t = (n_it - nb) % n_it on,
// cyclically, so step j is t = (j - nb) mod n_it, and a block's contributors take their turns
// in the order of the step at which they reach it. Key block nb's step j then waits for key
// block nb - 1's step j - 1 (or, for the first key block, for an earlier step of the last):
// CTAs that start together never wait on a chain. Waits go to larger tickets too, so every key
// block of a (KV head, sequence) must be able to be resident at once: the launcher sets
// p.dq_rot only for grids of at most half as many key blocks as the GPU has SMs.
template <int BN>
__device__ __forceinline__ bool dq_rotated(const AttnParams& p, int lk, int n_it) {
  return p.dq_rot && (lk + BN - 1) / BN <= n_it;
}
// Key block nb's turn in flat step t of the rotated order.
__device__ __forceinline__ int dq_rot_turn(int nb, int nkb, int n_it, int t) {
  const int lead = n_it - t;  // key blocks nb >= lead reach t first (their steps wrapped)
  return nb >= lead ? nb - lead : nb + max(0, nkb - lead);
}

__device__ __forceinline__ int ld_relaxed_gpu(const int* ptr) {
  int v;
  asm volatile("ld.relaxed.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(ptr) : "memory");
  return v;
}
__device__ __forceinline__ void red_release_gpu_add(int* ptr, int v) {
  asm volatile("red.release.gpu.global.add.s32 [%0], %1;\n" ::"l"(ptr), "r"(v) : "memory");
}
__device__ __forceinline__ int ld_acquire_gpu(const int* ptr) {
  int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(ptr) : "memory");
  return v;
}
__device__ __forceinline__ void red_relaxed_gpu_add(int* ptr, int v) {
  asm volatile("red.relaxed.gpu.global.add.s32 [%0], %1;\n" ::"l"(ptr), "r"(v) : "memory");
}
__device__ __forceinline__ void fence_acq_rel_gpu() {
  asm volatile("fence.acq_rel.gpu;\n" ::: "memory");
}
// Orders this thread's generic-proxy and async-proxy (bulk copy) accesses of global memory.
__device__ __forceinline__ void fence_proxy_async_global() {
  asm volatile("fence.proxy.async.global;\n" ::: "memory");
}
// dst[0, bytes / 4) += the floats at shared-memory address src, by the copy engine (a bulk group
// of this thread; bytes a multiple of 16, both addresses 16-byte aligned).
__device__ __forceinline__ void bulk_reduce_add_f32(float* dst, uint32_t src, uint32_t bytes) {
  asm volatile(
      "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(dst),
      "r"(src), "r"(bytes)
      : "memory");
}
// red_add2 (dst[0] += a, dst[1] += b) where `pred` (and red_add1_if: dst[0] += a), as a
// predicated instruction.
__device__ __forceinline__ void red_add2_if(bool pred, float* dst, float a, float b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %0, 0;\n@p red.global.add.v2.f32 [%1], {%2, %3};\n}\n" ::"r"(
          static_cast<int>(pred)),
      "l"(dst), "f"(a), "f"(b)
      : "memory");
}
__device__ __forceinline__ void red_add1_if(bool pred, float* dst, float a) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %0, 0;\n@p red.global.add.f32 [%1], %2;\n}\n" ::"r"(
                   static_cast<int>(pred)),
               "l"(dst), "f"(a)
               : "memory");
}
__device__ __forceinline__ void red_add4(float* dst, float4 v) {
  asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"l"(dst), "f"(v.x), "f"(v.y),
               "f"(v.z), "f"(v.w)
               : "memory");
}

// Preprocess: the statistics above, delta = rowsum(dO * O), and the dQ accumulator set to zero
// (no memset of its own). Each (padded row, head, sequence) has D / 8 adjacent threads of 8
// columns each, so that a warp's loads of O and dO are whole rows of D contiguous elements:
// delta sums a thread's 8 products in order, then over the row's threads by shuffles (a fixed
// tree: the same bits every run); the row's first thread writes the statistics; each thread
// zeroes 8 floats of the accumulator, one 32-byte run: its row's 8 columns (dq_acc_index), or
// with BM = 80 (dq_acc_index_t's column-major tiles) one column of its 8-row tile group. Only
// rows of [0, lq) are zeroed (with BM = 80, their groups' rows, up to the tensor's rows rounded
// to 8): they are all that bwd_kernel_sm90 adds to and the conversions read, since the
// sequences cover the packed rows. In the deterministic mode the first
// contributor of a whole query block (m + BM <= lq) of a sequence whose rows start on an 8-row
// tile stores the block instead of adding it (bwd_kernel_sm90's dQ writers), so its rows are
// not zeroed (unless p.dq_probe bit 1, measurement: every turn adds). Grid
// (ceil(round_up(max_q, BM) / kPrepRowsSm90<D>), hq, batch), 256 threads, no shared memory; any
// architecture.
template <int D>
constexpr int kPrepRowsSm90 = 256 / (D / 8);  // rows per CTA of the preprocess
template <typename T, int D, int BM>
__global__ void __launch_bounds__(256) bwd_prep_kernel_sm90(const AttnParams p) {
  constexpr int kLanes = D / 8;  // threads per row, a power of two dividing 32
  const int b = blockIdx.z, h = blockIdx.y, c = threadIdx.x % kLanes;
  const int i = blockIdx.x * kPrepRowsSm90<D> + threadIdx.x / kLanes;
  // The deterministic mode's counters start at 0: the ticket, and those of each query block
  // (the blocks of [0, lq) are all that bwd_kernel_sm90 touches).
  if (p.dq_sem != nullptr && (blockIdx.x | h | b | threadIdx.x) == 0) p.dq_sem[0] = 0;
  // ... and the persistent grid's tile counter.
  if (p.persist && (blockIdx.x | h | b | threadIdx.x) == 0) p.dq_done[1] = 0;
  const Seq sq(p, b);
  if (i >= (sq.lq + BM - 1) / BM * BM) return;  // all the row's threads alike
  if (p.dq_sem != nullptr && i % BM == 0 && c == 0) {
    const int64_t at = dq_sem_index_sm90<BM>(p, sq.q_start, b, h, i, 0);
    for (int piece = 0; piece < kDqSemPiecesSm90; ++piece) p.dq_sem[at + piece] = 0;
  }
  if (p.dq_done != nullptr && p.dq_done != p.dq_sem && i % BM == 0 && c == 0)
    p.dq_done[dq_sem_index_sm90<BM>(p, sq.q_start, b, h, i, 0)] = 0;
  float acc = 0.f;
  const int64_t row = sq.q_start + i;
  if (i < sq.lq) {
    acc = dot8(0.f, static_cast<const T*>(p.out) + row * p.o_row + h * D + 8 * c,
               static_cast<const T*>(p.dout) + row * p.do_row + h * D + 8 * c);
    if constexpr (TilesBwdSm90<D, BM>::kDqT) {
      // The column-major tiles (no deterministic mode here: every block is added): the thread
      // zeroes column 8 c + row % 8 of its tile group, the 8 rows' 32 contiguous bytes, so a
      // warp's stores are whole sectors (zeroing its row's 8 columns took 8 strided stores).
      // The group's rows' threads, of this sequence or its neighbours, cover the group's 8
      // columns of each tile; the tensor's last row also covers the columns of the rows past
      // it (up to a multiple of 8). Columns hold rows of neighbouring sequences too: zeroes,
      // all before the backward adds.
      const int r0 = static_cast<int>(row & 7), r1 = row == p.total_q - 1 ? 7 : r0;
      float4* z =
          reinterpret_cast<float4*>(p.dq_acc + dq_acc_tile<D>(row, h, 8 * c, p.hq) + 8 * r0);
      for (int r = r0; r <= r1; ++r, z += 2) z[0] = z[1] = make_float4(0.f, 0.f, 0.f, 0.f);
    } else {
      const int m0 = i / BM * BM;
      bool zero = true;
      if (p.dq_sem != nullptr && !(p.dq_probe & 2) && sq.q_start % 8 == 0 && m0 + BM <= sq.lq) {
        int klo, khi;
        sq.keys_of(m0, m0 + BM, p, klo, khi);
        zero = klo >= khi;  // no contributor: nobody stores the block
      }
      if (zero) {
        float4* const z =
            reinterpret_cast<float4*>(p.dq_acc + dq_acc_index<D>(row, h, 8 * c, p.hq));
        z[0] = z[1] = make_float4(0.f, 0.f, 0.f, 0.f);
      }
    }
  }
  const int lane = threadIdx.x % 32;
  const unsigned mask = ((1u << kLanes) - 1u) << (lane / kLanes * kLanes);  // the row's lanes
#pragma unroll
  for (int s = kLanes / 2; s > 0; s /= 2) acc += __shfl_xor_sync(mask, acc, s);
  if (c != 0) return;
  float lse2 = INFINITY;
  if (i < sq.lq) {
    const float l = p.lse[static_cast<int64_t>(h) * p.total_q + row];
    lse2 = l == -INFINITY ? INFINITY : l * kLog2e;
  }
  const int64_t rows = stats_rows_sm90(p);
  const int64_t at = static_cast<int64_t>(h) * rows + stats_start_sm90<BM>(sq.q_start, b) + i;
  p.delta[at] = lse2;
  p.delta[static_cast<int64_t>(p.hq) * rows + at] = acc;
}

// The overlapped dQ conversion (p.dq_done): one CTA per (BM-row query block, query head,
// sequence), launched as a programmatic dependent of bwd_kernel_sm90, so that it runs on the
// SMs the backward's last CTAs leave idle. Thread 0 waits until the block's count reaches its
// contributors (the key blocks that see any of its queries, as the deterministic mode's turns
// count them; acquire), then the CTA scales its rows of dq_acc (dq_acc_index's tiles, read past
// L1) into dQ (dq_acc_index_t's column-major tiles with 80-query steps). The grid's last CTA
// waits for the backward to complete, so that the grid never completes before it. Grid
// (ceil(max_q / BM), hq, batch), 256 threads; sm_90 (griddepcontrol).
template <typename T, int D, int BM>
__global__ void __launch_bounds__(256) dq_convert_tail_kernel(const AttnParams p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr int BN = TilesBwdSm90<D, BM>::kBlockN;
  constexpr bool kT = TilesBwdSm90<D, BM>::kDqT;
  const int b = blockIdx.z, h = blockIdx.y, m = blockIdx.x * BM;
  const Seq sq(p, b);
  if (m < sq.lq) {
    if (threadIdx.x == 0) {
      int klo, khi;
      sq.keys_of(m, min(m + BM, sq.lq), p, klo, khi);
      const int need = khi > klo ? (khi - 1) / BN - klo / BN + 1 : 0;
      const int* cnt = p.dq_done + dq_sem_index_sm90<BM>(p, sq.q_start, b, h, m, 0);
      for (uint32_t polls = 0; ld_acquire_gpu(cnt) < need; ++polls) {
        if (polls == (1u << 26)) __trap();  // a count that never completes: an error, not a hang
        __nanosleep(256);
      }
    }
    __syncthreads();
    const int rows = min(BM, sq.lq - m);
    if constexpr (kT) {
      // Column-major tiles: a thread takes one column of a tile group (its 8 rows, 32
      // contiguous bytes; a warp's 1 KiB) and writes its rows inside the block, a warp's 32
      // columns of a row 64 contiguous bytes (a row's 8 columns lie 8 floats apart: read row
      // by row, each sector was fetched by four warps).
      const int64_t r_lo = sq.q_start + m, r_hi = r_lo + rows;
      const int64_t g0 = r_lo / 8;
      const int n = static_cast<int>((r_hi - 1) / 8 - g0 + 1) * D;  // columns of the groups
      for (int j = threadIdx.x; j < n; j += 256) {
        const int64_t g = g0 + j / D;
        const int col = j % D;
        const float4* src =
            reinterpret_cast<const float4*>(p.dq_acc + dq_acc_tile<D>(8 * g, h, col, p.hq) +
                                            8 * (col & 7));
        const float4 x = __ldcg(src), y = __ldcg(src + 1);
        const float v[8] = {x.x, x.y, x.z, x.w, y.x, y.y, y.z, y.w};
        T* const dst = static_cast<T*>(p.dq) + 8 * g * p.dq_row + h * D + col;
#pragma unroll
        for (int r = 0; r < 8; ++r)
          if (8 * g + r >= r_lo && 8 * g + r < r_hi)
            dst[r * p.dq_row] = from_float<T>(v[r] * p.scale);
      }
    } else {
      for (int j = threadIdx.x; j < rows * (D / 8); j += 256) {
        const int64_t row = sq.q_start + m + j / (D / 8);
        const int c = 8 * (j % (D / 8));
        const float4* src =
            reinterpret_cast<const float4*>(p.dq_acc + dq_acc_index<D>(row, h, c, p.hq));
        const float4 x = __ldcg(src), y = __ldcg(src + 1);
        uint4 out;
        out.x = pack2<T>(x.x * p.scale, x.y * p.scale);
        out.y = pack2<T>(x.z * p.scale, x.w * p.scale);
        out.z = pack2<T>(y.x * p.scale, y.y * p.scale);
        out.w = pack2<T>(y.z * p.scale, y.w * p.scale);
        *reinterpret_cast<uint4*>(static_cast<T*>(p.dq) + row * p.dq_row + h * D + c) = out;
      }
    }
  }
  if (blockIdx.x == gridDim.x - 1 && blockIdx.y == gridDim.y - 1 && blockIdx.z == gridDim.z - 1)
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// dQ = scale * the float32 accumulator in dq_acc_index_t's column-major tiles: one thread per
// column of a tile (its 8 rows, 32 contiguous bytes), the 8 threads of a tile writing 8
// consecutive columns of each row (16 bytes; a warp's four tiles, 64 contiguous bytes of a
// row). Grid ceil(ceil(total_q / 8) hq D / 256) x 256 threads; any architecture.
template <typename T, int D>
__global__ void __launch_bounds__(256) dq_convert_t_kernel(const AttnParams p) {
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * 256 + threadIdx.x;
  const int64_t per_run = static_cast<int64_t>(p.hq) * D;  // columns of 8 rows (all heads)
  if (idx >= (p.total_q + 7) / 8 * per_run) return;
  const int64_t run = idx / per_run;
  const int64_t col = idx % per_run;  // h D + c; tile idx / 8, column idx % 8 of it
  const float4* src = reinterpret_cast<const float4*>(p.dq_acc + (idx / 8) * 64 + (idx % 8) * 8);
  const float4 x = src[0], y = src[1];
  const float v[8] = {x.x, x.y, x.z, x.w, y.x, y.y, y.z, y.w};
  T* const dst = static_cast<T*>(p.dq) + 8 * run * p.dq_row + col;
#pragma unroll
  for (int r = 0; r < 8; ++r)
    if (8 * run + r < p.total_q) dst[r * p.dq_row] = from_float<T>(v[r] * p.scale);
}

// A 1-D bulk copy of `bytes` (a multiple of 16; both addresses 16-byte aligned) from global
// memory into shared memory at `dst`, completing `bytes` of the transaction count on `bar`.
__device__ __forceinline__ void bulk_load_1d(uint32_t dst, const void* src, uint32_t bytes,
                                             uint32_t bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
      ::"r"(dst), "l"(reinterpret_cast<uint64_t>(src)), "r"(bytes), "r"(bar)
      : "memory");
}

// wgmma m64n64k16, float32 accumulators, A and B both MN-major in shared memory
// (imm-trans-a = imm-trans-b = 1): D (+)= A B with A (64 x 16) stored as 16 K-rows of 64
// M-elements and B (16 x 64) as 16 K-rows of 64 N-elements, each a 128-byte-swizzled column
// block (the layout of hopper_ptx.cuh's MN-major operand). Accumulator layout as Wgmma.
template <typename T>
struct WgmmaTT;
#define FUSEDOPS_WGMMA_TT(T, PTX_T)                                                           \
  template <>                                                                                 \
  struct WgmmaTT<T> {                                                                         \
    static __device__ __forceinline__ void ss(float (&d)[8][4], uint64_t a_desc,               \
                                              uint64_t b_desc, int scale_d) {                 \
      asm volatile(                                                                           \
          "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"                                        \
          "wgmma.mma_async.sync.aligned.m64n64k16.f32." PTX_T "." PTX_T " {"                  \
          "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"                            \
          "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, "                \
          "%32, %33, p, 1, 1, 1, 1;\n}\n"                                                     \
          : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]),        \
            "+f"(d[1][1]), "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]),        \
            "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]),        \
            "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]),        \
            "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]),        \
            "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]),        \
            "+f"(d[7][2]), "+f"(d[7][3])                                                      \
          : "l"(a_desc), "l"(b_desc), "r"(scale_d));                                          \
    }                                                                                         \
  };
FUSEDOPS_WGMMA_TT(__nv_bfloat16, "bf16")
FUSEDOPS_WGMMA_TT(__half, "f16")
#undef FUSEDOPS_WGMMA_TT

template <typename T, int D, bool kOverlap, bool kDet = false, bool kLag = false,
          int kBM = TilesBwdSm90<D>::kBlockM>
__global__ void __launch_bounds__(TilesBwdSm90<D, kBM>::kThreads, 1)
    bwd_kernel_sm90(const AttnParams p, const __grid_constant__ CUtensorMap tm_q,
                    const __grid_constant__ CUtensorMap tm_k,
                    const __grid_constant__ CUtensorMap tm_v,
                    const __grid_constant__ CUtensorMap tm_do,
                    const __grid_constant__ CUtensorMap tm_dq,
                    const __grid_constant__ CUtensorMap tm_dk,
                    const __grid_constant__ CUtensorMap tm_dv) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using namespace fusedops::sm90;
  using C = TilesBwdSm90<D, kBM>;
  constexpr int BM = C::kBlockM, BN = C::kBlockN, S = C::kStages;
  constexpr int kBlocks = D / 64;  // 64-element (128-byte) column blocks of a Q/K/V/dO row
  static_assert(!kLag || (!kOverlap && !kDet), "the lagged dQ is a form of the serial schedule");
  // The transposed dQ (80-query steps) in the lockstep serial schedule only.
  constexpr bool kDqT = C::kDqT;
  static_assert(!kDqT || (!kOverlap && !kDet && !kLag), "kDqT: the lockstep serial schedule");
  // Persistent (the top says how): every kernel but the deterministic mode's (its tickets order
  // the CTAs; at D=128 its dQ staging also takes the room) and kDqT's (no room for a second K/V
  // buffer).
  constexpr bool kPersist = !kDet && C::kPersistFits;
  // dQ's accumulator per consumer thread: m64n64 (dQ = dS K) or m64nBM (kDqT: dQ^T = K^T dS^T).
  constexpr int kDqN8 = kDqT ? BM / 8 : 8;
  // kLag's named barriers (256 threads: 128 arrive, the other warpgroup's 128 sync), per
  // consumer warpgroup w and dS^T buffer b: "ready" (w's half of buffer b written) and "free"
  // (w's dQ products have read buffer b).
  constexpr int kBarReady = 4, kBarFree = 8;
  // The overlapped dQ conversion may start once every CTA of this grid runs (or has ended).
  if (p.dq_done != nullptr && threadIdx.x == 0)
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  const uint32_t raw_u32 = sm90::smem_u32(smem_raw);
  const uint32_t base = (raw_u32 + 1023u) & ~1023u;
  const uint32_t sK = base + C::kKOff, sV = base + C::kVOff, sQ = base + C::kQOff;
  const uint32_t sDo = base + C::kDoOff, sDs = base + C::kDsOff;
  float* const stats = reinterpret_cast<float*>(smem_raw + (base - raw_u32) + C::kStatsOff);
  const uint32_t bars = base + C::kBarOff;
  // K/V buffer kb's full and (kPersist) empty barriers.
  auto bar_kv = [&](int kb) { return kb == 0 ? bars : bars + 8u * (5 + 2 * S); };
  auto bar_kv_empty = [&](int kb) { return bars + 8u * (6 + 2 * S + kb); };
  auto bar_full = [&](int s) { return bars + 8u * (1 + s); };
  auto bar_empty = [&](int s) { return bars + 8u * (1 + S + s); };
  // kDet: dQ staging buffer f full (the consumers' pieces written), empty (the writer has read it).
  auto bar_dq_full = [&](int f) { return bars + 8u * (1 + 2 * S + f); };
  auto bar_dq_empty = [&](int f) { return bars + 8u * (3 + 2 * S + f); };
  // ... and its address: a BM x D float32 block, 8-row runs of 32 D bytes (dq_acc_index's tile
  // order, so that each run is contiguous in dq_acc too).
  auto dq_stage = [&](int f) {
    return C::kDqInDs ? sDs + f * C::kDsBytes : base + C::kDqOff + f * C::kDqBytes;
  };
  // Stage s's lse2 (BM floats) and delta (BM floats).
  auto stats_lse = [&](int s) { return stats + s * 2 * BM; };
  auto stats_delta = [&](int s) { return stats + s * 2 * BM + BM; };

  // The CTA's tiles: a tile is a key block of one KV head and sequence, numbered t = nb + nkb
  // (hk + hkv b) (nkb key blocks per head). kDet: the one its ticket names, the key blocks of a
  // (KV head, sequence) in adding order (see the top). kPersist: the tiles the TMA thread takes
  // (the top), each in the slot of its K/V buffer kb. Otherwise the CTA's own, from blockIdx.
  // The tile is read from shared memory at each use, so that it holds no register across the
  // main loop (at D=64 the three indices held in registers spilled).
  int* const slots = reinterpret_cast<int*>(smem_raw + (base - raw_u32) + C::kTicketOff);
  if constexpr (kDet) {
    if (threadIdx.x == 0) *reinterpret_cast<volatile int*>(slots) = atomicAdd(p.dq_sem, 1);
    __syncthreads();
  }
  int kb = 0;  // the K/V buffer (and tile slot) of this thread's current tile
  // The tile of this CTA's block in a grid of a CTA per tile.
  auto block_tile = [&]() -> int {
    return blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  };
  auto tile_t = [&]() -> int {
    if constexpr (!kDet && !kPersist) return block_tile();
    return reinterpret_cast<volatile int*>(slots)[kb];
  };
  // Key blocks per head and KV heads (the grid's x and y where a CTA has one tile).
  auto nkb = [&]() -> int { return kPersist ? (p.max_k + BN - 1) / BN : gridDim.x; };
  auto nhk = [&]() -> int { return kPersist ? p.hkv : gridDim.y; };
  // The number of tiles (a past-the-end tile number ends a persistent CTA), recomputed at each
  // use from the parameters rather than held in a register.
  auto n_tiles_all = [&]() -> int { return nkb() * nhk() * p.batch; };
  auto cta_nb = [&]() -> int {
    const int nb = tile_t() % nkb();
    if constexpr (kDet) return p.dq_desc ? nkb() - 1 - nb : nb;
    return nb;
  };
  auto cta_hk = [&]() -> int { return tile_t() / nkb() % nhk(); };
  auto cta_b = [&]() -> int { return tile_t() / nkb() / nhk(); };
  // The current tile's indices, sequence and steps.
  int hk = 0, b = 0, n0 = 0, group = 0, t_lo = 0, n_tiles = 0, n_it = 0;
  Seq sq;
  auto set_tile = [&]() {
    hk = cta_hk(), b = cta_b(), n0 = cta_nb() * BN;
    sq = Seq(p, b);
    const KeySteps<BM, BN> ks(p, sq, n0);
    group = ks.group, t_lo = ks.t_lo, n_tiles = ks.n_tiles, n_it = ks.n_it;
  };
  // The overlapped conversion's counts of the current tile's steps: each (query head, query
  // block) once.
  auto count_done = [&]() {
    const int t = tile_t(), b_t = cta_b(), hk_t = cta_hk();
    const Seq sq_t(p, b_t);
    const KeySteps<BM, BN> ks(p, sq_t, (t % nkb()) * BN);
    const int64_t tiles = stats_rows_sm90(p) / BM;  // counters per query head
    int* cnt =
        p.dq_done + dq_sem_index_sm90<BM>(p, sq_t.q_start, b_t, hk_t * ks.group, ks.t_lo * BM, 0);
    static_assert(kDqSemPiecesSm90 == 1, "one counter per (query block, head)");
    for (int g = 0; g < ks.group; ++g, cnt += tiles)
      for (int i = 0; i < ks.n_tiles; ++i) red_relaxed_gpu_add(cnt + i, 1);
  };
  if constexpr (!kPersist) {
    set_tile();
    if (n0 >= sq.lk) return;  // uniform over the CTA, before any barrier is initialised
  }
  // The first step's query head and block (kDet's rotated order starts key block nb at flat
  // step (n_it - nb) % n_it) and the next step's, cyclically over the group's heads.
  auto first_step = [&](int& h, int& m) {
    h = hk * group, m = t_lo * BM;
    if constexpr (kDet) {
      const int nb = cta_nb();
      if (nb > 0 && dq_rotated<BN>(p, sq.lk, n_it)) {
        const int t0 = n_it - nb;
        h += t0 / n_tiles;
        m += (t0 % n_tiles) * BM;
      }
    }
  };
  auto step_on = [&](int& h, int& m) {
    next_step<BM>(h, m, t_lo, n_tiles);
    if constexpr (kDet) {
      const int h0 = cta_hk() * group;
      if (h == h0 + group) h = h0;
    }
  };

  if (threadIdx.x == 0) {
    sm90::mbar_init(bar_kv(0), 1);
    if constexpr (kPersist) {
      sm90::mbar_init(bar_kv(1), 1);  // the TMA thread
      // Every consumer thread, and the counting thread (below) where it runs.
      for (int k = 0; k < 2; ++k)
        sm90::mbar_init(bar_kv_empty(k),
                        128 * C::kConsumerWarpgroups + (p.dq_done != nullptr ? 1 : 0));
    }
    for (int s = 0; s < S; ++s) {
      sm90::mbar_init(bar_full(s), 1);                            // the TMA thread
      sm90::mbar_init(bar_empty(s), 128 * C::kConsumerWarpgroups);  // every consumer thread
    }
    if constexpr (kDet) {
      for (int f = 0; f < 2; ++f) {
        sm90::mbar_init(bar_dq_full(f), 128 * C::kConsumerWarpgroups);
        sm90::mbar_init(bar_dq_empty(f), 1);  // the writer warp's lane 0
      }
    } else if (p.dq_done != nullptr) {
      // The dQ additions of a tile done (kPersist: of tiles j with j % 2 == f).
      for (int f = 0; f < (kPersist ? 2 : 1); ++f)
        sm90::mbar_init(bar_dq_full(f), 128 * C::kConsumerWarpgroups);
    }
    mbar_init_fence();
  }
  __syncthreads();

  const int wg = threadIdx.x / 128;
  const int lane = threadIdx.x & 31;
  if (wg == 0) {
    // ---- producer ----
    setmaxnreg_dec<kDet       ? C::kProducerRegsDet
                   : kPersist ? C::kProducerRegsPersist
                              : C::kProducerRegs>();
    const int warp = threadIdx.x / 32;
    // One tile's loads from global step gs on: K and V into buffer kb, then per step Q, dO and
    // the statistics into stage (gs + it) % S.
    auto load_tile = [&](int gs) {
      mbar_arrive_expect_tx(bar_kv(kb), 2 * C::kKvBytes);
      const uint32_t kv = kb * C::kKvDelta;
#pragma unroll
      for (int c = 0; c < kBlocks; ++c)
        tma_load_3d(sK + kv + c * BN * 128, &tm_k, bar_kv(kb), 64 * c, hk, sq.k_start + n0);
#pragma unroll
      for (int c = 0; c < kBlocks; ++c)
        tma_load_3d(sV + kv + c * BN * 128, &tm_v, bar_kv(kb), 64 * c, hk, sq.k_start + n0);
      const float* lse2_g = p.delta + stats_start_sm90<BM>(sq.q_start, b);
      int h, m;
      first_step(h, m);
      const int g_end = gs + n_it;
#pragma unroll 1
      for (int g = gs; g < g_end; ++g) {  // global steps
        const int s = g % S;
        sm90::mbar_wait(bar_empty(s), ((g / S) & 1) ^ 1);
        mbar_arrive_expect_tx(bar_full(s), 2 * C::kQBytes + 2 * BM * 4);
        const int row = sq.q_start + m;
#pragma unroll
        for (int c = 0; c < kBlocks; ++c)
          tma_load_3d(sQ + s * C::kQBytes + c * BM * 128, &tm_q, bar_full(s), 64 * c, h, row);
#pragma unroll
        for (int c = 0; c < kBlocks; ++c)
          tma_load_3d(sDo + s * C::kQBytes + c * BM * 128, &tm_do, bar_full(s), 64 * c, h, row);
        // (the sizes from the parameters at each step: the TMA thread has 24 registers)
        const uint32_t dst = base + C::kStatsOff + s * 2 * BM * 4;
        if constexpr (kPersist) {  // the row count in 32 bits (< 2^31, the statistics' size)
          const int rows = static_cast<int>(stats_rows_sm90(p));
          const float* src = lse2_g + static_cast<int64_t>(h) * rows + m;
          bulk_load_1d(dst, src, BM * 4, bar_full(s));
          bulk_load_1d(dst + BM * 4, src + static_cast<int64_t>(p.hq) * rows, BM * 4, bar_full(s));
        } else {  // (in 32 bits the 80-query kernel's code came out 2% slower)
          const float* src = lse2_g + h * stats_rows_sm90(p) + m;
          bulk_load_1d(dst, src, BM * 4, bar_full(s));
          bulk_load_1d(dst + BM * 4, src + p.hq * stats_rows_sm90(p), BM * 4, bar_full(s));
        }
        step_on(h, m);
      }
      return g_end;
    };
    auto prefetch_descs = [&] {
      tma_prefetch_desc(&tm_q);
      tma_prefetch_desc(&tm_k);
      tma_prefetch_desc(&tm_v);
      tma_prefetch_desc(&tm_do);
      tma_prefetch_desc(&tm_dk);  // the consumers' stores at the end
      tma_prefetch_desc(&tm_dv);
    };
    if (kPersist && warp == 0 && lane == 0) {
      // The tiles: the CTA's own first (p.persist: blockIdx.x of a grid of at most one CTA per
      // SM, then those p.dq_done[1] hands out; otherwise only its own). A tile goes to K/V buffer
      // j % 2 (j counts the CTA's tiles) once the consumers are done with tile j - 2 there; its
      // number goes into the buffer's slot, where the consumers read it after the buffer's full
      // barrier (a past-the-end number ends them). Tiles of keys past their sequence's end are
      // passed over. Tile j + 1's K and V so load while tile j's last steps run.
      prefetch_descs();
      auto next_tile = [&]() -> int {
        if (!p.persist) return n_tiles_all();
        unsigned ctas;  // read here, not held across the tile (the TMA thread has 24 registers)
        asm volatile("mov.u32 %0, %%nctaid.x;\n" : "=r"(ctas));
        return static_cast<int>(ctas) + atomicAdd(p.dq_done + 1, 1);
      };
      // Whether tile t has keys (its key block starts inside its sequence).
      auto has_keys = [&](int t) {
        const int b_t = t / nkb() / nhk();
        return (t % nkb()) * BN < p.cu_k[b_t + 1] - p.cu_k[b_t];
      };
      int t = p.persist ? static_cast<int>(blockIdx.x) : block_tile();
      int gs = 0;  // the steps of the earlier tiles: the Q/dO stages run on across tiles
      for (int j = 0;; ++j) {
        kb = j & 1;
        sm90::mbar_wait(bar_kv_empty(kb), ((j >> 1) & 1) ^ 1);
        while (t < n_tiles_all() && !has_keys(t)) t = next_tile();
        reinterpret_cast<volatile int*>(slots)[kb] = t;
        if (t >= n_tiles_all()) {
          mbar_arrive(bar_kv(kb));
          break;
        }
        set_tile();  // (on every path to the loads: nothing of the tile lives across tiles)
        gs = load_tile(gs);
        t = next_tile();
      }
    } else if (kPersist && p.dq_done != nullptr && warp == 1 && lane == 0) {
      // The overlapped conversion's counts, off the TMA thread's and the consumers' paths: per
      // tile j, once it is published (the buffer's full barrier, which cannot run ahead: tile
      // j + 2 needs this thread's arrival on the buffer's empty barrier) and every consumer
      // thread's dQ additions of it are issued (their arrivals on dQ-full barrier j % 2
      // release them, this wait acquires them at CTA scope), the fence makes them visible at
      // GPU scope before each step's block is counted once; then the tile's slot is free.
      for (int j = 0;; ++j) {
        kb = j & 1;
        sm90::mbar_wait(bar_kv(kb), (j >> 1) & 1);
        if (tile_t() >= n_tiles_all()) break;
        sm90::mbar_wait(bar_dq_full(kb), (j >> 1) & 1);
        fence_acq_rel_gpu();
        count_done();  // (the slot holds the tile until this thread's arrival below)
        mbar_arrive(bar_kv_empty(kb));
      }
    } else if (!kPersist && warp == 0 && lane == 0 && n_it > 0) {
      prefetch_descs();
      load_tile(0);
      if constexpr (!kDet) {
        if (p.dq_done != nullptr) {
          // The overlapped conversion's counts: once every consumer thread's dQ additions are
          // issued (their arrivals release them, this wait acquires them at CTA scope), the
          // fence makes them visible at GPU scope before each step's block is counted once.
          sm90::mbar_wait(bar_dq_full(0), 0);
          fence_acq_rel_gpu();
          count_done();
        }
      }
    } else if (kDet && (warp == 1 || warp == 2) && n_it > 0) {
      // ---- kDet: the dQ writers ----
      // Warp 1 takes the even steps (staging buffer 0), warp 2 the odd ones (buffer 1), so that
      // one step's wait for its turn and its additions' round trip overlap the next step's.
      // Per step of its own, once the consumers have staged its dQ block: wait for the block's turn
      // (lane 0 polls the counter with relaxed loads, the fence after it is the acquire), add
      // the block to dq_acc, and once the additions are performed pass the turn on (release).
      // Sequences whose rows start on an 8-row tile of dq_acc add a whole block (m + BM <= lq)
      // with one tensor-map reduction (tm_dq: its BM / 8 runs of 8 rows x D, the staging
      // layout) -- or, its first turn, store it (the preprocess left those rows unzeroed) --
      // and a sequence's partial last block by one bulk reduction per 8-row run (2 or 4 KiB,
      // contiguous there); sequences that start inside a tile red.global.add.v4 from every
      // lane. Runs (rows) past the sequence's end are not added; the rows >= lq inside the
      // last run hold exact zeros (P = dS = 0 there), and the next sequence, which starts
      // inside that tile, only adds (from zeros): the order does not matter (x + 0 = x).
      const bool bulk = sq.q_start % 8 == 0;
      if (bulk && lane == 0) tma_prefetch_desc(&tm_dq);
      const int f = warp - 1;
      const uint32_t src = dq_stage(f);
      const bool rotated = dq_rotated<BN>(p, sq.lk, n_it);
      int h, m;
      first_step(h, m);
      for (int it = 0; it < n_it; step_on(h, m), ++it) {
        if ((it & 1) != f) continue;
        int klo, khi;
        sq.keys_of(m, min(m + BM, sq.lq), p, klo, khi);
        const int nb = cta_nb();
        const int turn =
            rotated ? dq_rot_turn(nb, (sq.lk + BN - 1) / BN, n_it,
                                  (h - cta_hk() * group) * n_tiles + m / BM - t_lo)
            : p.dq_desc ? (khi - 1) / BN - nb
                        : nb - klo / BN;
        int* const sem = p.dq_sem + dq_sem_index_sm90<BM>(p, sq.q_start, b, h, m, 0);
        const int rows = min(BM, sq.lq - m);
        sm90::mbar_wait(bar_dq_full(f), (it >> 1) & 1);
        if (lane == 0 && !(p.dq_probe & 1)) {
          for (uint32_t polls = 0; ld_relaxed_gpu(sem) != turn; ++polls)
            if (polls == (1u << 25)) __trap();  // a turn that never comes: an error, not a hang
          fence_acq_rel_gpu();
        }
        __syncwarp();
        if (bulk) {
          if (lane == 0) {
            fence_proxy_async_global();  // the acquire, before the copy engine's additions
            if (rows == BM) {
              if (turn == 0 && !(p.dq_probe & 2))
                tma_store_4d(&tm_dq, src, 0, 0, h, (sq.q_start + m) / 8);
              else
                tma_reduce_add_4d(&tm_dq, src, 0, 0, h, (sq.q_start + m) / 8);
            } else {
              float* const dst = p.dq_acc + dq_acc_index<D>(sq.q_start + m, h, 0, p.hq);
              for (int rt = 0; 8 * rt < rows; ++rt)
                bulk_reduce_add_f32(dst + static_cast<int64_t>(rt) * p.hq * D * 8,
                                    src + rt * D * 32, D * 32);
            }
            tma_store_commit();
            tma_store_wait_read<0>();
            mbar_arrive(bar_dq_empty(f));
            tma_store_wait<0>();
            fence_proxy_async_global();
            red_release_gpu_add(sem, 1);
          }
        } else {
          // float4 j of the block: run j / 2D, its column tile (j % 2D) / 16, row (j % 16) / 2
          // of the tile, columns 4 (j % 2) + [0, 4) of it.
          for (int j = lane; j < BM * D / 4; j += 32) {
            const int rr = 8 * (j / (2 * D)) + (j % 16) / 2;
            if (rr >= rows) continue;
            const int c = 8 * ((j % (2 * D)) / 16) + 4 * (j & 1);
            float4 v;
            asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];\n"
                         : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
                         : "r"(src + 16 * j)
                         : "memory");
            red_add4(p.dq_acc + dq_acc_index<D>(sq.q_start + m + rr, h, c, p.hq), v);
          }
          __syncwarp();
          if (lane == 0) mbar_arrive(bar_dq_empty(f));
          fence_acq_rel_gpu();  // this lane's additions performed
          __syncwarp();
          if (lane == 0) red_release_gpu_add(sem, 1);
        }
      }
    }
  } else {
    // ---- consumers ----
    setmaxnreg_inc<kDet       ? C::kConsumerRegsDet
                   : kPersist ? C::kConsumerRegsPersist
                              : C::kConsumerRegs>();
    const int cw = warpgroup_uniform() - 1;  // consumer warpgroup: keys [64 cw, 64 cw + 64)
    const int warp = (threadIdx.x / 32) % 4, g = lane >> 2, tq = lane & 3;
    const int kr0 = 64 * cw + 16 * warp + g;  // the lane's first key row in the block (+8)
    const Score score(p);
    // dQ piece of this warpgroup: query rows 64 dq_r + [0, 64), columns 64 dq_c + [0, 64).
    constexpr bool kRowSplit = C::kDqRowSplit == 2;
    const int dq_r = kRowSplit ? cw : 0, dq_c = kRowSplit ? 0 : cw;
    if constexpr (kDqT || kOverlap)
      if (score.capped()) __trap();  // the launcher never sends softcap here: no such path
    // Every consumer thread arrives: an arrival releases only its own thread's earlier reads
    // (of the stage's statistics, here), so one lane arriving for its warp would not order the
    // other lanes' reads before the producer's next copy into the stage.
    auto release = [&](uint32_t bar) { mbar_arrive(bar); };

    int gs = 0;  // the steps of the earlier tiles: the Q/dO stages run on across tiles
    // kPersist with p.dkv_defer (the default): whether this thread (a warpgroup's storing
    // thread) has issued a dK/dV store from the last tile's K/V buffer (kb ^ 1 once the next
    // tile is set) and not yet waited for it. Its wait and its arrival on the buffer's empty
    // barrier come after the next tile's first S^T and dP^T are issued (or
    // before that tile's own store, or at the end), so that the warpgroup does not stall on
    // the store before its next products; the buffer is next written two tiles on.
    // (D=128 only: at D=64 the flag took a stack slot.)
    constexpr bool kDeferKv = kPersist && D == 128;
    bool kv_pend = false;
    auto release_kv_pend = [&](int buf) {
      if (kDeferKv && kv_pend) {
        tma_store_wait_read<0>();
        mbar_arrive(bar_kv_empty(buf));
        kv_pend = false;
      }
    };
    for (int j = 0;; ++j) {  // the CTA's tiles (one unless kPersist)
    if constexpr (kPersist) {
      kb = j & 1;
      sm90::mbar_wait(bar_kv(kb), (j >> 1) & 1);
      if (tile_t() >= n_tiles_all()) break;
      set_tile();
    } else if (n_it > 0) {
      sm90::mbar_wait(bar_kv(0), 0);
    }
    const int j0 = n0 + kr0;  // the lane's first key of the sequence
    const uint32_t sKt = sK + kb * C::kKvDelta, sVt = sV + kb * C::kKvDelta;

    float dk[D / 8][4], dv[D / 8][4];
#pragma unroll
    for (int d8 = 0; d8 < D / 8; ++d8)
#pragma unroll
      for (int e = 0; e < 4; ++e) dk[d8][e] = dv[d8][e] = 0.f;

    // The wgmma descriptors of the tiles' stage 0 (SmemDesc: a step, stage or buffer further on
    // is one add): K-major K and V (this warpgroup's 64 rows), Q and dO; MN-major Q and dO (the
    // B of dK and dV), dS^T's column block dq_r and K's column block dq_c (dQ's A and B; kDqT:
    // K's column block cw as A, MN-major, and dS K-major as B).
    const SmemDesc dK_km = smem_desc_sw128(sKt + cw * 64 * 128, 16, 1024);
    const SmemDesc dV_km = smem_desc_sw128(sVt + cw * 64 * 128, 16, 1024);
    const SmemDesc dQ_km = smem_desc_sw128(sQ, 16, 1024);
    const SmemDesc dDo_km = smem_desc_sw128(sDo, 16, 1024);
    const SmemDesc dQ_mn = smem_desc_sw128(sQ, BM * 128, 1024);
    const SmemDesc dDo_mn = smem_desc_sw128(sDo, BM * 128, 1024);
    const SmemDesc dDs_mn = smem_desc_sw128(sDs + dq_r * BN * 128, BN * 128, 1024);
    const SmemDesc dK_mn = smem_desc_sw128(sKt + dq_c * BN * 128, BN * 128, 1024);
    const SmemDesc dDs_km = smem_desc_sw128(sDs, 16, 1024);

    // dQ_part = dS K from dS^T buffer `buf`: BN / 16 k-steps of 16 keys; A = dS^T's column
    // block dq_r, B = K's column block dq_c (committed as one group).
    // kDqT: dQ^T = K^T dS^T, this warpgroup's head-dim rows 64 cw + [0, 64) (dq_c = cw) by
    // the step's BM queries, over BN / 16 k-steps of 16 keys; A = K's column block cw (its 16
    // key rows per k-step, MN-major), B = dS's key chunk (K-major: kk / 4 the column block,
    // 32 bytes per k-step inside its 128-byte rows).
    auto issue_dq = [&](int buf, float (&dq)[kDqN8][4]) {
      wgmma_fence();
      if constexpr (kDqT) {
        const SmemDesc db = dDs_km + buf * C::kDsBytes;
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk)
          WgmmaSs<T, BM>::template run<1, 0>(dq, dK_mn + kk * 2048,
                                             db + ((kk / 4) * BM * 128 + (kk % 4) * 32),
                                             kk > 0 ? 1 : 0);
      } else {
        const SmemDesc da = dDs_mn + buf * C::kDsBytes;
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk)
          WgmmaTT<T>::ss(dq, da + kk * 2048, dK_mn + kk * 2048, kk > 0 ? 1 : 0);
      }
      wgmma_commit();
    };
    // dQ accumulation of step (h, m): the piece's rows 16 warp + g (+ 8), columns 8 n8 + 2 tq
    // (+ 1); row i + 8 is one 8-row tile further (dq_acc_index): hq D 8 floats on from row i.
    // kDqT: the lane holds head-dim rows d = 64 cw + 16 warp + g (+ 8 r) of queries q = 8 n8 +
    // 2 tq (+ 1): two rows of one column, adjacent in dq_acc_index_t's column-major tiles when
    // the packed row q_start + q is even (q is: m and 2 tq are). A warp's red.v2 then cover
    // one 256-byte tile (or two, when q_start % 8 != 0). Query q + 8 is one tile row further
    // (hq D 8 floats), head-dim row d + 8 one tile (64 floats). Where q < lq <= q + 1 the
    // second float is 0 (dS is 0 for queries >= lq) and lands in the next sequence's row or the
    // padding, which the preprocess zeroed or nobody reads: x + 0 = x. Sequences starting on an
    // odd row add float by float.
    auto add_dq = [&](const float (&dq)[kDqN8][4], int h_of, int m_of) {
      if constexpr (kDqT) {
        const int q = m_of + 2 * tq, d = 64 * cw + 16 * warp + g;
        const int64_t tile = static_cast<int64_t>(p.hq) * D * 8;
        if ((sq.q_start & 1) == 0) {
          float* dst = p.dq_acc + dq_acc_index_t<D>(sq.q_start + q, h_of, d, p.hq);
          if (m_of + BM <= sq.lq) {  // every query of the step inside the sequence
#pragma unroll
            for (int n8 = 0; n8 < kDqN8; ++n8, dst += tile) {
              red_add2(dst, dq[n8][0], dq[n8][1]);
              red_add2(dst + 64, dq[n8][2], dq[n8][3]);
            }
          } else {
            // ptxas makes each predicated reduction a branch with its convergence barrier:
            // only in the sequence's last step.
#pragma unroll
            for (int n8 = 0; n8 < kDqN8; ++n8, dst += tile) {
              const bool in = q + 8 * n8 < sq.lq;
              red_add2_if(in, dst, dq[n8][0], dq[n8][1]);
              red_add2_if(in, dst + 64, dq[n8][2], dq[n8][3]);
            }
          }
        } else {
          // Rows q_start + q and + 1 (the lane's two queries) lie in one tile unless the first
          // is the tile's last row; either way the same for every n8.
          float* dst0 = p.dq_acc + dq_acc_index_t<D>(sq.q_start + q, h_of, d, p.hq);
          float* dst1 = p.dq_acc + dq_acc_index_t<D>(sq.q_start + q + 1, h_of, d, p.hq);
          if (m_of + BM <= sq.lq) {
#pragma unroll
            for (int n8 = 0; n8 < kDqN8; ++n8, dst0 += tile, dst1 += tile) {
              atomicAdd(dst0, dq[n8][0]);
              atomicAdd(dst1, dq[n8][1]);
              atomicAdd(dst0 + 64, dq[n8][2]);
              atomicAdd(dst1 + 64, dq[n8][3]);
            }
          } else {
#pragma unroll
            for (int n8 = 0; n8 < kDqN8; ++n8, dst0 += tile, dst1 += tile) {
              red_add1_if(q + 8 * n8 < sq.lq, dst0, dq[n8][0]);
              red_add1_if(q + 8 * n8 + 1 < sq.lq, dst1, dq[n8][1]);
              red_add1_if(q + 8 * n8 < sq.lq, dst0 + 64, dq[n8][2]);
              red_add1_if(q + 8 * n8 + 1 < sq.lq, dst1 + 64, dq[n8][3]);
            }
          }
        }
        return;
      }
      // The lane's row in the block, 64 dq_r + 16 warp + g, from the thread index read here
      // (held across the step as one value, it spilled at D=64 in the lagged schedule).
      unsigned tid;
      asm volatile("mov.u32 %0, %%tid.x;\n" : "=r"(tid));
      const int lane_row = 64 * (kRowSplit ? static_cast<int>(tid / 128) - 1 : 0) +
                           16 * static_cast<int>((tid / 32) % 4) + static_cast<int>((tid % 32) / 4);
      const int i = m_of + lane_row;
      float* const dst =
          p.dq_acc + dq_acc_index<D>(sq.q_start + i, h_of, 64 * dq_c + 2 * tq, p.hq);
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        if (i + 8 * r >= sq.lq) continue;
        float* const dst_r = dst + static_cast<int64_t>(r) * p.hq * D * 8;
#pragma unroll
        for (int n8 = 0; n8 < 8; ++n8) red_add2(dst_r + n8 * 64, dq[n8][2 * r], dq[n8][2 * r + 1]);
      }
    };

    int h, m;
    first_step(h, m);
    int h_prev = h, m_prev = m;  // kLag: the step whose dQ_part is still to be formed

    for (int it = 0; it < n_it; ++it) {
      const int s = (gs + it) % S;
      const uint32_t sDs_b = sDs + (it & 1) * C::kDsBytes;
      sm90::mbar_wait(bar_full(s), ((gs + it) / S) & 1);

      // S^T = K Q^T and dP^T = V dO^T: D / 16 k-steps of 16 head-dim elements each.
      float st[BM / 8][4], dpt[BM / 8][4];
      reg_fence(st);
      reg_fence(dpt);
      wgmma_fence();
      // acc = A B^T over the head dim, A the warpgroup's 64 keys of sA (K or V), B the step's
      // queries of sB (Q or dO), both K-major.
      auto keys_by_queries = [&](float (&acc)[BM / 8][4], SmemDesc da, SmemDesc db) {
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
          const uint32_t off = (kk / 4) * BN * 128 + (kk % 4) * 32;
          const uint32_t offq = (kk / 4) * BM * 128 + (kk % 4) * 32;
          Wgmma<T, BM>::ss(acc, da + off, db + offq, kk > 0 ? 1 : 0);
        }
      };
      keys_by_queries(st, dK_km, dQ_km + s * C::kQBytes);
      if constexpr (kOverlap) wgmma_commit();  // S^T and dP^T as two groups
      keys_by_queries(dpt, dV_km, dDo_km + s * C::kQBytes);
      wgmma_commit();
      if (it == 0) release_kv_pend(kb ^ 1);  // (the last tile's store, while S^T and dP^T run)

      // P^T and dS^T in place (st, dpt); column c of the accumulators is query m + c.
      const float* l_s = stats_lse(s);
      const float* d_s = stats_delta(s);
      // The warp's first key (as j0 - g it held one register less in the persistent kernels).
      const int jw = kPersist ? j0 - g : n0 + 64 * cw + 16 * warp;
      // (p.dq_probe bit 2, measurement: every step takes the masked path.)
      const bool full = !(p.dq_probe & 4) && m + BM <= sq.lq &&
                        sq.all_visible(m, m + BM, jw, jw + 16, p);
      // Both at once (the serial schedule, and the softcap's, whose dS needs tanh of S).
      auto grad_tile = [&](auto path) {  // three copies: see run_path
        constexpr int kPath = decltype(path)::value;
#pragma unroll
        for (int ni = 0; ni < BM / 8; ++ni)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int c = ni * 8 + 2 * tq + (e & 1);
            const float lse2 = l_s[c], dl = d_s[c];
            float pv, ds;
            if constexpr (kPath > 0) {
              float t = 0.f;
              const float x = score.at<kPath == 2>(st[ni][e], t);
              const int i = m + c;
              const bool vis = (i < sq.lq) & sq.visible(i, j0 + (e >> 1) * 8, p);
              pv = vis ? ex2(x - lse2) : 0.f;
              ds = pv * (dpt[ni][e] - dl);
              if constexpr (kPath == 2) ds *= 1.f - t * t;
            } else {
              pv = ex2(st[ni][e] * score.scale_log2() - lse2);
              ds = pv * (dpt[ni][e] - dl);
            }
            st[ni][e] = pv;
            dpt[ni][e] = ds;
          }
      };
      // P^T alone (the overlapped schedule without softcap): Path<0> or Path<1>.
      auto p_tile = [&](auto path) {
        constexpr int kPath = decltype(path)::value;
#pragma unroll
        for (int ni = 0; ni < BM / 8; ++ni)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int c = ni * 8 + 2 * tq + (e & 1);
            const float lse2 = l_s[c];
            if constexpr (kPath > 0) {
              const int i = m + c;
              const bool vis = (i < sq.lq) & sq.visible(i, j0 + (e >> 1) * 8, p);
              st[ni][e] = vis ? ex2(st[ni][e] * score.scale_log2() - lse2) : 0.f;
            } else {
              st[ni][e] = ex2(st[ni][e] * score.scale_log2() - lse2);
            }
          }
      };
      // As wgmma A fragments: queries [16 kk, 16 kk + 16) are the accumulators' 8-column
      // blocks 2 kk and 2 kk + 1 (the m16n8k16 A layout, as the forward's P).
      auto to_frag = [&](const float (&acc)[BM / 8][4], uint32_t (&f)[BM / 16][4]) {
#pragma unroll
        for (int kk = 0; kk < BM / 16; ++kk) {
          f[kk][0] = pack2<T>(acc[2 * kk][0], acc[2 * kk][1]);
          f[kk][1] = pack2<T>(acc[2 * kk][2], acc[2 * kk][3]);
          f[kk][2] = pack2<T>(acc[2 * kk + 1][0], acc[2 * kk + 1][1]);
          f[kk][3] = pack2<T>(acc[2 * kk + 1][2], acc[2 * kk + 1][3]);
        }
      };
      uint32_t pa[BM / 16][4], dsa[BM / 16][4];
      // dV += P^T dO: BM / 16 k-steps of 16 queries (2048 bytes of rows); B is MN-major, its
      // head dim in 64-wide column blocks BM * 128 bytes apart (the LBO).
      auto issue_dv = [&] {
        reg_fence(dv);
        wgmma_fence();
        const SmemDesc b = dDo_mn + s * C::kQBytes;  // the stage's base, then one add per step
#pragma unroll
        for (int kk = 0; kk < BM / 16; ++kk) Wgmma<T, D>::rs_mn(dv, pa[kk], b + kk * 2048, 1);
        wgmma_commit();
      };
      // dK += dS^T Q: as dV, with dS^T's fragments and Q (MN-major).
      auto issue_dk = [&](int st_) {
        const SmemDesc b = dQ_mn + st_ * C::kQBytes;
#pragma unroll
        for (int kk = 0; kk < BM / 16; ++kk) Wgmma<T, D>::rs_mn(dk, dsa[kk], b + kk * 2048, 1);
        wgmma_commit();
      };
      if constexpr (!kOverlap) {
        wgmma_wait<0>();
        reg_fence(st);
        reg_fence(dpt);
        if constexpr (kDqT) {
          // No softcap here (sm90_bwd_q80): its path's tanh values, held across the 40
          // elements, took the registers that the wgmmas' accumulators need (ptxas serialised
          // every wgmma of the kernel, C7512).
          if (full)
            grad_tile(Path<0>{});
          else
            grad_tile(Path<1>{});
        } else {
          run_path(full, score.capped(), grad_tile);
        }
        to_frag(st, pa);
        issue_dv();
      } else {
        // Overlapped: P^T while dP^T runs, then (D=128) dS^T while dV += P^T dO runs (the
        // groups complete in order: wait_group 1 leaves only the last one in flight). At D=64
        // the P^T fragments held through dS^T (S^T, dP^T: 128 floats) would spill: dV waits.
        // No softcap here (the launcher sends it to the serial kernel; the check is before the
        // tiles): with the softcap's serial path in this kernel too, ptxas serialised every
        // wgmma of it (C7512).
        constexpr bool kEarlyDv = D == 128;
        wgmma_wait<1>();
        reg_fence(st);
        if (full)
          p_tile(Path<0>{});
        else
          p_tile(Path<1>{});
        if constexpr (kEarlyDv) {
          to_frag(st, pa);
          issue_dv();
          wgmma_wait<1>();
        } else {
          wgmma_wait<0>();
        }
        reg_fence(dpt);
#pragma unroll
        for (int ni = 0; ni < BM / 8; ++ni)
#pragma unroll
          for (int e = 0; e < 4; ++e)
            dpt[ni][e] = st[ni][e] * (dpt[ni][e] - d_s[ni * 8 + 2 * tq + (e & 1)]);
        if constexpr (!kEarlyDv) {
          to_frag(st, pa);
          issue_dv();
        }
      }
      to_frag(dpt, dsa);
      // dS^T into buffer it & 1: key row kr of the block at byte 128 kr of the column block of
      // its query c (BN rows x 128 bytes each), 16-byte chunk (c % 64) / 8 at chunk ^ (kr % 8)
      // -- the layout TMA writes, which the dQ wgmma reads as an MN-major A. One stmatrix.x4
      // per 16 queries: its matrices are dsa[kk][0..3], i.e. (rows + 8 r, query block 2 kk +
      // half) for k = 2 half + r; lane L gives the address of row L % 8 of matrix L / 8, whose
      // chunk is (2 kk % 8) ^ half ^ (L % 8): the lane's part (half ^ L % 8) sits in lane_x's
      // chunk bits (4-6), so each kk is one XOR with a constant (plus a column block at D=64).
      const int ds_row = 64 * cw + 16 * warp + 8 * ((lane >> 3) & 1) + (lane & 7);
      const uint32_t lane_x = sDs_b + ds_row * 128 + ((((lane >> 4) ^ lane) & 7) << 4);
      // kDet: the writer has read the dQ block that step it - 2 staged in this buffer (at D=64
      // over this very dS^T buffer).
      if constexpr (kDet) sm90::mbar_wait(bar_dq_empty(it & 1), ((it >> 1) & 1) ^ 1);
      // kLag: the other warpgroup's dQ products of step it - 2 have read this buffer.
      if constexpr (kLag)
        if (it >= 1) named_bar_sync<256>(kBarFree + 2 * (1 - cw) + (it & 1));
      if constexpr (kDqT) {
        // dS (queries x keys) instead, for dQ^T's K-major B: query q at byte 128 q of column
        // block cw (this warpgroup's 64 keys, BM rows x 128 bytes), the 8 keys of its 16-byte
        // chunk c at chunk c ^ (q % 8). stmatrix.trans writes matrix k = dsa[kk][k] (keys 8 (k
        // & 1) + [0, 8) of the warp's 16, queries 16 kk + 8 (k / 2) + [0, 8)) as 8 query rows
        // of 8 keys; lane L gives row L % 8 of matrix L / 8: query 16 kk + 8 (L / 16) + L % 8,
        // key chunk 2 warp + (L / 8) % 2. Each kk is 16 rows (2048 bytes) further.
        const uint32_t lane_q = sDs_b + cw * BM * 128 + (8 * (lane >> 4) + (lane & 7)) * 128 +
                                (((2 * warp + ((lane >> 3) & 1)) ^ (lane & 7)) << 4);
#pragma unroll
        for (int kk = 0; kk < BM / 16; ++kk)
          stmatrix_x4_trans(lane_q + kk * 2048, dsa[kk][0], dsa[kk][1], dsa[kk][2], dsa[kk][3]);
      } else {
#pragma unroll
        for (int kk = 0; kk < BM / 16; ++kk)
          stmatrix_x4((lane_x ^ (((2 * kk) % 8) << 4)) + ((2 * kk) / 8) * BN * 128, dsa[kk][0],
                      dsa[kk][1], dsa[kk][2], dsa[kk][3]);
      }
      fence_proxy_async_smem();  // the stores, before the wgmmas (async proxy) read them
      float dq[kDqN8][4];
      if constexpr (kLag) {
        // This warpgroup's half of dS^T(it) is written; dQ_part(it - 1) needs the other's half of
        // dS^T(it - 1), which it wrote a step ago, so the warpgroups are not held in lockstep.
        // The first step forms a product from buffer 1 too (not written in this tile) and
        // discards it: every step then issues the same wgmmas, none conditional (ptxas would
        // serialise them all, C7514), at the cost of one dQ product per CTA.
        named_bar_arrive<256>(kBarReady + 2 * cw + (it & 1));
        if (it >= 1) named_bar_sync<256>(kBarReady + 2 * (1 - cw) + ((it - 1) & 1));
        reg_fence(dk);
        reg_fence(dq);
        issue_dq((it - 1) & 1, dq);
        issue_dk(s);
        wgmma_wait<1>();  // dV(it) and dQ_part(it - 1) have completed
        reg_fence(dq);
        if (it >= 1) add_dq(dq, h_prev, m_prev);
        if (it + 1 < n_it) named_bar_arrive<256>(kBarFree + 2 * cw + ((it - 1) & 1));
      } else {
        named_bar_sync<256>(1);  // both consumer warpgroups' halves of dS^T are written
        // dQ_part = dS K, then dK += dS^T Q as dV, whose products run while dQ_part is added to
        // the accumulator (the groups complete in order: wait_group 1 leaves only dK's).
        reg_fence(dk);
        reg_fence(dq);
        issue_dq(it & 1, dq);
        issue_dk(s);
        wgmma_wait<1>();
        reg_fence(dq);
        if constexpr (kDet) {
          // Staged for the writer warp in dq_acc_index's tile order: the block's row 64 dq_r +
          // 16 warp + g + 8 r is row g of run 8 dq_r + 2 warp + r, column 64 dq_c + 8 n8 + 2 tq
          // is in its column tile 8 dq_c + n8; a warp's float2 stores cover 256 contiguous
          // bytes. This warpgroup's dQ products have completed (wait_group 1 above), the only
          // reads of its piece's bytes at D=64, where they lie over its dS^T column block.
          const uint32_t at = dq_stage(it & 1) + (8 * dq_r + 2 * warp) * D * 32 +
                              8 * dq_c * 256 + g * 32 + tq * 8;
#pragma unroll
          for (int r = 0; r < 2; ++r)
#pragma unroll
            for (int n8 = 0; n8 < 8; ++n8)
              asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(at + r * D * 32 + n8 * 256),
                           "f"(dq[n8][2 * r]), "f"(dq[n8][2 * r + 1])
                           : "memory");
          fence_proxy_async_smem();  // before the writer's bulk reductions read them
          mbar_arrive(bar_dq_full(it & 1));
        } else {
          add_dq(dq, h, m);
        }
      }
      wgmma_wait<0>();
      reg_fence(dv);
      reg_fence(dk);
      release(bar_empty(s));  // Q, dO and the stats of stage s are no longer read
      if constexpr (kLag) h_prev = h, m_prev = m;
      step_on(h, m);
    }
    if constexpr (kLag) {
      // The last step's dQ_part (n_it - 1).
      if (n_it > 0) {
        named_bar_sync<256>(kBarReady + 2 * (1 - cw) + ((n_it - 1) & 1));
        float dq[kDqN8][4];
        reg_fence(dq);
        issue_dq((n_it - 1) & 1, dq);
        wgmma_wait<0>();
        reg_fence(dq);
        add_dq(dq, h_prev, m_prev);
      }
    }
    gs += n_it;
    // This thread's dQ additions are issued: the producer's TMA thread (kPersist: its counting
    // thread) counts the steps' blocks.
    if (!kDet && p.dq_done != nullptr) mbar_arrive(bar_dq_full(kb));
    // ---- epilogue: dK (scaled) and dV of keys < lk ----
    // The sequence's bounds are read again (the loop's reductions are memory clobbers, so they
    // are reloaded): held across the loop, the key offset took a stack slot.
    const Seq se(p, cta_b());
    // Through shared memory and TMA stores where the warpgroup's 64 keys all lie inside the
    // sequence (a TMA store clips only at the tensor's end, so a slab crossing lk would write
    // the next sequence's rows): dK into the K buffer's rows of this warpgroup, dV into V's, in
    // the 128-byte swizzle of their tensor maps (row r's 16-byte chunk c at chunk c ^ (r % 8)),
    // then one thread stores the D / 64 column blocks of each. The other warpgroup's dQ
    // products read every row of K, so both warpgroups meet first (named barrier 1, as at every
    // step). Otherwise (or with p.dkv_regs, FUSEDOPS_ATTN_SM90_BWD_EPILOGUE=regs) 4-byte stores
    // from registers.
    // kPersist: always, so that no wgmma of this tile still reads a buffer when the next tile's
    // steps write it.
    if (kPersist || !p.dkv_regs) named_bar_sync<256>(1);
    release_kv_pend(kb ^ 1);  // a tile without steps: the last tile's store first
    bool kv_deferred = false;  // this thread's store's wait and arrival are deferred
    if (!p.dkv_regs && n0 + 64 * cw + 64 <= se.lk) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int row = kr0 + 8 * r;  // row of the block; row % 8 == g
#pragma unroll
        for (int d8 = 0; d8 < D / 8; ++d8) {
          const uint32_t off = (d8 / 8) * BN * 128 + row * 128 + (((d8 % 8) ^ g) << 4) + 4 * tq;
          st_shared_u32(sKt + off,
                        pack2<T>(dk[d8][2 * r] * p.scale, dk[d8][2 * r + 1] * p.scale));
          st_shared_u32(sVt + off, pack2<T>(dv[d8][2 * r], dv[d8][2 * r + 1]));
        }
      }
      fence_proxy_async_smem();
      named_bar_sync<128>(2 + cw);  // the warpgroup's 128 threads
      if (threadIdx.x % 128 == 0) {
        const int row0 = se.k_start + n0 + 64 * cw;
#pragma unroll
        for (int c = 0; c < kBlocks; ++c) {
          tma_store_3d(&tm_dk, sKt + c * BN * 128 + cw * 64 * 128, 64 * c, cta_hk(), row0);
          tma_store_3d(&tm_dv, sVt + c * BN * 128 + cw * 64 * 128, 64 * c, cta_hk(), row0);
        }
        tma_store_commit();
        if (kDeferKv && p.dkv_defer) {
          kv_deferred = true;
        } else {
          tma_store_wait_read<0>();  // before the buffer is reused or the CTA's shared memory goes
        }
      }
    } else {
      T* dK = static_cast<T*>(p.dk) + se.k_start * p.dk_row + static_cast<int64_t>(cta_hk()) * D;
      T* dV = static_cast<T*>(p.dv) + se.k_start * p.dv_row + static_cast<int64_t>(cta_hk()) * D;
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int j = j0 + 8 * r;
        if (j >= se.lk) continue;
        T* dk_row = dK + static_cast<int64_t>(j) * p.dk_row + 2 * tq;
        T* dv_row = dV + static_cast<int64_t>(j) * p.dv_row + 2 * tq;
#pragma unroll
        for (int d8 = 0; d8 < D / 8; ++d8) {
          *reinterpret_cast<uint32_t*>(dk_row + d8 * 8) =
              pack2<T>(dk[d8][2 * r] * p.scale, dk[d8][2 * r + 1] * p.scale);
          *reinterpret_cast<uint32_t*>(dv_row + d8 * 8) =
              pack2<T>(dv[d8][2 * r], dv[d8][2 * r + 1]);
        }
      }
    }
    if constexpr (!kPersist) break;
    if (kv_deferred)
      kv_pend = true;
    else
      mbar_arrive(bar_kv_empty(kb));  // this thread is done with the tile's K/V buffer and slot
    }  // tiles
    release_kv_pend(kb ^ 1);  // the CTA's last store has read its buffer before the CTA exits
  }
#elif defined(__CUDA_ARCH__)
  __trap();  // built for an architecture without wgmma: the host never launches this
#endif
}

}  // namespace attn
}  // namespace fusedops
