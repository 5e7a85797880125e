// Stepped mode of the device executor: one launch per step, and between launches
// the host waits for the peers on counters in POSIX shared memory. Shared by the CUDA
// communicator and the emulated device. No launch ever waits for another process, so ranks
// that time-slice one GPU make progress whatever the scheduler does.
#pragma once

#include <algorithm>
#include <string>
#include <vector>

#include "algo/call.h"
#include "common/dtypes.h"
#include "common/hash.h"
#include "device/kernel_args.h"
#include "host/executor.h"
#include "host/shm_transport.h"
#include "runtime/fingerprint.h"
#include "runtime/registrations.h"
#include "runtime/wait.h"

namespace pycoll {
namespace cuda {

// Between the launches of stepped mode a wait sleeps at most this long: a step of a small message
// takes a few microseconds, and the polling must not cost more than the step.
constexpr long kSteppedMaxSleepNs = 10000;

// Waits until step `d`'s messages have arrived and its outgoing slots are free: exactly the
// conditions the kernel checks on device flags in kernel mode.
void stepped_wait_step(const ShmTransport& shm, const ChannelCounters& c, const DevStep& d,
                       const WaitContext& w);
// Once the step's launch has finished: frees the slots it read, publishes what it sent.
void stepped_publish_step(const ShmTransport& shm, ChannelCounters& c, const DevStep& d);

}  // namespace cuda
}  // namespace pycoll

