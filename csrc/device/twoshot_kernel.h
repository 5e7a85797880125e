// The two-shot all-reduce over registered buffers: every rank maps every rank's input and
// output (CUDA IPC on the GPU, POSIX shared memory on the emulated device), so no byte goes
// through a staging slot. Rank r owns shard r (plan.h, twoshot_shard): each of its blocks
// reads its slice of shard r from every rank's input, reduces it in rank order 0..n-1 (one
// rank computes each element, in one order: the outputs are bitwise identical), and writes the
// result into every rank's output. Each byte of the message is read once and written n times
// over all ranks: S read and S written per rank, 2nS in all (n ranks, S bytes).
//
// Two synchronisations per call:
//   entry: the call's header exchange (step_kernel.h, check_call), which every two-shot launch
//          runs first (block 0; with several blocks the others wait at its gate, or, captured,
//          the check is a one-block launch before them: launches_of): a peer's header for this
//          call is written by its launch of this call, so once block 0 has every peer's, every
//          rank has started the call: its input is ready (the launch follows the caller's work
//          on its stream) and it no longer reads or writes its buffers for an earlier call;
//   exit:  per block (block b of every rank meets block b of every other: the grid and the
//          slices are the same on every rank), once it has read and written its slices: no
//          rank returns, and no later call or work on a rank's stream touches its input or
//          output, while a peer still reads or writes them. It counts the block's two-shot
//          calls on a flag of its own segment (the k-th call posts k and waits for k from every
//          peer), loaded from the flag at every launch like the channel counters, so graph
//          replays stay right. Its waits are step_kernel.h's: bounded, abortable, stopped by a
//          peer's failure word.
//
// In place (out == x on every rank): only rank r reads shard r, of any rank's input, and only
// rank r writes shard r, of any rank's output; each thread reads all n inputs of its elements
// before it writes them. So no rank reads an input element another rank has overwritten, and
// no barrier is needed between the reads and the writes.
#pragma once

#include <cstddef>
#include <cstdint>

#include "device/kernel_args.h"
#include "device/plan.h"
#include "device/primitives.cuh"
#include "device/step_kernel.h"

namespace pycoll {
namespace cuda {

// The step DeviceStatus names for a wait at the exit barrier (the launch's one step).
constexpr int kTwoShotStep = 0;

// Block b's exit barrier: posts its next count, then waits until every peer's block b has
// posted it. Leader only; false when a wait gave up.
PYCOLL_DEVICE bool twoshot_exit(const KernelArgs& a, const BlockState& s, int b) {
  const SegmentLayout& L = a.layout;
  const size_t off = L.flag_offset(b, L.reg_exit());
  const uint64_t k =
      ld_relaxed_sys(reinterpret_cast<const uint64_t*>(a.segments[a.rank] + off)) + 1;
  post_flag(a, off, k);
  for (int q = 0; q < L.size; ++q)
    if (q != a.rank && !wait_flag(a, s, b, a.segments[q], off, k, q, kTwoShotStep)) return false;
  return true;
}

// Elements [i, i + E) of the message: reduced over every rank's input in rank order, written
// into every rank's output.
template <class T, int E>
PYCOLL_DEVICE void twoshot_group(const KernelArgs& a, size_t i, bool vec) {
  using A = typename Acc<T>::type;
  const int n = a.layout.size;
  A acc[E];
  T v[E];
  for (int q = 0; q < n; ++q) {
    load(v, a.reg.in[q], i, vec);
    PYCOLL_UNROLL
    for (int k = 0; k < E; ++k)
      acc[k] = q == 0 ? Acc<T>::load(v[k]) : apply_op(a.op, acc[k], Acc<T>::load(v[k]));
  }
  const bool avg = a.op == static_cast<int>(RedOp::Avg);
  PYCOLL_UNROLL
  for (int k = 0; k < E; ++k)
    v[k] = Acc<T>::store(avg ? acc[k] / static_cast<A>(a.divisor) : acc[k]);
  for (int q = 0; q < n; ++q) store(a.reg.out[q], i, v, vec);
}

// Block b's part of the two-shot, once the call is compared: its slice of our shard, then the
// exit barrier.
template <class T, class Threads>
PYCOLL_DEVICE void run_twoshot(const KernelArgs& a, BlockState& s, int b, const Threads& th) {
  const Slice shard = twoshot_shard(a.reg.count, a.layout.size, a.rank);
  const Slice sl = block_slice(shard.hi - shard.lo, a.grid, b);
  const size_t lo = shard.lo + sl.lo, len = sl.hi - sl.lo;
  bool vec = true;
  for (int q = 0; q < a.layout.size; ++q)
    vec = vec && aligned16(a.reg.in[q]) && aligned16(a.reg.out[q]);
  th.each([&](int tid, int nt) {
    constexpr int E = kElemsPerThread<T>;
    const size_t groups = vec ? len / E : 0;
    for (size_t g = tid; g < groups; g += nt) twoshot_group<T, E>(a, lo + g * E, true);
    for (size_t j = groups * E + tid; j < len; j += nt) twoshot_group<T, 1>(a, lo + j, false);
  });
  th.sync();
  // Host mode (no flags): the host meets the peers once the launch has ended.
  if (th.leader()) s.p.failed = a.use_flags && !twoshot_exit(a, s, b);
  th.sync();
}

// Block b of a launch: its start (step_kernel.h, start_block: for the two-shot, block 0's
// comparison of the call and the others' gate are the entry synchronisation), the two-shot
// when a.reg.on, else the steps, and the launch's end (finish_launch) either way.
template <class T, class Threads>
PYCOLL_DEVICE void run_launch(const KernelArgs& a, BlockState& s, int b, const Threads& th) {
  if (start_block(a, s, b, th) && a.first_step < a.end_step) {
    if (a.reg.on)
      run_twoshot<T>(a, s, b, th);
    else
      run_steps<T>(a, s, b, th);
  }
  finish_launch(a, th);
}

}  // namespace cuda
}  // namespace pycoll
