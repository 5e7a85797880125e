#include "algo/ring.h"

#include <algorithm>

#include "algo/step_builders.h"

namespace pycoll {
using namespace steps;

size_t ring_shard_size(size_t count, int size, size_t align) {
  const size_t ss = (count + static_cast<size_t>(size) - 1) / static_cast<size_t>(size);
  return (ss + align - 1) / align * align;
}

void ring_allreduce(const ScheduleParams& p, StepSink& sink) {
  const int n = p.size, r = p.rank;
  if (n == 1) {
    emit(sink, copy(in(0), out(0), p.count));
    return;
  }
  const int next = mod(r + 1, n), prev = mod(r - 1, n);
  const size_t ss = ring_shard_size(p.count, n, p.shard_align);
  // Piece `o` of shard k: its offset and length (0 past the end of a short last shard).
  auto off_at = [&](int k, size_t o) { return static_cast<size_t>(k) * ss + o; };
  auto len_at = [&](int k, size_t o) {
    const size_t b = off_at(k, o), e = std::min(static_cast<size_t>(k) * ss + ss, p.count);
    return b < e ? std::min(p.piece, e - b) : size_t{0};
  };
  // The first message of piece o: our partial of shard r-1.
  auto first_send = [&](size_t o) {
    const int k = mod(r - 1, n);
    emit(sink, send(next, in(off_at(k, o)), len_at(k, o), Wire::Acc));
  };
  if (p.lookahead) first_send(0);
  for (size_t o = 0; o < ss; o += p.piece) {
    auto off = [&](int k) { return off_at(k, o); };
    auto len = [&](int k) { return len_at(k, o); };
    // Reduce-scatter: at step s we send shard r-s-1; shard k's partial sum starts at rank k+1
    // and ends, complete, at rank k.
    if (!p.lookahead) first_send(o);
    for (int s = 1; s < n - 1; ++s) {
      const int k = mod(r - s - 1, n);
      emit(sink, recv_reduce_send(prev, in(off(k)), next, len(k)));
    }
    emit(sink, recv_reduce_copy_send(prev, in(off(r)), out(off(r)), next, len(r)));
    // All-gather: at step t we receive finished shard r-t and pass it on.
    for (int t = 1; t < n - 1; ++t) {
      const int k = mod(r - t, n);
      emit(sink, recv_copy_send(prev, out(off(k)), next, len(k)));
    }
    // With lookahead, the next piece's first message goes out before this piece's last
    // receive (which sends nothing, so every channel carries the same messages in the same
    // order): the peer finishing this piece's reduction overlaps our next copy.
    if (p.lookahead && o + p.piece < ss) first_send(o + p.piece);
    const int k = mod(r + 1, n);
    emit(sink, recv(prev, out(off(k)), len(k)));
  }
}

namespace {
// The ring over every rank's block (`counts`, else `count` each): one rank copies its block;
// otherwise `body(next, prev, off, len, o)` emits the steps of piece `o` of every block at
// once, `off(k)` / `len(k)` being block k's piece (a block shorter than o has nothing left,
// skipped alike by both ends of each message).
template <class Body>
void ring_over_blocks(const ScheduleParams& p, StepSink& sink, Body&& body) {
  const int n = p.size, r = p.rank;
  const Blocks b(p.counts, p.count, n);
  if (n == 1) {
    emit(sink, copy(in(0), out(0), b.len(0)));
    return;
  }
  const int next = mod(r + 1, n), prev = mod(r - 1, n);
  for (size_t o = 0; o < b.longest(); o += p.piece) {
    auto off = [&](int k) { return b.off(k) + o; };
    auto len = [&](int k) { return piece_len(b.len(k), o, p.piece); };
    body(next, prev, off, len, o);
  }
}
}  // namespace

void ring_reduce_scatter(const ScheduleParams& p, StepSink& sink) {
  const int n = p.size, r = p.rank;
  ring_over_blocks(p, sink, [&](int next, int prev, auto off, auto len, size_t o) {
    int k = mod(r - 1, n);
    emit(sink, send(next, in(off(k)), len(k), Wire::Acc));
    for (int s = 1; s < n - 1; ++s) {
      k = mod(r - s - 1, n);
      emit(sink, recv_reduce_send(prev, in(off(k)), next, len(k)));
    }
    emit(sink, recv_reduce_copy(prev, in(off(r)), out(o), len(r)));
  });
}

void ring_allgather(const ScheduleParams& p, StepSink& sink) {
  const int n = p.size, r = p.rank;
  ring_over_blocks(p, sink, [&](int next, int prev, auto off, auto len, size_t o) {
    emit(sink, copy(in(o), out(off(r)), len(r)));
    emit(sink, send(next, in(o), len(r), Wire::Elem));
    for (int t = 1; t < n - 1; ++t) {
      const int k = mod(r - t, n);
      emit(sink, recv_copy_send(prev, out(off(k)), next, len(k)));
    }
    const int k = mod(r + 1, n);
    emit(sink, recv(prev, out(off(k)), len(k)));
  });
}

namespace {
// A chain along the ring, piece by piece, from the rank at position 0 to the one at n - 1
// (this rank at `pos`): `step_of(role, prev, next, o, len)` is the step of piece o for the
// first rank (role 0), a middle one (1) or the last (2).
template <class StepOf>
void ring_chain(const ScheduleParams& p, StepSink& sink, int pos, StepOf&& step_of) {
  const int n = p.size;
  const int next = mod(p.rank + 1, n), prev = mod(p.rank - 1, n);
  const int role = pos == 0 ? 0 : pos < n - 1 ? 1 : 2;
  for (size_t o = 0; o < p.count; o += p.piece)
    emit(sink, step_of(role, prev, next, o, std::min(p.piece, p.count - o)));
}
}  // namespace

void ring_broadcast(const ScheduleParams& p, StepSink& sink) {
  if (p.size == 1) return;
  ring_chain(p, sink, mod(p.rank - p.root, p.size),
             [](int role, int prev, int next, size_t o, size_t len) {
               if (role == 0) return send(next, out(o), len, Wire::Elem);
               if (role == 1) return recv_copy_send(prev, out(o), next, len);
               return recv(prev, out(o), len);
             });
}

void ring_reduce(const ScheduleParams& p, StepSink& sink) {
  if (p.size == 1) {
    emit(sink, copy(in(0), out(0), p.count));
    return;
  }
  // The chain starts after the root and ends at it.
  ring_chain(p, sink, mod(p.rank - p.root - 1, p.size),
             [](int role, int prev, int next, size_t o, size_t len) {
               if (role == 0) return send(next, in(o), len, Wire::Acc);
               if (role == 1) return recv_reduce_send(prev, in(o), next, len);
               return recv_reduce_copy(prev, in(o), out(o), len);
             });
}

}  // namespace pycoll
