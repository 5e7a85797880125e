// One entry point for every (algorithm, collective) schedule.
#pragma once

#include <cstddef>
#include <string>

#include "algo/step.h"

namespace pycoll {

enum class Collective : int {
  AllReduce = 0,
  ReduceScatter,
  AllGather,
  Broadcast,
  Reduce,
  AllToAll,
  Gather,
  Scatter
};
enum class Algo : int { Auto = 0, Ring = 1, Tree = 2, Direct = 3 };
constexpr int kNumAlgos = 4;
constexpr int kNumCollectives = 8;

const char* collective_name(Collective c);
const char* algo_name(Algo a);
// Whether `a` has a schedule for `c` (tree covers all-reduce, broadcast and reduce; all-to-all,
// gather and scatter are direct only).
bool algo_supports(Algo a, Collective c);
// Whether `c` has a root (broadcast, reduce, gather, scatter).
bool has_root(Collective c);
// Whether messages of `c` carry partial reductions (and so travel in the accumulation type).
bool carries_partials(Collective c);

// Names and codes as the API edges take them (every binding parses through these); an unknown
// name or a code the collective has no schedule for is an InvalidArgument.
Collective collective_from_name(const std::string& name);
Algo algo_from_name(const std::string& name);  // "auto" included
Algo algo_for(Collective c, int code);         // 0: Auto; else a schedule `c` has

// Emits rank p.rank's steps.
void make_schedule(Algo a, Collective c, const ScheduleParams& p, StepSink& sink);

}  // namespace pycoll
