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
// Reproducible mode's algorithm for `c`, where `a` was asked for or chosen: a reduction runs
// the direct schedules, which reduce every element once, on one rank, in rank order
// (((x0 op x1) op x2) ..., in the accumulation type, an average divided once at the end):
// one-shot, two-shot, reduce-scatter and reduce, and the paths built on them (shared buffers,
// the device's two-shot over registered buffers). Its bits then depend on the ranks' inputs
// alone, not on the algorithm, path, block count, slot size or node placement. Collectives
// that do not reduce keep `a`.
inline Algo rank_ordered(Collective c, Algo a) { return carries_partials(c) ? Algo::Direct : a; }

// Names and codes as the API edges take them (every binding parses through these); an unknown
// name or a code the collective has no schedule for is an InvalidArgument.
Collective collective_from_name(const std::string& name);
Algo algo_from_name(const std::string& name);  // "auto" included
Algo algo_for(Collective c, int code);         // 0: Auto; else a schedule `c` has

// Emits rank p.rank's steps.
void make_schedule(Algo a, Collective c, const ScheduleParams& p, StepSink& sink);

}  // namespace pycoll
