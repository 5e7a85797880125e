// Element-wise reduction kernels, type-erased per (dtype, op).
//
// Partial results travel in the accumulation type (float32 for float16/bfloat16, the element
// type otherwise), so a chain of n ranks rounds to 16 bits once, at the end.
#pragma once

#include <cstddef>

#include "common/dtypes.h"

namespace pycoll {

struct ReduceKernels {
  // dst_acc[i] = acc(src[i])
  void (*load)(void* dst_acc, const void* src, size_t n);
  // dst_acc[i] = op(a_acc[i], acc(b[i])); dst_acc may be a_acc.
  void (*reduce)(void* dst_acc, const void* a_acc, const void* b, size_t n);
  // dst_acc[i] = op(a_acc[i], b_acc[i]); dst_acc may be a_acc.
  void (*combine)(void* dst_acc, const void* a_acc, const void* b_acc, size_t n);
  // dst[i] = a_acc[i] (divided by `divisor` for avg), in the element type; also dst2 if set.
  void (*finalize)(void* dst, void* dst2, const void* a_acc, size_t n, int divisor);
  // v = op(a_acc[i], acc(b[i])), divided by `divisor` for avg; dst[i] = v, and dst2[i] = v when
  // dst2 is not null (both in the element type).
  void (*reduce_final)(void* dst, void* dst2, const void* a_acc, const void* b, size_t n,
                       int divisor);
  // As reduce_final into both dst and dst2 (both 16-byte aligned; each either disjoint from
  // a_acc and b or the very same range, in place), with non-temporal stores: for outputs that
  // will not be read again soon. Call stream_fence() before another core may read them.
  void (*reduce_final_stream)(void* dst, void* dst2, const void* a_acc, const void* b, size_t n,
                              int divisor);
  // As reduce_final_stream, but only dst (16-byte aligned) is streamed: dst2, if not null, is
  // written with ordinary stores (a staging slot that another core reads next).
  void (*reduce_final_stream_dst)(void* dst, void* dst2, const void* a_acc, const void* b, size_t n,
                                  int divisor);
  // As reduce_final_stream, but only dst2 (not null, 16-byte aligned) is streamed: dst is
  // written with ordinary stores (an output that stays in cache, beside a staging slot written
  // through memory).
  void (*reduce_final_stream_dst2)(void* dst, void* dst2, const void* a_acc, const void* b,
                                   size_t n, int divisor);
};

// Kernels for a (dtype, op) pair; the caller has validated the pair (avg needs a float type).
const ReduceKernels& reduce_kernels(DType t, RedOp op);

// dst = src; they may overlap or be the same buffer (then nothing moves). Every data copy of
// the host transport goes through here: it avoids glibc's slow `rep movsb` cases on AMD.
void copy_bytes(void* dst, const void* src, size_t bytes);

// dst = src with non-temporal stores: for large outputs that will not be read again soon, this
// saves the read-for-ownership of every destination line. Falls back to memcpy where the
// target has no streaming stores. Call stream_fence() before another core may read dst.
void stream_copy(void* dst, const void* src, size_t bytes);
void stream_fence();

// One rank's part of a reduction over every rank, folded into `acc` (n elements) in rank
// order: rank q's `p` is in the element type where `elems` (our own input), else in the
// accumulation type (a peer's message, acc_bytes an element); rank 0's is loaded, each later
// rank's reduced in. Calls for q = 0, 1, ... give ((x0 op x1) op x2) ..., the order every
// reduction over all ranks keeps (the direct schedules, reproducible mode).
inline void fold_rank(const ReduceKernels& k, size_t acc_bytes, void* acc, int q, bool elems,
                      const void* p, size_t n) {
  if (elems) {
    if (q == 0)
      k.load(acc, p, n);
    else
      k.reduce(acc, acc, p, n);
  } else if (q == 0) {
    copy_bytes(acc, p, n * acc_bytes);
  } else {
    k.combine(acc, acc, p, n);
  }
}

// out = the `nrows` rows of `count` elements of type t at `rows` folded in row order
// (fold_rank), finalized into the element type (an average divided by `divisor`) once.
void fold_rows(DType t, RedOp op, const void* rows, size_t nrows, size_t count, void* out,
               int divisor);

}  // namespace pycoll
