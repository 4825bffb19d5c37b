// Launcher and instantiations of the Hopper GEMM of the linear cross-entropy (gemm_sm90.cuh):
// the TMA tensor maps (made per call through the driver entry point the CUDA runtime hands
// out, so nothing links against libcuda), the tile order and the grid. Instantiated for fp16 /
// bf16 x the three layouts, plus accumulation for layout 3 (d_weight, the only product the
// linear cross-entropy accumulates). The kernel bodies exist only in the sm_90a build (setup.py
// also compiles this file for sm_80, where they trap; the binding launches them only on compute
// capability 9.0 with a 9.0a build). Also the logits GEMM with the cross-entropy statistics
// epilogue (EpiCEStats, gemm_sm90_stats.cuh), fp16 / bf16, and its combine kernel; and layouts
// 2 and 3 with dz computed from z in the operand path (DzPrologue, gemm_sm90_dz.cuh): fp16 /
// bf16 x {layout 2, layout 2 split-K, layout 3, layout 3 accumulating}.
#include <cuda.h>
#include <cudaTypedefs.h>  // PFN_cuTensorMapEncodeTiled

#include <cstdlib>
#include <type_traits>

#include "../static_switch.h"
#include "../tma_host.h"
#include "gemm_sm90.cuh"
#include "gemm_sm90.h"
#include "gemm_sm90_dz.cuh"
#include "gemm_sm90_stats.cuh"

