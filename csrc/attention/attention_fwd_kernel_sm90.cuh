// The Hopper (sm_90a) attention forward kernel: TMA loads through an mbarrier pipeline, wgmma
// for both products, online softmax in registers (the sm80 kernel's algorithm, kSlack lazy
// rescaling included; speculative exponentials on full tiles, below), lse in natural log, rows
// that see no key -> zeros and lse -inf.
//
// Persistent: each CTA runs a sequence of work tiles -- BM queries (128; 192 with three consumer
// warpgroups) of one (sequence, head) each, TileOrderSm90 below -- and the producer loads the
// next tile's Q and K/V while the consumers still finish the previous one (its last P V and
// epilogue). With one tile per CTA (grid = the number of tiles, FUSEDOPS_ATTN_SM90_PERSISTENT=0)
// it is the non-persistent kernel; tile tables without TilesSm90::kPersistent always are.
//
// Roles (warp specialisation, FlashAttention-3's scheme): warpgroup 0 is the producer, one of
// its threads issuing every TMA load -- per work tile its Q, then the K and V tiles of the
// tile's key range into kStages stages, each stage guarded by a "full" barrier (TMA transaction
// bytes) and an "empty" barrier (one arrival per consumer warp); Q has its own pair. In
// persistent tables a second producer thread is the tile scheduler: it picks the CTA's next
// work tile (TileOrderSm90), works out its loads and hands both over through shared memory.
// Warpgroups 1 .. kWarpgroups (2, or 3 at D=64: TilesSm90) each own 64 query rows: S = Q K^T
// by wgmma from shared memory (both K-major), the softmax in registers, P converted to
// bf16/fp16 in registers and O += P V by wgmma with A from registers and V MN-major in shared
// memory. The output is normalised, staged in shared memory (the tile table's O buffer, or the
// warpgroup's Q rows) and written by a TMA store (register stores for a slab that crosses the
// sequence's end, or with epilogue == 0). kSchedule: 0 serial (each wgmma waited for at once),
// 1 intra-warpgroup overlap (the softmax of tile i + 1 while P_i V_i runs), 2 the same with the
// consumer warpgroups taking turns at the tensor cores (ping-pong). kPolyBlocks: how many of a
// tile's BN / 8 column blocks take their exponentials from ex2_poly (FMA pipe) instead of
// MUFU.EX2 (0: none).
//
// Constraints: T is __half or __nv_bfloat16; D is 64, 128 or 256 (TilesSm90); the packed layout
// of attention_params.h with row strides that are multiples of 8 elements and 16-byte aligned
// tensors (TMA's rules; attention_api.cpp checks them), hq a multiple of hkv, every sequence no
// longer than max_q (the tile order's n_mb blocks). Tensor maps (attention_launch_sm90.cuh):
// 3-D (D, heads, rows) over the packed tensors, boxes of 64 x 1 x rows (tm_o: 64 rows, one
// warpgroup's), 128-byte swizzle. A tile that crosses a sequence's end reads the next
// sequence's rows (TMA zero-fills only past the tensor's end): key columns >= lk are masked to
// -inf by index, so P is 0 there, and query rows >= lq are never stored. Launch: a 1-D grid of
// at most order.n_work CTAs, TilesSm90<D, kN, kWarpgroups>'s kThreads, kSmem bytes of dynamic
// shared memory, one CTA per SM; with kv_multicast in clusters of two along x. The body is empty (a trap) unless compiled for sm_90a.
#pragma once

#include <cuda.h>  // CUtensorMap (a type only; nothing links against the driver)

#include <cstdint>
#include <type_traits>

#include "../hopper_ptx.cuh"
#include "../mma_sm80.cuh"
#include "attention_common.cuh"
#include "attention_config_sm90.h"
#include "attention_order_sm90.h"

