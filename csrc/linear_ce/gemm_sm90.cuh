// The Hopper (sm_90a) GEMM of the linear cross-entropy: C[M, N] = A B (or C += A B) with
// fp16/bf16 operands and float32 accumulation, persistent and warp-specialised, wgmma + TMA.
//
// Roles: warpgroup 0 is the producer -- one thread issues every TMA load (2-D tiles, 128-byte
// swizzle) into a ring of kStages stages, each guarded by a "full" barrier (transaction bytes)
// and an "empty" barrier (one arrival per consumer warp). Warpgroups 1 and 2 are the consumers:
// for a CTA tile of kBlockM x kBlockN = 128 x 256, consumer warpgroup w owns rows [64 w, 64 w +
// 64) and runs m64n256k16 wgmmas from shared memory, kBlockK / 16 = 4 per stage, keeping one
// stage's group in flight while it waits for the next. The producer runs ahead across tiles, so
// the next tile's first stages load while the consumers run the epilogue.
// Tiles: persistent CTAs (grid = min(work units, SMs)) take work units blockIdx.x, + gridDim.x,
// ...; a unit is a tile, or with split-K (unit_range) a tile's share of the k-blocks. Tiles go in
// a grouped order (tile_coords): the shorter of the two tile dimensions is swept fastest in
// groups of p.group tiles, so that the operand of that dimension (group x 128 or 256 rows) stays
// in L2 while the other operand streams through once per group.
//
// Operand layouts (row-major torch tensors; kATrans / kBTrans pick the wgmma transposes):
//   kATrans = 0: A [M, K] (K contiguous), loaded as one 64 (K) x 128 (M) box per stage.
//   kATrans = 1: A stored [K, M] (M contiguous), two 64 (M) x 64 (K) boxes per stage.
//   kBTrans = 0: B stored [N, K] (K contiguous), one 64 (K) x 256 (N) box.
//   kBTrans = 1: B [K, N] (N contiguous), four 64 (N) x 64 (K) boxes.
// The linear cross-entropy uses (0, 0) for the logits X W^T, (0, 1) for d_hidden = dz W and
// (1, 1) for d_weight = dz^T X.
//
// Epilogue hook: each consumer thread hands its accumulator fragment to the functor Epi after
// the main loop of every tile (Epi::end_tile), with its coordinates (FragCoord); Epi::begin_tile
// runs before the main loop (e.g. to prefetch what the epilogue reads) and Epi::finish once after
// the last tile. EpiStore is the plain one (convert, optionally add the old C, store through
// shared memory by TMA), EpiPartial split-K's (float32 partial sums); a functor that reduces
// over the fragment (row statistics) can reuse SlabStager for its stores.
//
// Constraints (lce_gemm_sm90 in gemm_sm90.cu and the binding check them): T is __half or
// __nv_bfloat16; every operand and C row-major with unit column stride, row strides multiples
// of 8 elements (any for a single row) and 16-byte aligned base addresses (TMA's rules); M, N,
// K >= 1 and < 2^31.
// Out-of-range rows and columns of a tile load as zeros (TMA) and are never stored: TMA clips
// stores at the last row, but along a row only at 16-byte granularity of the global address
// (seen on an H200: a box ending past N also wrote the columns up to the next multiple of 8 of
// a strided C), so C's tensor map ends at N rounded down to 8 columns and the last N % 8 columns
// are copied from the staging buffer by plain stores (SlabStager::store_tail); the accumulate
// path's loads are predicated. C must not overlap A or B. Launch: GemmTilesSm90::kThreads
// threads, kSmem bytes of dynamic shared memory, one CTA per SM. The body is empty (a trap)
// unless compiled for sm_90a.
#pragma once

#include <cuda.h>  // CUtensorMap (a type only; nothing links against the driver)

#include <cstdint>
#include <type_traits>

#include "../device_utils.cuh"
#include "../hopper_ptx.cuh"

