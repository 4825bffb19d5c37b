// Device counters that kernels reset themselves (the split merge of the decode kernel, the
// Hopper attention forward's tile scheduler): one int32 buffer per (device, stream, user), which
// every call on that stream reuses. Calls on one stream run one after another and each leaves
// its counters at zero, so an eager call costs no memset after the first. A CUDA graph zeroes
// the buffer once, before its first such call (one memset node), so that its replays do not
// depend on what ran on the stream before. A buffer that has to grow is replaced but never
// freed (a captured graph may hold its address), and the containers are never destroyed (they
// would outlive the CUDA allocator at exit).
#pragma once

#include <ATen/ATen.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <mutex>
#include <tuple>
#include <vector>

#include "torch_utils.h"

namespace fusedops {

// The users of stream_counters, each with buffers of its own.
enum class CounterUser : int { kDecodeSplits = 0, kAttentionTiles = 1 };

// At least n zeroed int32 counters on like's device for kernels on `stream` (what: the op, for
// error messages).
inline at::Tensor stream_counters(const at::Tensor& like, cudaStream_t stream, int64_t n,
                                  CounterUser user, const char* what) {
  struct Counters {
    at::Tensor t;
    bool zeroed = false;                // zeroed by an executed (not captured) memset
    unsigned long long capture_id = 0;  // the capture whose graph zeroes it first
  };
  static std::mutex mutex;
  static auto* current = new std::map<std::tuple<int, cudaStream_t, int>, Counters>();
  static auto* retired = new std::vector<at::Tensor>();
  const std::lock_guard<std::mutex> lock(mutex);
  Counters& c = (*current)[std::make_tuple(static_cast<int>(like.get_device()), stream,
                                           static_cast<int>(user))];
  if (!c.t.defined() || c.t.numel() < n) {
    if (c.t.defined()) retired->push_back(c.t);
    c.t = at::empty({std::max<int64_t>(n, 64)}, like.options().dtype(at::kInt));
    c.zeroed = false;
    c.capture_id = 0;
  }
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  unsigned long long id = 0;
  check_launch(cudaStreamGetCaptureInfo(stream, &status, &id), what);
  const bool capturing = status == cudaStreamCaptureStatusActive;
  if (capturing ? c.capture_id != id : !c.zeroed) {
    check_launch(cudaMemsetAsync(c.t.data_ptr(), 0, c.t.numel() * sizeof(int), stream), what);
    if (capturing) c.capture_id = id;
    else c.zeroed = true;
  }
  return c.t;
}

}  // namespace fusedops