namespace fusedops {
namespace attn {

// The work tiles of a call -- (q-block, head, sequence) triples, n_mb x hq x batch of them --
// in the order the CTAs take them. Static (`dynamic` 0): CTA c runs tiles c, c + gridDim.x,
// c + 2 gridDim.x, ... of the launch's range (a round-robin that every role of a CTA computes
// from blockIdx.x alone); right when all tiles are alike (no mask, one length). Dynamic
// (`dynamic` 1, persistent launches with a tile counter): CTA c runs tile c first, then each
// CTA's producer takes the next tile of the order from a global counter when it has issued the
// loads of its current one and hands it to the consumers through shared memory; with the
// longest tiles first that is a greedy longest-first schedule, which balances unequal tiles
// (causal, windows, varlen) to within about one short tile, where the round-robin left
// 5-20% of the SMs' time idle at the end of causal calls. The last CTA to finish resets the
// counters, so that the next launch on the stream (or a graph's replay) starts from zero.
// Order: the (sequence, head) pairs, head fastest (the query heads of one KV head adjacent, so
// that they run at the same time and share its K/V tiles in L2), are cut into sections: n_small
// of `sec` pairs, then the rest of `sec_big`; inside a section the q-blocks go one block index
// at a time over all its pairs, blocks of most keys first (`reverse`: the last blocks, which see
// the most keys under a causal mask; the first ones with only a left bound). The host picks
// the sections: one pair each without a mask (every block sees the same keys; then the order is
// the non-persistent grid's, q-blocks fastest), else sections of whole KV-head groups whose K/V
// fit within part of the L2, of sizes that differ by at most one group, the smaller first (a
// short last section would put its longest tiles at the very end; attention_launch_sm90.cuh).
// With grid = n_work and one tile per CTA the same kernel is the non-persistent launch; tile
// tables without TilesSm90::kPersistent compile it without the loop's back edge. The struct is
// in attention_order_sm90.h (the backward orders its key blocks with it too).

// Synchronisation across work tiles (every count and parity; a miscount is a hang):
// - A work tile is *skipped* by every role alike when none of its queries lies in the sequence
//   (m0 >= lq, or m0 + BM <= 0 with align_end: the sequence is shorter than max_q) and is
//   *empty* when its queries see no key (n_tiles == 0): the producer loads nothing for it, the
//   consumers touch no barrier and store zeros and lse -inf from registers. Both roles compute
//   m0, lq and n_tiles with the same code (tile_at, first_query, skipped, key_tiles), so they
//   agree on which tiles use the pipeline.
// - K/V stages: a running index kv over the key tiles of the CTA's non-empty tiles, kept by the
//   producer thread and by every consumer thread; key tile kv uses stage kv % S at phase
//   (kv / S) & 1. "full" barriers (count 1: the producer's arrive.expect_tx, plus the bytes)
//   complete once per use; "empty" barriers (count 4 NW: lane 0 of each consumer warp, after the
//   warp's wgmma reading the stage has completed -- K with kSpec only after the tile's softmax,
//   which may read it again, below; 8 NW with multicast) complete once per use, and the producer
//   waits for phase ((kv / S) & 1) ^ 1 before refilling (a fresh barrier passes parity 1, so
//   the first S fills do not wait). The producer can run at most S key tiles ahead, into the
//   next work tile as well, since the indices simply continue.
// - Q: full (count 1 + bytes) and empty (count 4 NW) barriers, used once per non-empty tile, a
//   running count q_use on both sides: the consumers wait full at parity q_use & 1, the producer
//   waits empty at parity (q_use & 1) ^ 1 before loading the next Q (issued after that tile's
//   first K, so that K streams in while Q is still held). The 4 NW empty arrivals: each consumer
//   warp's lane 0 after its last Q K^T of the tile (release_q; with kSpec after the last
//   softmax, which may read its rows again), or -- for a warpgroup that
//   stages O in its Q rows (q_late) -- one arrive of count 4 by its storing thread after the TMA
//   store has read them. Either way each consumer warp is accounted for exactly once per use,
//   and the producer cannot complete the next phase of full before the consumers have waited
//   for the current one (it needs their empty arrivals first).
// - K/V multicast (kv_multicast, launched in clusters of two CTAs): the two CTAs of a cluster
//   run tiles t and t + 1 (t even) of the static order at every step -- the same (sequence,
//   head), adjacent q-blocks, so the same key tiles in the same order -- and each loads half of
//   the rows of every K and V tile (its rank's half) into both CTAs' shared memory at the same
//   offsets. Each full barrier still counts the whole tile (its own expect_tx, both halves'
//   bytes). A stage is refilled only when both CTAs' consumers have released it: each consumer
//   warp's lane 0 arrives on its own CTA's empty barrier and lane 1 on the other's (count 8 NW,
//   after the warp's last read of the stage). The host enables it only where
//   both CTAs see identical key sequences (no mask or window, equal lengths, an even number of
//   q-blocks and CTAs, the static order, one launch); a skipped tile under multicast traps. A cluster barrier after the barriers' initialisation
//   and one at the end keep either CTA from touching the other's shared memory before it is
//   set up or after it has gone.
// - The producer thread exits after its last tile's loads; the TMA transactions still complete
//   on the full barriers the consumers wait for. The last releases of the empty barriers are
//   never waited for (harmless).
// - Tile slots (persistent tables): the j-th tile of the CTA (j = 0, 1, ..; the last one a
//   sentinel >= t_end) goes through slot j % 2 -- the tile and its loads (h, hk, first Q and K
//   rows, key tiles; 0 key tiles for a skipped or empty tile) -- guarded by a "full" barrier
//   (count 1: the scheduler's arrive after writing the slot) and an "empty" one (count 128 NW +
//   32: every consumer thread and every lane of the load warp, each after its own read -- an
//   arrive releases only the arriving thread's accesses); the scheduler waits
//   for empty at parity ((j / 2) & 1) ^ 1, the readers for full at (j / 2) & 1. Every tile is
//   handed over, skipped and empty ones too, so all roles walk the same sequence, and the
//   scheduler is at most two tiles ahead of the slowest reader. Dynamic order: for j > 0 the
//   scheduler first waits for the load thread's request (a count-1 barrier, phase j - 1: one
//   arrive after each tile's loads), then takes the counter's next ticket. After its sentinel
//   the scheduler counts its CTA as done (after a fence: its last ticket is taken before); the
//   last CTA resets both counters. tests/attention/test_sm90_sync_model.py models all of this.
// - Ping-pong turns (named barriers 1 .. NW, 256 threads): balanced within each non-empty tile
//   (see take_turn); the epilogue uses ids NW + 1 .. 2 NW (128 threads each), also per tile.
// - Speculative exponentials (kSpec): with kWarpRedo every decision is the warp's own (warp
//   votes, no named barrier), as a failed check computes the warp's rows of S again by
//   mma.sync, a warp instruction. Otherwise each warpgroup's 4 warps take the same path
//   through every softmax (its conditions are the warpgroup's), and each path ends in one
//   bar.red of ids 2 NW + 1 .. 3 NW (128 threads): or of the failed checks on the speculative
//   path, and of the finite running maxima on the exact one; S is computed again by wgmma. A
//   key tile's K stage goes back after its softmax, as the recomputation reads it (Q after the
//   last softmax); still one release per use.
// - The O staging buffer (o_in_q false): a warpgroup's storing thread waits until its previous
//   TMA store has read its rows, then a named barrier lets the warpgroup write them; it waits
//   for the last one before the CTA exits.
template <typename T, int D, int kSchedule, int kN = sm90_block_n(D), int kPolyBlocks = 0,
          int kWarpgroups = 2>
__global__ void __launch_bounds__(TilesSm90<D, kN, kWarpgroups>::kThreads, 1)
    fwd_kernel_sm90(const AttnParams p, const __grid_constant__ CUtensorMap tm_q,
                    const __grid_constant__ CUtensorMap tm_k,
                    const __grid_constant__ CUtensorMap tm_v,
                    const __grid_constant__ CUtensorMap tm_o, const int epilogue,
                    const TileOrderSm90 order, const int kv_multicast_arg) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using namespace fusedops::sm90;
  using C = TilesSm90<D, kN, kWarpgroups>;
  constexpr int BM = C::kBlockM, BN = C::kBlockN, S = C::kStages;
  constexpr int NW = C::kConsumerWarpgroups;
  constexpr int kBlocks = D / 64;  // 64-element (128-byte) column blocks per row
  // K/V multicast (the comment block above): built into the tables with the work-tile loop
  // only; in the others (D=256, 176 keys), whose consumers fill their registers, its code would
  // make ptxas spill, and the host does not ask for it.
  const bool kv_multicast = C::kPersistent && kv_multicast_arg != 0;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  // The swizzle atoms must start 1024-byte aligned (kSmem has the slack for this).
  const uint32_t raw_u32 = smem_u32(smem_raw);
  const uint32_t base = (raw_u32 + 1023u) & ~1023u;
  const uint32_t sQ = base + C::kQOff, sK = base + C::kKOff, sV = base + C::kVOff;
  // epilogue: 0 register stores, 1 TMA store staged in the O buffer (where the table has one),
  // 2 TMA store staged in the Q rows (FUSEDOPS_ATTN_SM90_EPILOGUE=qrows; the only TMA path of
  // a table without an O buffer).
  const bool o_in_q = !C::kSeparateO || epilogue == 2;
  const uint32_t sO = o_in_q ? sQ : base + C::kOOff;
  const uint32_t bars = base + C::kBarOff;
  // Barrier addresses: Q full, Q empty, then K full / K empty / V full / V empty per stage.
  const uint32_t bar_qfull = bars, bar_qempty = bars + 8u;
  auto bar_kfull = [&](int s) { return bars + 8u * (2 + s); };
  auto bar_kempty = [&](int s) { return bars + 8u * (2 + S + s); };
  auto bar_vfull = [&](int s) { return bars + 8u * (2 + 2 * S + s); };
  auto bar_vempty = [&](int s) { return bars + 8u * (2 + 3 * S + s); };
  auto bar_tfull = [&](uint32_t j) { return bars + 8u * (2 + 4 * S + (j & 1)); };
  auto bar_tempty = [&](uint32_t j) { return bars + 8u * (2 + 4 * S + 2 + (j & 1)); };
  const uint32_t bar_treq = bars + 8u * (2 + 4 * S + 4);
  auto tile_slot = [&](uint32_t j) { return base + C::kTileSlotOff + 32u * (j & 1); };
  // Persistent tables hand every work tile from the producer to the consumers through the
  // slots, as 32-bit indices (the host launches them only with n_work + gridDim.x < 2^31), so
  // that the consumers carry no tile index through the key loop, only j; the producer takes
  // the tiles after the first from the counter when the order is dynamic. Tile: the index type
  // of a CTA's loop.
  constexpr bool kHandOver = C::kPersistent;
  using Tile = std::conditional_t<kHandOver, int, int64_t>;
  const bool dynamic = C::kPersistent && order.dynamic != 0;
  // The CTA's work tiles: t_begin + blockIdx.x, then every gridDim.x-th (persistent tables), or
  // that one tile alone (the others: no back edge, straight-line code as registers demand).
  auto next_tile = [&](int64_t t) { return C::kPersistent ? t + gridDim.x : order.t_end; };

