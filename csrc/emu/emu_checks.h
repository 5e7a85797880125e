// What the emulated device (the step kernel compiled for the host) checks and how it waits.
//
// Every load and store of the kernel's code goes through check_access: it must fall inside
// one of the launch's buffers (every rank's device segment, the call's input and output), and
// a store must fall inside a buffer this rank may write (its own segment and its output). A
// staging slot access must also stay inside the sub-slot that its block owns.
//
// The data loads and stores (check_data: whole 16-byte words and single elements, not flags,
// call headers or LL words) are also counted, by whose memory they touch (Traffic).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "device/kernel_args.h"

namespace pycoll {
namespace emu {

struct Region {
  const uint8_t* lo = nullptr;
  size_t bytes = 0;
  bool writable = false;
  const char* what = "";
  int rank = -1;
};

// Bytes of data the device code has loaded and stored, by whose memory: this rank's own (its
// segment, its input and output) or a peer's (a peer's segment or registered buffers).
struct Traffic {
  std::atomic<uint64_t> read_own{0}, read_peer{0}, write_own{0}, write_peer{0};
  void reset() { read_own = read_peer = write_own = write_peer = 0; }
};

// The buffers of one emulated launch; installed for each block's thread.
struct Regions {
  std::vector<Region> list;
  int self = -1;               // the launching rank: regions of other ranks are peers'
  Traffic* traffic = nullptr;  // where check_data's counts go (flush_traffic); none: not counted
  bool weak_stores = false;    // the launch's data stores are buffered (buffer_store)
};

// The regions of the launch running on this thread (none: nothing is checked).
const Regions* current_regions();
void set_current_regions(const Regions* r);

// Installs a launch's regions on this thread for a scope.
class RegionsScope {
 public:
  explicit RegionsScope(const Regions* r) { set_current_regions(r); }
  ~RegionsScope() { set_current_regions(nullptr); }
  RegionsScope(const RegionsScope&) = delete;
  RegionsScope& operator=(const RegionsScope&) = delete;
};

[[noreturn]] void fail_access(const void* p, size_t bytes, bool write);
[[noreturn]] void fail(const char* what);

inline void check_access(const void* p, size_t bytes, bool write) {
  const Regions* rs = current_regions();
  if (rs == nullptr) return;
  const uint8_t* q = static_cast<const uint8_t*>(p);
  for (const Region& r : rs->list)
    if (q >= r.lo && q + bytes <= r.lo + r.bytes && (!write || r.writable)) return;
  fail_access(p, bytes, write);
}

// Counts of this thread's data accesses since the last flush_traffic.
struct TrafficCounts {
  uint64_t read_own = 0, read_peer = 0, write_own = 0, write_peer = 0;
};
TrafficCounts& thread_traffic();
// Adds this thread's counts to its launch's Traffic and zeroes them (end of a block's run).
void flush_traffic();

// check_access of a data load or store, counted.
inline void check_data(const void* p, size_t bytes, bool write) {
  const Regions* rs = current_regions();
  if (rs == nullptr) return;
  const uint8_t* q = static_cast<const uint8_t*>(p);
  for (const Region& r : rs->list)
    if (q >= r.lo && q + bytes <= r.lo + r.bytes && (!write || r.writable)) {
      const bool own = r.rank < 0 || r.rank == rs->self;
      TrafficCounts& t = thread_traffic();
      (write ? (own ? t.write_own : t.write_peer) : (own ? t.read_own : t.read_peer)) += bytes;
      return;
    }
  fail_access(p, bytes, write);
}

// Weak visibility. A GPU makes a plain store visible to other processes' loads only once a
// release or a fence orders it (st_release_sys, fence_system, fence_device) or the kernel has
// ended; x86 shows every store to every core in order at once, so a missing fence would never
// fail here. Where the launch asks for it (Regions::weak_stores), a data store (store16,
// store_elem) goes into the storing thread's buffer instead of memory until that thread's next
// release or fence, or its block's end (flush_stores); the thread's own loads see it
// (forward_load), nobody else's do. So a peer that reads data whose flag was posted without a
// release reads what was there before. (The threads of one emulated block share a buffer: a
// block's threads see each other's stores, as they do after __syncthreads.)
// Buffers [p, p + bytes) of `v`; false where stores are not buffered (write it to memory).
bool buffer_store(void* p, const void* v, size_t bytes);
// Overlays this thread's buffered bytes of [p, p + bytes) onto `v`, loaded from memory.
void forward_load(const void* p, void* v, size_t bytes);
// Writes this thread's buffered stores to memory (a release or a fence, a block's end).
void flush_stores();
// Drops them (a block that failed).
void drop_stores();

inline void check_aligned16(const void* p) {
  if ((reinterpret_cast<uintptr_t>(p) & 15) != 0) fail("a 16-byte access is not 16-byte aligned");
}

// [p, p + bytes) must lie inside block `block`'s sub-slot of message m on channel `channel` of
// the segment at `seg`.
void check_slot(const void* p, size_t bytes, const void* seg, const cuda::SegmentLayout& layout,
                int block, int channel, uint64_t m);
// ... and inside its LL sub-slot (the LL format's words of message m).
void check_ll_slot(const void* p, size_t bytes, const void* seg, const cuda::SegmentLayout& layout,
                   int block, int channel, uint64_t m);

// What the emulated device watches of one kernel-mode launch as its blocks end (its checks of
// cuda::finish_launch and of the stream order, cuda::DeviceComm::launch_kernel_mode): how many
// blocks have reached their end, and whether one reached it before the call before this one had
// reported its end (the done word below `after`). For tests, a stagger makes block b reach its end
// b * stagger_ms later.
struct LaunchProbe {
  std::atomic<int> ended{0};
  std::atomic<bool> ahead{false};
  const uint64_t* done = nullptr;
  uint64_t after = 0;
  int stagger_ms = 0;
};
// The probe of the launch running on this thread (none: nothing is watched).
LaunchProbe* current_probe();
class ProbeScope {
 public:
  explicit ProbeScope(LaunchProbe* p);
  ~ProbeScope();
  ProbeScope(const ProbeScope&) = delete;
  ProbeScope& operator=(const ProbeScope&) = delete;
};

uint64_t now_ns();
// The pause after `spins` unsuccessful polls of the flag `flag`, last seen holding `seen`: a
// short spin, then a sleep in the kernel until a post to the flag (post_flag, which wakes its
// waiters) or 200 us, whichever comes first. Ranks outnumber cores here (3 ranks x 4 blocks on
// 2 cores in CI): a block that yields or naps instead hands the core around until the one
// block that can make progress happens to run.
void wait_change(const uint64_t* flag, uint64_t seen, uint64_t spins);
// Wakes the blocks of every rank waiting on `flag` (after a store to it).
void wake(const uint64_t* flag);

}  // namespace emu
}  // namespace pycoll
