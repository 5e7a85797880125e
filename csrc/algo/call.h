// One collective call, everything needed to run it later: what every transport (shared
// memory, CUDA) executes once the arguments have been checked.
#pragma once

#include <cstddef>

#include "algo/schedule.h"
#include "common/dtypes.h"

namespace pycoll {

struct CollectiveCall {
  bool barrier = false;  // a barrier, not a data collective
  Collective collective = Collective::AllReduce;
  Algo algo = Algo::Auto;  // Auto: forced algorithm if set and available, else the tuning table
  const void* in = nullptr;
  void* out = nullptr;
  size_t count = 0;  // as in ScheduleParams
  DType dtype = DType::Float32;
  RedOp op = RedOp::Sum;
  int root = 0;
};

// Elements of the input and output arrays that `call` may touch on `rank` of `size`: broadcast
// works in place on its output, and reduce writes only the root's.
struct CallExtents {
  size_t in = 0, out = 0;
};
inline CallExtents call_extents(const CollectiveCall& call, int rank, int size) {
  CallExtents e{call.count, call.count};
  const size_t n = static_cast<size_t>(size);
  if (call.collective == Collective::ReduceScatter) e.in = call.count * n;
  if (call.collective == Collective::AllGather) e.out = call.count * n;
  if (call.collective == Collective::Reduce && rank != call.root) e.out = 0;
  if (call.collective == Collective::Broadcast) e.in = 0;
  return e;
}

}  // namespace pycoll
