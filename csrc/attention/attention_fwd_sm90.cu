// The Hopper (sm_90a) attention forward, instantiated for fp16/bf16 x head dim 64/128/256 x the
// schedules, plus 176-key tiles at D=128 (attention_launch_sm90.cuh). The kernel body exists only
// in the sm_90a build (setup.py also compiles this file for sm_80, where it traps;
// attention_api.cpp launches it only on compute capability 9.0). The backward of the sm90 family
// is its own at D=64/128 (attention_bwd_sm90.cu; same AttnParams, same lse layout); at D=256,
// where no CUDA backward is built, the Python op runs Triton's, which reads the same lse.
#include "../static_switch.h"
#include "attention_launch_sm90.cuh"

namespace fusedops {

cudaError_t attention_fwd_sm90(AttnParams& p) {
  return FP16_BF16_SWITCH(p.is_bf16, [&] {
    return HEADDIM_SWITCH_64_128_256(p.head_dim,
                                     [&] { return attn::run_fwd_sm90<elem_t, kD>(p); });
  });
}

}  // namespace fusedops
