// Host-side launch of the Hopper attention forward: the TMA tensor maps (made once per call
// through the driver entry point that the CUDA runtime hands out, so nothing links against
// libcuda), the schedule, tile, exponential, epilogue and persistence choices, the tile order,
// the grid and the launch (tile sizes and shared memory: attention_config_sm90.h).
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>  // PFN_cuTensorMapEncodeTiled
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <type_traits>

#include "../tma_host.h"
#include "attention_config_sm90.h"
#include "attention_fwd_kernel_sm90.cuh"

namespace fusedops {
namespace attn {

// A tensor map over a packed (rows, heads, D) tensor of 2-byte elements, rows `row_stride`
// elements apart and heads D apart, read in boxes of 64 (head dim) x 1 (head) x box_rows (rows),
// 128-byte swizzle (the layout the kernel's wgmma descriptors assume); out-of-range rows read
// as zeros. False when the driver refuses it.
inline bool make_tensor_map(CUtensorMap* map, const void* ptr, bool bf16, int head_dim,
                            int heads, int rows, int64_t row_stride, int box_rows) {
  const PFN_cuTensorMapEncodeTiled_v12000 encode = tensor_map_encoder();
  if (encode == nullptr) return false;
  const cuuint64_t dims[3] = {static_cast<cuuint64_t>(head_dim), static_cast<cuuint64_t>(heads),
                              static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[2] = {static_cast<cuuint64_t>(head_dim) * 2,  // bytes, dims 1 and 2
                                 static_cast<cuuint64_t>(row_stride) * 2};
  const cuuint32_t box[3] = {64, 1, static_cast<cuuint32_t>(box_rows)};
  const cuuint32_t elem_strides[3] = {1, 1, 1};
  const CUresult res = encode(
      map, bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 3,
      const_cast<void*>(ptr), dims, strides, box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
      CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return res == CUDA_SUCCESS;
}

// The consumers' schedule: sm90_auto_schedule (attention_config_sm90.h, from measurements)
// unless FUSEDOPS_ATTN_SM90_SCHEDULE names one, for measurement and debugging: "serial" 0 (no
// overlap; tells a pipelining fault from a layout fault), "overlap" 1 (intra-warpgroup
// overlap), "pingpong" 2 (overlap, and the two consumer warpgroups alternate at the tensor
// cores); anything else, "auto" included, is the table's choice. Read at every call (a getenv),
// so that a test can switch it.
inline int sm90_schedule(const AttnParams& p) {
  const char* s = std::getenv("FUSEDOPS_ATTN_SM90_SCHEDULE");
  if (s != nullptr) {
    if (std::strcmp(s, "serial") == 0) return 0;
    if (std::strcmp(s, "overlap") == 0) return 1;
    if (std::strcmp(s, "pingpong") == 0) return 2;
  }
  return sm90_auto_schedule(p.head_dim, /*causal=*/p.right == 0, p.max_k);
}

// The epilogue (the kernel's `epilogue` argument): a TMA store of O through shared memory (1,
// the default: staged in the tile table's O buffer where it has one, else in the Q rows), with
// FUSEDOPS_ATTN_SM90_EPILOGUE=qrows the TMA store staged in the Q rows also where the table has
// an O buffer (2; the path of tables without one, so that it stays tested), with =regs the
// 4-byte stores from registers (0; the same code also stores the slabs a TMA store cannot).
// For measurement and tests; a kernel argument, not a template parameter: no extra
// instantiations.
inline int sm90_epilogue() {
  const char* s = std::getenv("FUSEDOPS_ATTN_SM90_EPILOGUE");
  if (s != nullptr && std::strcmp(s, "regs") == 0) return 0;
  if (s != nullptr && std::strcmp(s, "qrows") == 0) return 2;
  return 1;
}

// Persistent launch: min(work tiles, SMs) CTAs, each looping over work tiles, where
// sm90_auto_persistent (attention_config_sm90.h) says so, else one CTA per work tile.
// FUSEDOPS_ATTN_SM90_PERSISTENT=0: one CTA per work tile (the same kernel; for measurement);
// =1..N (a positive integer): at most N CTAs, so that even a small call runs many tiles per CTA
// (for tests of the cross-tile pipeline). `dynamic`: the tiles would come from the counter.
// Returns the CTA cap, 0 for one CTA per tile.
inline int64_t sm90_persistent_ctas(const AttnParams& p, int sms, bool dynamic) {
  const char* s = std::getenv("FUSEDOPS_ATTN_SM90_PERSISTENT");
  if (s != nullptr && *s != '\0') {
    char* end = nullptr;
    const long n = std::strtol(s, &end, 10);
    if (*end == '\0' && n >= 0) return n;
  }
  return sm90_auto_persistent(p.head_dim, /*causal=*/p.right == 0, p.max_k, dynamic)
             ? std::max(1, sms)
             : 0;
}

// The current device (its index, SM count and L2 size), asked once per device.
struct DeviceSm90 {
  int dev = 0, sms = 0, l2_bytes = 0;
};
inline cudaError_t device_sm90(DeviceSm90& out) {
  constexpr int kMaxDevices = 64;
  static DeviceSm90 cache[kMaxDevices];  // sms == 0: not asked yet (benign race: same values)
  int dev = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err != cudaSuccess) return err;
  DeviceSm90 d = dev < kMaxDevices ? cache[dev] : DeviceSm90{};
  if (d.sms == 0) {
    if ((err = cudaDeviceGetAttribute(&d.sms, cudaDevAttrMultiProcessorCount, dev)) !=
            cudaSuccess ||
        (err = cudaDeviceGetAttribute(&d.l2_bytes, cudaDevAttrL2CacheSize, dev)) != cudaSuccess)
      return err;
    if (dev < kMaxDevices) cache[dev] = d;
  }
  d.dev = dev;
  out = d;
  return cudaSuccess;
}

// Whether the work tiles of a call differ in length: a causal mask or a window, or sequences of
// different lengths (the packed totals fall short of batch x max).
inline bool sm90_unequal_tiles(const AttnParams& p) {
  return p.left >= 0 || p.right >= 0 ||
         static_cast<int64_t>(p.total_q) != static_cast<int64_t>(p.batch) * p.max_q ||
         static_cast<int64_t>(p.total_k) != static_cast<int64_t>(p.batch) * p.max_k;
}

// Whether a persistent launch takes its tiles from the counter (TileOrderSm90's dynamic):
// where the tiles differ in length (sm90_unequal_tiles) and the binding gave a counter, unless
// FUSEDOPS_ATTN_SM90_TILES says "static" or "dynamic" (for measurement; read at every call).
inline bool sm90_dynamic_tiles(const AttnParams& p) {
  if (p.tile_counter == nullptr) return false;
  const char* s = std::getenv("FUSEDOPS_ATTN_SM90_TILES");
  if (s != nullptr) {
    if (std::strcmp(s, "static") == 0) return false;
    if (std::strcmp(s, "dynamic") == 0) return true;
  }
  return sm90_unequal_tiles(p);
}

// Q-blocks counted from each sequence's end (TileOrderSm90::align_end) when the mask has a
// right bound (causal): later queries see more keys, so the partial block is best first.
// FUSEDOPS_ATTN_SM90_QALIGN=start|end forces one, for measurement (read at every call).
inline bool sm90_q_align_end(const AttnParams& p) {
  const char* s = std::getenv("FUSEDOPS_ATTN_SM90_QALIGN");
  if (s != nullptr) {
    if (std::strcmp(s, "start") == 0) return false;
    if (std::strcmp(s, "end") == 0) return true;
  }
  return p.right >= 0;
}

// The work tiles and their order (TileOrderSm90, attention_order_sm90.h). Unmasked, all
// q-blocks see the same keys: sections of one (sequence, head) pair, q-blocks fastest (the
// non-persistent grid's order: the blocks of a few heads at a time share their K/V in L2).
// Causal or windowed, the blocks of most keys go first (the last ones, or the first with only
// a left bound) over sections of whole KV-head groups, as many as keep their K/V (max_k rows of
// K and V per KV head) within half the L2 at most, of sizes that differ by one group at most,
// the smaller first.
inline TileOrderSm90 sm90_tile_order(const AttnParams& p, int block_m, int l2_bytes) {
  TileOrderSm90 o;
  o.n_mb = (p.max_q + block_m - 1) / block_m;
  o.hq = p.hq;
  o.n_bh = static_cast<int64_t>(p.batch) * p.hq;
  o.reverse = !(p.left >= 0 && p.right < 0);
  o.align_end = sm90_q_align_end(p) ? 1 : 0;
  o.dynamic = 0;
  const bool masked = p.left >= 0 || p.right >= 0;
  // A unit: a KV-head group (its query heads adjacent), max_k rows of K and V per KV head.
  const int64_t kv_bytes = static_cast<int64_t>(p.max_k > 0 ? p.max_k : 1) * p.head_dim * 4;
  tile_order_sections(o, p.hq / p.hkv, masked ? kv_bytes : 0, l2_bytes);
  o.t_begin = 0;
  o.t_end = o.n_work;
  return o;
}

// The key tile: the table's (sm90_block_n) unless FUSEDOPS_ATTN_SM90_BLOCK_N=176 asks for 176
// keys at D=128 with the overlap or ping-pong schedule (FlashAttention-3's shape for D=128
// without a causal mask or window), built to be timed against 128 keys: for measurement only,
// read at every call. Any other value, head dim or schedule gets the table's tile.
inline bool sm90_block_n_176(const AttnParams& p) {
  const char* s = std::getenv("FUSEDOPS_ATTN_SM90_BLOCK_N");
  return s != nullptr && std::strcmp(s, "176") == 0 && p.head_dim == 128 && sm90_schedule(p) != 0;
}

// The softmax's exponentials: sm90_auto_exp2 (attention_config_sm90.h) unless
// FUSEDOPS_ATTN_SM90_EXP2 says "mufu" (every one by MUFU.EX2) or "poly" (ex2_poly for
// TilesSm90's kExp2PolyBlocks of the column blocks), for measurement; read at every call. A
// template parameter of the kernel (the blocks must be static inside the unrolled loop), built
// for the 128-key tiles of D=64/128 with the overlap and ping-pong schedules; elsewhere
// ignored.
inline bool sm90_exp2_poly(const AttnParams& p) {
  const char* s = std::getenv("FUSEDOPS_ATTN_SM90_EXP2");
  if (s != nullptr) {
    if (std::strcmp(s, "mufu") == 0) return false;
    if (std::strcmp(s, "poly") == 0) return true;
  }
  return sm90_auto_exp2(p.head_dim, /*causal=*/p.right == 0);
}

// The consumer warpgroups per CTA: sm90_consumer_warpgroups (attention_config_sm90.h) unless
// FUSEDOPS_ATTN_SM90_TILE says "m128" (2 warpgroups) or "m192" (3; D=64 only, elsewhere
// ignored), for measurement; read at every call.
inline int sm90_warpgroups(const AttnParams& p) {
  const char* s = std::getenv("FUSEDOPS_ATTN_SM90_TILE");
  int wg = sm90_consumer_warpgroups(p.head_dim, /*causal=*/p.right == 0, p.max_k);
  if (s != nullptr) {
    if (std::strcmp(s, "m128") == 0) wg = 2;
    if (std::strcmp(s, "m192") == 0) wg = 3;
  }
  return p.head_dim == 64 ? wg : 2;
}

// K/V multicast in clusters of two (attention_fwd_kernel_sm90.cuh): sm90_auto_multicast
// unless FUSEDOPS_ATTN_SM90_MULTICAST is "0" (off), "1" (on wherever the launch allows it) or
// "require" (as 1, and a call the launch does not allow it for fails with
// cudaErrorNotSupported: for tests, so that a silent fallback cannot pass for multicast), for
// measurement; read at every call. The launch allows it only where both CTAs of a cluster see
// the same key tiles: equal tiles (sm90_unequal_tiles false), an even number of q-blocks per
// sequence (tiles 2c and 2c + 1 then share their sequence and head), the static order, one
// launch, and an even grid; and tile tables with the work-tile loop (TilesSm90::kPersistent:
// D=64 and 128 with 128 keys; the kernel has no multicast code in the others). Returns 0 off,
// 1 on, 2 required.
inline int sm90_multicast_wanted(const AttnParams& p) {
  const char* s = std::getenv("FUSEDOPS_ATTN_SM90_MULTICAST");
  if (s != nullptr && std::strcmp(s, "0") == 0) return 0;
  if (s != nullptr && std::strcmp(s, "1") == 0) return 1;
  if (s != nullptr && std::strcmp(s, "require") == 0) return 2;
  return sm90_auto_multicast(p.head_dim, p.max_k) ? 1 : 0;
}

// A launch of clusters of two CTAs along x (cfg.attrs points at attr: not copyable).
struct PairLaunch {
  cudaLaunchConfig_t cfg = {};
  cudaLaunchAttribute attr = {};
  PairLaunch(dim3 grid, int threads, size_t smem, cudaStream_t stream) {
    cfg.gridDim = grid;
    cfg.blockDim = dim3(static_cast<unsigned>(threads));
    cfg.dynamicSmemBytes = smem;
    cfg.stream = stream;
    attr.id = cudaLaunchAttributeClusterDimension;
    attr.val.clusterDim.x = 2;
    attr.val.clusterDim.y = 1;
    attr.val.clusterDim.z = 1;
    cfg.attrs = &attr;
    cfg.numAttrs = 1;
  }
  PairLaunch(const PairLaunch&) = delete;
  PairLaunch& operator=(const PairLaunch&) = delete;
};

// The most clusters of two CTAs of `kernel` resident at once on the current device (a cluster
// lives in one GPC, so an odd SM of a GPC stays idle) into `pairs`, asked once per kernel and
// device (0: clusters of two cannot run); an error of the query is returned, not cached.
inline cudaError_t sm90_max_pairs(const void* kernel, int threads, size_t smem, int dev, int sms,
                                  int& pairs) {
  struct Entry {
    const void* kernel;
    int dev, pairs;
  };
  static std::mutex mu;
  static Entry cache[64];
  static int used = 0;
  std::lock_guard<std::mutex> lock(mu);
  for (int i = 0; i < used; ++i)
    if (cache[i].kernel == kernel && cache[i].dev == dev) {
      pairs = cache[i].pairs;
      return cudaSuccess;
    }
  const PairLaunch launch(dim3(static_cast<unsigned>(2 * std::max(1, sms / 2))), threads, smem,
                          nullptr);
  pairs = 0;
  const cudaError_t err = cudaOccupancyMaxActiveClusters(&pairs, kernel, &launch.cfg);
  if (err != cudaSuccess) {
    pairs = 0;
    return err;
  }
  if (used < 64) cache[used++] = {kernel, dev, pairs};
  return cudaSuccess;
}

template <typename T, int D, int kN, int kWarpgroups = 2>
cudaError_t launch_fwd_sm90(const AttnParams& p) {
  using C = TilesSm90<D, kN, kWarpgroups>;
  static_assert(sizeof(T) == C::kElem);
  constexpr bool kBf16 = std::is_same_v<T, __nv_bfloat16>;
  if (p.max_q == 0 || p.hq == 0 || p.batch == 0) return cudaSuccess;
  DeviceSm90 dev;
  cudaError_t err = device_sm90(dev);
  if (err != cudaSuccess) return err;
  // Persistent: one CTA per SM (the shared memory allows no second), unless the override caps
  // or disables it or the tile table has no loop (kPersistent); else one CTA per tile, in
  // launches of at most 2^31 - 1 CTAs.
  TileOrderSm90 order = sm90_tile_order(p, C::kBlockM, dev.l2_bytes);
  const bool dynamic = C::kPersistent && sm90_dynamic_tiles(p);
  const int64_t cap = C::kPersistent ? sm90_persistent_ctas(p, dev.sms, dynamic) : 0;
  // Tables with the loop hand their tiles on as 32-bit indices (attention_fwd_kernel_sm90.cuh),
  // which 2^31 - 2^20 tiles of 128 query rows would need hundreds of TB of q to exceed.
  if (C::kPersistent && order.n_work > 0x7fffffff - (1 << 20)) return cudaErrorInvalidValue;
  order.dynamic = cap > 0 && dynamic;
  int64_t max_grid = cap > 0 ? std::min<int64_t>(cap, 0x7fffffff) : int64_t{0x7fffffff};
  const int64_t per_launch = cap > 0 ? order.n_work : max_grid;
  // The kernel (its schedule, tiles and exponentials), before the multicast check that asks
  // for its occupancy.
  constexpr int W = kWarpgroups, kPoly = C::kExp2PolyBlocks;
  const int schedule = sm90_schedule(p);
  auto kernel = fwd_kernel_sm90<T, D, 1, kN, 0, W>;
  switch (schedule) {
    case 0:  // serial: built with the table's tiles only
      if constexpr (kN == sm90_block_n(D)) kernel = fwd_kernel_sm90<T, D, 0, kN, 0, W>;
      break;
    case 2: kernel = fwd_kernel_sm90<T, D, 2, kN, 0, W>; break;
    default: break;
  }
  if constexpr (kPoly > 0)
    if (schedule != 0 && sm90_exp2_poly(p))
      kernel = schedule == 2 ? fwd_kernel_sm90<T, D, 2, kN, kPoly, W>
                             : fwd_kernel_sm90<T, D, 1, kN, kPoly, W>;
  err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             static_cast<int>(C::kSmem));
  if (err != cudaSuccess) return err;
  // K/V multicast (sm90_multicast_wanted): clusters of two, a grid of whole resident pairs.
  const int wanted = sm90_multicast_wanted(p);
  bool multicast = C::kPersistent && wanted > 0 && p.total_k > 0 && !sm90_unequal_tiles(p) &&
                   order.n_mb % 2 == 0 && order.sec == 1 && order.sec_big == 1 &&
                   !order.dynamic && per_launch >= order.n_work;
  if (multicast) {
    int pairs = 0;
    err = sm90_max_pairs(reinterpret_cast<const void*>(kernel), C::kThreads, C::kSmem, dev.dev,
                         dev.sms, pairs);
    if (err != cudaSuccess) {
      if (wanted == 2) return err;
      (void)cudaGetLastError();  // the query's error, so that the plain launch's check is clean
      pairs = 0;                 // run without clusters
    }
    // Persistent: at most the resident pairs (and the cap, rounded down to pairs); one CTA per
    // tile: every tile (n_work is even), the hardware placing the clusters.
    const int64_t grid = cap > 0 ? std::min<int64_t>(max_grid / 2, pairs) * 2 : max_grid;
    multicast = pairs > 0 && grid >= 2;
    if (multicast) max_grid = grid;
  }
  if (wanted == 2 && !multicast) return cudaErrorNotSupported;
  CUtensorMap tm_q, tm_k, tm_v, tm_o;
  // With no keys at all (total_k == 0) no CTA reads K or V; the maps then describe one row of q
  // so that they stay valid. With multicast each CTA loads half of a K/V tile's rows.
  const bool no_keys = p.total_k == 0;
  const int kv_box = multicast ? C::kBlockN / 2 : C::kBlockN;
  if (!make_tensor_map(&tm_q, p.q, kBf16, D, p.hq, p.total_q, p.q_row, C::kBlockM) ||
      !make_tensor_map(&tm_k, no_keys ? p.q : p.k, kBf16, D, no_keys ? p.hq : p.hkv,
                       no_keys ? 1 : p.total_k, no_keys ? p.q_row : p.k_row, kv_box) ||
      !make_tensor_map(&tm_v, no_keys ? p.q : p.v, kBf16, D, no_keys ? p.hq : p.hkv,
                       no_keys ? 1 : p.total_k, no_keys ? p.q_row : p.v_row, kv_box) ||
      !make_tensor_map(&tm_o, p.out, kBf16, D, p.hq, p.total_q, p.o_row, 64))
    return cudaErrorInvalidValue;  // the driver refused a tensor map (attention_api.cpp says)
  const int epilogue = sm90_epilogue();
  for (int64_t t0 = 0; t0 < order.n_work; t0 += per_launch) {
    TileOrderSm90 part = order;
    part.t_begin = t0;
    part.t_end = std::min(order.n_work, t0 + per_launch);
    const dim3 grid(static_cast<unsigned>(std::min(part.t_end - t0, max_grid)));
    if (multicast) {
      const PairLaunch launch(grid, C::kThreads, C::kSmem, p.stream);
      err = cudaLaunchKernelEx(&launch.cfg, kernel, p, tm_q, tm_k, tm_v, tm_o, epilogue, part, 1);
    } else {
      kernel<<<grid, C::kThreads, C::kSmem, p.stream>>>(p, tm_q, tm_k, tm_v, tm_o, epilogue, part,
                                                        0);
      err = cudaGetLastError();
    }
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

// The 192-query tiles (D=64) are instantiated in attention_fwd_sm90_m192.cu, a translation
// unit of their own, so that the two halves of the kernels compile side by side.
extern template cudaError_t launch_fwd_sm90<__half, 64, 128, 3>(const AttnParams&);
extern template cudaError_t launch_fwd_sm90<__nv_bfloat16, 64, 128, 3>(const AttnParams&);

template <typename T, int D>
cudaError_t run_fwd_sm90(const AttnParams& p) {
  if constexpr (D == 128)
    if (sm90_block_n_176(p)) return launch_fwd_sm90<T, D, 176>(p);
  if constexpr (D == 64)
    if (sm90_warpgroups(p) == 3) return launch_fwd_sm90<T, D, 128, 3>(p);
  return launch_fwd_sm90<T, D, sm90_block_n(D)>(p);
}

}  // namespace attn
}  // namespace fusedops
