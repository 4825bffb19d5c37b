// Compile-time branching helpers: turn a runtime value into a constexpr for a templated lambda.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#define BOOL_SWITCH(COND, CONST_NAME, ...)      \
  [&] {                                         \
    if (COND) {                                 \
      constexpr static bool CONST_NAME = true;  \
      return __VA_ARGS__();                     \
    } else {                                    \
      constexpr static bool CONST_NAME = false; \
      return __VA_ARGS__();                     \
    }                                           \
  }()

// IS_BF16 -> elem_t is __nv_bfloat16, else __half.
#define FP16_BF16_SWITCH(IS_BF16, ...)   \
  [&] {                                  \
    if (IS_BF16) {                       \
      using elem_t = __nv_bfloat16;      \
      return __VA_ARGS__();              \
    } else {                             \
      using elem_t = __half;             \
      return __VA_ARGS__();              \
    }                                    \
  }()

// Attention head dim: 64 -> kD = 64, anything else (the caller checks) -> kD = 128.
#define HEADDIM_SWITCH(D_VALUE, ...) \
  [&] {                              \
    if ((D_VALUE) == 64) {           \
      constexpr static int kD = 64;  \
      return __VA_ARGS__();          \
    } else {                         \
      constexpr static int kD = 128; \
      return __VA_ARGS__();          \
    }                                \
  }()

// The same with head dim 256 too (the Hopper forward): 64 -> 64, 256 -> 256, else 128.
#define HEADDIM_SWITCH_64_128_256(D_VALUE, ...) \
  [&] {                                         \
    if ((D_VALUE) == 64) {                      \
      constexpr static int kD = 64;             \
      return __VA_ARGS__();                     \
    } else if ((D_VALUE) == 256) {              \
      constexpr static int kD = 256;            \
      return __VA_ARGS__();                     \
    } else {                                    \
      constexpr static int kD = 128;            \
      return __VA_ARGS__();                     \
    }                                           \
  }()
