// The Hopper (sm_90a) attention backward, instantiated for fp16/bf16 x head dim 64/128. The
// kernel body exists only in the sm_90a build (setup.py also compiles this file for sm_80, where
// it traps; attention_api.cpp takes this entry point only for arch 90, on compute capability
// 9.0). Its deterministic mode orders the dQ reductions (p.dq_sem); FUSEDOPS_ATTN_SM90_BWD=sm80
// makes attention_api.cpp run the sm80 backward instead (in the deterministic mode its separate
// dQ pass).
#include <cstdlib>
#include <cstring>

#include "../static_switch.h"
#include "attention_launch_bwd_sm90.cuh"

namespace fusedops {

// FUSEDOPS_ATTN_SM90_BWD=sm80 takes the sm80 backward on Hopper (for measurement, and as a way
// out); read at every call, so that a test can switch it.
bool attention_bwd_sm90_enabled() {
  const char* s = std::getenv("FUSEDOPS_ATTN_SM90_BWD");
  return s == nullptr || std::strcmp(s, "sm80") != 0;
}

// attention_api.cpp calls this only to run the sm90 kernel (it reads the switch above once and
// takes attention_bwd_sm80 otherwise), with a dQ accumulator that the preprocess zeroes.
cudaError_t attention_bwd_sm90(AttnParams& p) {
  if (p.dq_acc == nullptr) return cudaErrorInvalidValue;
  return FP16_BF16_SWITCH(p.is_bf16, [&] {
    return HEADDIM_SWITCH(p.head_dim, [&] { return attn::run_bwd_sm90<elem_t, kD>(p); });
  });
}

}  // namespace fusedops
