// PTX wrappers for the Hopper (sm_90a) tensor-core path: mbarrier transactions, TMA tile loads
// and stores (cp.async.bulk.tensor), wgmma with shared-memory descriptors (128-byte swizzle) and its
// fence / commit / wait, and setmaxnreg. Raw PTX rather than CuTe atoms, so that the extension
// keeps no build dependency beyond torch; every layout assumption is written out below.
//
// Everything here is device code that needs sm_90a (wgmma, setmaxnreg); callers guard their
// kernel bodies by __CUDA_ARCH_FEAT_SM90_ALL (the same sources are also compiled for sm_80).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>

namespace fusedops {
namespace sm90 {

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// ---- mbarrier ----------------------------------------------------------------------------
__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
// Makes the initialised barriers visible to the async proxy (TMA) and to the other threads
// (followed by a __syncthreads in the caller).
__device__ __forceinline__ void mbar_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
// Arrives once and adds `bytes` to the transactions the current phase waits for.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// Arrives `count` times at once (as many threads' arrivals).
__device__ __forceinline__ void mbar_arrive_cnt(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(count)
               : "memory");
}
// Waits until the phase of parity `parity` has completed. A fresh barrier is in phase 0, and
// waiting for parity 1 (the phase "before" it) returns at once: producers start with parity 1 on
// their empty-slot barriers.
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred done;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_%=;\n}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}

// ---- clusters -------------------------------------------------------------------------------
// The calling CTA's rank in its cluster.
__device__ __forceinline__ uint32_t cluster_ctarank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
  return r;
}
// One arrival on the barrier at offset `bar` of this CTA where `local`, and one on the same
// barrier of the other CTA of a cluster of two where `peer`, with the default semantics
// (release, CTA scope). For handing back a buffer whose reads have completed (a wgmma's
// shared-memory operands after its wait_group): the other CTA's next write into it needs no
// ordering beyond the arrival itself; release.cluster would cost a MEMBAR.ALL.GPU per arrival
// (nvcc 13.0, sm_90a). Predicated instructions, not a branch: a branch between the two costs a
// warp convergence barrier (BSSY / BSYNC) and a reload of the condition per call, on the
// consumers' path from one wgmma's wait to the next wgmma. The peer's address is computed
// either way (address arithmetic only, hoisted by ptxas into uniform registers).
__device__ __forceinline__ void mbar_arrive_local_or_peer(uint32_t bar, bool local, bool peer) {
  asm volatile(
      "{\n.reg .pred pl, pp;\n.reg .b32 remote;\n"
      "setp.ne.b32 pl, %1, 0;\n"
      "setp.ne.b32 pp, %2, 0;\n"
      "@pl mbarrier.arrive.shared::cta.b64 _, [%0];\n"
      "mapa.shared::cluster.u32 remote, %0, %3;\n"
      "@pp mbarrier.arrive.shared::cluster.b64 _, [remote];\n}\n" ::"r"(bar),
      "r"(static_cast<int>(local)), "r"(static_cast<int>(peer)), "r"(cluster_ctarank() ^ 1u)
      : "memory");
}
// Every thread of every CTA of the cluster: arrive (release), then wait for all (acquire).
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;\n" ::: "memory");
}

// ---- TMA -----------------------------------------------------------------------------------
// A 3-D tile (coordinates innermost first, in elements) from the tensor map at `tmap` (a
// __grid_constant__ kernel parameter) into shared memory at `dst`; completes `bytes` of the
// transaction count on `bar`. Elements outside the tensor are zero-filled (and still counted).
__device__ __forceinline__ void tma_load_3d(uint32_t dst, const void* tmap, uint32_t bar, int c0,
                                            int c1, int c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4, %5}], [%2];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(tmap)), "r"(bar), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
}
// The same tile multicast to the CTAs of the cluster in `cta_mask` (bit r: the CTA of rank r):
// each receives it at the same shared-memory offset `dst`, and the transaction bytes complete
// on its own barrier at the offset `bar`.
__device__ __forceinline__ void tma_load_3d_multicast(uint32_t dst, const void* tmap, uint32_t bar,
                                                      int c0, int c1, int c2, uint16_t cta_mask) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      ".multicast::cluster [%0], [%1, {%3, %4, %5}], [%2], %6;\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(tmap)), "r"(bar), "r"(c0), "r"(c1), "r"(c2), "h"(cta_mask)
      : "memory");
}
__device__ __forceinline__ void tma_prefetch_desc(const void* tmap) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(tmap)) : "memory");
}

