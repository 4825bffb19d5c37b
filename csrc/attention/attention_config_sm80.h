// Tile table of the sm80 attention kernels: the tile sizes per head dim and, from them, the shared
// memory each kernel takes (read by attention_launch_sm80.cuh; another architecture has its own).
#pragma once

#include <cstddef>

namespace fusedops {
namespace attn {

// Tile configurations per head dim, each measured against its neighbours on the H200
// (docs/attention.md). Forward and dQ: NW warps of MT row tiles (BM = 16 MT NW
// queries), BN keys per step; dK/dV (deterministic path): BN = 16 NW keys, BM queries per step.
// Registers stay <= 255 per thread without spills in the loops (the D=128 forward spills at
// BN=64; at D=64 the forward, 96 keys per tile, takes 128 registers).
template <int D>
struct Tiles {
  static constexpr int kFwdMT = D == 128 ? 2 : 1, kFwdN = D == 128 ? 48 : 96, kFwdWarps = 4;
  static constexpr int kDkdvM = D == 128 ? 48 : 96, kDkdvWarps = 4;
  // dQ by atomics: dkdv_split_kernel, 128 keys x kSplitM queries, 8 warps; its shared memory
  // (K, V; two stages of Q, dO and their row statistics; two P^T/dS^T buffers; two mbarriers)
  // fits Hopper's 227 KiB per block, not an A100's 163: with less, run_bwd takes the dQ pass.
  static constexpr int kSplitM = D == 128 ? 64 : 128;
  static constexpr size_t kSplitSmem =
      (2 * 128 * D + 2 * 2 * kSplitM * D + 2 * 2 * 128 * kSplitM) * 2 + 2 * 2 * kSplitM * 4 + 16;
  // dQ (deterministic path): at D=64, MT=2 with 32-key tiles (MT=2 x 64 keys spills 68 bytes
  // since the masked tiles have their own copy; MT=1 was 3% slower at L=4096).
  static constexpr int kDqMT = D == 128 ? 1 : 2, kDqN = D == 128 ? 64 : 32, kDqWarps = 4;

  // Block sizes that follow, and the dynamic shared memory of each kernel in bytes (fp16/bf16
  // elements, 2 bytes; float32 row statistics).
  static constexpr int kElem = 2;
  static constexpr int kFwdM = 16 * kFwdMT * kFwdWarps;  // queries per forward CTA
  static constexpr int kDkdvN = 16 * kDkdvWarps;         // keys per dK/dV CTA
  static constexpr int kDqM = 16 * kDqMT * kDqWarps;     // queries per dQ CTA
  // Forward: Q (BM x D), K and V in two stages (BN x D each).
  static constexpr size_t kFwdSmem = (kFwdM + 4 * kFwdN) * D * kElem;
  // dK/dV: K, V (BN x D); Q, dO in two stages (BM x D); lse, delta in two stages (BM).
  static constexpr size_t kDkdvSmem = (2 * kDkdvN + 4 * kDkdvM) * D * kElem + 4 * kDkdvM * 4;
  // dQ: Q, dO (BM x D); K, V in two stages (BN x D).
  static constexpr size_t kDqSmem = (2 * kDqM + 4 * kDqN) * D * kElem;
};

}  // namespace attn
}  // namespace fusedops
