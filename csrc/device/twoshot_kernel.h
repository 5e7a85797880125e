// Collectives over registered buffers: every rank maps every rank's input and output (CUDA IPC
// on the GPU, POSIX shared memory on the emulated device), so no byte goes through a staging
// slot. All-reduce, reduce, reduce-scatter, all-gather and broadcast each read peers' buffers
// directly (run_registered says what each rank covers); the all-reduce is the two-shot, the
// model of the others:
//
// Rank r owns shard r (plan.h, twoshot_shard): each of its blocks
// reads its slice of shard r from every rank's input, reduces it in rank order 0..n-1 (one
// rank computes each element, in one order: the outputs are bitwise identical), and writes the
// result into every rank's output. Each byte of the message is read once and written n times
// over all ranks: S read and S written per rank, 2nS in all (n ranks, S bytes).
//
// Two synchronisations per call:
//   entry: the call's header exchange (step_kernel.h, match_calls), which every such launch
//          runs first (block 0; with several blocks the others wait at its gate, or, captured,
//          the check is a one-block launch before them: launches_of): a peer's header for this
//          call is written by its launch of this call, so once block 0 has every peer's, every
//          rank has started the call: its input is ready (the launch follows the caller's work
//          on its stream) and it no longer reads or writes its buffers for an earlier call;
//   exit:  per block (block b of every rank meets block b of every other: the grid and the
//          slices are the same on every rank), once it has read and written its slices: no
//          rank returns, and no later call or work on a rank's stream touches its input or
//          output, while a peer still reads or writes them. It counts the block's registered
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

// Elements [i, i + E) of every rank's input at `src_off` (elements): reduced in rank order
// 0..n-1, written at i into the outputs of ranks [dst_lo, dst_hi).
template <class T, int E>
PYCOLL_DEVICE void reduce_group(const KernelArgs& a, size_t src_off, size_t i, int dst_lo,
                                int dst_hi, bool vec) {
  using A = typename Acc<T>::type;
  const int n = a.layout.size;
  A acc[E];
  T v[E];
  for (int q = 0; q < n; ++q) {
    load(v, a.reg.in[q], src_off + i, vec);
    PYCOLL_UNROLL
    for (int k = 0; k < E; ++k)
      acc[k] = q == 0 ? Acc<T>::load(v[k]) : apply_op(a.op, acc[k], Acc<T>::load(v[k]));
  }
  const bool avg = a.op == static_cast<int>(RedOp::Avg);
  PYCOLL_UNROLL
  for (int k = 0; k < E; ++k)
    v[k] = Acc<T>::store(avg ? acc[k] / static_cast<A>(a.divisor) : acc[k]);
  for (int q = dst_lo; q < dst_hi; ++q) store(a.reg.out[q], i, v, vec);
}

// Elements [i, i + E) copied from `src` to `dst`.
template <class T, int E>
PYCOLL_DEVICE void copy_group(const uint8_t* src, uint8_t* dst, size_t i, bool vec) {
  T v[E];
  load(v, src, i, vec);
  store(dst, i, v, vec);
}

// Block b's part of a collective over registered buffers, once the call is compared (see
// registered_range for what each rank covers), then the exit barrier. With c = reg.count:
//   all-reduce:     shard r of every input reduced into every rank's output (the two-shot);
//   reduce:         the same, into the root's output alone;
//   reduce-scatter: block r (elements [r c, r c + c)) of every input reduced into ours;
//   all-gather:     every rank's input copied into block q of ours (in place, ours is there);
//   broadcast:      the root's buffer copied into ours (the root copies nothing).
// Each rank writes only its own output, but for the all-reduce's shard (which only it reads
// and writes on every rank) and the reduce's (into the root's); every read of an element that
// a write could change comes first in the same thread, so in-place forms need no barrier.
template <class T, class Threads>
PYCOLL_DEVICE void run_registered(const KernelArgs& a, BlockState& s, int b, const Threads& th) {
  const RegisteredArgs& g = a.reg;
  const int n = a.layout.size, r = a.rank;
  const auto kind = static_cast<Collective>(g.kind);
  const Slice range = registered_range(kind, g.count, n, r);
  const Slice sl = block_slice(range.hi - range.lo, a.grid, b);
  const size_t lo = range.lo + sl.lo, len = sl.hi - sl.lo;
  // Blocks at q c elements: whole 16-byte words only where c elements are.
  bool vec =
      g.count * sizeof(T) % 16 == 0 || kind == Collective::AllReduce || kind == Collective::Reduce;
  for (int q = 0; q < n; ++q) vec = vec && aligned16(g.in[q]) && aligned16(g.out[q]);
  const size_t block_bytes = g.count * sizeof(T);
  th.each([&](int tid, int nt) {
    switch (kind) {
      case Collective::AllReduce:
      case Collective::Reduce: {
        const int d0 = kind == Collective::Reduce ? g.root : 0;
        const int d1 = kind == Collective::Reduce ? g.root + 1 : n;
        for_groups<T>(lo, len, vec, tid, nt, [&](auto e, size_t i, bool v) {
          reduce_group<T, decltype(e)::value>(a, 0, i, d0, d1, v);
        });
        break;
      }
      case Collective::ReduceScatter:
        for_groups<T>(lo, len, vec, tid, nt, [&](auto e, size_t i, bool v) {
          reduce_group<T, decltype(e)::value>(a, static_cast<size_t>(r) * g.count, i, r, r + 1, v);
        });
        break;
      case Collective::AllGather:
        for (int q = 0; q < n; ++q) {
          uint8_t* dst = g.out[r] + static_cast<size_t>(q) * block_bytes;
          if (dst == g.in[q]) continue;  // in place: our own block is there already
          for_groups<T>(lo, len, vec, tid, nt, [&](auto e, size_t i, bool v) {
            copy_group<T, decltype(e)::value>(g.in[q], dst, i, v);
          });
        }
        break;
      case Collective::Broadcast:
        if (r != g.root)
          for_groups<T>(lo, len, vec, tid, nt, [&](auto e, size_t i, bool v) {
            copy_group<T, decltype(e)::value>(g.in[g.root], g.out[r], i, v);
          });
        break;
      default:
        break;
    }
  });
  th.sync();
  // Stepped mode (no flags): the fence after the launch (stepped.h) stands for this.
  if (th.leader()) s.p.failed = a.use_flags && !twoshot_exit(a, s, b);
  th.sync();
}

// Block b of a launch: its start (step_kernel.h, start_block: for registered buffers, block 0's
// comparison of the call and the others' gate are the entry synchronisation), the collective
// over registered buffers when a.reg.on, else the steps, and the launch's end (finish_launch)
// either way.
template <class T, class Threads>
PYCOLL_DEVICE void run_launch(const KernelArgs& a, BlockState& s, int b, const Threads& th) {
  if (start_block(a, s, b, th) && a.first_step < a.end_step) {
    if (a.reg.on)
      run_registered<T>(a, s, b, th);
    else
      run_steps<T>(a, s, b, th);
  }
  finish_launch(a, th);
}

}  // namespace cuda
}  // namespace pycoll