// A 3-D tile from shared memory at `src` (the same 128-byte-swizzled layout the loads write)
// to the tensor map's tile at the given coordinates; rows past the tensor's end are not written.
// Completion is tracked per thread by bulk groups: commit, then wait (".read": until the shared
// memory has been read, after which it may be reused or the CTA may exit).
__device__ __forceinline__ void tma_store_3d(const void* tmap, uint32_t src, int c0, int c1,
                                             int c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.global.shared::cta.tile.bulk_group [%0, {%2, %3, %4}], [%1];\n"
      ::"l"(reinterpret_cast<uint64_t>(tmap)), "r"(src), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
}
// Adds a dense 4-D float32 box at `src` (innermost coordinate fastest) into the tensor map's
// box at the given coordinates, element by element, in the copy engine (`.add`); nothing outside
// the tensor is touched. Completion as tma_store_3d.
__device__ __forceinline__ void tma_reduce_add_4d(const void* tmap, uint32_t src, int c0, int c1,
                                                  int c2, int c3) {
  asm volatile(
      "cp.reduce.async.bulk.tensor.4d.global.shared::cta.add.tile.bulk_group"
      " [%0, {%2, %3, %4, %5}], [%1];\n" ::"l"(reinterpret_cast<uint64_t>(tmap)),
      "r"(src), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
}
// The same box stored (no addition).
__device__ __forceinline__ void tma_store_4d(const void* tmap, uint32_t src, int c0, int c1, int c2,
                                             int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.global.shared::cta.tile.bulk_group [%0, {%2, %3, %4, %5}], [%1];\n"
      ::"l"(reinterpret_cast<uint64_t>(tmap)), "r"(src), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
}
__device__ __forceinline__ void tma_store_commit() {
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void tma_store_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory");
}
// 2-D versions for plain row-major matrices (coordinates innermost first, in elements): the
// GEMM operands and outputs. Same completion rules as the 3-D ones.
__device__ __forceinline__ void tma_load_2d(uint32_t dst, const void* tmap, uint32_t bar, int c0,
                                            int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4}], [%2];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(tmap)), "r"(bar), "r"(c0), "r"(c1)
      : "memory");
}
__device__ __forceinline__ void tma_store_2d(const void* tmap, uint32_t src, int c0, int c1) {
  asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.tile.bulk_group [%0, {%2, %3}], [%1];\n"
               ::"l"(reinterpret_cast<uint64_t>(tmap)), "r"(src), "r"(c0), "r"(c1)
               : "memory");
}
// Waits until at most N of this thread's committed bulk groups are pending, writes to global
// memory included (not only the shared-memory reads, as tma_store_wait_read).
template <int N>
__device__ __forceinline__ void tma_store_wait() {
  asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(N) : "memory");
}
// Orders this thread's generic-proxy shared-memory writes before later async-proxy accesses
// (a TMA store reading them), once the writers have also synchronised with the issuing thread.
__device__ __forceinline__ void fence_proxy_async_smem() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
__device__ __forceinline__ void st_shared_u32(uint32_t addr, uint32_t v) {
  asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(addr), "r"(v) : "memory");
}
__device__ __forceinline__ void st_shared_v2_u32(uint32_t addr, uint32_t a, uint32_t b) {
  asm volatile("st.shared.v2.u32 [%0], {%1, %2};\n" ::"r"(addr), "r"(a), "r"(b) : "memory");
}
__device__ __forceinline__ void st_shared_v4_u32(uint32_t addr, uint32_t a, uint32_t b,
                                                 uint32_t c, uint32_t d) {
  asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(a), "r"(b),
               "r"(c), "r"(d)
               : "memory");
}
// Four 8 x 8 b16 matrices from registers to shared memory (sm_90): register k of every lane
// holds matrix k's row lane / 4, columns 2 (lane % 4) and + 1 (the mma / wgmma accumulator
// fragment layout); lanes 8 k .. 8 k + 7 give the 16-byte-aligned addresses of matrix k's rows.
__device__ __forceinline__ void stmatrix_x4(uint32_t addr, uint32_t a, uint32_t b, uint32_t c,
                                            uint32_t d) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr),
               "r"(a), "r"(b), "r"(c), "r"(d)
               : "memory");
}
// The same with .trans: matrix k's element (row r, column c) -- register k of lane 4 r + c / 2 --
// goes to column r of its row c, so lanes 8 k .. 8 k + 7 give the addresses of the rows that
// hold the fragment's columns 0..7 (an accumulator tile stored transposed).
__device__ __forceinline__ void stmatrix_x4_trans(uint32_t addr, uint32_t a, uint32_t b,
                                                  uint32_t c, uint32_t d) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(
                   addr),
               "r"(a), "r"(b), "r"(c), "r"(d)
               : "memory");
}
__device__ __forceinline__ uint32_t ld_shared_u32(uint32_t addr) {
  uint32_t v;
  asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(v) : "r"(addr) : "memory");
  return v;
}

