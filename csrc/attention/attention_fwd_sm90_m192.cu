// The Hopper (sm_90a) attention forward's 192-query tiles (three consumer warpgroups, head dim
// 64, fp16/bf16), a translation unit apart from attention_fwd_sm90.cu so that the two compile
// in parallel; attention_launch_sm90.cuh declares them extern and picks them at run time.
#include "attention_launch_sm90.cuh"

namespace fusedops {
namespace attn {

template cudaError_t launch_fwd_sm90<__half, 64, 128, 3>(const AttnParams&);
template cudaError_t launch_fwd_sm90<__nv_bfloat16, 64, 128, 3>(const AttnParams&);

}  // namespace attn
}  // namespace fusedops