namespace pycoll {
namespace cuda {

// One launch's arguments: steps [0, nsteps) of `steps` (as the device reads them) for `call`,
// run by the first `grid` blocks, starting from the message counts `c`.
struct LaunchSetup {
  int rank = 0;
  int size = 1;
  SegmentLayout layout;
  uint8_t* const* segments = nullptr;  // every rank's segment as this process maps it
  DeviceStatus* status = nullptr;
  uint32_t* error_claim = nullptr;
  double timeout_s = 300;
  bool use_flags = true;
};
KernelArgs make_kernel_args(const LaunchSetup& setup, const CollectiveCall& call,
                            const DevStep* steps, size_t nsteps, int grid,
                            const ChannelCounters& c);
// Kernel mode: the launch compares call `f` with every peer's on the device, before its first
// step (step_kernel.h, match_calls). A launch that checks runs even with no steps to run.
void check_on_device(KernelArgs& a, const Fingerprint& f);
// Whether the ranks meet on the host before `call` is queued and compare their fingerprints
// there (all-to-all's split matrix too): in stepped mode (unless `host_checks` is off), for a
// capture, and for all-to-all, whose split matrix only the host compares. Kernel mode compares
// every other call on the device (step_kernel.h, match_calls), with no host wait.
inline bool meets_on_host(const CollectiveCall& call, bool kernel_mode, bool capturing,
                          bool host_checks = true) {
  return capturing || call.collective == Collective::AllToAll || (!kernel_mode && host_checks);
}

// Whether `call` (its algorithm resolved to `algo`) runs over registered buffers where they
// are registered (run_registered; an all-reduce: the two-shot): all-reduces, reduces,
// broadcasts and even reduce-scatters and all-gathers of at least one element (an empty
// array's pointer may be null on one rank and not on another), the algorithm automatic or
// direct.
inline bool registered_eligible(const CollectiveCall& call, Algo algo) {
  if (call.barrier || call.count == 0 || !(call.algo == Algo::Auto || algo == Algo::Direct))
    return false;
  switch (call.collective) {
    case Collective::AllReduce:
    case Collective::Reduce:
    case Collective::Broadcast:
      return true;
    case Collective::ReduceScatter:
    case Collective::AllGather:
      return call.counts.empty();
    default:
      return false;
  }
}
// The bytes of a registered call's input and output on every rank (every rank's alike: a
// reduce's output is looked up off the root too, so that the ranks agree on the call).
struct RegisteredBytes {
  size_t in, out;
};
inline RegisteredBytes registered_bytes(const CollectiveCall& call, int size) {
  const size_t one = call.bytes(), all = one * static_cast<size_t>(size);
  switch (call.collective) {
    case Collective::ReduceScatter:
      return {all, one};
    case Collective::AllGather:
      return {one, all};
    default:
      return {one, one};
  }
}

// A call over registered buffers (run_registered): every rank's input and output as this
// process maps them, and the words its fingerprint carries (registered_fingerprint): where the
// buffers whose peers' addresses it uses lie, which must be the same on every rank.
struct RegisteredCall {
  bool on = false;
  std::vector<uint8_t*> in, out;  // a rank that writes only its own output: the others null
  uint64_t where[4] = {};
};
// `call` as one, or off: where `find(pointer, bytes)` (the registry's) finds what it needs
// registered on every rank. A reduce-scatter and an all-gather write only this rank's output,
// which need not be registered; an in-place all-gather's inputs are every rank's block of its
// registered output. All-reduce, reduce and broadcast need both registered.
template <class Find>
RegisteredCall registered_call(const CollectiveCall& call, Algo algo, int rank, int size,
                               Find&& find) {
  RegisteredCall t;
  if (!registered_eligible(call, algo)) return t;
  const RegisteredBytes bytes = registered_bytes(call, size);
  const size_t block = call.bytes();
  uint8_t* const out = static_cast<uint8_t*>(call.out);
  const bool own_output =
      call.collective == Collective::ReduceScatter || call.collective == Collective::AllGather;
  if (call.collective == Collective::AllGather && call.in == out + rank * block) {
    const Registered o = find(call.out, bytes.out);  // in place
    if (!o.on) return t;
    for (int q = 0; q < size; ++q) t.in.push_back(o.at[q] + q * block);
    t.out.assign(size, nullptr);
    t.out[rank] = out;
    t.where[0] = o.id;
    t.where[1] = o.delta;
    t.where[2] = 1;  // in place: a registration is never number 0
    t.on = true;
    return t;
  }
  const Registered in = find(call.in, bytes.in);
  if (!in.on) return t;
  t.in = in.at;
  t.where[0] = in.id;
  t.where[1] = in.delta;
  if (own_output) {
    t.out.assign(size, nullptr);
    t.out[rank] = out;
  } else {
    const Registered o = find(call.out, bytes.out);
    if (!o.on) return t;
    t.out = o.at;
    t.where[2] = o.id;
    t.where[3] = o.delta;
  }
  t.on = true;
  return t;
}
// Stepped mode through scratch (run_scratch): every rank's segment data area (its staging slots,
// as one flat buffer that every peer maps already) holds a chunk of the message at a time, and
// between two fences per chunk the GPU copies and reduces over every rank's scratch, no
// device wait in it: two fences per chunk, not a host round trip per step. For host
// mode's all-reduces that the two-shot would take (registered_eligible), and the automatic
// choice's reduces, broadcasts, all-gathers and reduce-scatters (even or not), gathers,
// scatters and all-to-alls; unless turned off. An all-to-all with splits only where the host
// has read every rank's (check_split_matrix: `splits_met`): every rank's chunks are counted
// by the widest split of all.
inline bool stepped_scratch_eligible(const CollectiveCall& call, Algo algo, bool kernel_mode,
                                     bool on, bool splits_met = false) {
  // (An all-to-all with splits has count 0: its splits say what moves.)
  if (!on || kernel_mode || call.barrier || (call.count == 0 && call.send_counts.empty()))
    return false;
  switch (call.collective) {
    case Collective::AllReduce:
      return registered_eligible(call, algo);
    case Collective::AllGather:
    case Collective::ReduceScatter:
    case Collective::Reduce:
    case Collective::Broadcast:
    case Collective::Gather:
    case Collective::Scatter:
      return call.algo == Algo::Auto;
    case Collective::AllToAll:
      return call.algo == Algo::Auto && (call.send_counts.empty() || splits_met);
    default:
      return false;
  }
}
// Elements of `esize` bytes a chunk holds: the data area, in whole kSliceAlign groups.
size_t scratch_elems(const SegmentLayout& L, size_t esize);
// Every rank's scratch (its data area), from its segment as this process maps it.
std::vector<uint8_t*> scratch_of(const SegmentLayout& L, uint8_t* const* segments);

// Runs stepped_scratch_eligible's `call` through every rank's scratch, a chunk at a time, on a
// transport that provides (DeviceComm::run_stepped_scratch: the device's own stream):
//   copy(dst, src, bytes)   queued behind what is queued (the GPU's copy engines; a peer's
//                           scratch is read through its mapping)
//   twoshot(len, scratch)   queues the two-shot all-reduce of `len` elements in place over
//                           every rank's scratch (device/twoshot_kernel.h): rank r reads and
//                           writes shard r only, so no rank reads what another has written
//   fence()                 what is queued after it runs once what every rank queued before
//                           it has run (event_fence: the stream waits on the peers'
//                           interprocess events; without them the host waits for the GPU,
//                           then meets every peer)
//   meet()                  meets every peer on the host (host_meet), bounded
//   chunk_done()            after each chunk's work, before its last fence (drills, counts)
// Before the first copy every rank must have finished its call before, whose last receiver
// may still read the slots the scratch is made of: the caller's meeting of the fingerprints
// (`met`), else a meeting here (a call before that ended in a fence is ordered by it). Per
// chunk:
//   all-reduce: copy in, fence, two-shot, fence, copy the sums out (reduce: the root only;
//               reduce-scatter: the chunk is the pieces at one offset of every rank's block,
//               packed, and each rank copies out its own block's);
//   all-gather: copy in, fence, copy every rank's scratch out, fence (gather: the root alone
//               copies out);
//   scatter:    the root copies a piece of every rank's block into its scratch (piece q at
//               q * cap), fence, each rank copies its own out of the root's, fence;
//   all-to-all: each rank copies a piece of every block it sends into its scratch (the piece
//               for rank q at q * cap), fence, each copies the pieces for it out of every
//               rank's scratch, fence (with splits: chunks up to `widest`, the largest split of
//               every rank's);
//   broadcast:  the root copies in, fence, the others copy the root's scratch out, fence.
// Where blocks differ in length (all-gather's and reduce-scatter's `counts`, all-to-all's
// splits), chunk k holds what each block has from offset k * cap, nothing of one that ended.
// The second fence of a chunk: no rank writes its scratch again while a peer still reads it.
template <class Ops>
void run_scratch(const CollectiveCall& call, const SegmentLayout& L, uint8_t* const* segments,
                 int rank, bool met, Ops& ops, uint64_t widest = 0) {
  const size_t esize = dtype_size(call.dtype);
  const size_t n = static_cast<size_t>(L.size);
  const Collective c = call.collective;
  const bool rs = c == Collective::ReduceScatter;
  // A chunk holds a piece of every rank's block (a piece for every rank).
  const bool per_rank = rs || c == Collective::Scatter || c == Collective::AllToAll;
  const bool blocks = per_rank || c == Collective::AllGather || c == Collective::Gather;
  // Each rank's block (all but all-reduce, reduce, broadcast): its length and where it starts;
  // an all-to-all's blocks received apart (`r`), as its splits may differ from those sent.
  std::vector<size_t> len(n, call.count), at(n, 0), rlen(n, call.count), rat(n, 0);
  size_t span = call.count;  // the chunks cover [0, span) of the message or of every block
  if (blocks) {
    span = 0;
    const bool splits = !call.send_counts.empty();
    for (size_t q = 0; q < n; ++q) {
      if (!call.counts.empty()) len[q] = rlen[q] = call.counts[q];
      if (splits) len[q] = call.send_counts[q], rlen[q] = call.recv_counts[q];
      at[q] = q == 0 ? 0 : at[q - 1] + len[q - 1];
      rat[q] = q == 0 ? 0 : rat[q - 1] + rlen[q - 1];
      span = std::max(span, len[q]);
    }
    if (splits) span = widest;  // every rank's chunks alike
  }
  // Elements per chunk: of the message, or of each block (n of them where a chunk holds a
  // piece for every rank).
  const size_t cap = scratch_elems(L, esize) / (per_rank ? n : 1);
  const std::vector<uint8_t*> scratch = scratch_of(L, segments);
  const uint8_t* in = static_cast<const uint8_t*>(call.in);
  uint8_t* out = static_cast<uint8_t*>(call.out);
  uint8_t* own = scratch[rank];
  std::vector<size_t> piece(n), packed(n), rpiece(n);  // this chunk's piece of each block
  if (!met) ops.meet();
  for (size_t off = 0; off < span; off += cap) {
    const size_t chunk = std::min(cap, span - off), bytes = chunk * esize;
    size_t total = 0;
    for (size_t q = 0; q < n; ++q) {
      piece[q] = len[q] > off ? std::min(cap, len[q] - off) : 0;
      rpiece[q] = rlen[q] > off ? std::min(cap, rlen[q] - off) : 0;
      packed[q] = total;
      total += piece[q];
    }
    switch (call.collective) {
      case Collective::AllReduce:
      case Collective::Reduce:
        ops.copy(own, in + off * esize, bytes);
        ops.fence();  // every rank's chunk is in its scratch
        ops.twoshot(chunk, scratch);
        ops.chunk_done();
        ops.fence();  // every rank's shard is in every scratch
        if (call.collective == Collective::AllReduce || rank == call.root)
          ops.copy(out + off * esize, own, bytes);
        break;
      case Collective::ReduceScatter:  // the pieces at `off` of every rank's block, packed
        for (size_t q = 0; q < n; ++q)
          if (piece[q] != 0)
            ops.copy(own + packed[q] * esize, in + (at[q] + off) * esize, piece[q] * esize);
        ops.fence();
        ops.twoshot(total, scratch);
        ops.chunk_done();
        ops.fence();
        if (piece[rank] != 0)
          ops.copy(out + off * esize, own + packed[rank] * esize, piece[rank] * esize);
        break;
      case Collective::AllGather:
      case Collective::Gather:
        if (piece[rank] != 0) ops.copy(own, in + off * esize, piece[rank] * esize);
        ops.fence();
        if (c == Collective::AllGather || rank == call.root)
          for (size_t q = 0; q < n; ++q)
            if (piece[q] != 0) ops.copy(out + (at[q] + off) * esize, scratch[q], piece[q] * esize);
        ops.chunk_done();
        ops.fence();  // every rank has read every scratch
        break;
      case Collective::Scatter:
      case Collective::AllToAll: {
        const bool sends = c == Collective::AllToAll || rank == call.root;
        for (size_t q = 0; sends && q < n; ++q)
          if (piece[q] != 0)
            ops.copy(own + q * cap * esize, in + (at[q] + off) * esize, piece[q] * esize);
        ops.fence();
        for (size_t q = 0; q < n; ++q) {  // rank q's piece for this rank, at rank * cap
          if (c == Collective::Scatter && q != static_cast<size_t>(call.root)) continue;
          const uint8_t* mine = scratch[q] + static_cast<size_t>(rank) * cap * esize;
          const size_t at_out = c == Collective::Scatter ? off : rat[q] + off;
          const size_t got = c == Collective::Scatter ? piece[rank] : rpiece[q];
          if (got != 0) ops.copy(out + at_out * esize, mine, got * esize);
        }
        ops.chunk_done();
        ops.fence();
        break;
      }
      default:  // Broadcast, in place on `out`
        if (rank == call.root) ops.copy(own, out + off * esize, bytes);
        ops.fence();
        if (rank != call.root) ops.copy(out + off * esize, scratch[call.root], bytes);
        ops.chunk_done();
        ops.fence();
        break;
    }
  }
}
// Stepped mode's meeting of every rank on the host barrier flags (ShmTransport::barrier): posts
// `epoch` (one more than this rank's last), then waits, bounded, until every peer has posted
// it. Stepped mode's registered calls and scratch fence with it (a fence: the host waits for the
// GPU, then meets; or counter_fence, event_fence): no launch of stepped mode waits for another
// process.
void host_meet(const ShmTransport& shm, uint64_t epoch, const WaitContext& w);
// Stepped mode's fence on counters (CudaCommOptions::stepped_events, where the GPU offers 64-bit
// stream memory operations), the host never waiting for the GPU: every rank has a fence
// counter in its device segment (SegmentLayout::fence_offset), which every peer maps. The fence
// queues on this rank's stream a write of `epoch` into its counter, after everything queued
// before it (`write(epoch)`: cuStreamWriteValue64, whose default fence orders the stream's
// earlier writes before it), meets every peer on the host at `epoch` (bounded: a peer that
// never comes is found here, not by a stream that would wait for it forever), then queues on
// its stream a wait until every peer's counter is at least `epoch` (`wait_peer(q, epoch)`:
// cuStreamWaitValue64, GEQ). Counters only grow, and a peer writes one greater than `epoch`
// only after this fence's work too, so the wait is right however late the GPU reaches it, and
// whenever it binds: nothing is recorded again under it, as an event is (event_fence).
template <class Write, class WaitPeer>
void counter_fence(const ShmTransport& shm, uint64_t epoch, const WaitContext& w, Write&& write,
                   WaitPeer&& wait_peer) {
  write(epoch);
  host_meet(shm, epoch, w);
  for (int q = 0; q < shm.size(); ++q)
    if (q != shm.rank()) wait_peer(q, epoch);
}
// Stepped mode's fence on interprocess events (CudaCommOptions::stepped_events, where the GPU has
// no 64-bit stream memory operations), the host never waiting for the GPU: every rank has two
// events that every peer has opened. It assumes that a queued wait on a peer's event waits for
// the record current when it was queued, as cudaStreamWaitEvent documents within a process;
// were a GPU to bind it when it reaches the wait, a wait queued long before could take a
// record made two fences later, and the streams would wait for each other in a cycle (the
// emulated device's events bind so, and this fence hangs there: counter_fence does not). The fence
// records this rank's event fence_event(epoch) on its stream (`record(k)`), meets every peer on the
// host at `epoch`, then queues on its stream a wait on every peer's event of that number
// (`wait_peer(q, k)`): what it queues next runs once every rank's work queued before the fence
// has run. A queued wait is for the event's last record before it; the meeting makes that this
// fence's record, never an earlier one (the peer records before it posts) nor a later one (the
// peer records that event again at epoch + 2 at the earliest, after meeting at epoch + 1, which
// this rank posts only once its waits are queued).
inline int fence_event(uint64_t epoch) { return static_cast<int>(epoch & 1); }
template <class Record, class WaitPeer>
void event_fence(const ShmTransport& shm, uint64_t epoch, const WaitContext& w, Record&& record,
                 WaitPeer&& wait_peer) {
  const int k = fence_event(epoch);
  record(k);
  host_meet(shm, epoch, w);
  for (int q = 0; q < shm.size(); ++q)
    if (q != shm.rank()) wait_peer(q, k);
}
// Makes `a` the launch of the two-shot over every rank's `in` and `out` (as mapped here): one
// step, twoshot_grid's blocks. The caller then compares the call on the device
// (check_on_device): that is the two-shot's entry synchronisation.
void set_twoshot(KernelArgs& a, size_t count, const std::vector<uint8_t*>& in,
                 const std::vector<uint8_t*>& out);
// Makes `a` the launch of `call` over every rank's registered `in` and `out` (run_registered).
void set_registered(KernelArgs& a, const CollectiveCall& call, const std::vector<uint8_t*>& in,
                    const std::vector<uint8_t*>& out);

// The fingerprint of a call over registered buffers (device/twoshot_kernel.h): `f` marked as
// one (Fingerprint::shared), its splits word a hash of where the buffers whose peers'
// addresses it uses lie (RegisteredCall::where: registration number and offset into it, the
// same on every rank of a symmetric call). Ranks that disagree raise CollectiveMismatch
// instead of one reading or writing memory its peers do not expect.
inline Fingerprint registered_fingerprint(Fingerprint f, const RegisteredCall& t) {
  Fnv1a h;
  for (uint64_t v : t.where) h.mix(v);
  f.shared = true;
  f.splits = h.h | 1;  // never 0: an even call's word
  return f;
}

// The message of the CollectiveMismatch that a device status with kMismatch stands for: the
// two calls and the fields that differ where this rank found it, else which rank stopped on one.
std::string device_mismatch_message(const char* name, const DeviceStatus& st, int rank);
// What a device wait that gave up (kTimeout, kAborted) waited for: "rank 2 (step 3, block 0)",
// or this rank's comparison of the call (the gate).
std::string device_wait_target(const DeviceStatus& st, int rank);

}  // namespace cuda
}  // namespace pycoll
