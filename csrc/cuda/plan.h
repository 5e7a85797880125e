// Host-side planning for the CUDA transport: a schedule's steps in the kernel's format.
//
// Pure code (no CUDA calls), so it is built and tested without a GPU.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "algo/schedule.h"
#include "common/dtypes.h"
#include "cuda/device_step.h"

namespace pycoll {
namespace cuda {

// One collective's steps for one rank, and the messages they move on each channel: the host
// advances its counters by these once the steps are queued.
struct Plan {
  std::vector<DevStep> steps;
  std::vector<uint64_t> sent, received, bcast_received;  // by peer
  uint64_t bcast_sent = 0;
};

// Builds rank p.rank's plan. Throws InvalidArgument when a step does not fit the kernel format.
Plan build_plan(Algo a, Collective c, const ScheduleParams& p);

// Elements [lo, hi) of an n-element message that block `block` of `nblocks` carries. Both ends
// of a message compute the same split; the schedules touch memory in whole pieces with fixed
// boundaries, so a block alone ever touches the elements it is given.
struct Slice {
  size_t lo, hi;
};
PYCOLL_HD inline Slice block_slice(size_t n, int nblocks, int block) {
  size_t per = (n + nblocks - 1) / nblocks;
  per = (per + kSliceAlign - 1) / kSliceAlign * kSliceAlign;
  const size_t lo = per * block < n ? per * block : n;
  const size_t hi = lo + per < n ? lo + per : n;
  return Slice{lo, hi};
}

// Bytes one block's share of a `slot_bytes` slot needs (the largest slice of the largest
// message, in the widest wire type, rounded to 256 bytes).
size_t sub_slot_bytes(size_t slot_bytes, int nblocks);

// The layout of a rank's device segment.
SegmentLayout make_layout(int size, int nslots, int nblocks, size_t slot_bytes);

}  // namespace cuda
}  // namespace pycoll
