// Device helpers that every kernel family shares and that need no particular architecture:
// log2(e), zeroing of accumulator arrays, float <-> fp16/bf16 conversions and packing, and ex2
// (MUFU.EX2, or a polynomial on the FMA pipe).
// The tensor-core and async-copy PTX of the Ampere path is mma_sm80.cuh's.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>

namespace fusedops {
namespace dev {

constexpr float kLog2e = 1.4426950408889634f;

// An accumulator of MT x N fragments of 4 floats (the m16n8 tile layout) set to zero.
template <int MT, int N>
__device__ __forceinline__ void zero(float (&acc)[MT][N][4]) {
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int i = 0; i < N; ++i)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[mt][i][e] = 0.f;
}

template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi);
template <>
__device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}
template <>
__device__ __forceinline__ uint32_t pack2<__half>(float lo, float hi) {
  __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

// Element <-> float32; the float32 versions are the identity, for kernels that also take float32
// tensors (the gradient scaling).
template <typename T>
__device__ __forceinline__ float to_float(T v);
template <>
__device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 v) {
  return __bfloat162float(v);
}
template <>
__device__ __forceinline__ float to_float<__half>(__half v) { return __half2float(v); }
template <>
__device__ __forceinline__ float to_float<float>(float v) { return v; }

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}
template <>
__device__ __forceinline__ __half from_float<__half>(float v) {
  return __float2half_rn(v);
}
template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }

__device__ __forceinline__ float ex2(float x) {  // 2^x, MUFU.EX2 (ex2(-inf) = 0)
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// 2^x on the FMA pipe, for kernels whose exponentials outrun MUFU.EX2 (16 per clock per SM on
// sm_80/sm_90, against 128 FMAs): Cody-Waite reduction x = j + f, j = round(x), f in [-0.5, 0.5],
// then 2^f by a minimax polynomial (Horner, FFMA) times 2^j, a float whose exponent field is
// j + 127 (one shift of the rounding sum's bits). Inputs are clamped to -127 first, where
// 2^j's bits are all zero: -inf and everything below -127 give exactly 0 (no garbage exponent),
// NaN stays NaN (max.NaN). Valid for x <= 127; the attention softmax passes x <= kSlack.
// Relative error (tests/attention/test_exp2_poly.py, a float32 model of these steps): degree 3
// 7.5e-5, degree 4 2.7e-6 (ex2.approx: a few float32 ulps). Instructions: 3 FADD, kDegree FFMA
// and one FMUL on the FMA pipe, the clamp (FMNMX) and the shift (SHF or IMAD.SHL). Coefficients:
// minimax of the relative error of 2^f on [-0.5, 0.5] (Lawson's algorithm), rounded to float32.
template <int kDegree = 3>
__device__ __forceinline__ float ex2_poly(float x) {
  static_assert(kDegree == 3 || kDegree == 4, "ex2_poly has degree 3 or 4");
  float xc;
  asm("max.NaN.f32 %0, %1, %2;\n" : "=f"(xc) : "f"(x), "f"(-127.f));
  // 1.5 * 2^23 + 127: the sum is rounded to an integer (to nearest) held in the low mantissa
  // bits, offset by the exponent bias, so that its bits shifted by 23 are 2^j's.
  constexpr float kRound = 12583039.f;
  const float t = __fadd_rn(xc, kRound);
  const float f = __fsub_rn(xc, __fsub_rn(t, kRound));  // exact
  float p;
  if constexpr (kDegree == 3) {
    p = __fmaf_rn(f, 0.05517167f, 0.24261113f);
    p = __fmaf_rn(p, f, 0.69326097f);
    p = __fmaf_rn(p, f, 0.99992806f);
  } else {
    p = __fmaf_rn(f, 0.009570102f, 0.05591786f);
    p = __fmaf_rn(p, f, 0.24024744f);
    p = __fmaf_rn(p, f, 0.6931218f);
    p = __fmaf_rn(p, f, 0.9999993f);
  }
  return __fmul_rn(p, __int_as_float(__float_as_int(t) << 23));
}

}  // namespace dev
}  // namespace fusedops