namespace fusedops {
namespace lce_gemm {

// The tile table. 128 x 256 x 64 with two consumer warpgroups (64 x 256 each: 128 float32
// accumulators per thread) and four stages is the shape of CUTLASS's cooperative Hopper kernels
// for large bf16 GEMMs; not tuned here yet (no measurement of alternatives so far).
struct GemmTilesSm90 {
  static constexpr int kBlockM = 128, kBlockN = 256, kBlockK = 64, kStages = 4;
  static constexpr int kConsumerWarpgroups = 2;
  static constexpr int kThreads = 128 * (1 + kConsumerWarpgroups);
  // setmaxnreg: 128 x 40 + 256 x 232 = 64512 of the SM's 65536 registers.
  static constexpr int kProducerRegs = 40, kConsumerRegs = 232;
  static constexpr int kABytes = kBlockM * kBlockK * 2;  // 16 KB
  static constexpr int kBBytes = kBlockN * kBlockK * 2;  // 32 KB
  static constexpr int kStageBytes = kABytes + kBBytes;
  // Epilogue staging: two buffers of 64 rows x 64 columns (8 KB, one TMA store box) per
  // consumer warpgroup, so that one is filled while the other's store reads it.
  static constexpr int kOutBufBytes = 64 * 64 * 2;
  static constexpr int kAOff = 0;
  static constexpr int kBOff = kStages * kABytes;
  static constexpr int kOutOff = kBOff + kStages * kBBytes;
  static constexpr int kBarOff = kOutOff + 2 * kConsumerWarpgroups * kOutBufBytes;
  static constexpr int kSmem = kBarOff + 2 * kStages * 8 + 1024;  // + slack for 1024 alignment
  static_assert(kSmem <= 227 * 1024, "shared memory of one CTA on sm_90");
  static_assert(kBlockK == 64, "one 128-byte swizzle row of K per box row");
};

struct GemmParamsSm90 {
  int m = 0, n = 0, k = 0;
  int tiles_m = 0, tiles_n = 0, n_tiles = 0, k_blocks = 0;
  int group = 16;  // tiles of the fast dimension per group (tile_coords)
  int m_fast = 1;  // 1: m is the fast index (tiles_m <= tiles_n), 0: n is
  // Split-K: work unit u is tile u % n_tiles over k-blocks [kb_per_split s, + kb_per_split) of
  // split s = u / n_tiles (every split non-empty); k_splits = 1 without.
  int k_splits = 1, kb_per_split = 0, n_units = 0;
};

// Work unit u -> its tile (tile_coords) and k-block range [kb0, kb1).
__host__ __device__ __forceinline__ void unit_range(const GemmParamsSm90& p, int u, int& t,
                                                    int& split, int& kb0, int& kb1) {
  split = u / p.n_tiles;
  t = u - split * p.n_tiles;
  kb0 = split * p.kb_per_split;
  kb1 = kb0 + p.kb_per_split < p.k_blocks ? kb0 + p.kb_per_split : p.k_blocks;
}

// Tile t of the grouped order -> (tile row mb, tile column nb). With m_fast, groups of `group`
// tile rows are taken one after another; inside a group the tile row changes fastest, so the
// CTAs running at one time share a few B tiles and the group's A rows stay in L2.
__host__ __device__ __forceinline__ void tile_coords(const GemmParamsSm90& p, int t, int& mb,
                                                     int& nb) {
  const int fast = p.m_fast ? p.tiles_m : p.tiles_n, slow = p.m_fast ? p.tiles_n : p.tiles_m;
  const int per_group = p.group * slow;
  const int g = t / per_group, first = g * p.group;
  const int size = fast - first < p.group ? fast - first : p.group;
  const int r = t - g * per_group;
  const int f = first + r % size, s = r / size;
  mb = p.m_fast ? f : s;
  nb = p.m_fast ? s : f;
}

// Where a consumer thread's accumulator fragment sits in C. For the warpgroup's 64 x 256 slab
// the fragment is float acc[32][4] (wgmma's m64nNk16 accumulator: per warp the m16n8 layout of
// mma.sync, per 8-column block): acc[j][e] holds
//   row = row0 + 8 * (e >> 1),  col = col0 + 8 * j + (e & 1),   j < 32, e < 4,
// with row0 = slab_m0 + 16 * warp + lane / 4 and col0 = n0 + 2 * (lane % 4). Rows >= M and
// columns >= N hold zeros (zero-filled operands): never stored, and to be masked by a functor
// that reduces over the fragment. A row's 256 columns lie in the four lanes of one quad (lane / 4
// fixed), 64 each, so a per-row reduction is 64 values per thread and two quad shuffles.
struct FragCoord {
  int m0, n0;     // the CTA tile's first row and column in C
  int split;      // the k-split of this work unit (0 without split-K)
  int slab_m0;    // m0 + 64 * wg: the warpgroup's first row
  int row0, col0; // the thread's first row and column (see above)
  int wg;         // consumer warpgroup, 0 or 1
  int warp, lane; // warp in the warpgroup (0..3), lane
};

// Stores a warpgroup's 64 x 256 slab in four 64 x 64 boxes through its two 8 KB staging buffers
// (128-byte swizzle: row r's 16-byte chunk c at chunk c ^ (r % 8), the layout the tensor map
// expects and conflict-free for the fragment layout) and TMA stores issued by the warpgroup's
// first thread. Per box: begin() (the buffer's previous store has read it), put() per pair,
// end(...) (fence, barrier, store; with store = false, for a box that lies wholly right of the
// tensor map's columns, no store). The buffers alternate over every box this warpgroup stores,
// across tiles (a tile at C's right edge stores fewer than four). finish() once after the last
// tile.
struct SlabStager {
  uint32_t buf;  // the warpgroup's two buffers, kOutBufBytes apart
  int bar_id;    // named barrier of the warpgroup's 128 threads
  bool leader;
  int stored = 0;  // boxes stored so far (the same in every thread of the warpgroup)