// ---- named barriers (ids 1..15; 0 is __syncthreads) ----------------------------------------
// bar.sync waits until `threads` threads (a multiple of 32) have arrived at barrier `id`,
// counting itself; bar.arrive counts itself and goes on.
template <int kThreads>
__device__ __forceinline__ void named_bar_sync(int id) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "n"(kThreads) : "memory");
}
template <int kThreads>
__device__ __forceinline__ void named_bar_arrive(int id) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "n"(kThreads) : "memory");
}

// bar.red over named barrier id's kThreads threads (whole warps, each executing it
// convergently): every thread gets the OR (named_bar_any) or the AND (named_bar_all) of all
// their predicates.
template <int kThreads>
__device__ __forceinline__ bool named_bar_any(int id, bool pred) {
  uint32_t r;
  asm volatile(
      "{\n .reg .pred p, q;\n setp.ne.u32 p, %1, 0;\n bar.red.or.pred q, %2, %3, p;\n"
      " selp.u32 %0, 1, 0, q;\n}\n"
      : "=r"(r)
      : "r"(static_cast<uint32_t>(pred)), "r"(id), "n"(kThreads)
      : "memory");
  return r != 0;
}
template <int kThreads>
__device__ __forceinline__ bool named_bar_all(int id, bool pred) {
  uint32_t r;
  asm volatile(
      "{\n .reg .pred p, q;\n setp.ne.u32 p, %1, 0;\n bar.red.and.pred q, %2, %3, p;\n"
      " selp.u32 %0, 1, 0, q;\n}\n"
      : "=r"(r)
      : "r"(static_cast<uint32_t>(pred)), "r"(id), "n"(kThreads)
      : "memory");
  return r != 0;
}

// ---- register reallocation between warpgroups ---------------------------------------------
template <int N>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}
template <int N>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}

// ---- wgmma ---------------------------------------------------------------------------------
// Orders this thread's earlier register writes (accumulators, A fragments) before the next
// wgmma.mma_async reads them; needed before the first wgmma of every batch.
__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// After wgmma_wait, the accumulator registers are read by ordinary code: this empty asm, taking
// them as in/out operands, keeps the compiler from moving those reads above the wait.
template <int N, int M>
__device__ __forceinline__ void reg_fence(float (&d)[N][M]) {
#pragma unroll
  for (int i = 0; i < N; ++i)
#pragma unroll
    for (int j = 0; j < M; ++j) asm volatile("" : "+f"(d[i][j])::"memory");
}

// The calling thread's warpgroup, read from lane 0 of its warp: the same value, but one the
// compiler knows to be warp-uniform, so that what is computed from it (wgmma descriptors) stays
// in uniform registers instead of being moved there (R2UR) at every wgmma.
__device__ __forceinline__ int warpgroup_uniform() {
  return __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x / 128), 0);
}

