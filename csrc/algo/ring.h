// Ring schedules. Pure code: (rank, size, count, root, piece) -> steps.
//
// Every collective is pipelined in pieces of at most `piece` elements, so messages larger than
// the staging buffer stream through it and neighbours work on consecutive pieces at once.
#pragma once

#include <cstddef>

#include "algo/step.h"

namespace pycoll {

// Shards of an all-reduce: shard i holds [i*ceil(count/size), ...), clipped to count.
size_t ring_shard_size(size_t count, int size, size_t align = 1);

// all-reduce = reduce-scatter + all-gather. Input -> Output (they may alias).
void ring_allreduce(const ScheduleParams& p, StepSink& sink);
// Input holds size*count elements; rank r ends with shard r reduced in Output[0, count).
void ring_reduce_scatter(const ScheduleParams& p, StepSink& sink);
// Input holds count elements; Output holds size*count, rank-major.
void ring_allgather(const ScheduleParams& p, StepSink& sink);
// Pipelined chain root -> root+1 -> ... -> root-1 over Output (in place).
void ring_broadcast(const ScheduleParams& p, StepSink& sink);
// Pipelined chain root+1 -> ... -> root; the root's Output gets op over all Inputs.
void ring_reduce(const ScheduleParams& p, StepSink& sink);

}  // namespace pycoll