  __device__ __forceinline__ uint32_t current() const {
    return buf + (stored & 1) * GemmTilesSm90::kOutBufBytes;
  }
  __device__ __forceinline__ void begin() const {
    // At most one store (the previous box's, in the other buffer) may still read shared memory.
    if (leader) sm90::tma_store_wait_read<1>();
    sm90::named_bar_sync<128>(bar_id);
  }
  // The pair of columns (8 c + 2 tq, + 1) of box row r (r % 8 == lane / 4 in the fragment).
  __device__ __forceinline__ void put(int r, int c, int tq, uint32_t v) const {
    sm90::st_shared_u32(current() + r * 128 + ((c ^ (r & 7)) << 4) + 4 * tq, v);
  }
  __device__ __forceinline__ void end(const CUtensorMap* tm, int col, int row, bool store = true) {
    sm90::fence_proxy_async_smem();  // this thread's stores, before the TMA engine reads them
    sm90::named_bar_sync<128>(bar_id);
    if (leader && store) {
      sm90::tma_store_2d(tm, current(), col, row);
      sm90::tma_store_commit();
    }
    ++stored;
  }
  __device__ __forceinline__ void finish() const {
    if (leader) sm90::tma_store_wait<0>();
  }
  // After end() of the box at column box_col that holds C's columns [n_tma, n), which the
  // tensor map leaves out (fewer than 8: one 16-byte chunk per box row): threads tid < 64 of the
  // warpgroup (tid = its thread index, 0..127) copy row tid's chunk from the box's staging buffer
  // to C's row row0 + tid (< m; rows ldc elements apart). end()'s barrier has made every
  // thread's put visible; the buffer is rewritten only after the next box's begin() barrier,
  // which these threads reach after their copy.
  template <typename T>
  __device__ __forceinline__ void store_tail(T* c, int64_t ldc, int row0, int m, int box_col,
                                             int n_tma, int n, int tid) const {
    const int row = row0 + tid;
    if (tid >= 64 || row >= m) return;
    const int chunk = (n_tma - box_col) >> 3;
    const uint32_t src = buf + ((stored - 1) & 1) * GemmTilesSm90::kOutBufBytes + tid * 128 +
                         ((chunk ^ (tid & 7)) << 4);
    uint32_t w[4];
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3])
                 : "r"(src));
    unsigned short* dst =
        reinterpret_cast<unsigned short*>(c + static_cast<int64_t>(row) * ldc + n_tma);
#pragma unroll
    for (int e = 0; e < 7; ++e)
      if (n_tma + e < n) dst[e] = static_cast<unsigned short>(w[e >> 1] >> (16 * (e & 1)));
  }
};