// Shared-memory matrix descriptor (PTX ISA, "matrix descriptor" of wgmma), 128-byte swizzle:
//   bits  0-13 start address >> 4, bits 16-29 leading-dimension byte offset (LBO) >> 4,
//   bits 32-45 stride-dimension byte offset (SBO) >> 4, bits 49-51 base offset (0: every
//   swizzle atom, 8 rows x 128 bytes, starts 1024-byte aligned), bits 62-63 layout (1 = 128B).
// The tiles are written by TMA with CU_TENSOR_MAP_SWIZZLE_128B: row r of a 64-element (128-byte)
// wide column block at byte 128 r, its 16-byte chunk c at chunk c ^ (r % 8) -- the address-based
// swizzle wgmma's 128B layout reads, as long as each column block starts 1024-byte aligned.
//  K-major operand (rows = M or N, K contiguous; Q and K): SBO = 1024 (8 rows of 128 bytes to
//    the next 8), LBO unused with this swizzle (1, as CUTLASS sets it); a k-step of 16 elements
//    (32 bytes) inside a 128-byte row adds 32 bytes to the start address, the hardware applying
//    the swizzle to the resulting addresses.
//  MN-major operand (rows = K, N contiguous; V as the B of P V): an atom is 8 K-rows x 64 N
//    elements; SBO = 1024 (the next 8 K-rows), LBO = the byte distance between 64-wide N column
//    blocks.
// A descriptor advanced along a tile by one add. The start address field is (addr mod 2^18) /
// 16 and shared memory is below 2^18 bytes, so adding bytes / 16 to the descriptor of an address
// inside a tile gives the descriptor of an address bytes further on in the same tile, with no
// carry into the LBO field (nor into the high word): the same bits as smem_desc_sw128(addr +
// bytes, lbo, sbo), without rebuilding (masking, shifting, or-ing) every field for every wgmma.
// The add is a 64-bit one on purpose: ptxas (13.0, sm_90a) emits it as one UIADD3.64 into the
// uniform-register pair the HGMMA reads, where an add on the low word alone cost a UIADD3 plus a
// UMOV of the constant high word for every operand of every wgmma.
struct SmemDesc {
  uint64_t v;
  __device__ __forceinline__ SmemDesc operator+(uint32_t bytes) const {
    return {v + static_cast<uint64_t>(bytes >> 4)};
  }
  __device__ __forceinline__ operator uint64_t() const { return v; }
};
// The descriptor of the address `addr` with these LBO and SBO (the fields above).
__device__ __forceinline__ SmemDesc smem_desc_sw128(uint32_t addr, uint32_t lbo, uint32_t sbo) {
  const uint32_t lo = ((addr & 0x3FFFF) >> 4) | (((lbo >> 4) & 0x3FFF) << 16);
  const uint32_t hi = ((sbo >> 4) & 0x3FFF) | (1u << 30);
  return {(static_cast<uint64_t>(hi) << 32) | lo};
}

// d with a run-time zero ORed into its high word: ptxas then cannot treat that word as the known
// constant it is, and adds a k-step's offset with one 64-bit add (UIADD3.64 with an immediate)
// instead of an add with carry on each word plus a move of the constant (3 instructions per
// operand). `zero` must be 0 at run time (e.g. a non-negative int shifted right by 31).
__device__ __forceinline__ SmemDesc opaque_desc(SmemDesc d, uint32_t zero) {
  return {d.v | (static_cast<uint64_t>(zero) << 32)};
}

// wgmma.mma_async m64nNk16 with float32 accumulators for T = __nv_bfloat16 / __half. Per warp w
// of the warpgroup, the accumulator d[N / 8][4] holds rows 16 w + (lane / 4) (+ 8 for e >= 2)
// and column 8 i + 2 (lane % 4) + (e & 1) in d[i][e] -- the m16n8 layout of mma.sync, per
// 8-column block. ss: D (+)= A B^T with A (64 x 16) and B (N x 16) in shared memory, both
// K-major. rs_mn: D (+)= A B with A (64 x 16) from registers in the m16n8k16 A-fragment layout
// per warp (a[0]: row g, k 2t..2t+1; a[1]: row g + 8; a[2]: row g, k + 8; a[3]: row g + 8, k + 8)
// and B (16 x N) in shared memory MN-major (imm-trans-b = 1). scale_d = 0 overwrites D.
template <typename T, int N>
struct Wgmma;

// The accumulator operands: 4 per 8-column block i, 8 blocks (64 columns) from block i, and the
// N / 8 blocks of each specialised N.
#define FUSEDOPS_ACC8(i) "+f"(d[i][0]), "+f"(d[i][1]), "+f"(d[i][2]), "+f"(d[i][3])
#define FUSEDOPS_ACC64(i)                                                                 \
  FUSEDOPS_ACC8(i), FUSEDOPS_ACC8(i + 1), FUSEDOPS_ACC8(i + 2), FUSEDOPS_ACC8(i + 3),       \
      FUSEDOPS_ACC8(i + 4), FUSEDOPS_ACC8(i + 5), FUSEDOPS_ACC8(i + 6), FUSEDOPS_ACC8(i + 7)
