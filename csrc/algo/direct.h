// Direct schedules for small and mid-sized messages: every rank talks to every other rank
// at once, through its broadcast channel or one channel per peer, instead of passing pieces
// along a ring. Fewer steps, more parallel traffic.
#pragma once

#include "algo/step.h"

namespace pycoll {

// One-shot: every rank publishes its input and reduces all of them itself, in rank order.
void oneshot_allreduce(const ScheduleParams& p, StepSink& sink);
// Two-shot: direct reduce-scatter (rank r reduces shard r from every rank's piece), then
// direct all-gather of the reduced shards.
void twoshot_allreduce(const ScheduleParams& p, StepSink& sink);
// One-shot up to p.oneshot_max_bytes, two-shot above.
void direct_allreduce(const ScheduleParams& p, StepSink& sink);
void direct_reduce_scatter(const ScheduleParams& p, StepSink& sink);
void direct_allgather(const ScheduleParams& p, StepSink& sink);
void direct_broadcast(const ScheduleParams& p, StepSink& sink);
void direct_reduce(const ScheduleParams& p, StepSink& sink);

}  // namespace pycoll
