// One collective call, everything needed to run it later: what every transport (shared
// memory, CUDA) executes once the arguments have been checked.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <numeric>
#include <vector>

#include "algo/schedule.h"
#include "common/dtypes.h"

namespace pycoll {

struct CollectiveCall {
  bool barrier = false;  // a barrier, not a data collective
  Collective collective = Collective::AllReduce;
  Algo algo = Algo::Auto;  // Auto: forced algorithm if set and available, else the tuning table
  const void* in = nullptr;
  void* out = nullptr;
  size_t count = 0;  // as in ScheduleParams; with `counts`, their sum; with splits, 0
  DType dtype = DType::Float32;
  RedOp op = RedOp::Sum;
  int root = 0;
  // Uneven forms (empty: even). Held by value: an asynchronous call outlives its arguments.
  std::vector<uint64_t> counts;       // all-gather / reduce-scatter: each rank's block
  std::vector<uint64_t> send_counts;  // all-to-all: this rank's row of the split matrix
  std::vector<uint64_t> recv_counts;  // all-to-all: this rank's column
  // A node-local phase of a call across nodes: that call's record (runtime/fingerprint.h,
  // Fingerprint::record), compared with the peers' along with this call's own fingerprint.
  std::array<uint64_t, 4> outer{};
  // Reproducible mode for this call (rank_ordered, algo/schedule.h): 1 on, 0 off, -1 the
  // communicator's setting.
  int8_t reproducible = -1;
  bool reproducible_or(bool communicator) const {
    return reproducible < 0 ? communicator : reproducible != 0;
  }

  bool uneven() const { return !counts.empty() || !send_counts.empty(); }
  // The call's bytes: `count` elements of `dtype` (with `counts`, their sum).
  size_t bytes() const { return count * dtype_size(dtype); }
  // Points `p` at this call's uneven counts (they must outlive the schedule).
  void apply_counts(ScheduleParams& p) const {
    p.counts = counts.empty() ? nullptr : counts.data();
    p.send_counts = send_counts.empty() ? nullptr : send_counts.data();
    p.recv_counts = recv_counts.empty() ? nullptr : recv_counts.data();
  }
};

inline size_t sum_of(const std::vector<uint64_t>& v) {
  return static_cast<size_t>(std::accumulate(v.begin(), v.end(), uint64_t{0}));
}

// Elements of the input and output arrays that `call` may touch on `rank` of `size`: broadcast
// works in place on its output, reduce and gather write only the root's, scatter reads only
// the root's.
struct CallExtents {
  size_t in = 0, out = 0;
};
inline CallExtents call_extents(const CollectiveCall& call, int rank, int size) {
  CallExtents e{call.count, call.count};
  const size_t n = static_cast<size_t>(size);
  const bool root = rank == call.root;
  switch (call.collective) {
    case Collective::ReduceScatter:
      e.in = call.counts.empty() ? call.count * n : sum_of(call.counts);
      if (!call.counts.empty()) e.out = call.counts[rank];
      break;
    case Collective::AllGather:
      e.out = call.counts.empty() ? call.count * n : sum_of(call.counts);
      if (!call.counts.empty()) e.in = call.counts[rank];
      break;
    case Collective::AllToAll:
      e.in = call.send_counts.empty() ? call.count * n : sum_of(call.send_counts);
      e.out = call.recv_counts.empty() ? call.count * n : sum_of(call.recv_counts);
      break;
    case Collective::Reduce:
      if (!root) e.out = 0;
      break;
    case Collective::Broadcast:
      e.in = 0;
      break;
    case Collective::Gather:
      e.out = root ? call.count * n : 0;
      break;
    case Collective::Scatter:
      e.in = root ? call.count * n : 0;
      break;
    case Collective::AllReduce:
      break;
  }
  return e;
}

// Elements the automatic algorithm choice is keyed on: a size every rank agrees on, so that
// every rank picks the same schedule. The input for the even forms (the whole vector for
// broadcast); uneven all-gather blocks differ by rank, so their mean stands for the even
// form's block; all-to-all and scatter count the full send buffer (split all-to-alls have no
// agreed size, but only the direct schedule runs them).
inline size_t choice_count(const CollectiveCall& call, int size) {
  const size_t n = static_cast<size_t>(size);
  switch (call.collective) {
    case Collective::ReduceScatter:  // uneven: count is already sum(counts)
      return call.counts.empty() ? call.count * n : call.count;
    case Collective::AllGather:
      return call.counts.empty() ? call.count : call.count / n;
    case Collective::AllToAll:
    case Collective::Scatter:
      return call.count * n;
    default:
      return call.count;
  }
}

// Whether `call` moves nothing on `rank`: its schedule has no step there, so no plan is needed.
// (A rank whose split row and column are all zeros idles while its peers exchange.)
inline bool moves_nothing(const CollectiveCall& call, int rank, int size) {
  const CallExtents e = call_extents(call, rank, size);
  return e.in == 0 && e.out == 0;
}

// Why a call runs the algorithm it runs (PYCOLL_DEBUG=INFO prints it).
enum class Reason : uint8_t {
  Asked,       // the call named it
  Forced,      // PYCOLL_ALGO, for an automatic call
  SingleCopy,  // large enough for direct writes into the peers' outputs (host/single_copy.h)
  Table,       // a rule of the tuning table
  Size,        // the transport's size threshold (the device: direct up to direct_max_bytes)
  Default,     // nothing else applies: ring, or direct where the collective has no ring
};
inline const char* reason_name(Reason r) {
  static const char* const names[] = {"asked",        "PYCOLL_ALGO", "single copy",
                                      "tuning table", "by size",     "default"};
  return names[static_cast<int>(r)];
}

struct AlgoChoice {
  Algo algo;
  Reason why;
};

// What is decided about one call, once, before anything moves (resolve_call): every executor
// reads it and decides none of it again.
struct ResolvedCall {
  const CollectiveCall* call = nullptr;
  int rank = 0, size = 1;
  size_t elem = 0;  // bytes per element of the arrays
  size_t acc = 0;   // ... of the accumulation type (partial reductions travel in it)
  CallExtents ext;  // elements of the input and output this rank touches
  // Bytes the automatic choices are keyed on: the same on every rank (choice_count).
  size_t choice_bytes = 0;
  // The input and output share bytes: the collective's in-place layout (the checks allow no
  // other overlap), where a later step may overwrite what an earlier one reads.
  bool in_place = false;
  Algo algo = Algo::Auto;
  Reason why = Reason::Asked;
  bool rank_ordered = false;  // reproducible mode turned a reduction's algorithm to direct

