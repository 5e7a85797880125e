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

}  // namespace pycoll