#define FUSEDOPS_ACC_N64 FUSEDOPS_ACC64(0)
#define FUSEDOPS_ACC_N80 FUSEDOPS_ACC64(0), FUSEDOPS_ACC8(8), FUSEDOPS_ACC8(9)
#define FUSEDOPS_ACC_N128 FUSEDOPS_ACC64(0), FUSEDOPS_ACC64(8)
#define FUSEDOPS_ACC_N176                                                                   \
  FUSEDOPS_ACC_N128, FUSEDOPS_ACC8(16), FUSEDOPS_ACC8(17), FUSEDOPS_ACC8(18), FUSEDOPS_ACC8(19), \
      FUSEDOPS_ACC8(20), FUSEDOPS_ACC8(21)
#define FUSEDOPS_ACC_N256 FUSEDOPS_ACC_N128, FUSEDOPS_ACC64(16), FUSEDOPS_ACC64(24)

// The "%0,%1,...,%(N / 2 - 1)" lists naming those accumulators in the instruction, built from
// decades: FUSEDOPS_OPS10(p) is "%p0,...,%p9" (p empty: "%0,...,%9").
#define FUSEDOPS_OPS10(p) \
  "%" #p "0,%" #p "1,%" #p "2,%" #p "3,%" #p "4,%" #p "5,%" #p "6,%" #p "7,%" #p "8,%" #p "9"
#define FUSEDOPS_REGS_N64 FUSEDOPS_OPS10() "," FUSEDOPS_OPS10(1) "," FUSEDOPS_OPS10(2) ",%30,%31"
#define FUSEDOPS_REGS_N80 \
  FUSEDOPS_OPS10() "," FUSEDOPS_OPS10(1) "," FUSEDOPS_OPS10(2) "," FUSEDOPS_OPS10(3)
#define FUSEDOPS_REGS_N128 \
  FUSEDOPS_REGS_N80 "," FUSEDOPS_OPS10(4) "," FUSEDOPS_OPS10(5) ",%60,%61,%62,%63"
#define FUSEDOPS_REGS_N176                                                                \
  FUSEDOPS_REGS_N80 "," FUSEDOPS_OPS10(4) "," FUSEDOPS_OPS10(5) "," FUSEDOPS_OPS10(6) ","   \
      FUSEDOPS_OPS10(7) ",%80,%81,%82,%83,%84,%85,%86,%87"
#define FUSEDOPS_REGS_N256                                                                \
  FUSEDOPS_REGS_N80 "," FUSEDOPS_OPS10(4) "," FUSEDOPS_OPS10(5) "," FUSEDOPS_OPS10(6) ","   \
      FUSEDOPS_OPS10(7) "," FUSEDOPS_OPS10(8) "," FUSEDOPS_OPS10(9) "," FUSEDOPS_OPS10(10) \
      "," FUSEDOPS_OPS10(11) ",%120,%121,%122,%123,%124,%125,%126,%127"

// One specialisation: element type T named PTX_T in the instruction, N columns, and the numbers
// of the operands that follow the N / 2 accumulators (a0 = N / 2, ..., a5): ss takes the two
// descriptors and scale_d (a0-a2), rs_mn the four A registers, the B descriptor and scale_d.
#define FUSEDOPS_WGMMA(T, N, PTX_T, a0, a1, a2, a3, a4, a5)                                    \
  template <>                                                                                 \
  struct Wgmma<T, N> {                                                                        \
    static __device__ __forceinline__ void ss(float (&d)[N / 8][4], uint64_t a_desc,           \
                                              uint64_t b_desc, int scale_d) {                 \
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" #a2 ", 0;\n"                          \
                   "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." PTX_T "." PTX_T " {"     \
                   FUSEDOPS_REGS_N##N "}, %" #a0 ", %" #a1 ", p, 1, 1, 0, 0;\n}\n"            \
                   : FUSEDOPS_ACC_N##N                                                        \
                   : "l"(a_desc), "l"(b_desc), "r"(scale_d));                                 \
    }                                                                                         \
    static __device__ __forceinline__ void rs_mn(float (&d)[N / 8][4], const uint32_t (&a)[4], \
                                                 uint64_t b_desc, int scale_d) {              \
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" #a5 ", 0;\n"                          \
                   "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." PTX_T "." PTX_T " {"     \
                   FUSEDOPS_REGS_N##N "}, {%" #a0 ", %" #a1 ", %" #a2 ", %" #a3 "}, %" #a4   \
                   ", p, 1, 1, 1;\n}\n"                                                       \
                   : FUSEDOPS_ACC_N##N                                                        \
                   : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc), "r"(scale_d));  \
    }                                                                                         \
  };
