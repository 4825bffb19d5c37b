// The Ampere (sm_80) attention forward, instantiated for fp16/bf16 x head dim 64/128. Also run
// on Hopper (the sm_90a build of the same code) until the wgmma path exists. The backward is in
// attention_bwd_sm80.cu, a separate translation unit so that the two compile in parallel.
#include "../static_switch.h"
#include "attention_launch_sm80.cuh"

namespace fusedops {

cudaError_t attention_fwd_sm80(AttnParams& p) {
  return FP16_BF16_SWITCH(p.is_bf16, [&] {
    return HEADDIM_SWITCH(p.head_dim, [&] { return attn::run_fwd<elem_t, kD>(p); });
  });
}

}  // namespace fusedops
