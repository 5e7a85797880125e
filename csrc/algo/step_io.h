// What every CPU executor (shared memory, MPI between nodes) does with a step's arrays: where
// its source and destination lie in the caller's arrays, checked, and the reduction of its
// incoming messages in the schedule's order. The executors differ only in how a message
// arrives (a staging slot, an MPI receive).
#pragma once

#include <cstddef>
#include <cstdint>

#include "algo/step.h"
#include "common/errors.h"
#include "common/reduce.h"

namespace pycoll {

// The caller's input and output as steps address them (Step::src / Step::dst: an offset in
// elements), every access checked against the elements the call may touch (call_extents).
struct StepArrays {
  const uint8_t* in = nullptr;
  uint8_t* out = nullptr;
  size_t in_count = 0, out_count = 0;
  size_t elem = 0;  // bytes per element

  const uint8_t* src(const Step& s) const {
    if (s.src.buf == Buf::Input) {
      PYCOLL_CHECK(s.src.offset + s.count <= in_count, "input range");
      return in + s.src.offset * elem;
    }
    PYCOLL_CHECK(s.src.buf == Buf::Output && s.src.offset + s.count <= out_count, "source range");
    return out + s.src.offset * elem;
  }
  uint8_t* dst(const Step& s) const {
    PYCOLL_CHECK(s.dst.buf == Buf::Output && s.dst.offset + s.count <= out_count, "output range");
    return out + s.dst.offset * elem;
  }
};

// acc = op over step `s`'s incoming messages and `local` (this rank's own part), in the
// schedule's order. A step that takes every peer's (kAllPeers) adds every rank's contribution
// in rank order, ours from `local`, so its result is bit-identical on every rank. `take(q)`
// waits for peer q's message (in the accumulator type) and returns it; `done(q)` releases it.
template <class Take, class Done>
void reduce_step(const ReduceKernels& k, size_t acc_bytes, uint8_t* acc, const uint8_t* local,
                 const Step& s, int me, int size, Take&& take, Done&& done) {
  const size_t n = s.count;
  if (s.from == kAllPeers) {
    for (int q = 0; q < size; ++q) {
      if (q == me) {
        fold_rank(k, acc_bytes, acc, q, /*elems=*/true, local, n);
        continue;
      }
      fold_rank(k, acc_bytes, acc, q, /*elems=*/false, take(q), n);
      done(q);
    }
    return;
  }
  k.reduce(acc, take(s.from), local, n);
  done(s.from);
  if (s.from2 != kNoPeer) {
    k.combine(acc, acc, take(s.from2), n);
    done(s.from2);
  }
}

}  // namespace pycoll
