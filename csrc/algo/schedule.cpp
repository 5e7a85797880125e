#include "algo/schedule.h"

#include "algo/alltoall.h"
#include "algo/direct.h"
#include "algo/ring.h"
#include "algo/tree.h"
#include "common/errors.h"

namespace pycoll {

const char* collective_name(Collective c) {
  static const char* names[] = {"all_reduce", "reduce_scatter", "all_gather", "broadcast",
                                "reduce",     "all_to_all",     "gather",     "scatter"};
  return names[static_cast<int>(c)];
}

const char* algo_name(Algo a) {
  static const char* names[] = {"auto", "ring", "tree", "direct"};
  return names[static_cast<int>(a)];
}

bool algo_supports(Algo a, Collective c) {
  const bool personalised =
      c == Collective::AllToAll || c == Collective::Gather || c == Collective::Scatter;
  if (a == Algo::Tree)
    return c == Collective::AllReduce || c == Collective::Broadcast || c == Collective::Reduce;
  if (a == Algo::Ring) return !personalised;
  return a == Algo::Direct;
}

bool has_root(Collective c) {
  return c == Collective::Broadcast || c == Collective::Reduce || c == Collective::Gather ||
         c == Collective::Scatter;
}

bool carries_partials(Collective c) {
  return c == Collective::AllReduce || c == Collective::ReduceScatter || c == Collective::Reduce;
}

Algo algo_for(Collective c, int algo) {
  const char* fn = collective_name(c);
  if (algo < 0 || algo >= kNumAlgos)
    throw InvalidArgument(str_cat(fn, ": unknown algorithm code ", algo));
  const Algo a = static_cast<Algo>(algo);
  if (a != Algo::Auto && !algo_supports(a, c)) {
    std::string avail;
    for (int k = 1; k < kNumAlgos; ++k)
      if (algo_supports(static_cast<Algo>(k), c))
        avail += str_cat(avail.empty() ? "" : ", ", algo_name(static_cast<Algo>(k)));
    throw InvalidArgument(str_cat(fn, ": algorithm ", algo_name(a), " is not available for ", fn,
                                  " (available: ", avail, ")"));
  }
  return a;
}

Collective collective_from_name(const std::string& name) {
  for (int k = 0; k < kNumCollectives; ++k)
    if (name == collective_name(static_cast<Collective>(k))) return static_cast<Collective>(k);
  throw InvalidArgument(str_cat("unknown collective ", name));
}

Algo algo_from_name(const std::string& name) {
  for (int k = 0; k < kNumAlgos; ++k)
    if (name == algo_name(static_cast<Algo>(k))) return static_cast<Algo>(k);
  throw InvalidArgument(str_cat("unknown algorithm ", name));
}

void make_schedule(Algo a, Collective c, const ScheduleParams& p, StepSink& sink) {
  PYCOLL_CHECK(algo_supports(a, c), algo_name(a), " has no ", collective_name(c));
  switch (a) {
    case Algo::Ring:
      switch (c) {
        case Collective::AllReduce:
          return ring_allreduce(p, sink);
        case Collective::ReduceScatter:
          return ring_reduce_scatter(p, sink);
        case Collective::AllGather:
          return ring_allgather(p, sink);
        case Collective::Broadcast:
          return ring_broadcast(p, sink);
        case Collective::Reduce:
          return ring_reduce(p, sink);
        default:
          break;
      }
      break;
    case Algo::Tree:
      if (c == Collective::AllReduce) return tree_allreduce(p, sink);
      if (c == Collective::Broadcast) return tree_broadcast(p, sink);
      return tree_reduce(p, sink);
    case Algo::Direct:
      switch (c) {
        case Collective::AllReduce:
          return direct_allreduce(p, sink);
        case Collective::ReduceScatter:
          return direct_reduce_scatter(p, sink);
        case Collective::AllGather:
          return direct_allgather(p, sink);
        case Collective::Broadcast:
          return direct_broadcast(p, sink);
        case Collective::Reduce:
          return direct_reduce(p, sink);
        case Collective::AllToAll:
          return direct_alltoall(p, sink);
        case Collective::Gather:
          return direct_gather(p, sink);
        case Collective::Scatter:
          return direct_scatter(p, sink);
      }
      break;
    case Algo::Auto:
      break;
  }
  PYCOLL_CHECK(false, "no schedule chosen");
}

}  // namespace pycoll
