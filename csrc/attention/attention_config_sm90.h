// Tile table of the Hopper (sm_90a) attention forward: block sizes, pipeline depth, warp roles
// and the shared memory they take (read by attention_fwd_kernel_sm90.cuh and
// attention_launch_sm90.cuh).
#pragma once

#include <cstddef>

namespace fusedops {
namespace attn {

// The key tile of each head dim (queries are 128 everywhere). D=64 and D=128: 128 keys,
// FlashAttention-3's published shape for these head dims. D=256: 80 keys, FlashAttention-3's
// shape for hdim 256, chosen over 64 by the budgets (ptxas, sm_90a): O is 64 x 256 per consumer
// warpgroup, 128 floats a thread, S 40 and the bf16 P 20 more; shared memory Q 64 KiB + 2 stages
// x (K 40 + V 40) = 224 KiB of the 227. Neither D=256 shape has been timed yet. The tiles of
// D=64/128 have not been measured against neighbouring shapes either (the schedule table below
// has, on the H200); 176 keys at D=128 is built as a measurement option
// (FUSEDOPS_ATTN_SM90_BLOCK_N, attention_launch_sm90.cuh).
constexpr int sm90_block_n(int head_dim) { return head_dim == 256 ? 80 : 128; }

// kWarpgroups: consumer warpgroups, 2 (128 queries) or, at D=64 with 128 keys, 3 (192 queries,
// FlashAttention-3's published hdim-64 tile; sm90_consumer_warpgroups below picks).
template <int D, int kN = sm90_block_n(D), int kWarpgroups = 2>
struct TilesSm90 {
  static_assert(D == 64 || D == 128 || D == 256, "the sm90 forward takes head dim 64, 128 or 256");
  static_assert(kWarpgroups == 2 || (kWarpgroups == 3 && D == 64 && kN == 128),
                "3 consumer warpgroups only at D=64 with 128 keys (registers)");
  // Queries per CTA: kWarpgroups consumer warpgroups of 64 rows (wgmma's M), sharing each K/V
  // tile, so that a tile streamed once from L2 feeds 128 (192) rows.
  static constexpr int kBlockM = 64 * kWarpgroups;
  // Keys per tile (sm90_block_n): S = Q K^T is one m64nN accumulator (N / 2 floats per thread)
  // and the P V product N / 16 k-steps. At D=128, 128 keeps S + O (64 + 64 floats) and the bf16
  // P (32 registers) within the consumers' 240 registers; at D=256, 80 keys (40 + 128 + 20).
  static constexpr int kBlockN = kN;
  static_assert(kBlockN % 16 == 0 && kBlockN <= 256,
                "key tiles are whole k-steps of P V (16 keys) and at most wgmma's N (256)");
  // K/V stages: 2 at D=128 (Q 32 KiB + 2 x (K 32 + V 32) = 160 KiB of the 227 KiB, + the O
  // buffer's 32 below; 208 KiB with 176 keys) and D=256 (224 KiB); 3 at D=64, where the tiles are
  // half the size and more loads in flight hide more latency.
  static constexpr int kStages = D == 64 ? 3 : 2;
  // Independent running maxima per row in the softmax (a shallower FMNMX chain before the
  // exponentials). 4 at D=64 and 256, where the H200 runs at git 657fd6b passed parity and
  // timed D=64 at 440 TFLOP/s at L=4096 (cuDNN 478 in that run; one chain, git bc3f69e: 422
  // against 458). 1 at D=128: with 4 it timed 587-594 at L=4096 against cuDNN's
  // 624-645, where one chain had timed 660 against 612, so D=128 keeps the one-chain code.
  static constexpr int kMaxChains = D == 128 ? 1 : 4;
  static_assert(kMaxChains == 1 || kMaxChains == 4, "the softmax combines one or four chains");
  // Warpgroup 0 produces (one thread issues every TMA load), warpgroups 1.. compute.
  static constexpr int kConsumerWarpgroups = kWarpgroups;
  static constexpr int kThreads = 128 * (1 + kConsumerWarpgroups);
  // Softmax exponentials on the FMA pipe (ex2_poly, device_utils.cuh) instead of MUFU.EX2, for
  // this many of the kBlockN / 8 = 16 column blocks of a tile, when the polynomial is selected
  // (sm90_auto_exp2 below, FUSEDOPS_ATTN_SM90_EXP2=poly; built for the 128-key tiles and the
  // overlapped schedules only). At D=64 a 128 x 128 tile takes about as many MUFU cycles
  // (16384 / 16 per clock) as tensor-core cycles, so moving a share of them to the FMA pipe,
  // which issues the 9-10 instructions of a polynomial, may pay; at D=128 the tensor cores take
  // twice as long per tile, at D=256 four times. Estimates, to be measured on the H200.
  static constexpr int kExp2PolyBlocks = kN != 128 ? 0 : D == 64 ? 3 : D == 128 ? 2 : 0;
  // Whether a CTA loops over work tiles (attention_fwd_kernel_sm90.cuh): the loop's back edge
  // keeps the tile bookkeeping and the shared-memory addresses live through the key loop, which
  // ptxas (13.0, sm_90a) fits next to the accumulators -- O (D / 2 floats a thread), S
  // (BN / 2) and P (BN / 4 packed pairs) -- when they leave 72 of the consumers' 232
  // registers (160 + 72 at D=128 and 128 keys spills nothing), or in the 160 of three consumer
  // warpgroups at D=64 (128 + 32: the consumers' highest register is R157, no local memory),
  // while 188 (D=256, 80 keys) or 196 (176 keys) at 240 spill 100-200 bytes. Tiles without it
  // run one work tile per CTA (the same code, no back edge; grid = the number of tiles).
  static constexpr int kAccRegs = D / 2 + kBlockN / 2 + kBlockN / 4;
  static constexpr bool kPersistent = kWarpgroups == 3 || kAccRegs + 72 <= 232;
  // setmaxnreg: the kernel's cap at entry is 65536 / (128 (1 + kWarpgroups)) rounded down to 8
  // -- 168 a lane with two consumer warpgroups, 128 with three -- which the warpgroups' new
  // limits share. Two consumers: 40 + 2 x 232 = 504 a lane of each warpgroup in persistent
  // tables (the producer warpgroup's tile scheduler and load threads need the 40: at 24 their
  // tile records spill), 24 + 2 x 240 in one-tile tables (the sum may not exceed 3 x 168:
  // setmaxnreg.inc would wait for registers that never come free). Three: 32 + 3 x 160 = 512, where O 32
  // + S 64 + P 32 registers at D=64 leave 32 for the rest, and the producer fits its 32.
  static constexpr int kProducerRegs = kWarpgroups == 3 ? 32 : kPersistent ? 40 : 24;
  static constexpr int kConsumerRegs = kWarpgroups == 3 ? 160 : kPersistent ? 232 : 240;
  // setmaxnreg.inc waits until the registers are free: a sum above the CTA's allocation hangs.
  static_assert(kProducerRegs + kConsumerWarpgroups * kConsumerRegs <=
                (65536 / kThreads) / 8 * 8 * (1 + kConsumerWarpgroups));