  // Work tile t: sequence b, head h, q-block mb (TileOrderSm90); its first query m0 (negative
  // for a partial first block with align_end); skipped when none of its queries lies in the
  // sequence; the key tiles [t_lo, t_lo + n_tiles) its queries [max(m0, 0), min(m0 + BM, lq))
  // can see.
  auto tile_at = [&](int64_t t, int& b, int& h, int& mb) {
    order.template decode<kHandOver>(t, b, h, mb);
  };
  auto first_query = [&](const Seq& sq, int mb) {
    return order.align_end ? sq.lq - (order.n_mb - mb) * BM : mb * BM;
  };
  auto skipped = [&](const Seq& sq, int m0) { return m0 >= sq.lq || m0 + BM <= 0; };
  auto key_tiles = [&](const Seq& sq, int m0, int& t_lo) {
    int t_hi;
    sq.key_tiles_of<BN>(m0, BM, p, t_lo, t_hi);
    return t_hi - t_lo;
  };

  if (threadIdx.x == 0) {
    mbar_init(bar_qfull, 1);
    mbar_init(bar_qempty, 4 * C::kConsumerWarpgroups);  // lane 0 of every consumer warp
    for (uint32_t j = 0; j < 2; ++j) {
      mbar_init(bar_tfull(j), 1);
      // Every reading thread arrives (its own arrive releases its own read): the consumer
      // threads and the load warp's 32 lanes.
      mbar_init(bar_tempty(j), 128 * C::kConsumerWarpgroups + 32);
    }
    mbar_init(bar_treq, 1);
    // K/V empty: every consumer warp of this CTA, and of the other CTA of the pair when the
    // two share their K/V tiles by multicast.
    const int kv_releases = 4 * C::kConsumerWarpgroups * (kv_multicast ? 2 : 1);
    for (int s = 0; s < S; ++s) {
      mbar_init(bar_kfull(s), 1);
      mbar_init(bar_vfull(s), 1);
      mbar_init(bar_kempty(s), kv_releases);
      mbar_init(bar_vempty(s), kv_releases);
    }
    mbar_init_fence();
  }
  // With multicast, both CTAs' barriers are initialised before either CTA arrives on the
  // other's or writes into its shared memory.
  if (kv_multicast)
    cluster_sync();
  else
    __syncthreads();
  // With multicast, this CTA's rank in its cluster of two (0 or 1) is read where it is used
  // (cluster_ctarank), so that it holds no register through the loops.

