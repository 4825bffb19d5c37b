// Tile table of the Hopper (sm_90a) attention backward: block sizes, pipeline depth, warp roles
// and the shared memory they take (read by attention_bwd_kernel_sm90.cuh and
// attention_launch_bwd_sm90.cuh).
#pragma once

#include <cstddef>

namespace fusedops {
namespace attn {

// The tiles follow FlashAttention-3's published backward shapes (keys as wgmma's M, 128 keys per
// CTA in two consumer warpgroups of 64) and the register budget; they have not been measured
// against neighbouring shapes yet (the stages have).
template <int D, int BM = D == 128 ? 64 : 128>
struct TilesBwdSm90 {
  static_assert(D == 64 || D == 128, "the sm90 backward takes head dim 64 or 128");
  static_assert(BM == (D == 128 ? 64 : 128) || (D == 128 && BM == 80),
                "query steps: 64 (D=128), 128 (D=64), or 80 (D=128, transposed dQ)");
  // Keys per CTA: two consumer warpgroups of 64 keys (wgmma's M) each, sharing every Q/dO tile.
  static constexpr int kBlockN = 128;
  // Queries per step. Per consumer thread the dK and dV accumulators take 2 D / 2 floats
  // (64 keys x D over 128 lanes) and S^T, dP^T 2 BM / 2: D=128, BM=64: 128 + 64; D=64, BM=128:
  // 64 + 128 -- 192 floats either way, within the consumers' 240 registers; D=128, BM=80:
  // 128 + 80 = 208.
  static constexpr int kBlockM = BM;
  // dQ of a step. BM a multiple of 64: dQ = dS K (queries x D) is one m64n64 accumulator per
  // consumer warpgroup: at D=128 the warpgroups split the head dim (columns 64 w + [0, 64)), at
  // D=64 the queries (rows 64 w). BM = 80 (kDqT; no m80 wgmma): dQ^T = K^T dS^T (D x queries),
  // an m64n80 accumulator per warpgroup, head-dim rows 64 w + [0, 64), from dS stored queries x
  // keys (K-major, the B of that product).
  static constexpr bool kDqT = BM % 64 != 0;
  static constexpr int kDqRowSplit = kDqT ? 1 : kBlockM / 64;  // 1 at D=128, 2 at D=64
  static_assert(kDqT || (kBlockM / 64) * (D / 64) == 2);
  // Q/dO stages: 3 (192 KiB of shared memory) measured no faster than 2 on the H200
  // (2026-12-01, bf16, B*L = 16384, H*D = 2048, TFLOP/s 2 / 3 stages: D=128 L=4096 535/509,
  // L=16384 547/537; D=64 L=4096 436/436, L=16384 462/463).
  static constexpr int kStages = 2;
  static constexpr int kConsumerWarpgroups = 2;
  static constexpr int kThreads = 128 * (1 + kConsumerWarpgroups);
  // setmaxnreg: 24 + 2 x 240 registers per lane = 504, the 168 x 3 the CTA holds at entry
  // (65536 / 384 rounded down to 8). The consumers peak near 240 (dK, dV, S^T, dP^T: 192
  // floats at both head dims).
  static constexpr int kProducerRegs = 24, kConsumerRegs = 240;
  // The persistent kernels' TMA thread keeps its tile loop's state (at 24 registers it spilled
  // 20-32 bytes): 32 + 2 x 232 = 496.
  static constexpr int kProducerRegsPersist = 32, kConsumerRegsPersist = 232;
  // The deterministic mode's producer warpgroup also runs the dQ writer warp (its loop state,
  // the turn and the addresses of a step): 40 + 2 x 232 = 504.
  static constexpr int kProducerRegsDet = 40, kConsumerRegsDet = 232;