namespace fusedops {
namespace lce_gemm {
namespace {

// A 2-D map over a row-major matrix of 2-byte elements (`cols` contiguous per row, rows
// `row_stride` elements apart), boxes of box_cols (64: one 128-byte swizzle row) x box_rows;
// out-of-range elements load as zeros. Stores clip along a row only at 16-byte granularity, so
// maps that are stored to end at a multiple of 8 columns (tma_store_cols, gemm_sm90.cuh).
bool make_map(CUtensorMap* map, const void* ptr, bool bf16, int64_t cols, int64_t rows,
              int64_t row_stride, int box_cols, int box_rows) {
  const PFN_cuTensorMapEncodeTiled_v12000 encode = tensor_map_encoder();
  if (encode == nullptr) return false;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(row_stride) * 2};  // bytes
  const cuuint32_t box[2] = {static_cast<cuuint32_t>(box_cols), static_cast<cuuint32_t>(box_rows)};
  const cuuint32_t elem_strides[2] = {1, 1};
  const CUresult res = encode(
      map, bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 2,
      const_cast<void*>(ptr), dims, strides, box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
      CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return res == CUDA_SUCCESS;
}

// The tile order's group size: FUSEDOPS_LCE_GEMM_GROUP (for measurement) else args.group else
// 16 (at the Llama-3 shapes one group covers the 16 tile rows of a 2048-token logits chunk or
// the 16 tile columns of H = 4096; not tuned).
int group_size(const LceGemmSm90Args& args) {
  if (const char* s = std::getenv("FUSEDOPS_LCE_GEMM_GROUP")) {
    const int g = std::atoi(s);
    if (g >= 1) return g;
  }
  return args.group >= 1 ? args.group : 16;
}

// The workspace row stride: N rounded up to 4 floats (16 bytes, the reduce kernel's float4).
int64_t ws_ld(int64_t n) { return (n + 3) / 4 * 4; }

GemmParamsSm90 make_params(const LceGemmSm90Args& args) {
  using C = GemmTilesSm90;
  GemmParamsSm90 p;
  p.m = static_cast<int>(args.m);
  p.n = static_cast<int>(args.n);
  p.k = static_cast<int>(args.k);
  p.tiles_m = (p.m + C::kBlockM - 1) / C::kBlockM;
  p.tiles_n = (p.n + C::kBlockN - 1) / C::kBlockN;
  p.k_blocks = (p.k + C::kBlockK - 1) / C::kBlockK;
  p.m_fast = p.tiles_m <= p.tiles_n ? 1 : 0;
  p.group = group_size(args);
  const int64_t tiles = static_cast<int64_t>(p.tiles_m) * p.tiles_n;
  const int splits = args.k_splits < 1 ? 1 : (args.k_splits > p.k_blocks ? p.k_blocks
                                                                           : args.k_splits);
  p.kb_per_split = (p.k_blocks + splits - 1) / splits;
  p.k_splits = (p.k_blocks + p.kb_per_split - 1) / p.kb_per_split;  // every split non-empty
  p.n_tiles = tiles > INT32_MAX ? 0 : static_cast<int>(tiles);
  p.n_units = tiles * p.k_splits > INT32_MAX ? 0 : p.n_tiles * p.k_splits;
  return p;
}

template <typename T, bool kATrans, bool kBTrans, class Epi, class Pro = NoPrologue>
cudaError_t launch_kernel(const GemmParamsSm90& p, const CUtensorMap& tm_a,
                          const CUtensorMap& tm_b, const typename Epi::Params& ep,
                          const LceGemmSm90Args& args,
                          const typename Pro::Params& pp = typename Pro::Params{}) {
  using C = GemmTilesSm90;
  auto kernel = gemm_kernel_sm90<T, kATrans, kBTrans, Epi, Pro>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         C::kSmem);
  if (err != cudaSuccess) return err;
  const int grid = p.n_units < args.num_sms ? p.n_units : args.num_sms;
  kernel<<<grid, C::kThreads, C::kSmem, args.stream>>>(p, tm_a, tm_b, ep, pp);
  return cudaGetLastError();
}

template <typename T, bool kATrans, bool kBTrans, bool kAccumulate, class Pro = NoPrologue>
cudaError_t launch(const LceGemmSm90Args& args,
                   const typename Pro::Params& pp = typename Pro::Params{}) {
  using C = GemmTilesSm90;
  constexpr bool kBf16 = std::is_same_v<T, __nv_bfloat16>;
  constexpr bool kSplitK = !kATrans && kBTrans && !kAccumulate;  // layout 2
  const GemmParamsSm90 p = make_params(args);
  if (p.n_units == 0) return cudaErrorInvalidValue;
  if (p.k_splits > 1 && (!kSplitK || args.workspace == nullptr)) return cudaErrorInvalidValue;

  CUtensorMap tm_a, tm_b;
  // A: [M, K] read in 64 (K) x 128 (M) boxes, or stored [K, M] and read in 64 x 64 boxes.
  const bool ok_a = kATrans ? make_map(&tm_a, args.a, kBf16, args.m, args.k, args.lda, 64, 64)
                            : make_map(&tm_a, args.a, kBf16, args.k, args.m, args.lda, 64,
                                       C::kBlockM);
  // B: stored [N, K] and read in 64 (K) x 256 (N) boxes, or [K, N] in 64 x 64 boxes.
  const bool ok_b = kBTrans ? make_map(&tm_b, args.b, kBf16, args.n, args.k, args.ldb, 64, 64)
                            : make_map(&tm_b, args.b, kBf16, args.k, args.n, args.ldb, 64,
                                       C::kBlockN);
  if (!ok_a || !ok_b) return cudaErrorInvalidValue;

  if constexpr (kSplitK) {
    if (p.k_splits > 1) {
      typename EpiPartial<T>::Params ep;
      ep.ws = args.workspace;
      ep.ld_ws = ws_ld(args.n);
      ep.split_stride = args.m * ep.ld_ws;
      ep.m = p.m;
      ep.n = p.n;
      cudaError_t err =
          launch_kernel<T, kATrans, kBTrans, EpiPartial<T>, Pro>(p, tm_a, tm_b, ep, args, pp);
      if (err != cudaSuccess) return err;
      const int64_t threads = args.m * ((args.n + 3) / 4);
      const int64_t blocks64 = (threads + 255) / 256;
      const int blocks = static_cast<int>(blocks64 < 8 * args.num_sms ? blocks64
                                                                       : 8 * args.num_sms);
      splitk_reduce_kernel<T><<<blocks, 256, 0, args.stream>>>(
          ep.ws, p.k_splits, ep.split_stride, ep.ld_ws, static_cast<T*>(args.c), args.ldc, p.m,
          p.n, 0);
      return cudaGetLastError();
    }
  }
  using Epi = EpiStore<T, kAccumulate, Pro::kOn>;
  typename Epi::Params ep{};
  ep.n_tma = tma_store_cols(p.n);
  if (ep.n_tma > 0 && !make_map(&ep.tm_c, args.c, kBf16, ep.n_tma, args.m, args.ldc, 64, 64))
    return cudaErrorInvalidValue;
  ep.c = static_cast<T*>(args.c);
  ep.ldc = args.ldc;
  ep.m = p.m;
  ep.n = p.n;
  return launch_kernel<T, kATrans, kBTrans, Epi, Pro>(p, tm_a, tm_b, ep, args, pp);
}

// Layout 1 with EpiCEStats, then ce_stats_combine_kernel.
template <typename T>
cudaError_t launch_ce_stats(const LceCeStatsSm90Args& args) {
  using C = GemmTilesSm90;
  constexpr bool kBf16 = std::is_same_v<T, __nv_bfloat16>;
  const LceGemmSm90Args& g = args.gemm;
  LceGemmSm90Args one = g;
  one.k_splits = 1;
  const GemmParamsSm90 p = make_params(one);
  if (p.n_units == 0 || args.target == nullptr || args.partials == nullptr ||
      args.lse == nullptr || args.zt == nullptr || args.zsum == nullptr ||
      reinterpret_cast<uintptr_t>(args.partials) % 16 != 0)
    return cudaErrorInvalidValue;
  CUtensorMap tm_a, tm_b;
  if (!make_map(&tm_a, g.a, kBf16, g.k, g.m, g.lda, 64, C::kBlockM) ||
      !make_map(&tm_b, g.b, kBf16, g.k, g.n, g.ldb, 64, C::kBlockN))
    return cudaErrorInvalidValue;
  using Epi = EpiCEStats<T>;
  typename Epi::Params ep{};
  ep.n_tma = tma_store_cols(p.n);
  if (ep.n_tma > 0 && !make_map(&ep.tm_c, g.c, kBf16, ep.n_tma, g.m, g.ldc, 64, 64))
    return cudaErrorInvalidValue;
  ep.c = static_cast<T*>(g.c);
  ep.ldc = g.ldc;
  ep.bias = args.bias;
  ep.target = args.target;
  ep.partials = reinterpret_cast<float4*>(args.partials);
  ep.ld_part = p.tiles_n;
  ep.softcap = args.softcap;
  ep.m = p.m;
  ep.n = p.n;
  cudaError_t err = launch_kernel<T, false, false, Epi>(p, tm_a, tm_b, ep, one);
  if (err != cudaSuccess) return err;
  constexpr int kWarps = 8;
  const int blocks = (p.m + kWarps - 1) / kWarps;
  ce_stats_combine_kernel<kWarps><<<blocks, 32 * kWarps, 0, g.stream>>>(
      ep.partials, ep.ld_part, p.tiles_n, p.m, args.lse, args.zt, args.zsum);
  return cudaGetLastError();
}

// The per-token table of DzPrologue: {lse log2e, w (1 + 2 zl lse), w, target bits (-1 outside
// [0, V))}, one thread per token. Any architecture.
__global__ void __launch_bounds__(256)
    dz_table_kernel(const float* lse, const float* w, const int64_t* target, int tokens,
                    int64_t vocab, float z_loss, float4* tab) {
  const int i = blockIdx.x * 256 + threadIdx.x;
  if (i >= tokens) return;
  const float l = lse[i], wi = w[i];
  const int64_t t = target[i];
  tab[i] = make_float4(l * dev::kLog2e, wi * (1.f + 2.f * z_loss * l), wi,
                       __int_as_float(t >= 0 && t < vocab ? static_cast<int>(t) : -1));
}

template <typename T>
cudaError_t launch_dz(const LceDzGemmSm90Args& args) {
  const LceGemmSm90Args& g = args.gemm;
  const bool l3 = g.layout == 3;
  const int64_t tokens = l3 ? g.k : g.m, vocab = l3 ? g.m : g.k;
  if (args.lse == nullptr || args.w == nullptr || args.target == nullptr || args.tab == nullptr ||
      reinterpret_cast<uintptr_t>(args.tab) % 16 != 0 ||
      (args.bias != nullptr && reinterpret_cast<uintptr_t>(args.bias) % 8 != 0))
    return cudaErrorInvalidValue;
  float4* tab = reinterpret_cast<float4*>(args.tab);
  dz_table_kernel<<<static_cast<unsigned>((tokens + 255) / 256), 256, 0, g.stream>>>(
      args.lse, args.w, args.target, static_cast<int>(tokens), vocab, args.z_loss, tab);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  typename DzPrologue<T, false>::Params pp;  // the same fields for both layouts
  pp.tab = tab;
  pp.bias = args.bias;
  pp.c_zs = -args.eps / static_cast<float>(vocab);
  pp.c_zt = -(1.f - args.eps);
  pp.softcap = args.softcap;
  pp.vocab = static_cast<int>(vocab);
  pp.tokens = static_cast<int>(tokens);
  pp.dbias = nullptr;
  if (!l3) {
    if (args.dbias != nullptr) return cudaErrorInvalidValue;
    if (g.accumulate) return cudaErrorNotSupported;
    return launch<T, false, true, false, DzPrologue<T, false>>(g, pp);
  }
  typename DzPrologue<T, true>::Params pp3;
  pp3.tab = pp.tab;
  pp3.bias = pp.bias;
  pp3.c_zs = pp.c_zs;
  pp3.c_zt = pp.c_zt;
  pp3.softcap = pp.softcap;
  pp3.vocab = pp.vocab;
  pp3.tokens = pp.tokens;
  pp3.dbias = args.dbias;
  return g.accumulate ? launch<T, true, true, true, DzPrologue<T, true>>(g, pp3)
                      : launch<T, true, true, false, DzPrologue<T, true>>(g, pp3);
}

}  // namespace
}  // namespace lce_gemm