  const int wg = threadIdx.x / 128;
  if (wg == 0) {
    // ---- producer ----
    setmaxnreg_dec<C::kProducerRegs>();
    // The loads of one work tile: its n_tiles key tiles from K/V row k_row0 on (KV head hk),
    // its Q rows from q_row (head h) with the first K tile.
    // Waits by every thread that calls it; the loads and their transaction counts by `leader`
    // (lane 0 of the load warp, or the one load thread).
    const bool leader = threadIdx.x == 0;
    uint32_t kv = 0, q_use = 0;  // running key-tile and Q indices (the comment block above)
    // A K or V tile into stage buffer `dst` (full barrier `bar`): its D / 64 column blocks of
    // BN rows, or with multicast this CTA's half of the rows of each (the tensor maps' boxes
    // are BN / 2 rows then), written into both CTAs of the pair, whose full barriers each count
    // the whole tile's bytes.
    auto load_kv = [&](uint32_t dst, const CUtensorMap* tm, uint32_t bar, int hk, int row) {
      mbar_arrive_expect_tx(bar, C::kKvBytes);
      if (kv_multicast) {
        const int half_row = static_cast<int>(cluster_ctarank()) * (BN / 2);
#pragma unroll
        for (int c = 0; c < kBlocks; ++c)
          tma_load_3d_multicast(dst + c * BN * 128 + half_row * 128, tm, bar, 64 * c, hk,
                                row + half_row, 0x3);
      } else {
#pragma unroll
        for (int c = 0; c < kBlocks; ++c) tma_load_3d(dst + c * BN * 128, tm, bar, 64 * c, hk, row);
      }
    };
    auto load_tile = [&](int h, int hk, int q_row, int k_row0, int n_tiles) {
      for (int i = 0; i < n_tiles; ++i) {
        const uint32_t it = kv + i, s = it % S, ph = (it / S) & 1;
        const int row = k_row0 + i * BN;
        mbar_wait(bar_kempty(s), ph ^ 1);
        if (leader) load_kv(sK + s * C::kKvBytes, &tm_k, bar_kfull(s), hk, row);
        if (i == 0) {
          mbar_wait(bar_qempty, (q_use & 1) ^ 1);
          if (leader) {
            mbar_arrive_expect_tx(bar_qfull, C::kQBytes);
#pragma unroll
            for (int c = 0; c < kBlocks; ++c)
              tma_load_3d(sQ + c * BM * 128, &tm_q, bar_qfull, 64 * c, h, q_row);
          }
        }
        mbar_wait(bar_vempty(s), ph ^ 1);
        if (leader) load_kv(sV + s * C::kKvBytes, &tm_v, bar_vfull(s), hk, row);
      }
      kv += n_tiles;
      ++q_use;
    };
    // Tile t's loads, or n_tiles = 0 for a tile that is skipped or sees no key.
    auto plan = [&](int64_t t, int& h, int& hk, int& q_row, int& k_row0) {
      int b, mb, t_lo;
      tile_at(t, b, h, mb);
      const Seq sq(p, b);
      const int m0 = first_query(sq, mb);
      if (skipped(sq, m0)) return 0;
      const int n_tiles = key_tiles(sq, m0, t_lo);
      hk = h / (p.hq / p.hkv);
      q_row = sq.q_start + m0;
      k_row0 = sq.k_start + t_lo * BN;
      return n_tiles;
    };
    if constexpr (kHandOver) {
      if (threadIdx.x == 32) {
        // ---- tile scheduler (persistent tables): the CTA's j-th work tile into slot j % 2,
        // with what the load thread needs of it (TileSlot). Static: the round-robin, up to two
        // tiles ahead. Dynamic: tile 0 is blockIdx.x's, each later one the counter's next
        // ticket, taken when the load thread asks for it (once it has issued the loads of the
        // tile before), so that a CTA claims work only when it is about to need it. In a thread
        // of its own, so that the load thread keeps within its 40 registers.
        Tile t = static_cast<Tile>(order.t_begin + blockIdx.x);
        for (uint32_t j = 0;; ++j) {
          if (j > 0) {
            if (dynamic) {
              mbar_wait(bar_treq, (j - 1) & 1);
              t = static_cast<Tile>(order.t_begin + gridDim.x + atomicAdd(p.tile_counter, 1u));
            } else {
              t = static_cast<Tile>(next_tile(t));
            }
          }
          int h = 0, hk = 0, q_row = 0, k_row0 = 0, n_tiles = 0;
          if (t < order.t_end) n_tiles = plan(t, h, hk, q_row, k_row0);
          mbar_wait(bar_tempty(j), ((j >> 1) & 1) ^ 1);
          const uint32_t slot = tile_slot(j);
          st_shared_v4_u32(slot, static_cast<uint32_t>(t), static_cast<uint32_t>(n_tiles),
                           static_cast<uint32_t>(h), static_cast<uint32_t>(hk));
          st_shared_v2_u32(slot + 16, static_cast<uint32_t>(q_row), static_cast<uint32_t>(k_row0));
          mbar_arrive(bar_tfull(j));
          if (t >= order.t_end) break;
        }
        if (dynamic) {
          // Every ticket of this CTA is taken; the last CTA to get here resets the counters.
          __threadfence();
          if (atomicAdd(p.tile_counter + 1, 1u) == gridDim.x - 1) {
            __threadfence();
            atomicExch(p.tile_counter, 0u);
            atomicExch(p.tile_counter + 1, 0u);
          }
        }
      } else if (threadIdx.x < 32) {
        // ---- load warp: the tiles as the scheduler hands them over; lane 0 issues ----
        // (A whole warp: with the one thread of the other tables ptxas 13.0 spilled here.)
        if (leader) {
          tma_prefetch_desc(&tm_q);
          tma_prefetch_desc(&tm_k);
          tma_prefetch_desc(&tm_v);
        }
        for (uint32_t j = 0;; ++j) {
          mbar_wait(bar_tfull(j), (j >> 1) & 1);
          const uint32_t slot = tile_slot(j);
          const int t = static_cast<int>(ld_shared_u32(slot));
          const int n_tiles = static_cast<int>(ld_shared_u32(slot + 4));
          const int h = static_cast<int>(ld_shared_u32(slot + 8));
          const int hk = static_cast<int>(ld_shared_u32(slot + 12));
          const int q_row = static_cast<int>(ld_shared_u32(slot + 16));
          const int k_row0 = static_cast<int>(ld_shared_u32(slot + 20));
          mbar_arrive(bar_tempty(j));  // every lane, after its own reads
          if (t >= order.t_end) break;
          if (n_tiles > 0) load_tile(h, hk, q_row, k_row0, n_tiles);
          if (dynamic && leader) mbar_arrive(bar_treq);  // the next tile, please
        }
      }
    } else if (threadIdx.x == 0) {
      // ---- load thread of a one-tile CTA (tables without the loop) ----
      tma_prefetch_desc(&tm_q);
      tma_prefetch_desc(&tm_k);
      tma_prefetch_desc(&tm_v);
      const int64_t t = order.t_begin + blockIdx.x;
      int h, hk, q_row, k_row0;
      if (t < order.t_end) {
        const int n_tiles = plan(t, h, hk, q_row, k_row0);
        if (n_tiles > 0) load_tile(h, hk, q_row, k_row0, n_tiles);
      }
    }
  } else {
    // ---- consumers ----
    setmaxnreg_inc<C::kConsumerRegs>();
    const int cw = warpgroup_uniform() - 1;  // consumer warpgroup: query rows [64 cw, 64 cw + 64)
    // The wgmma descriptors of stage 0 (SmemDesc: a k-step or stage further on is one add): Q
    // (this warpgroup's 64 rows) and K K-major, V MN-major.
    // opaque_desc: the batch size is positive, so `zero` is 0.
    const uint32_t zero = static_cast<uint32_t>(p.batch) >> 31;
    const SmemDesc dQ = opaque_desc(smem_desc_sw128(sQ + cw * 64 * 128, 16, 1024), zero);
    const SmemDesc dK = opaque_desc(smem_desc_sw128(sK, 16, 1024), zero);
    const SmemDesc dV = opaque_desc(smem_desc_sw128(sV, BN * 128, 1024), zero);
    auto stage_desc = [](SmemDesc d, uint32_t s) { return d + s * C::kKvBytes; };
    const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3;
    const int row0 = 64 * cw + 16 * warp;  // the warp's first row in the block
    const Score score(p);
    uint32_t kv = 0, q_use = 0;  // as the producer's
    // The CTA's j-th work tile: from the producer's slot (persistent tables), else the one tile.
    auto fetch = [&](uint32_t j, int64_t t_static) -> Tile {
      if constexpr (!kHandOver) {
        return t_static;
      } else {
        mbar_wait(bar_tfull(j), (j >> 1) & 1);
        const Tile t = static_cast<Tile>(ld_shared_u32(tile_slot(j)));
        mbar_arrive(bar_tempty(j));  // every thread, after its own read
        return t;
      }
    };
    uint32_t j = 0;
    for (Tile t = fetch(0, order.t_begin + blockIdx.x); t < order.t_end;
         t = fetch(++j, next_tile(t))) {
      int b, h, mb, t_lo;
      tile_at(t, b, h, mb);
      const Seq sq(p, b);
      const int m0 = first_query(sq, mb);
      if (skipped(sq, m0)) {  // uniform over the CTA
        // A multicast pair runs only where no tile is skipped (the host's check of the packed
        // totals): cu_seqlens that disagree with them would leave the other CTA waiting for
        // this one's halves forever, so stop with an error instead.
        if (kv_multicast) __trap();
        continue;
      }
      const int n_tiles = key_tiles(sq, m0, t_lo);
      const int i0 = m0 + row0 + g;  // the lane's first query (+8: its second)
      // This warpgroup's O goes out by a TMA store (warpgroup-uniform); q_late: staged in the Q
      // rows, which then go back to the producer only after the store has read them.
      const bool tma_slab =
          epilogue != 0 && m0 + 64 * cw >= 0 && m0 + 64 * cw + 64 <= sq.lq && n_tiles > 0;
      const bool q_late = tma_slab && o_in_q;

      float o[D / 8][4];
#pragma unroll
      for (int d8 = 0; d8 < D / 8; ++d8)
#pragma unroll
        for (int e = 0; e < 4; ++e) o[d8][e] = 0.f;
      float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.f, 0.f}, alpha_run[2] = {1.f, 1.f};

      // The steps of key tile i of the work tile (pipeline index kv + i: stage (kv + i) % S,
      // barrier phase ((kv + i) / S) & 1), shared by the schedules below.
      float sacc[BN / 8][4];    // S of a tile, then its probabilities in float
      uint32_t pa[BN / 16][4];  // P as wgmma A fragments (bf16/fp16 pairs)
      bool rescale = false;     // the last softmax moved a running maximum: O needs alpha_run
      // Every row of this warp (kWarpRedo) or warpgroup has a finite running maximum (uniform
      // over it): full tiles may take the speculative exponentials (softmax below). False until
      // a tile's first softmax.
      bool spec_ok = false;
      // How far a tile's row maximum may exceed the running one before it moves: kSlack, but 0
      // in the exact softmax after a failed speculation, so that scores which settle a few
      // units above the running maximum move it once instead of failing every later tile.
      float slack = kSlack;
      // S = Q K^T: D / 16 k-steps of 16 head-dim elements (32 bytes inside a 128-byte row).
      auto issue_qk = [&](int i) {
        const uint32_t it = kv + i, s = it % S;
        mbar_wait(bar_kfull(s), (it / S) & 1);
        reg_fence(sacc);
        wgmma_fence();
        // The stage's base first, then a constant per k-step: one 64-bit add with an immediate
        // per operand (an offset s * kKvBytes + c formed first became an OR, a zero high word
        // and the add).
        const SmemDesc dKs = stage_desc(dK, s);
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
          const uint32_t blk = kk / 4, in_row = (kk % 4) * 32;
          Wgmma<T, BN>::ss(sacc, dQ + (blk * BM * 128 + in_row), dKs + (blk * BN * 128 + in_row),
                           kk > 0 ? 1 : 0);
        }
        wgmma_commit();
      };
      // O += P V: BN / 16 k-steps of 16 keys (2048 bytes of V rows); B is MN-major, its N (head
      // dim) split into 64-wide column blocks BN * 128 bytes apart (the LBO).
      auto issue_pv = [&](int i) {
        const uint32_t it = kv + i, s = it % S;
        mbar_wait(bar_vfull(s), (it / S) & 1);
        reg_fence(o);
        wgmma_fence();
        const SmemDesc dVs = stage_desc(dV, s);
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) {
          Wgmma<T, D>::rs_mn(o, pa[kk], dVs + kk * 16 * 128, 1);
        }
        wgmma_commit();
      };
      // After its last read of a stage (the wgmma's, after this warp's wait_group; with kSpec a
      // K stage after the tile's softmax), the warp hands the stage back to the producer.
      auto release = [&](uint32_t bar) {
        __syncwarp();
        if (lane == 0) mbar_arrive(bar);
      };
      // A K/V stage goes back to both producers of a multicast pair (lane 1 arrives on the other
      // CTA's barrier), whose next loads write into both CTAs.
      auto release_kv = [&](uint32_t bar) {
        __syncwarp();
        mbar_arrive_local_or_peer(bar, lane == 0, kv_multicast && lane == 1);
      };
      auto kempty = [&](int i) { return bar_kempty((kv + i) % S); };
      auto vempty = [&](int i) { return bar_vempty((kv + i) % S); };
      // Q is handed back once this warp's last Q K^T has completed (with kSpec: its last
      // softmax, which may compute S again from Q), unless this warpgroup stages O in its Q rows
      // (then after the TMA store has read them, in the epilogue).
      auto release_q = [&] {
        if (!q_late) release(bar_qempty);
      };
      // ex2_poly's degree: 3 rounds 0.9% of bf16 probabilities one ulp away from the exact 2^x's
      // rounding, but 5% of fp16 ones; 4 brings fp16 to 0.2% (tests/attention/test_exp2_poly.py).
      constexpr int kPolyDegree = std::is_same_v<T, __half> ? 4 : 3;
      // The warp's 16 rows of S = Q K^T of tile i once more (kWarpRedo), by mma.sync m16n8k16
      // from the Q rows and the K stage in shared memory (both in the 128-byte swizzle: row r's
      // 16-byte chunk c at c ^ (r % 8)): its C fragments are the wgmma accumulator's rows of
      // this warp, sacc's layout. Only after a failed speculative check (rare); float32 sums of
      // the same products, in another order.
      auto recompute_s = [&](int i) {
        const uint32_t sk = sK + ((kv + i) % S) * C::kKvBytes;
        const int mat = lane >> 3, r8 = lane & 7;
#pragma unroll
        for (int ni = 0; ni < BN / 8; ++ni)
#pragma unroll
          for (int e = 0; e < 4; ++e) sacc[ni][e] = 0.f;
        // ldmatrix.x4 lane addresses: A's matrices (rows 0-7 / 8-15 of the warp's) x (k 0-7 /
        // 8-15), B's (k 0-7 / 8-15) x (keys 0-7 / 8-15) of each 16-key pair of n-blocks; a key
        // row's swizzle is r8 (key % 8). A loop, not unrolled: the registers of the fast path's
        // neighbours stay free.
        const uint32_t qrow = row0 + (mat & 1) * 8 + r8;
        const uint32_t a_row = sQ + qrow * 128, b_row = sk + ((mat >> 1) * 8 + r8) * 128;
#pragma unroll 1
        for (int kk = 0; kk < D / 16; ++kk) {
          const uint32_t ca = 2 * kk + (mat >> 1), cb = 2 * kk + (mat & 1);
          uint32_t a[4];
          sm80::ldmatrix_x4(a, a_row + (ca / 8) * (BM * 128) + (((ca % 8) ^ (qrow % 8)) << 4));
          const uint32_t b_addr = b_row + (cb / 8) * (BN * 128) + (((cb % 8) ^ r8) << 4);
#pragma unroll
          for (int j = 0; j < BN / 16; ++j) {
            uint32_t b[4];
            sm80::ldmatrix_x4(b, b_addr + j * 16 * 128);
            sm80::mma_16816<T>(sacc[2 * j], a, b[0], b[1]);
            sm80::mma_16816<T>(sacc[2 * j + 1], a, b[2], b[3]);
          }
        }
      };
      // Softmax of tile i in place (sacc becomes probabilities), as fwd_kernel (sm80) with one
      // row tile: Path<0> (every pair visible, no softcap, a positive scale) takes the maximum of
      // the raw scores and folds the scale into one FFMA per exponential; the masked paths mask
      // by index (a select, so that scores of another sequence's keys never reach P).
      // Speculative exponentials (tiles whose every pair the warp's rows see, no softcap, once
      // spec_ok): p = 2^(x - m_run) at once, without the tile's row maxima, whose FMNMX chain
      // and quad shuffles every exponential would otherwise wait for. They are the exponentials
      // the maxima would have given whenever no x exceeds m_run + kSlack (the maximum would not
      // have moved; up to ex2.approx's rounding within a few ulps of kSlack), their sum added to
      // l_run per tile rather than one by one; each lane's row sums of its p bound every p, so
      // sums within 2^kSlack in the deciding warp (warpgroup) accept it. Otherwise (a larger
      // score, inf or NaN) softmax returns false with sacc overwritten (spec_ok cleared): the
      // caller computes S again and calls softmax once more, which then takes the exact path.
      // kWarpRedo (two consumer warpgroups, 128 keys): every decision is the warp's (a vote)
      // and the warp computes its rows of S again by mma.sync (recompute_s), so no other warp
      // waits for it (measured: the forward 1-5% faster than with warpgroup decisions).
      // Otherwise (three consumer warpgroups at D=64, and the 176-key tiles at D=128, where
      // recompute_s made ptxas spill) the decisions are the warpgroup's (bar.red on its own
      // named barrier, ids 2 NW + 1 .. 3 NW) and S is computed again by its wgmma, a warpgroup
      // instruction. Not with the polynomial exponentials (a measurement switch), nor at D=256,
      // whose ping-pong kernel then spilled 4 bytes.
      constexpr bool kSpec = kPolyBlocks == 0 && D <= 128;
      constexpr bool kWarpRedo = kSpec && NW == 2 && BN == 128;
      const int spec_bar = 1 + 2 * NW + cw;
      auto softmax = [&](int i) -> bool {
        const int n0 = (t_lo + i) * BN;
        const bool full = sq.all_visible(m0 + row0, m0 + row0 + 16, n0, n0 + BN, p);
        if (kSpec && spec_ok && score.scale_log2() > 0.f && !score.capped() &&
            (kWarpRedo ? full
                       : sq.all_visible(m0 + 64 * cw, m0 + 64 * cw + 64, n0, n0 + BN, p))) {
          float lt[2] = {0.f, 0.f};
#pragma unroll
          for (int ni = 0; ni < BN / 8; ++ni)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const float pv = ex2(fmaf(sacc[ni][e], score.scale_log2(), -m_run[e >> 1]));
              sacc[ni][e] = pv;
              lt[e >> 1] += pv;
            }
          constexpr float kSpecMax = static_cast<float>(1 << static_cast<int>(kSlack));
          const bool bad = !(lt[0] <= kSpecMax && lt[1] <= kSpecMax);  // NaN is bad
          if (kWarpRedo ? __any_sync(0xffffffffu, bad) : named_bar_any<128>(spec_bar, bad)) {
            spec_ok = false;
            return false;
          }
          l_run[0] += lt[0];
          l_run[1] += lt[1];
          rescale = false;
          return true;
        }
        bool moved = false;
        auto tile = [&](auto path) {
          constexpr int kPath = decltype(path)::value;
          // The row maxima as kMaxChains independent running maxima per row (the tile table's
          // choice), combined at the end, so that the FMNMX dependency chain that every
          // exponential waits for is BN / 4 / kMaxChains deep instead of BN / 4.
          constexpr int kMaxChains = C::kMaxChains;
          // The masked paths' visible keys of the lane's two rows i0, i0 + 8, as bands of the
          // column offsets ni * 8 + (e & 1) from key n0 + 2 tq (attention_mask.h): a
          // subtraction and an unsigned compare per element, against a subtraction and three
          // compares for each pair with Seq::visible. Not with three consumer warpgroups, whose
          // 160 registers leave no room for the bands (28-112 bytes of spills in every way tried),
          // nor at D=256, whose 240 then spilled 4-12 bytes.
          constexpr bool kBands = NW == 2 && D <= 128;
          Band band[2];
          if constexpr (kPath > 0 && kBands) {
#pragma unroll
            for (int r = 0; r < 2; ++r) band[r] = sq.keys_band(i0 + 8 * r, n0 + 2 * tq, BN, p);
          }
          float mxc[2][kMaxChains];
#pragma unroll
          for (int r = 0; r < 2; ++r)
#pragma unroll
            for (int c = 0; c < kMaxChains; ++c) mxc[r][c] = -INFINITY;
#pragma unroll
          for (int ni = 0; ni < BN / 8; ++ni)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              if constexpr (kPath > 0) {
                float unused;
                const float x = score.at<kPath == 2>(sacc[ni][e], unused);
                const bool vis =
                    kBands ? band[e >> 1].has(ni * 8 + (e & 1))
                           : sq.visible(i0 + (e >> 1) * 8, n0 + ni * 8 + 2 * tq + (e & 1), p);
                sacc[ni][e] = vis ? x : -INFINITY;
              }
              float& m = mxc[e >> 1][(2 * ni + (e & 1)) % kMaxChains];
              m = fmaxf(m, sacc[ni][e]);
            }
          float mx[2], mu[2];
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            if constexpr (kMaxChains == 4)
              mx[r] = fmaxf(fmaxf(mxc[r][0], mxc[r][1]), fmaxf(mxc[r][2], mxc[r][3]));
            else
              mx[r] = mxc[r][0];
            mx[r] = quad_max(mx[r]);
            if constexpr (kPath == 0) mx[r] *= score.scale_log2();
            if (mx[r] > m_run[r] + slack) {
              const float alpha = ex2(m_run[r] - mx[r]);
              m_run[r] = mx[r];
              l_run[r] *= alpha;
              alpha_run[r] = alpha;
              moved = true;
            }
            mu[r] = m_run[r] == -INFINITY ? 0.f : m_run[r];  // nothing visible yet: p = 0
          }