// C's columns a TMA store may write: N rounded down to a multiple of 8 (16 bytes), so that a
// row's last store ends on a 16-byte boundary (see the constraints above); 0 for N < 8, when
// there is no tensor map and every column goes through store_tail.
__host__ __device__ __forceinline__ int tma_store_cols(int n) { return n & ~7; }

// The plain epilogue: C = round(acc), or with kAccumulate C = round(float(C_old) + acc) (one
// rounding, as torch.addmm into a bf16/fp16 tensor). The old values are read by the consumer
// threads in the fragment layout (4-byte loads, predicated at the edges) before the tile's main
// loop, so that their latency hides behind it (64 more registers: the accumulate kernels peak at
// about 214 of the consumers' 232). kLateOld reads them per box in the epilogue instead (16
// registers), for main loops that need those registers themselves (the dz prologue's).
template <typename T, bool kAccumulate, bool kLateOld = false>
struct EpiStore {
  struct Params {
    CUtensorMap tm_c;  // C [M, n_tma], boxes 64 x 64, 128-byte swizzle (none when n_tma = 0)
    T* c;              // C itself: the old values (kAccumulate) and the columns >= n_tma
    int64_t ldc;       // C's row stride in elements
    int m, n;
    int n_tma;         // tma_store_cols(n)
  };
  static constexpr int kBoxes = GemmTilesSm90::kBlockN / 64;

  const Params& p;
  SlabStager st;
  static constexpr bool kPrefetch = kAccumulate && !kLateOld;
  uint32_t old[kPrefetch ? kBoxes : 1][8][2];  // old C pairs: [box][chunk][row half]

  __device__ __forceinline__ EpiStore(const Params& params, const SlabStager& stager)
      : p(params), st(stager) {}

