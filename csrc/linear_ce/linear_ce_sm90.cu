// The Hopper (sm_90a) kernel family. Compiled to device code only for sm_90 and later (the body
// traps below that) and dispatched separately from the sm_80 family. It is still the mma.sync
// design with a deeper pipeline (4 stages, 64 KB per CTA, two CTAs in 228 KB); the wgmma + TMA
// version is the linear cross-entropy performance issue's work.
#include "../static_switch.h"
#include "linear_ce_launch.cuh"

namespace fusedops {

using ConfigSm90 = lce::Config</*kStages=*/4, /*kMinArch=*/900>;

cudaError_t linear_ce_fwd_sm90(LinearCeParams& p) {
  return FP16_BF16_SWITCH(p.is_bf16, [&] { return lce::run_fwd<ConfigSm90, elem_t>(p); });
}
cudaError_t linear_ce_bwd_sm90(LinearCeParams& p) {
  return FP16_BF16_SWITCH(p.is_bf16, [&] { return lce::run_bwd<ConfigSm90, elem_t>(p); });
}

}  // namespace fusedops