#pragma unroll
          for (int ni = 0; ni < BN / 8; ++ni)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const float x = kPath > 0 ? sacc[ni][e] - mu[e >> 1]
                                        : fmaf(sacc[ni][e], score.scale_log2(), -mu[e >> 1]);
              // kPolyBlocks of the BN / 8 column blocks, spread evenly, take ex2_poly (FMA
              // pipe) instead of MUFU.EX2: a constant condition once the loop is unrolled. Full
              // and masked tiles; not the softcap path, nor masked tiles with three consumer
              // warpgroups, where its temporaries made ptxas spill at 160 registers.
              const bool poly = (kPath == 0 || (kPath == 1 && NW == 2)) &&
                                (ni * kPolyBlocks) % (BN / 8) < kPolyBlocks;
              const float pv = poly ? ex2_poly<kPolyDegree>(x) : ex2(x);
              sacc[ni][e] = pv;
              l_run[e >> 1] += pv;
            }
        };
        run_path(full && score.scale_log2() > 0.f, score.capped(), tile);
        rescale = __any_sync(0xffffffffu, moved);  // warp-uniform
        if constexpr (kSpec) {
          const bool finite = m_run[0] > -INFINITY && m_run[1] > -INFINITY;
          spec_ok = kWarpRedo ? __all_sync(0xffffffffu, finite)
                              : named_bar_all<128>(spec_bar, finite);
        }
        return true;
      };
      // The softmax of tile i, with S computed again when the speculation failed, and the
      // release of its K stage: after it with kSpec (the recomputation reads the stage), before
      // it otherwise, as S is final (the order these kernels had before: D=256 ping-pong
      // spilled 4 bytes the other way).
      auto softmax_then_release_k = [&](int i) {
        if constexpr (!kSpec) {
          release_kv(kempty(i));
          softmax(i);
        } else {
          if (!softmax(i)) {
            if constexpr (kWarpRedo) {
              recompute_s(i);
            } else {
              issue_qk(i);
              wgmma_wait<0>();
              reg_fence(sacc);
            }
            slack = 0.f;
            softmax(i);
            slack = kSlack;
          }
          release_kv(kempty(i));
        }
      };
      // O *= alpha_run where a maximum moved; only while no wgmma writing O is in flight.
      auto rescale_o = [&] {
        if (!rescale) return;
#pragma unroll
        for (int r = 0; r < 2; ++r) {
#pragma unroll
          for (int d8 = 0; d8 < D / 8; ++d8) {
            o[d8][2 * r] *= alpha_run[r];
            o[d8][2 * r + 1] *= alpha_run[r];
          }
          alpha_run[r] = 1.f;
        }
      };
      // P as wgmma A fragments: keys [16 kk, 16 kk + 16) are the accumulator's 8-column blocks
      // 2 kk and 2 kk + 1, already in the m16n8k16 A layout (as acc_to_a in the sm80 kernel).
      auto to_p = [&] {
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) {
          pa[kk][0] = pack2<T>(sacc[2 * kk][0], sacc[2 * kk][1]);
          pa[kk][1] = pack2<T>(sacc[2 * kk][2], sacc[2 * kk][3]);
          pa[kk][2] = pack2<T>(sacc[2 * kk + 1][0], sacc[2 * kk + 1][1]);
          pa[kk][3] = pack2<T>(sacc[2 * kk + 1][2], sacc[2 * kk + 1][3]);
        }
      };

      // Ping-pong (kSchedule 2): the consumer warpgroups take turns at issuing their wgmmas, in
      // a cycle 0, 1, .., NW - 1, 0, .., each waiting at its own named barrier (ids 1 .. NW: 128
      // threads waiting + 128 arriving) until the one before has issued, so that one's softmax
      // runs while the others' products do. Warpgroup 0 goes first; every turn taken is handed
      // over, except the last warpgroup's last, which nobody would wait for (every warpgroup
      // takes n_tiles + 1 turns per work tile, none for a tile without keys): the turns balance
      // within every work tile, so none is left over for the next one (the comment block at the
      // top of the kernel).
      constexpr bool kPingPong = kSchedule == 2;
      auto take_turn = [&] {
        if constexpr (kPingPong) named_bar_sync<256>(1 + cw);
      };
      auto hand_over = [&](bool last) {
        if constexpr (kPingPong)
          if (!(last && cw == NW - 1)) named_bar_arrive<256>(1 + (cw + 1) % NW);
      };

      if (n_tiles > 0) mbar_wait(bar_qfull, q_use & 1);
      if constexpr (kSchedule == 0) {
        // Serial: each tile's two products and its softmax one after another (the other
        // consumer warpgroup's work fills the tensor cores meanwhile).
        for (int i = 0; i < n_tiles; ++i) {
          issue_qk(i);
          wgmma_wait<0>();
          reg_fence(sacc);
          if constexpr (kSpec) {
            softmax_then_release_k(i);
            if (i + 1 == n_tiles) release_q();  // after a possible S recomputation
          } else {
            release_kv(kempty(i));
            if (i + 1 == n_tiles) release_q();
            softmax(i);
          }
          rescale_o();
          to_p();
          issue_pv(i);
          wgmma_wait<0>();
          reg_fence(o);
          release_kv(vempty(i));
        }
      } else if (n_tiles > 0) {
        // Overlapped (FlashAttention-3's intra-warpgroup pipelining): S of tile i + 1 and
        // P_i V_i are issued together, and the softmax of tile i + 1 runs while P_i V_i is still
        // on the tensor cores. The groups complete in order, so wait_group 1 means S_{i+1} is
        // done; O (being written) and pa (being read) are touched only after wait_group 0.
        if (kPingPong && cw == NW - 1) named_bar_arrive<256>(1);  // warpgroup 0's first turn
        take_turn();
        issue_qk(0);
        hand_over(false);
        wgmma_wait<0>();
        reg_fence(sacc);
        softmax_then_release_k(0);
        rescale_o();
        to_p();
        // The last tile is peeled off so that every wait_group sits on straight-line code:
        // ptxas checks (path-insensitively) that no accumulator of an unfinished wgmma is read,
        // and a conditional S_{i+1} made it serialise every wgmma (C7514).
        for (int i = 0; i + 1 < n_tiles; ++i) {
          take_turn();
          issue_qk(i + 1);
          issue_pv(i);
          hand_over(false);
          wgmma_wait<1>();
          reg_fence(sacc);
          softmax_then_release_k(i + 1);
          wgmma_wait<0>();
          reg_fence(o);
          release_kv(vempty(i));
          rescale_o();
          to_p();
        }
        release_q();  // the last Q K^T (of tile n_tiles - 1) and its softmax have completed
        take_turn();
        issue_pv(n_tiles - 1);
        hand_over(true);
        wgmma_wait<0>();
        reg_fence(o);
        release_kv(vempty(n_tiles - 1));
      }

      // ---- epilogue: normalise, lse (natural log), store rows in [0, lq) ----
      float inv[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const float l = quad_sum(l_run[r]);
        inv[r] = l > 0.f ? 1.f / l : 0.f;
        const int i = i0 + r * 8;
        if (tq == 0 && i >= 0 && i < sq.lq)
          p.lse[static_cast<int64_t>(h) * p.total_q + sq.q_start + i] =
              l > 0.f ? (m_run[r] + __log2f(l)) * kLn2 : -INFINITY;
      }
      // O through shared memory and a TMA store when the warpgroup's 64 rows all lie inside the
      // sequence (a TMA store clips only at the tensor's end, so a slab crossing lq would write
      // the next sequence's rows) and the tile has keys: the rows go into the staging buffer sO
      // (the table's O buffer, or the warpgroup's own Q rows: its last Q K^T has completed, and
      // the others read only their own rows), in the 128-byte swizzle the tensor map
      // expects -- row r's 16-byte chunk c at chunk c ^ (r % 8), conflict-free for the
      // accumulator layout -- then one thread stores the D / 64 column blocks. Otherwise, and
      // with epilogue == 0 (FUSEDOPS_ATTN_SM90_EPILOGUE=regs), 4-byte stores from registers.
      if (tma_slab) {
        if (!o_in_q) {
          // The O buffer outlives the tile: this warpgroup's store of the previous tile must
          // have read its rows before they are overwritten.
          if (threadIdx.x % 128 == 0) tma_store_wait_read<0>();
          named_bar_sync<128>(1 + NW + cw);
        }
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int row = 64 * cw + 16 * warp + g + 8 * r;  // row of the block; row % 8 == g
#pragma unroll
          for (int d8 = 0; d8 < D / 8; ++d8) {
            const uint32_t addr =
                sO + (d8 / 8) * BM * 128 + row * 128 + (((d8 % 8) ^ g) << 4) + 4 * tq;
            st_shared_u32(addr, pack2<T>(o[d8][2 * r] * inv[r], o[d8][2 * r + 1] * inv[r]));
          }
        }
        fence_proxy_async_smem();
        named_bar_sync<128>(1 + NW + cw);  // the warpgroup's 128 threads (1 .. NW: ping-pong)
        if (threadIdx.x % 128 == 0) {
#pragma unroll
          for (int c = 0; c < kBlocks; ++c)
            tma_store_3d(&tm_o, sO + c * BM * 128 + cw * 64 * 128, 64 * c, h,
                         sq.q_start + m0 + 64 * cw);
          tma_store_commit();
          if (q_late) {
            // O staged in the Q rows: they go back to the producer (for the next tile's Q) once
            // read, for the warpgroup's 4 warps at once.
            tma_store_wait_read<0>();
            mbar_arrive_cnt(bar_qempty, 4);
          }
        }
      } else {
        T* O = static_cast<T*>(p.out) + sq.q_start * p.o_row + static_cast<int64_t>(h) * D;
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int i = i0 + r * 8;
          if (i < 0 || i >= sq.lq) continue;
          T* dst = O + static_cast<int64_t>(i) * p.o_row + 2 * tq;
#pragma unroll
          for (int d8 = 0; d8 < D / 8; ++d8)
            *reinterpret_cast<uint32_t*>(dst + d8 * 8) =
                pack2<T>(o[d8][2 * r] * inv[r], o[d8][2 * r + 1] * inv[r]);
        }
      }

      kv += n_tiles;
      q_use += n_tiles > 0;
    }
    // The O buffer's last store must have read it before the CTA's shared memory goes.
    if (!o_in_q && threadIdx.x % 128 == 0) tma_store_wait_read<0>();
  }
  // The other CTA of a multicast pair arrives on this one's barriers until its last K/V
  // release: neither leaves before both are done.
  if (kv_multicast) cluster_sync();
#elif defined(__CUDA_ARCH__)
  __trap();  // built for an architecture without wgmma: the host never launches this
#endif
}

}  // namespace attn
}  // namespace fusedops