  // Shared memory (bytes, 2-byte elements). Every tile is stored as column blocks of
  // rows x 128 bytes (64 elements, 128-byte swizzle), each 1024-byte aligned.
  static constexpr int kElem = 2;
  static constexpr int kKvBytes = kBlockN * D * kElem;  // K or V
  static constexpr int kQBytes = kBlockM * D * kElem;   // one Q or dO stage
  // dS^T (keys x queries) in kBlockM / 64 column blocks of kBlockN rows, or (kDqT) dS
  // (queries x keys) in kBlockN / 64 column blocks of kBlockM rows; two buffers.
  static constexpr int kDsBytes = kBlockN * kBlockM * kElem;
  static constexpr int kKOff = 0;
  static constexpr int kVOff = kKOff + kKvBytes;
  static constexpr int kQOff = kVOff + kKvBytes;
  static constexpr int kDoOff = kQOff + kStages * kQBytes;
  static constexpr int kDsOff = kDoOff + kStages * kQBytes;
  // Row statistics per stage: lse2 and delta (BM floats each, bwd_prep_kernel_sm90's layout).
  static constexpr int kStatsOff = kDsOff + 2 * kDsBytes;
  static constexpr int kBarOff = kStatsOff + kStages * 2 * kBlockM * 4;
  // Barriers: K/V full; per stage Q/dO full, Q/dO empty; two dQ "full" (the deterministic
  // mode's staging buffers; else the dQ additions of a tile done, for the overlapped conversion's
  // counts, alternating by tile in the persistent kernels) and two dQ "empty" (the deterministic
  // mode's); (persistent kernels) the second K/V buffer's full, each K/V buffer's empty.
  static constexpr int kNumBars = 1 + 2 * kStages + 4 + 3;
  // The tile slots (attention_bwd_kernel_sm90.cuh): the deterministic mode's ticket, or the
  // tile of each K/V buffer; 16 bytes.
  static constexpr int kTicketOff = kBarOff + kNumBars * 8;
  // The deterministic mode's two dQ staging buffers: a step's float32 dQ block (BM x D) in the
  // accumulator's tile order, which the dQ writer warp adds to dq_acc. At D=128 a region of its
  // own (2 x 32 KiB); at D=64 (BM = 128) no room is left for one, and each consumer warpgroup
  // stages its 64 x 64 piece (16 KiB) over the dS^T column block that only its own dQ products
  // read (kDqInDs), in the dS^T buffer of the step.
  static constexpr bool kDqInDs = D == 64;
  static constexpr int kDqBytes = kBlockM * D * 4;
  static constexpr int kDqOff = (kTicketOff + 16 + 1023) / 1024 * 1024;
  // + 1024: base alignment. kSmemDet: the deterministic kernel's.
  static constexpr size_t kSmem = kTicketOff + 16 + 1024;
  // (kDqT has no deterministic mode.)
  static constexpr size_t kSmemDet =
      kDqInDs || kDqT ? kSmem : kDqOff + 2 * kDqBytes + 1024;
  // The persistent kernels (every kernel but the deterministic mode's and the 80-query steps'):
  // a second K/V buffer, so that the next tile's K and V load while this one's last steps run,
  // where the deterministic mode's staging buffers would be (kDqOff). D=128: 227 KiB in all.
  static constexpr bool kPersistFits = !kDqT;
  static constexpr int kKv1Off = kDqOff;
  static constexpr int kKvDelta = kKv1Off - kKOff;  // buffer 1 = buffer 0 + kKvDelta (K and V)
  static constexpr size_t kSmemPersist = kKv1Off + 2 * kKvBytes + 1024;
  static_assert(!kPersistFits || kSmemPersist <= 227 * 1024, "the persistent kernel's buffers");
  static_assert(!kDqInDs || kDqBytes == kDsBytes, "a dQ block per dS^T buffer");
  static_assert(kBlockM % 16 == 0 && kBlockM <= 128, "whole k-steps; stats_rows_sm90's bound");
  static_assert(kQBytes % 1024 == 0 && kKvBytes % 1024 == 0 && kDsBytes % 1024 == 0);
  static_assert(kSmem <= 227 * 1024 && kSmemDet <= 227 * 1024,
                "exceeds Hopper's shared memory per block");
};

}  // namespace attn
}  // namespace fusedops
