// Builders for Steps, shared by the schedule files.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "algo/step.h"

namespace pycoll {
namespace steps {

inline int mod(int a, int n) { return ((a % n) + n) % n; }
inline BufRef in(size_t off) { return BufRef{Buf::Input, off}; }
inline BufRef out(size_t off) { return BufRef{Buf::Output, off}; }

// Elements of piece `o` of a range of `len` elements, `piece` at a time (0 past its end).
inline size_t piece_len(size_t len, size_t o, size_t piece) {
  return o < len ? std::min(piece, len - o) : size_t{0};
}

// Rank-major, contiguous blocks: block k holds len(k) elements at off(k). Even (`even` each)
// when `counts` is null, so one schedule serves both forms.
class Blocks {
 public:
  Blocks(const uint64_t* counts, size_t even, int size) : off_(static_cast<size_t>(size) + 1, 0) {
    for (int k = 0; k < size; ++k) {
      const size_t len = counts ? static_cast<size_t>(counts[k]) : even;
      off_[k + 1] = off_[k] + len;
      longest_ = std::max(longest_, len);
    }
  }
  size_t off(int k) const { return off_[k]; }
  size_t len(int k) const { return off_[k + 1] - off_[k]; }
  size_t longest() const { return longest_; }

 private:
  std::vector<size_t> off_;
  size_t longest_ = 0;
};

// Every field of a step, in Step's order: kind, wires in and out, the peers it receives from
// and sends to, whether it receives on the senders' broadcast channels, operand, result, count.
inline Step make_step(StepKind k, Wire in, Wire out, int from, int from2, int to, int to2,
                      bool bcast, BufRef src, BufRef dst, size_t n) {
  return Step{k, in, out, from, from2, to, to2, bcast, src, dst, n};
}

inline Step send(int to, BufRef src, size_t n, Wire w, int to2 = kNoPeer) {
  return make_step(StepKind::Send, Wire::Elem, w, kNoPeer, kNoPeer, to, to2, false, src, {}, n);
}

inline Step recv(int from, BufRef dst, size_t n, bool bcast = false) {
  return make_step(StepKind::Recv, Wire::Elem, Wire::Elem, from, kNoPeer, kNoPeer, kNoPeer, bcast,
                   {}, dst, n);
}

inline Step recv_reduce_send(int from, BufRef src, int to, size_t n, int from2 = kNoPeer) {
  return make_step(StepKind::RecvReduceSend, Wire::Acc, Wire::Acc, from, from2, to, kNoPeer, false,
                   src, {}, n);
}

inline Step recv_reduce_copy(int from, BufRef src, BufRef dst, size_t n, int from2 = kNoPeer,
                             bool bcast = false) {
  return make_step(StepKind::RecvReduceCopy, Wire::Acc, Wire::Elem, from, from2, kNoPeer, kNoPeer,
                   bcast, src, dst, n);
}

inline Step recv_reduce_copy_send(int from, BufRef src, BufRef dst, int to, size_t n,
                                  int from2 = kNoPeer, int to2 = kNoPeer) {
  return make_step(StepKind::RecvReduceCopySend, Wire::Acc, Wire::Elem, from, from2, to, to2, false,
                   src, dst, n);
}

inline Step recv_copy_send(int from, BufRef dst, int to, size_t n, int to2 = kNoPeer) {
  return make_step(StepKind::RecvCopySend, Wire::Elem, Wire::Elem, from, kNoPeer, to, to2, false,
                   {}, dst, n);
}

inline Step copy(BufRef src, BufRef dst, size_t n) {
  return make_step(StepKind::Copy, Wire::Elem, Wire::Elem, kNoPeer, kNoPeer, kNoPeer, kNoPeer,
                   false, src, dst, n);
}

// Emits a step unless it moves nothing; both ends of a message compute the same length, so
// they skip it alike.
inline void emit(StepSink& sink, const Step& s) {
  if (s.count != 0) sink.step(s);
}

}  // namespace steps
}  // namespace pycoll