  __device__ __forceinline__ void load_old(int j, const FragCoord& f) {
    if constexpr (kAccumulate) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = f.row0 + 8 * h;
#pragma unroll
        for (int c = 0; c < 8; ++c) {
          const int col = f.col0 + 64 * j + 8 * c;  // even: a 4-byte-aligned pair
          const T* src = p.c + static_cast<int64_t>(row) * p.ldc + col;
          uint32_t v = 0;
          if (row < p.m && col + 1 < p.n)
            v = *reinterpret_cast<const uint32_t*>(src);
          else if (row < p.m && col < p.n)  // the last column of an odd N
            v = *reinterpret_cast<const unsigned short*>(src);
          old[kPrefetch ? j : 0][c][h] = v;
        }
      }
    }
  }

  __device__ __forceinline__ void begin_tile(const FragCoord& f) {
    if constexpr (kPrefetch) {
#pragma unroll
      for (int j = 0; j < kBoxes; ++j) load_old(j, f);
    }
  }

  __device__ __forceinline__ static float lo_f(uint32_t v) {
    if constexpr (std::is_same_v<T, __nv_bfloat16>)
      return __uint_as_float(v << 16);
    else
      return __half2float(__ushort_as_half(static_cast<unsigned short>(v & 0xffffu)));
  }
  __device__ __forceinline__ static float hi_f(uint32_t v) {
    if constexpr (std::is_same_v<T, __nv_bfloat16>)
      return __uint_as_float(v & 0xffff0000u);
    else
      return __half2float(__ushort_as_half(static_cast<unsigned short>(v >> 16)));
  }

  __device__ __forceinline__ void end_tile(float (&acc)[GemmTilesSm90::kBlockN / 8][4],
                                           const FragCoord& f) {
    if (f.slab_m0 >= p.m) return;  // warpgroup-uniform: the slab lies below C
    const int g = f.lane >> 2, tq = f.lane & 3;
#pragma unroll
    for (int j = 0; j < kBoxes; ++j) {
      const int box_col = f.n0 + 64 * j;
      if (box_col >= p.n) break;  // uniform: the box lies right of C
      if constexpr (kAccumulate && kLateOld) load_old(j, f);
      st.begin();
#pragma unroll
      for (int c = 0; c < 8; ++c)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          float x0 = acc[8 * j + c][2 * h], x1 = acc[8 * j + c][2 * h + 1];
          if constexpr (kAccumulate) {
            x0 += lo_f(old[kPrefetch ? j : 0][c][h]);
            x1 += hi_f(old[kPrefetch ? j : 0][c][h]);
          }
          st.put(16 * f.warp + g + 8 * h, c, tq, dev::pack2<T>(x0, x1));
        }
      st.end(&p.tm_c, box_col, f.slab_m0, box_col < p.n_tma);
      if (p.n_tma < p.n && p.n_tma < box_col + 64)  // uniform: the box holds C's last columns
        st.store_tail(p.c, p.ldc, f.slab_m0, p.m, box_col, p.n_tma, p.n, 32 * f.warp + f.lane);
    }
  }

  __device__ __forceinline__ void finish() { st.finish(); }
};

// Split-K's epilogue: the float32 accumulators of split s into its slice of the workspace,
// ws[s][row][col] (rows ld_ws floats apart, ld_ws a multiple of 4), by 8-byte stores from the
// fragment (a quad's four lanes write 32 contiguous bytes of a row); splitk_reduce_kernel sums
// the slices into C afterwards.
template <typename T>
struct EpiPartial {
  struct Params {
    float* ws;
    int64_t ld_ws, split_stride;  // floats
    int m, n;
  };
  const Params& p;

  __device__ __forceinline__ EpiPartial(const Params& params, const SlabStager&) : p(params) {}
  __device__ __forceinline__ void begin_tile(const FragCoord&) {}
  __device__ __forceinline__ void end_tile(float (&acc)[GemmTilesSm90::kBlockN / 8][4],
                                           const FragCoord& f) {
    float* ws = p.ws + f.split * p.split_stride;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = f.row0 + 8 * h;
      if (row >= p.m) continue;
      float* dst = ws + static_cast<int64_t>(row) * p.ld_ws;
#pragma unroll
      for (int j = 0; j < GemmTilesSm90::kBlockN / 8; ++j) {
        const int col = f.col0 + 8 * j;
        if (col + 1 < p.n)
          *reinterpret_cast<float2*>(dst + col) = make_float2(acc[j][2 * h], acc[j][2 * h + 1]);
        else if (col < p.n)
          dst[col] = acc[j][2 * h];
      }
    }
  }
  __device__ __forceinline__ void finish() {}
};