cudaError_t lce_dz_gemm_sm90(const LceDzGemmSm90Args& args) {
  const LceGemmSm90Args& g = args.gemm;
  if (g.m < 1 || g.n < 1 || g.k < 1 || g.m > INT32_MAX || g.n > INT32_MAX || g.k > INT32_MAX ||
      g.num_sms < 1 || (g.layout != 2 && g.layout != 3))
    return cudaErrorInvalidValue;
  return FP16_BF16_SWITCH(g.is_bf16, [&]() -> cudaError_t {
    return lce_gemm::launch_dz<elem_t>(args);
  });
}

int64_t lce_ce_stats_tiles(int64_t n) {
  using C = lce_gemm::GemmTilesSm90;
  return (n + C::kBlockN - 1) / C::kBlockN;
}

cudaError_t lce_logits_ce_stats_sm90(const LceCeStatsSm90Args& args) {
  const LceGemmSm90Args& g = args.gemm;
  if (g.m < 1 || g.n < 1 || g.k < 1 || g.m > INT32_MAX || g.n > INT32_MAX || g.k > INT32_MAX ||
      g.num_sms < 1)
    return cudaErrorInvalidValue;
  return FP16_BF16_SWITCH(g.is_bf16, [&]() -> cudaError_t {
    return lce_gemm::launch_ce_stats<elem_t>(args);
  });
}

