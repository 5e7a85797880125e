// Buffers the ranks of a machine can map, and collectives over them in one pass.
//
// The staged schedules move every byte through a staging slot: a cross-core copy per byte on
// top of reading the input and writing the output. With buffers every rank can map
// (Communicator.empty: a memfd per buffer), the reducing and copying collectives need no slot
// at all; each rank reads what it needs from its peers' buffers and writes every byte once:
//   - all-reduce: rank r reduces shard r of every rank's input and writes it into shard r of
//     every rank's output (each rank reads S and writes S, S the message: the memory bound;
//     the staged ring adds a cross-core copy of S. On a 2-core EPYC guest that took the 64 MiB
//     all-reduce from 60% of the copy bound to about 95%);
//   - reduce-scatter: rank r reduces block r of every rank's input into its own output;
//   - reduce: rank r reduces shard r of every rank's input into shard r of the root's output;
//   - all-gather: rank r copies every rank's input into its own output;
//   - broadcast: every rank copies the root's buffer into its own.
// Even counts only (the uneven forms keep the staged schedules).
//
// One call:
//   1. the ranks trade descriptors of their input and output (memfd, inode, offset) through
//      the slots; a rank whose buffers are not shared sends none;
//   2. every rank maps its peers' buffers (cached: /proc/<pid>/fd/<fd>, the inode checked)
//      and the ranks trade verdicts; where any buffer is missing or any mapping refused,
//      nothing has moved and every rank runs the staged schedule;
//   3. each rank does its part (reductions in rank order, into a cache-resident block copied
//      into every output it feeds; non-temporal stores for large messages), then fences;
//   4. a last exchange tells every rank that its peers are done with its buffers.
// Every element is computed once and copied, so the outputs are bitwise identical. In place is
// safe: each rank writes only what it alone reads (its shard, its own output's blocks).
//
// Whether a communicator runs step 1 at all is agreed when the ranks allocate (Communicator
// .empty is collective) and is part of every call's fingerprint, so a rank that disagrees
// raises CollectiveMismatch instead of reading a descriptor as data.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <utility>
#include <vector>

#include "algo/call.h"
#include "host/executor.h"
#include "host/p2p.h"
#include "host/shm_transport.h"

namespace pycoll {

// A page-rounded anonymous shared mapping (memfd) that peers of this process may map.
// Registered process-wide while it lives, so a collective finds it from any pointer into it.
class SharedBuffer {
 public:
  explicit SharedBuffer(size_t bytes);
  ~SharedBuffer();
  SharedBuffer(const SharedBuffer&) = delete;
  SharedBuffer& operator=(const SharedBuffer&) = delete;

  uint8_t* data() const { return base_; }
  size_t bytes() const { return bytes_; }

 private:
  uint8_t* base_ = nullptr;
  size_t bytes_ = 0;
  size_t mapped_ = 0;
  int fd_ = -1;
};

// Where a range lies in a live SharedBuffer, as a peer needs it to map the buffer.
struct SharedRef {
  uint64_t pid = 0;     // owner process
  uint64_t fd = 0;      // its memfd, in the owner
  uint64_t inode = 0;   // checked by whoever opens the fd
  uint64_t mapped = 0;  // bytes of the whole mapping
  uint64_t offset = 0;  // of the range in the buffer
  uint64_t addr = 0;    // of the buffer in the owner (ranks that are threads of one process)
  uint64_t frees = 0;   // buffers the owner has freed so far (peers then drop stale views)
};

// The SharedBuffer holding [p, p + bytes), if any.
bool find_shared(const void* p, size_t bytes, SharedRef& out);

class SharedCollectives {
 public:
  SharedCollectives(const ShmTransport& t, CmaMode mode, size_t min_bytes, bool debug)
      : t_(t), mode_(mode), min_bytes_(min_bytes), debug_(debug) {}
  ~SharedCollectives();

  // Whether `call`, left to the automatic choice, runs steps 1-2 (every rank decides the same;
  // the communicator has agreed that its ranks allocate shared buffers): all-reduces from
  // `min_bytes`, the others from kOtherMinFactor times that.
  bool eligible(const CollectiveCall& call) const;
  // Runs `call` over mapped buffers; false when some buffer is not shared or cannot be mapped
  // (nothing moved: the caller runs the staged schedule).
  bool run(HostExecutor& ex, const CollectiveCall& call, const CallBuffers& buf);

  // The other collectives' staged schedules are quicker for small messages (2 ranks: the
  // mapped path wins from 128 KiB, against 16 KiB for all-reduce).
  static constexpr size_t kOtherMinFactor = 8;

 private:
  struct View {
    uint8_t* base;
    size_t bytes;
    uint64_t used;
  };
  // The address of `ref`'s buffer in this process, mapping it if needed; null if refused.
  uint8_t* map(const SharedRef& ref);
  void drop_stale(uint64_t pid, uint64_t frees);
  void evict();
  // Step 3: the reduction of `srcs` (rank order) over `count` elements into every one of `dsts`.
  void reduce_into(const CallBuffers& buf, const std::vector<const uint8_t*>& srcs,
                   const std::vector<uint8_t*>& dsts, size_t count, bool stream) const;

  const ShmTransport& t_;
  const CmaMode mode_;
  const size_t min_bytes_;
  const bool debug_;
  std::map<std::pair<uint64_t, uint64_t>, View> views_;  // (pid, inode) -> mapping
  std::map<uint64_t, uint64_t> frees_seen_;              // pid -> its free count we know
  uint64_t clock_ = 0;
};

}  // namespace pycoll