  // Shared memory (bytes, 2-byte elements). Every tile is stored as D / 64 column blocks of
  // rows x 128 bytes (TMA boxes of 64 elements, 128-byte swizzle), each 1024-byte aligned: the
  // swizzle atom is 8 rows, so BN must be a multiple of 8 (16 above).
  static constexpr int kElem = 2;
  static constexpr int kQBytes = kBlockM * D * kElem;
  static constexpr int kKvBytes = kBlockN * D * kElem;  // one K or one V tile
  static constexpr int kQOff = 0;
  static constexpr int kKOff = kQOff + kQBytes;
  static constexpr int kVOff = kKOff + kStages * kKvBytes;
  // Barriers: Q full, Q empty; per stage K full, K empty, V full, V empty; then the two slots
  // of the tile scheduler's hand-over (full, empty each) and the load thread's request.
  static constexpr int kNumBars = 2 + 4 * kStages + 5;
  // The epilogue's staging buffer of O (BM x D, the layout of Q), when it fits next to the
  // pipeline: the Q rows are then free for the next work tile's Q as soon as the last Q K^T has
  // completed (D=128: 32 + 128 + 32 KiB; D=64: 16 + 96 + 16 KiB). Without it (kSeparateO
  // false) O is staged in the Q rows, and Q is released only after the TMA store has read
  // them (attention_fwd_kernel_sm90.cuh).
  static constexpr bool kSeparateO =
      kVOff + kStages * kKvBytes + kQBytes + kNumBars * 8 + 16 + 2 * 32 + 1024 <= 227 * 1024;
  static constexpr int kOOff = kVOff + kStages * kKvBytes;  // used only when kSeparateO
  static constexpr int kBarOff = kOOff + (kSeparateO ? kQBytes : 0);
  // The two work-tile slots (32 bytes each: the tile and its loads) through which the tile
  // scheduler thread hands the tiles of a persistent CTA to the load thread and the consumers
  // (attention_fwd_kernel_sm90.cuh).
  static constexpr int kTileSlotOff = (kBarOff + kNumBars * 8 + 15) / 16 * 16;
  // + 1024: the dynamic shared memory base is rounded up to 1024 bytes in the kernel.
  static constexpr size_t kSmem = kTileSlotOff + 2 * 32 + 1024;
  static_assert(kQBytes % 1024 == 0 && kKvBytes % 1024 == 0);
  static_assert(kSmem <= 227 * 1024, "exceeds Hopper's shared memory per block");
};

// The consumers' schedule (attention_fwd_kernel_sm90.cuh's kSchedule: 0 serial, 1 overlap,
// 2 ping-pong) for a call, from the first H200 timing (git 2a112fd, 2026-12-01, bf16,
// B*L = 16384, H*D = 2048, TFLOP/s overlap / pingpong):
//   D=64: ping-pong wins or ties everywhere -- L=1024 335/342, causal 217/230; 4096 410/415,
//     causal 352/356; 16384 433/434, causal 412/422.
//   D=128 non-causal: overlap -- 1024 473/471, 4096 632/586, 16384 617/614.
//   D=128 causal: ping-pong up to L=2048 (1024: 320/336), overlap beyond (4096: 495/462;
//     16384 601/607 is within the run's spread, and 4096 is not).
// Timed again with the persistent tile scheduler, 3 interleaved rounds each, TFLOP/s overlap /
// ping-pong at D=128: git 8c12dec non-causal 4096 659/658, 16384 643/659,
// causal 4096 578/598, 16384 628/637; git 000cc76 non-causal 16384 630/648,
// causal 4096 577/565, 16384 621/622 (and the same overlap kernel at 4096 non-causal 605 and
// 621 under two names: the spread). Ping-pong won both times only for non-causal calls of
// 16384 keys, so D=128 took it for non-causal calls from 8192 keys. With the speculative
// exponentials (a shorter softmax to hide) overlap is ahead there (H100 80GB, git 31fcce3,
// 2026-12-06, 5 interleaved rounds, TFLOP/s overlap / ping-pong, both with K/V multicast:
// L=8192 688/670, 16384 708/678; without multicast 660/655 and 706/665; at 4096 overlap 666
// without multicast, ping-pong 645 with it), so non-causal D=128 takes overlap at every length.
// D=64 took ping-pong from the first timing, made with 128-query tiles. With the 192-query
// tiles (the D=64 default since) overlap is ahead at every length, causal or not (H100 80GB,
// git f5a182a, 2026-12-06, forward only, medians of 7 interleaved rounds, TFLOP/s overlap /
// ping-pong: L=1024 400/395, causal 287/287; 2048 466/455, causal 379/366; 4096 489/475,
// causal 438/433; 16384 523/510, causal 497/489; in a first run of 5 rounds 8192 523/503,
// causal 493/469; at git cc80059, 5 rounds: 1024 401/407, causal 286/286; 4096 493/482,
// causal 447/445; 16384 527/524, causal 511/510), so D=64 takes overlap: level or ahead.
// FUSEDOPS_ATTN_SM90_SCHEDULE overrides it, for measurement (attention_launch_sm90.cuh).
// D=256: overlap, unmeasured (FlashAttention-3 takes turns between its consumer warpgroups only
// up to hdim 128); the place to change once check_attention_sm90.py --dims 256 has timed it.
// Causal D=128 took ping-pong up to 2048 keys; with the speculative exponentials overlap is
// level at 1024 and ahead at 2048 (H100 80GB, 2026-12-06, 9 interleaved rounds, TFLOP/s overlap
// / ping-pong: git 63eab54 L=1024 404/404, 2048 512/498; with this table 1024 399/402, 2048
// 507/491, 4096 576/557). So every head dim, mask and length takes overlap; ping-pong stays a
// measurement variant.
constexpr int sm90_auto_schedule(int /*head_dim*/, bool /*causal*/, int /*max_k*/) {
  return 1;
}

// Consumer warpgroups of a call's CTA (TilesSm90's kWarpgroups), from an H200 timing of
// benchmarks/check_attention_sm90.py (git ae6b1d6, 2026-12-01, bf16, B*L = 16384, H*D = 2048,
// ping-pong, TFLOP/s 128 / 192 queries per CTA):
//   D=64: L=1024 347/364, causal 251/216; 4096 402/463, causal 355/378; 16384 415/501, causal
//     398/471. Causal calls of at most 2048 keys then kept 128 queries: their q-blocks counted
//     from the start, so a partial last block of 192 rows read every key tile. Counted from the
//     end (TileOrderSm90::align_end; git 32f1a4a, 128 / 192): causal L=1024
//     272/282, 2048 332/362. So 192 queries (3 warpgroups) at D=64 everywhere.
//   D=128/256: 2 (the 192-query tile is built for D=64 only).
constexpr int sm90_consumer_warpgroups(int head_dim, bool /*causal*/, int /*max_k*/) {
  return head_dim == 64 ? 3 : 2;
}

// Whether the softmax uses ex2_poly for TilesSm90's kExp2PolyBlocks of its column blocks: no.
// In the same H200 timing the polynomial was slower than MUFU.EX2 at every point (e.g. D=128,
// L=4096: 560 against 633 TFLOP/s; D=64, L=16384: 397 against 415), so it stays a measurement
// switch (FUSEDOPS_ATTN_SM90_EXP2=poly).
constexpr bool sm90_auto_exp2(int /*head_dim*/, bool /*causal*/) { return false; }

// Whether the forward runs persistent (one CTA per SM looping over work tiles, the longest
// first) or one CTA per tile, from the same H200 timing (TFLOP/s persistent / one per tile):
//   D=128: L=4096 633/561, causal 504/487; 16384 628/594, causal 511/568; L=1024 509/448,
//     causal 380/337. D=64 (128 queries): 4096 402/390, causal 355/345; 16384 415/413, causal
//     398/406.
// With the static round-robin order: persistent everywhere except long causal (or windowed)
// calls at D=128, where the one-CTA-per-tile grid's hardware scheduler balanced L=16384 better
// (measured at 4096 and 16384 keys only; the switch sits between them, at 8192). With the
// dynamic tile scheduler (`dynamic`: unequal tiles, TileOrderSm90), persistent everywhere: it
// balances the tiles as the hardware scheduler does and keeps the overlap across tiles (H200,
// git ed082ad, causal D=128, TFLOP/s dynamic / one CTA per tile: L=1024 409/351, 4096 557/531,
// 16384 624/558).
constexpr bool sm90_auto_persistent(int head_dim, bool causal, int max_k, bool dynamic) {
  return dynamic || !(causal && head_dim == 128 && max_k >= 8192);
}

// Whether calls whose tiles all see the same keys (no mask or window, equal lengths; the launcher
// checks the rest) run in clusters of two CTAs that share each K/V tile by TMA multicast
// (attention_fwd_kernel_sm90.cuh): half the K/V traffic from L2 per query (FlashAttention-3 does
// this for 16-bit inputs from head dim 128). On at D=128 from 8192 keys: since the consumers
// release a stage by two predicated arrivals (git d511626; before, a branch between the local and
// the remote arrival cost every release a convergence barrier), it is 4-5% faster there on an H100
// 80GB (2026-12-05, git e941e75, bf16, B*L = 16384, H*D = 2048, five interleaved rounds, forward
// TFLOP/s with / without): D=128 L=1024 558/574, 2048 597/594, 4096 623/627, 8192 646/623, 16384
// 663/634 (FA4 659 and 674 at 8192 and 16384 in the same run); D=64 level (L=4096 484/481, 8192
// 518/517, 16384 530/525). Before that change (H200, git 07324d0) it was level or slower: D=128
// L=4096 601/604, L=16384 621/615; D=64 L=4096 459/473. Under the overlap schedule (H100 80GB,
// git 31fcce3, with / without): L=8192 688/660, 16384 708/706. FUSEDOPS_ATTN_SM90_MULTICAST
// overrides it.
constexpr bool sm90_auto_multicast(int head_dim, int max_k) {
  return head_dim == 128 && max_k >= 8192;
}

}  // namespace attn
}  // namespace fusedops