// C = round(sum over s of ws[s]) (+ float(C_old) first with accumulate): one thread per 4
// columns of a row, grid-stride. Any architecture; 256 threads per CTA.
template <typename T>
__global__ void __launch_bounds__(256)
    splitk_reduce_kernel(const float* ws, int splits, int64_t split_stride, int64_t ld_ws, T* c,
                         int64_t ldc, int m, int n, int accumulate) {
  const int groups = (n + 3) / 4;
  const int64_t total = static_cast<int64_t>(m) * groups;
  for (int64_t i = blockIdx.x * int64_t(256) + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * 256) {
    const int row = static_cast<int>(i / groups), col = static_cast<int>(i % groups) * 4;
    float4 sum = *reinterpret_cast<const float4*>(ws + row * ld_ws + col);
    for (int s = 1; s < splits; ++s) {
      const float4 v = *reinterpret_cast<const float4*>(ws + s * split_stride + row * ld_ws + col);
      sum.x += v.x;
      sum.y += v.y;
      sum.z += v.z;
      sum.w += v.w;
    }
    T* dst = c + row * ldc + col;
    const float vals[4] = {sum.x, sum.y, sum.z, sum.w};
#pragma unroll
    for (int e = 0; e < 4; ++e)
      if (col + e < n)
        dst[e] = dev::from_float<T>(accumulate ? dev::to_float(dst[e]) + vals[e] : vals[e]);
  }
}

// The plain operand path: A from shared memory (SS wgmma). A prologue functor Pro with kOn
// instead builds every A fragment in registers from the stage's A tile (Pro::fragment, RS
// wgmma; gemm_sm90_dz.cuh's DzPrologue: dz from z); Pro::begin_tile(row0) runs before a tile's
// main loop, Pro::end_tile(row0, n0) after it.
struct NoPrologue {
  static constexpr bool kOn = false;
  struct Params {};
  __device__ __forceinline__ NoPrologue(const Params&, int, int) {}
  __device__ __forceinline__ void begin_tile(int) {}
  __device__ __forceinline__ void end_tile(int, int) {}
  __device__ __forceinline__ void fragment(uint32_t, int, int, int, int, int,
                                           uint32_t (&)[4]) {}
};