  // The schedule's parameters: pieces of one `slot_bytes` slot in the messages' type (the
  // accumulation type where they carry partial reductions), shards of whole `shard_align`
  // elements. The per-rank counts point into the call, which must outlive them.
  ScheduleParams schedule(size_t slot_bytes, size_t oneshot_max_bytes, size_t shard_align = 1,
                          bool lookahead = false) const {
    ScheduleParams p;
    p.rank = rank;
    p.size = size;
    p.count = call->count;
    p.root = call->root;
    p.piece = slot_bytes / (carries_partials(call->collective) ? acc : elem);
    p.acc_bytes = acc;
    p.oneshot_max_bytes = oneshot_max_bytes;
    p.shard_align = shard_align;
    p.lookahead = lookahead;
    call->apply_counts(p);
    return p;
  }
};

// Resolves `call` (its arguments already checked) on `rank` of `size`. An automatic call's
// algorithm is `automatic(collective, choice_bytes)`, the transport's policy (an AlgoChoice);
// in reproducible mode (the call's own setting, else `reproducible`) a reduction then runs in
// rank order (rank_ordered, algo/schedule.h).
template <class Automatic>
ResolvedCall resolve_call(const CollectiveCall& call, int rank, int size, bool reproducible,
                          Automatic&& automatic) {
  ResolvedCall r;
  r.call = &call;
  r.rank = rank;
  r.size = size;
  r.elem = dtype_size(call.dtype);
  r.acc = acc_size(call.dtype);
  r.ext = call_extents(call, rank, size);
  r.choice_bytes = choice_count(call, size) * r.elem;
  const auto* in = static_cast<const uint8_t*>(call.in);
  const auto* out = static_cast<const uint8_t*>(call.out);
  const size_t in_bytes = r.ext.in * r.elem, out_bytes = r.ext.out * r.elem;
  r.in_place = in_bytes != 0 && out_bytes != 0 && in < out + out_bytes && out < in + in_bytes;
  const AlgoChoice c = call.algo == Algo::Auto ? automatic(call.collective, r.choice_bytes)
                                               : AlgoChoice{call.algo, Reason::Asked};
  r.algo = c.algo;
  r.why = c.why;
  if (call.reproducible_or(reproducible)) {
    r.algo = rank_ordered(call.collective, c.algo);
    r.rank_ordered = r.algo != c.algo;
  }
  return r;
}

}  // namespace pycoll
