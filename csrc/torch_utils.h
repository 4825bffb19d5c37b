// Host helpers of the torch bindings (attention_api.cpp, linear_ce_api.cpp): the launch-error
// check and the `arch` argument's check, written once so that both ops raise alike.
#pragma once

#include <c10/util/Exception.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

// Integers in check messages go through std::to_string: on the H200 machine (torch 2.11) a
// TORCH_CHECK message holding an int64_t argument crashed the process instead of raising (strings,
// dtypes and literals raised as they should).

namespace fusedops {

inline void check_launch(cudaError_t err, const char* what) {
  TORCH_CHECK(err == cudaSuccess, "fusedops ", what, " launch failed: ", cudaGetErrorString(err));
}

// The `arch` argument of the CUDA ops names the kernel family to run: 80 the sm80 family
// (mma.sync + cp.async, built for sm_80 and for sm_90a), 90 the Hopper one. Checked before
// anything is allocated, so that a bad value raises for empty inputs too; an op without a
// Hopper family raises for 90 itself.
inline void check_arch(int64_t arch) {
  TORCH_CHECK_VALUE(arch == 80 || arch == 90, "arch must be 80 or 90, got ",
                    std::to_string(arch));
}

}  // namespace fusedops
