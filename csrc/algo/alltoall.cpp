#include "algo/alltoall.h"

#include "algo/step_builders.h"

namespace pycoll {
using namespace steps;

namespace {

// Whether a block between two different ranks is left to the caller (both ends agree: they
// see the same length).
bool left_out(const ScheduleParams& p, size_t len) {
  return p.direct_min_count != 0 && len >= p.direct_min_count;
}

}  // namespace

void direct_alltoall(const ScheduleParams& p, StepSink& sink) {
  const int n = p.size, r = p.rank;
  const Blocks sends(p.send_counts, p.count, n), recvs(p.recv_counts, p.count, n);
  auto kept = [&](size_t len) { return left_out(p, len) ? 0 : len; };
  // Rounds cover the longest block this rank copies, sends or receives; a pair with nothing
  // left in a round skips it on both ends (its length is agreed: the split matrix was checked).
  size_t rounds_end = sends.len(r);
  for (int q = 0; q < n; ++q)
    if (q != r) rounds_end = std::max({rounds_end, kept(sends.len(q)), kept(recvs.len(q))});
  for (size_t o = 0; o < rounds_end; o += p.piece) {
    emit(sink,
         copy(in(sends.off(r) + o), out(recvs.off(r) + o), piece_len(sends.len(r), o, p.piece)));
    for (int k = 1; k < n; ++k) {
      const int to = mod(r + k, n), from = mod(r - k, n);
      emit(sink,
           send(to, in(sends.off(to) + o), piece_len(kept(sends.len(to)), o, p.piece), Wire::Elem));
      emit(sink,
           recv(from, out(recvs.off(from) + o), piece_len(kept(recvs.len(from)), o, p.piece)));
    }
  }
}

namespace {
// Gather (`gather`) or scatter, piece by piece: the root moves block q of its output (gather)
// or input (scatter) from or to rank q, and copies its own; every other rank sends or receives
// its one block. Blocks left out (left_out) move point-to-point instead.
void direct_rooted(const ScheduleParams& p, StepSink& sink, bool gather) {
  const int n = p.size, r = p.rank;
  const size_t m = p.count;
  auto at = [m](int q, size_t o) { return static_cast<size_t>(q) * m + o; };
  for (size_t o = 0; o < m; o += p.piece) {
    const size_t len = piece_len(m, o, p.piece);
    if (r != p.root) {
      if (!left_out(p, m))
        emit(sink, gather ? send(p.root, in(o), len, Wire::Elem) : recv(p.root, out(o), len));
      continue;
    }
    emit(sink, gather ? copy(in(o), out(at(r, o)), len) : copy(in(at(r, o)), out(o), len));
    for (int k = 1; k < n && !left_out(p, m); ++k) {
      const int q = mod(r + k, n);
      emit(sink, gather ? recv(q, out(at(q, o)), len) : send(q, in(at(q, o)), len, Wire::Elem));
    }
  }
}
}  // namespace

void direct_gather(const ScheduleParams& p, StepSink& sink) { direct_rooted(p, sink, true); }

void direct_scatter(const ScheduleParams& p, StepSink& sink) { direct_rooted(p, sink, false); }

}  // namespace pycoll