#define FUSEDOPS_WGMMA_BF16_F16(N, ...)                  \
  FUSEDOPS_WGMMA(__nv_bfloat16, N, "bf16", __VA_ARGS__) \
  FUSEDOPS_WGMMA(__half, N, "f16", __VA_ARGS__)

// N = 64, 128, 256: the head dims (O += P V, rs_mn) and key tiles (S = Q K^T, ss); 80 and 176:
// key tiles (attention_config_sm90.h).
FUSEDOPS_WGMMA_BF16_F16(64, 32, 33, 34, 35, 36, 37)
FUSEDOPS_WGMMA_BF16_F16(80, 40, 41, 42, 43, 44, 45)
FUSEDOPS_WGMMA_BF16_F16(128, 64, 65, 66, 67, 68, 69)
FUSEDOPS_WGMMA_BF16_F16(176, 88, 89, 90, 91, 92, 93)
FUSEDOPS_WGMMA_BF16_F16(256, 128, 129, 130, 131, 132, 133)

// ss with either operand MN-major: D (+)= A B, A (64 x 16) K-major (kTransA = 0: 64 rows of
// 16 K-elements) or M-major (kTransA = 1: 16 K-rows of 64 M-elements, one 128-byte column
// block), B K-major (kTransB = 0: N rows of 16 K-elements) or N-major (kTransB = 1: 16 K-rows of
// N elements in 64-wide column blocks LBO bytes apart). The descriptors as smem_desc_sw128 says;
// the accumulator layout as Wgmma. Wgmma<T, N>::ss is WgmmaSs<T, N>::run<0, 0>.
template <typename T, int N>
struct WgmmaSs;
#define FUSEDOPS_WGMMA_SS(T, N, PTX_T, a0, a1, a2, a3, a4)                                     \
  template <>                                                                                 \
  struct WgmmaSs<T, N> {                                                                      \
    template <int kTransA, int kTransB>                                                       \
    static __device__ __forceinline__ void run(float (&d)[N / 8][4], uint64_t a_desc,          \
                                               uint64_t b_desc, int scale_d) {                \
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %" #a2 ", 0;\n"                          \
                   "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." PTX_T "." PTX_T " {"     \
                   FUSEDOPS_REGS_N##N "}, %" #a0 ", %" #a1 ", p, 1, 1, %" #a3 ", %" #a4       \
                   ";\n}\n"                                                                   \
                   : FUSEDOPS_ACC_N##N                                                        \
                   : "l"(a_desc), "l"(b_desc), "r"(scale_d), "n"(kTransA), "n"(kTransB));     \
    }                                                                                         \
  };
FUSEDOPS_WGMMA_SS(__nv_bfloat16, 80, "bf16", 40, 41, 42, 43, 44)
FUSEDOPS_WGMMA_SS(__half, 80, "f16", 40, 41, 42, 43, 44)
FUSEDOPS_WGMMA_SS(__nv_bfloat16, 128, "bf16", 64, 65, 66, 67, 68)
FUSEDOPS_WGMMA_SS(__half, 128, "f16", 64, 65, 66, 67, 68)
FUSEDOPS_WGMMA_SS(__nv_bfloat16, 256, "bf16", 128, 129, 130, 131, 132)
FUSEDOPS_WGMMA_SS(__half, 256, "f16", 128, 129, 130, 131, 132)
#undef FUSEDOPS_WGMMA_SS

#undef FUSEDOPS_WGMMA_BF16_F16
#undef FUSEDOPS_WGMMA
#undef FUSEDOPS_REGS_N256
#undef FUSEDOPS_REGS_N176
#undef FUSEDOPS_REGS_N128
#undef FUSEDOPS_REGS_N80
#undef FUSEDOPS_REGS_N64
#undef FUSEDOPS_OPS10
#undef FUSEDOPS_ACC_N256
#undef FUSEDOPS_ACC_N176
#undef FUSEDOPS_ACC_N128
#undef FUSEDOPS_ACC_N80
#undef FUSEDOPS_ACC_N64
#undef FUSEDOPS_ACC64
#undef FUSEDOPS_ACC8

}  // namespace sm90
}  // namespace fusedops