template <typename T, bool kATrans, bool kBTrans, class Epi, class Pro = NoPrologue>
__global__ void __launch_bounds__(GemmTilesSm90::kThreads, 1)
    gemm_kernel_sm90(const GemmParamsSm90 p, const __grid_constant__ CUtensorMap tm_a,
                     const __grid_constant__ CUtensorMap tm_b,
                     const __grid_constant__ typename Epi::Params ep,
                     const __grid_constant__ typename Pro::Params pp) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using namespace fusedops::sm90;
  using C = GemmTilesSm90;
  constexpr int BM = C::kBlockM, BN = C::kBlockN, BK = C::kBlockK, S = C::kStages;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  // Every swizzle atom must start 1024-byte aligned (kSmem has the slack for this).
  const uint32_t base = (smem_u32(smem_raw) + 1023u) & ~1023u;
  const uint32_t sA = base + C::kAOff, sB = base + C::kBOff, bars = base + C::kBarOff;
  auto bar_full = [&](int s) { return bars + 8u * s; };
  auto bar_empty = [&](int s) { return bars + 8u * (S + s); };

  if (threadIdx.x == 0) {
    for (int s = 0; s < S; ++s) {
      mbar_init(bar_full(s), 1);
      mbar_init(bar_empty(s), 4 * C::kConsumerWarpgroups);  // lane 0 of every consumer warp
    }
    mbar_init_fence();
  }
  __syncthreads();

  const int wg = threadIdx.x / 128;
  if (wg == 0) {
    // ---- producer ----
    setmaxnreg_dec<C::kProducerRegs>();
    if (threadIdx.x == 0) {
      tma_prefetch_desc(&tm_a);
      tma_prefetch_desc(&tm_b);
      int it = 0;  // stage uses so far, over all of this CTA's tiles (the consumers count alike)
      for (int u = blockIdx.x; u < p.n_units; u += gridDim.x) {
        int t, split, kb0, kb1, mb, nb;
        unit_range(p, u, t, split, kb0, kb1);
        tile_coords(p, t, mb, nb);
        const int m0 = mb * BM, n0 = nb * BN;
        for (int kb = kb0; kb < kb1; ++kb, ++it) {
          const int s = it % S, k0 = kb * BK;
          mbar_wait(bar_empty(s), ((it / S) & 1) ^ 1);
          mbar_arrive_expect_tx(bar_full(s), C::kStageBytes);  // out-of-range bytes count too
          const uint32_t a = sA + s * C::kABytes, b = sB + s * C::kBBytes;
          if constexpr (!kATrans) {
            tma_load_2d(a, &tm_a, bar_full(s), k0, m0);
          } else {
#pragma unroll
            for (int c = 0; c < BM / 64; ++c)
              tma_load_2d(a + c * 64 * 128, &tm_a, bar_full(s), m0 + 64 * c, k0);
          }
          if constexpr (!kBTrans) {
            tma_load_2d(b, &tm_b, bar_full(s), k0, n0);
          } else {
#pragma unroll
            for (int c = 0; c < BN / 64; ++c)
              tma_load_2d(b + c * 64 * 128, &tm_b, bar_full(s), n0 + 64 * c, k0);
          }
        }
      }
    }
  } else {
    // ---- consumers ----
    setmaxnreg_inc<C::kConsumerRegs>();
    const int cw = warpgroup_uniform() - 1;  // rows [64 cw, 64 cw + 64) of every tile
    const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x & 31;
    const SlabStager stager{base + C::kOutOff + 2 * cw * C::kOutBufBytes, 1 + cw,
                            threadIdx.x % 128 == 0};
    Epi epi(ep, stager);
    Pro pro(pp, warp, lane);

    // Shared-memory descriptors of k-step kk (16 K-elements) of stage s for this warpgroup.
    //  A K-major: 128 rows of 128 bytes, the warpgroup's 64 from byte 64 cw 128; a k-step is
    //    32 bytes along the row. A M-major: column block cw (64 M-elements) of 64 K-rows; a
    //    k-step is 16 K-rows (2048 bytes).
    //  B K-major: 256 rows of 128 bytes. B N-major: four 64-wide column blocks of 64 K-rows,
    //    8 KB apart (the LBO).
    // Built once (SmemDesc): a stage or k-step further on is one add. The stage's base is
    // formed first and the k-step's constant added to it (an immediate): a sum of the two
    // offsets became an OR, a zero high word and the add per wgmma.
    const SmemDesc da0 = smem_desc_sw128(sA + cw * 64 * 128, kATrans ? 64 * 128 : 16, 1024);
    const SmemDesc db0 = smem_desc_sw128(sB, kBTrans ? 64 * 128 : 16, 1024);
    auto desc_a = [&](int s, int kk) {
      const SmemDesc base = da0 + s * C::kABytes;
      return base + kk * (kATrans ? 2048 : 32);
    };
    auto desc_b = [&](int s, int kk) {
      const SmemDesc base = db0 + s * C::kBBytes;
      return base + kk * (kBTrans ? 2048 : 32);
    };
    auto release = [&](int s) {
      __syncwarp();
      if (lane == 0) mbar_arrive(bar_empty(s));
    };

    float acc[BN / 8][4];
    int it = 0;
    for (int u = blockIdx.x; u < p.n_units; u += gridDim.x) {
      int t, kb0, kb1, mb, nb;
      FragCoord f;
      unit_range(p, u, t, f.split, kb0, kb1);
      tile_coords(p, t, mb, nb);
      f.m0 = mb * BM;
      f.n0 = nb * BN;
      f.slab_m0 = f.m0 + 64 * cw;
      f.row0 = f.slab_m0 + 16 * warp + (lane >> 2);
      f.col0 = f.n0 + 2 * (lane & 3);
      f.wg = cw;
      f.warp = warp;
      f.lane = lane;
      epi.begin_tile(f);
      pro.begin_tile(f.row0);

      // One k-block's products on stage s, SS: A from shared memory; first: its first k-step
      // overwrites the accumulators.
      auto mma_block = [&](int s, bool first) {
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < BK / 16; ++kk)
          WgmmaSs<T, BN>::template run<kATrans, kBTrans>(acc, desc_a(s, kk), desc_b(s, kk),
                                                         (first && kk == 0) ? 0 : 1);
        wgmma_commit();
      };
      // With a prologue (RS): the four A fragments of k-block kb are built into `a` (and fenced)
      // before its first wgmma. The wgmmas read `a` asynchronously, until the wait_group that
      // retires them; the compiler does not know that, so the caller must neither rebuild `a`
      // before then nor let the register allocator reuse its registers (keep_frag below).
      auto mma_block_rs = [&](uint32_t (&a)[BK / 16][4], int s, int kb, bool first) {
#pragma unroll
        for (int kk = 0; kk < BK / 16; ++kk)
          pro.fragment(sA + s * C::kABytes, cw, kk, kb * BK, f.slab_m0, lane, a[kk]);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < BK / 16; ++kk)
          Wgmma<T, BN>::rs_mn(acc, a[kk], desc_b(s, kk), (first && kk == 0) ? 0 : 1);
        wgmma_commit();
      };

      if constexpr (Pro::kOn) {
        // Two fragment sets, a0 for the k-blocks kb0, kb0 + 2, ... and a1 for the others: set
        // a0 is rebuilt only after the wait that follows the next block's issue has retired the
        // wgmmas reading it (and likewise a1), so one k-block's products stay in flight while
        // the next block's fragments are built. keep_frag after each wait is a use of the set
        // those wgmmas read, which keeps its registers allocated (and unwritten) until then.
        uint32_t a0[BK / 16][4], a1[BK / 16][4];
        auto keep_frag = [](uint32_t (&a)[BK / 16][4]) {
#pragma unroll
          for (int kk = 0; kk < BK / 16; ++kk)
            asm volatile("" ::"r"(a[kk][0]), "r"(a[kk][1]), "r"(a[kk][2]), "r"(a[kk][3]));
        };
#pragma unroll
        for (int kk = 0; kk < BK / 16; ++kk)
#pragma unroll
          for (int i = 0; i < 4; ++i) a1[kk][i] = 0u;
        reg_fence(acc);
        for (int kb = kb0; kb < kb1; kb += 2) {
          {
            const int s = it % S;
            mbar_wait(bar_full(s), (it / S) & 1);
            mma_block_rs(a0, s, kb, kb == kb0);
            if (kb > kb0) {
              wgmma_wait<1>();  // the previous block (set a1) is done: its stage is free
              keep_frag(a1);
              release((it - 1) % S);
            }
            ++it;
          }
          if (kb + 1 < kb1) {
            const int s = it % S;
            mbar_wait(bar_full(s), (it / S) & 1);
            mma_block_rs(a1, s, kb + 1, false);
            wgmma_wait<1>();  // block kb (set a0) is done
            keep_frag(a0);
            release((it - 1) % S);
            ++it;
          }
        }
        wgmma_wait<0>();
        keep_frag(a0);
        keep_frag(a1);
        reg_fence(acc);
        release((it - 1) % S);
      } else {
        // The first k-block overwrites the accumulators (scale_d = 0 on its first k-step); each
        // later one is issued before the previous one is waited for, which then frees its stage.
        {
          const int s = it % S;
          mbar_wait(bar_full(s), (it / S) & 1);
          reg_fence(acc);
          mma_block(s, true);
          ++it;
        }
        for (int kb = kb0 + 1; kb < kb1; ++kb, ++it) {
          const int s = it % S;
          mbar_wait(bar_full(s), (it / S) & 1);
          mma_block(s, false);
          wgmma_wait<1>();  // the previous k-block's products are done: its stage is free
          release((it - 1) % S);
        }
        wgmma_wait<0>();
        reg_fence(acc);
        release((it - 1) % S);
      }
      pro.end_tile(f.row0, f.n0);
      epi.end_tile(acc, f);
    }
    epi.finish();
  }
#elif defined(__CUDA_ARCH__)
  __trap();  // built for an architecture without wgmma: the host never launches this
#endif
}

}  // namespace lce_gemm
}  // namespace fusedops