int lce_gemm_sm90_splits(const LceGemmSm90Args& args, int64_t* workspace_floats) {
  using C = lce_gemm::GemmTilesSm90;
  *workspace_floats = 0;
  if (args.layout != 2 || args.accumulate || args.m < 1 || args.n < 1 || args.k < 1) return 1;
  const int64_t tiles = ((args.m + C::kBlockM - 1) / C::kBlockM) *
                        ((args.n + C::kBlockN - 1) / C::kBlockN);
  const int64_t k_blocks = (args.k + C::kBlockK - 1) / C::kBlockK;
  const int64_t sms = args.num_sms < 1 ? 1 : args.num_sms;
  // Busy fraction of the SMs over the waves of `units` work units.
  auto busy = [&](int64_t units) {
    return static_cast<double>(units) / (static_cast<double>((units + sms - 1) / sms) * sms);
  };
  int splits = 1;
  if (const char* s = std::getenv("FUSEDOPS_LCE_GEMM_SPLITK")) {
    splits = std::atoi(s) >= 1 ? std::atoi(s) : 1;
  } else if (busy(tiles) < 0.9) {
    // The fewest splits that keep 90% of the SMs busy, with at least 16 k-blocks (1024 of K)
    // per split and at most 16 splits; else the best of those.
    double best = busy(tiles);
    for (int s = 2; s <= 16 && k_blocks / s >= 16; ++s) {
      const double b = busy(tiles * s);
      if (b > best + 1e-9) {
        best = b;
        splits = s;
      }
      if (b >= 0.9) break;
    }
  }
  if (splits > k_blocks) splits = static_cast<int>(k_blocks);
  const int64_t per = (k_blocks + splits - 1) / splits;
  splits = static_cast<int>((k_blocks + per - 1) / per);
  if (splits > 1) *workspace_floats = splits * args.m * lce_gemm::ws_ld(args.n);
  return splits;
}

cudaError_t lce_gemm_sm90(const LceGemmSm90Args& args) {
  if (args.m < 1 || args.n < 1 || args.k < 1 || args.m > INT32_MAX || args.n > INT32_MAX ||
      args.k > INT32_MAX || args.num_sms < 1)
    return cudaErrorInvalidValue;
  return FP16_BF16_SWITCH(args.is_bf16, [&]() -> cudaError_t {
    switch (args.layout) {
      case 1:
        if (args.accumulate) return cudaErrorNotSupported;
        return lce_gemm::launch<elem_t, false, false, false>(args);
      case 2:
        if (args.accumulate) return cudaErrorNotSupported;
        return lce_gemm::launch<elem_t, false, true, false>(args);
      case 3:
        return args.accumulate ? lce_gemm::launch<elem_t, true, true, true>(args)
                               : lce_gemm::launch<elem_t, true, true, false>(args);
      default:
        return cudaErrorInvalidValue;
    }
  });
}

}  // namespace fusedops
