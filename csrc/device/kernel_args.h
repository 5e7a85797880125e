// What the host hands the GPU: a schedule's steps in a compact form, and one launch's arguments.
//
// Plain structs shared by host code (compiled by the host compiler) and kernels (nvcc).
#pragma once

#include <cstddef>
#include <cstdint>

#include "algo/messages.h"
#include "common/hd.h"

namespace pycoll {
namespace cuda {

// Ranks one CUDA communicator can hold: bounds the per-launch arguments and shared memory.
constexpr int kMaxRanks = 32;
// Flags sit this far apart so that no two writers share a line (NVLink moves 128-byte lines).
constexpr size_t kFlagStride = 128;
// Per-block slices of a message start at multiples of this many elements, so that a slice of
// a 16-byte-aligned message is 16-byte aligned for every element and accumulation type.
constexpr size_t kSliceAlign = 16;

// One Step (algo/step.h) as the kernel reads it.
struct DevStep {
  uint8_t kind;     // StepKind
  uint8_t flags;    // kRecvAcc | kSendAcc | kRecvBcast | kRecvLL | kSendLL
  uint8_t src_buf;  // Buf
  uint8_t dst_buf;  // Buf
  int16_t from, from2, to, to2;
  uint32_t count;    // elements; at most one staging slot's worth
  uint64_t src_off;  // elements
  uint64_t dst_off;
};
static_assert(sizeof(DevStep) == 32, "DevStep is uploaded as raw bytes");

constexpr uint8_t kRecvAcc = 1;
constexpr uint8_t kSendAcc = 2;
constexpr uint8_t kRecvBcast = 4;
// The step's incoming (kRecvLL) or outgoing (kSendLL) messages travel in the low-latency
// format (ll_message): the flag in every word, no posted flag to wait for.
constexpr uint8_t kRecvLL = 8;
constexpr uint8_t kSendLL = 16;

PYCOLL_HD_INLINE StepPeers peers_of(const DevStep& d) {
  return StepPeers{static_cast<StepKind>(d.kind), d.from, d.from2, d.to, d.to2,
                   (d.flags & kRecvBcast) != 0};
}

// Where a rank's flags and staging slots are, relative to the base of its device segment. Every
// block of a launch is a channel of its own (NCCL's word): its own flags and its own slice of
// every slot, so blocks never wait for each other.
struct SegmentLayout {
  int size = 1;
  int nslots = 2;
  int nblocks = 1;
  size_t sub_slot_bytes = 0;  // one block's share of a slot
  size_t flags_bytes = 0;     // flags of every block, the call headers, then the data
  // The low-latency (LL) area, after the data: the first `ll_blocks` blocks (those that an LL
  // message can reach) have an LL sub-slot of `ll_sub_slot_bytes` per slot of every channel.
  // It holds LL words only, never a message in the plain format (see ll_message).
  size_t ll_offset = 0;
  size_t ll_sub_slot_bytes = 0;
  int ll_blocks = 0;
  int ll_flag_bits = 32;  // an LL word's flag is message number mod 2^ll_flag_bits (tests: less)
  // Where a message of a channel between two ranks (not a broadcast channel) travels. Pull
  // (false): the sender writes it into its own segment's slot for the receiver and posts
  // posted(to) there; the receiver polls that flag and reads the slot remotely, then posts
  // consumed(from) in its own segment, which the sender polls remotely. Push (true): the sender
  // writes the message into the receiver's segment, in the receiver's slot for it (channel =
  // the sender), and posts pushed(sender) there; the receiver polls its own memory and reads
  // its own slot, then posts freed(receiver) into the sender's segment, which the sender polls
  // in its own memory: every remote access is a write. Both ends keep their counts in their own
  // posted and consumed flags too (relaxed), as a launch reads them back (load_own_counts).
  bool push = false;
  // Flag indices within a block's flag area (see CudaTransport for what each counts).
  PYCOLL_HD static constexpr int posted(int peer) { return 3 * peer; }
  PYCOLL_HD static constexpr int consumed(int peer) { return 3 * peer + 1; }
  PYCOLL_HD static constexpr int bcast_consumed(int peer) { return 3 * peer + 2; }
  PYCOLL_HD int bcast_posted() const { return 3 * size; }
  // A two-shot all-reduce over registered buffers (device/twoshot_kernel.h) counts its calls on
  // a flag of each block: its exit barrier's.
  PYCOLL_HD int reg_exit() const { return 3 * size + 1; }
  // Push (above): messages `peer` has written into this segment, and slots of this rank's in
  // `peer`'s segment that `peer` has freed.
  PYCOLL_HD int pushed(int peer) const { return 3 * size + 2 + 2 * peer; }
  PYCOLL_HD int freed(int peer) const { return 3 * size + 3 + 2 * peer; }
  PYCOLL_HD int flags_per_block() const { return 5 * size + 2; }
  PYCOLL_HD size_t flag_offset(int block, int index) const {
    return (static_cast<size_t>(block) * flags_per_block() + index) * kFlagStride;
  }
  // Call headers (kernel mode; step_kernel.h, match_calls): after every block's flags, one line
  // per peer for the header the segment's owner writes for that peer (CallHeader), one line
  // per peer for the number of that peer's headers the owner has read (its acknowledgement),
  // the owner's failure word (kFailMismatch...), its gate: the number of the last eager
  // call whose block 0 has compared it with every peer (KernelArgs::gate), and stepped mode's
  // fence counter.
  PYCOLL_HD size_t header_offset(int peer) const { return flag_offset(nblocks, peer); }
  PYCOLL_HD size_t ack_offset(int peer) const { return flag_offset(nblocks, size + peer); }
  PYCOLL_HD size_t fail_offset() const { return flag_offset(nblocks, 2 * size); }
  PYCOLL_HD size_t gate_offset() const { return flag_offset(nblocks, 2 * size + 1); }
  // Stepped mode's fence counter (stepped.h, counter_fence): the last fence whose work before
  // it the owner's stream has run.
  PYCOLL_HD size_t fence_offset() const { return flag_offset(nblocks, 2 * size + 2); }
  PYCOLL_HD size_t headers_end() const { return flag_offset(nblocks, 2 * size + 3); }
  // Block `block`'s sub-slot of the slot of message m (1-based) that the segment's owner
  // sends to `to` (to == size: its broadcast channel). It holds the block's slice of the
  // message from its first byte.
  PYCOLL_HD size_t slot_offset(int block, int to, uint64_t m) const {
    const size_t channel = static_cast<size_t>(block) * (size + 1) + to;
    return flags_bytes + (channel * nslots + channel::slot_index(m, nslots)) * sub_slot_bytes;
  }
  // Block `block`'s LL sub-slot of the slot of message m on channel `to` (block < ll_blocks).
  PYCOLL_HD size_t ll_slot_offset(int block, int to, uint64_t m) const {
    const size_t channel = static_cast<size_t>(block) * (size + 1) + to;
    return ll_offset + (channel * nslots + channel::slot_index(m, nslots)) * ll_sub_slot_bytes;
  }
  size_t data_end() const {
    return flags_bytes + static_cast<size_t>(nblocks) * (size + 1) * nslots * sub_slot_bytes;
  }
  size_t total_bytes() const {
    return ll_offset + static_cast<size_t>(ll_blocks) * (size + 1) * nslots * ll_sub_slot_bytes;
  }
};

// Messages moved on each channel before a launch, for stepped mode (where every block takes the
// same count from the host). In kernel mode each block counts for itself, on its own flags.
struct LaunchCounters : MessageCounts<uint64_t[kMaxRanks]> {};

// What a rank's call header carries to one peer: the call's fingerprint (Fingerprint::packed,
// count and splits; runtime/fingerprint.h) and, written last, how many headers the owner has
// written for that peer. The k-th call a pair of ranks shares is compared with the k-th on the
// other side, counted on the device, so graph replays are checked as eager launches are.
struct CallHeader {
  uint64_t words[3];  // packed, count, splits
  uint64_t n;         // release-stored after the words
};
static_assert(sizeof(CallHeader) <= kFlagStride, "a call header fits one flag line");

// A segment's failure word: 0, or kFailMismatch | the two ranks whose calls differ (found by
// the first, against the second). Written by its owner, device or host, once; peers' waits read
// it, so a mismatch stops every rank that waits on one that has stopped.
constexpr uint64_t kFailMismatch = uint64_t{1} << 63;
PYCOLL_HD_INLINE uint64_t fail_word(int finder, int other) {
  return kFailMismatch | static_cast<uint64_t>(finder & 0xff) << 8 |
         static_cast<uint64_t>(other & 0xff);
}
PYCOLL_HD_INLINE int fail_finder(uint64_t w) { return static_cast<int>(w >> 8 & 0xff); }
PYCOLL_HD_INLINE int fail_other(uint64_t w) { return static_cast<int>(w & 0xff); }

// Written by the device when it gives up; lives in host-mapped memory.
struct DeviceStatus {
  uint32_t abort;  // set by the host (or a failing block) to stop every wait
  uint32_t code;   // DeviceError
  int32_t peer;
  int32_t step;
  int32_t block;
  int32_t pad;
  // kMismatch: the host's number of the call, its fingerprint words, and the failure word:
  // ours when found here (then `theirs` holds the peer's words), else that of the rank that
  // stopped first (propagated; theirs all 0).
  uint64_t seq;
  uint64_t mine[3];
  uint64_t theirs[3];
  uint64_t fail;
  // Kernel mode: the number of this rank's last eager call whose launch has ended, every block
  // of it (finish_launch, step_kernel.h). The host reads it instead of querying an event.
  uint64_t done;
};
enum DeviceError : uint32_t { kOk = 0, kTimeout = 1, kAborted = 2, kMismatch = 3 };

// A collective over registered buffers (device/twoshot_kernel.h, run_registered), run instead
// of steps: every rank's input and output as this process maps them (ours at index `rank`). Its
// launch always compares the call first (check_on_device): that exchange is its entry barrier.
struct RegisteredArgs {
  bool on;
  int kind;        // the Collective: all-reduce, reduce, reduce-scatter, all-gather, broadcast
  int root;        // reduce and broadcast
  uint64_t count;  // elements: the call's count (reduce-scatter, all-gather: one rank's block)
  const uint8_t* in[kMaxRanks];
  uint8_t* out[kMaxRanks];
};

struct KernelArgs {
  const DevStep* steps;
  uint32_t first_step, end_step;
  int grid;        // blocks launched, the first `grid` of layout.nblocks (plan_grid)
  bool use_flags;  // false: the host orders the steps (stepped mode)
  int rank;
  int op;       // RedOp
  int divisor;  // avg divides by this
  const uint8_t* input;
  uint8_t* output;
  uint8_t* segments[kMaxRanks];  // every rank's segment as this process maps it
  SegmentLayout layout;
  LaunchCounters counters;
  DeviceStatus* status;   // device pointer of host-mapped memory
  uint32_t* error_claim;  // device memory: the first failing block claims the status
  uint64_t timeout_ns;    // a device wait gives up after this long
  uint64_t max_spins;     // ... or after this many polls, whichever comes first
  // Kernel mode: block 0 trades call headers with every peer before its first step and
  // compares them (step_kernel.h, match_calls); false in stepped mode, where the host compares.
  bool matches_calls;
  uint64_t seq;             // the host's number of the call, for its error message
  uint64_t fingerprint[3];  // CallHeader::words of this call
  // Kernel mode, eager launches (0 in a capture and in stepped mode): the last block of the
  // launch to end writes done_seq into status->done; `finished` (device memory) counts the
  // blocks that have ended, back to 0 once the last has. No block waits for this rank's call
  // before: a launch on another stream than that call's is ordered after it by the host (an
  // event on that call's stream), so that a rank never has two launches resident at once.
  uint32_t* finished;
  uint64_t done_seq;
  // An eager launch of several blocks that checks the call (launches_of): block 0 opens the
  // gate (writes done_seq there) once it has compared the call with every peer's, and the
  // other blocks wait for it before anything else, so no block moves data, or waits for a
  // peer's, before the call is compared.
  bool gate;
  // When reg.on, the launch runs the two-shot as its one step ([0, 1)), not `steps`.
  RegisteredArgs reg;
};
// Passed by value to the kernel: CUDA's limit on a kernel's parameters is 4 KiB.
static_assert(sizeof(KernelArgs) <= 4096, "KernelArgs exceeds CUDA's kernel-parameter limit");

// Whether launching `a` does anything: steps to run, or the call to compare with its peers'.
// A call that moves nothing on a one-rank communicator (a barrier, a broadcast, any count-0
// call) does neither: it is not launched, so no end of it is ever reported (DeviceStatus::done)
// and nothing may wait for one. The GPU's launcher and the emulated device's both decide by it.
inline bool runs_anything(const KernelArgs& a) {
  return a.first_step < a.end_step || a.matches_calls;
}

// The launches that run `a`, in order (returns how many, 0 when it runs nothing): no block
// moves data, or waits for a peer's, before every peer's call has been compared. One launch,
// unless it checks the call and runs several blocks: then an eager launch gates its other
// blocks on block 0's check (gate), and a captured one (no call number to gate on: the same
// arguments are replayed) is a one-block launch that only checks, then the steps unchecked
// (where there are steps).
inline int launches_of(const KernelArgs& a, KernelArgs (&out)[2]) {
  out[0] = a;
  if (!runs_anything(a)) return 0;
  if (!a.matches_calls || a.grid <= 1) return 1;
  if (a.done_seq != 0) {
    out[0].gate = true;
    return 1;
  }
  out[0].end_step = out[0].first_step;
  out[0].grid = 1;
  out[0].done_seq = 0;  // the call has not ended with its check
  out[1] = a;
  out[1].matches_calls = false;
  return runs_anything(out[1]) ? 2 : 1;
}

}  // namespace cuda
}  // namespace pycoll
