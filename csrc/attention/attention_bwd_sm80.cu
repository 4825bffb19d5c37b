// The Ampere (sm_80) attention backward (delta, dK/dV with or without atomic dQ, dQ, dQ
// conversion), instantiated for fp16/bf16 x head dim 64/128; also run on Hopper when forced.
#include "../static_switch.h"
#include "attention_launch_sm80.cuh"

namespace fusedops {

cudaError_t attention_bwd_sm80(AttnParams& p) {
  return FP16_BF16_SWITCH(p.is_bf16, [&] {
    return HEADDIM_SWITCH(p.head_dim, [&] { return attn::run_bwd<elem_t, kD>(p); });
  });
}

bool attention_bwd_atomic_fits_sm80(int head_dim) {
  return head_dim == 128 ? attn::split_fits<128>() : attn::split_fits<64>();
}

}  // namespace fusedops
