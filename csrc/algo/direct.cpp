#include "algo/direct.h"

#include "algo/ring.h"
#include "algo/step_builders.h"

namespace pycoll {
using namespace steps;

void oneshot_allreduce(const ScheduleParams& p, StepSink& sink) {
  if (p.size == 1) {
    emit(sink, copy(in(0), out(0), p.count));
    return;
  }
  for (size_t o = 0; o < p.count; o += p.piece) {
    const size_t len = piece_len(p.count, o, p.piece);
    emit(sink, send(kAllPeers, in(o), len, Wire::Acc));
    emit(sink, recv_reduce_copy(kAllPeers, in(o), out(o), len, kNoPeer, /*bcast=*/true));
  }
}

void twoshot_allreduce(const ScheduleParams& p, StepSink& sink) {
  const int n = p.size, r = p.rank;
  if (n == 1) {
    emit(sink, copy(in(0), out(0), p.count));
    return;
  }
  const size_t ss = ring_shard_size(p.count, n, p.shard_align);
  auto shard_len = [&](int k) {
    const size_t b = static_cast<size_t>(k) * ss;
    return b < p.count ? std::min(ss, p.count - b) : size_t{0};
  };
  // Piece o of every peer's shard, to its owner; peers in a rotated order, so that not every
  // rank starts with rank 0.
  auto sends = [&](size_t o) {
    for (int d = 1; d < n; ++d) {
      const int q = mod(r + d, n);
      const size_t at = static_cast<size_t>(q) * ss + o;
      emit(sink, send(q, in(at), piece_len(shard_len(q), o, p.piece), Wire::Acc));
    }
  };
  if (p.lookahead) sends(0);
  for (size_t o = 0; o < ss; o += p.piece) {
    auto off = [&](int k) { return static_cast<size_t>(k) * ss + o; };
    if (!p.lookahead) sends(o);
    emit(sink, recv_reduce_copy_send(kAllPeers, in(off(r)), out(off(r)), kAllPeers,
                                     piece_len(shard_len(r), o, p.piece)));
    // With lookahead, as in the ring: the next piece's partials go out before this piece's
    // reduced shards come in, so the peers' reductions overlap our copies (every channel
    // carries the same messages in the same order; 2 slots a channel).
    if (p.lookahead && o + p.piece < ss) sends(o + p.piece);
    for (int d = 1; d < n; ++d) {
      const int q = mod(r - d, n);
      emit(sink, recv(q, out(off(q)), piece_len(shard_len(q), o, p.piece), /*bcast=*/true));
    }
  }
}

void direct_allreduce(const ScheduleParams& p, StepSink& sink) {
  if (p.count * p.acc_bytes <= p.oneshot_max_bytes)
    oneshot_allreduce(p, sink);
  else
    twoshot_allreduce(p, sink);
}

void direct_reduce_scatter(const ScheduleParams& p, StepSink& sink) {
  const int n = p.size, r = p.rank;
  const Blocks b(p.counts, p.count, n);
  if (n == 1) {
    emit(sink, copy(in(0), out(0), b.len(0)));
    return;
  }
  for (size_t o = 0; o < b.longest(); o += p.piece) {
    for (int d = 1; d < n; ++d) {
      const int q = mod(r + d, n);
      emit(sink, send(q, in(b.off(q) + o), piece_len(b.len(q), o, p.piece), Wire::Acc));
    }
    emit(sink,
         recv_reduce_copy(kAllPeers, in(b.off(r) + o), out(o), piece_len(b.len(r), o, p.piece)));
  }
}

void direct_allgather(const ScheduleParams& p, StepSink& sink) {
  const int n = p.size, r = p.rank;
  const Blocks b(p.counts, p.count, n);
  for (size_t o = 0; o < b.longest(); o += p.piece) {
    const size_t len = piece_len(b.len(r), o, p.piece);
    emit(sink, copy(in(o), out(b.off(r) + o), len));
    if (n == 1) continue;
    emit(sink, send(kAllPeers, in(o), len, Wire::Elem));
    for (int d = 1; d < n; ++d) {
      const int q = mod(r - d, n);
      emit(sink, recv(q, out(b.off(q) + o), piece_len(b.len(q), o, p.piece), /*bcast=*/true));
    }
  }
}

void direct_broadcast(const ScheduleParams& p, StepSink& sink) {
  if (p.size == 1) return;
  for (size_t o = 0; o < p.count; o += p.piece) {
    const size_t len = piece_len(p.count, o, p.piece);
    if (p.rank == p.root)
      emit(sink, send(kAllPeers, out(o), len, Wire::Elem));
    else
      emit(sink, recv(p.root, out(o), len, /*bcast=*/true));
  }
}

void direct_reduce(const ScheduleParams& p, StepSink& sink) {
  if (p.size == 1) {
    emit(sink, copy(in(0), out(0), p.count));
    return;
  }
  for (size_t o = 0; o < p.count; o += p.piece) {
    const size_t len = piece_len(p.count, o, p.piece);
    if (p.rank == p.root)
      emit(sink, recv_reduce_copy(kAllPeers, in(o), out(o), len));
    else
      emit(sink, send(p.root, in(o), len, Wire::Acc));
  }
}

}  // namespace pycoll
