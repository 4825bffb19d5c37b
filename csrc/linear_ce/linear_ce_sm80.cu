// The Ampere (sm_80) kernel family: mma.sync + cp.async, 3 pipeline stages (48 KB of shared
// memory per CTA, two CTAs per SM on A100's 164 KB). Also runs on Hopper when forced.
#include "../static_switch.h"
#include "linear_ce_launch.cuh"

namespace fusedops {

using ConfigSm80 = lce::Config</*kStages=*/3, /*kMinArch=*/800>;

cudaError_t linear_ce_fwd_sm80(LinearCeParams& p) {
  return FP16_BF16_SWITCH(p.is_bf16, [&] { return lce::run_fwd<ConfigSm80, elem_t>(p); });
}
cudaError_t linear_ce_bwd_sm80(LinearCeParams& p) {
  return FP16_BF16_SWITCH(p.is_bf16, [&] { return lce::run_bwd<ConfigSm80, elem_t>(p); });
}

}  // namespace fusedops
