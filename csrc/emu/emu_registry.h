// Registered buffers of the emulated device: its stand-in for cudaMalloc'd memory that peers map
// through CUDA IPC handles.
//
// An allocation (EmuAllocation, what cudaMalloc is to the GPU) is a POSIX shared-memory segment;
// its name stands for the IPC handle. Registering a range of one (collective: every rank
// registers its own range, in the same order) trades, per rank, which allocation and where in
// it; an allocation's name goes to the peers the first time any range of it is registered, and
// each peer maps it once and keeps the mapping (by owner rank and allocation key), so later
// registrations of the same allocation trade only its key and an offset. Once every peer has
// mapped it the owner removes the name (unlink_exchanged): no segment outlives the job.
//
// A registration lapses with its allocation (the array that holds it), and a peer's mapping
// goes with the communicator.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "runtime/registrations.h"
#include "runtime/shm_segment.h"

namespace pycoll {
namespace emu {

class EmuAllocation {
 public:
  EmuAllocation(uint64_t key, size_t bytes);
  uint8_t* data() const { return seg_.data(); }
  size_t bytes() const { return bytes_; }
  uint64_t key() const { return key_; }
  const std::string& name() const { return seg_.name(); }

 private:
  friend class Registry;
  uint64_t key_;
  size_t bytes_;
  ShmSegment seg_;
  bool sent_ = false;      // its name has gone to the peers
  bool unlinked_ = false;  // ... and been removed since
};

class Registry {
 public:
  Registry(int rank, int size) : rank_(rank), size_(size), table_(size) {}
  std::shared_ptr<EmuAllocation> alloc(size_t bytes);
  // Our handle for [p, p + bytes); InvalidArgument unless it lies in a live allocation.
  RegisterHandle handle(const void* p, size_t bytes);
  // Records the registration of [p, p + bytes) with every rank's handle (ours included), mapping
  // the peers' allocations not mapped yet; returns its number.
  uint64_t add(const void* p, size_t bytes, const std::vector<RegisterHandle>& all);
  // Removes the names of our allocations that every peer has mapped (after add, on every rank).
  void unlink_exchanged();
  // The live allocation that holds [p, p + bytes), or null (registration on first use).
  std::shared_ptr<EmuAllocation> allocation_of(const void* p, size_t bytes) const;
  // Removes the name of our allocation `key` (every peer has mapped it), if it lives. (By key:
  // a new allocation at a freed one's address is not mapped yet.)
  void unlink_key(uint64_t key);
  // Where a call's buffer lies on every rank (runtime/registrations.h).
  Registered find(const void* p, size_t bytes) const { return table_.find(p, bytes); }
  size_t live() const { return table_.live(); }

 private:
  int rank_, size_;
  uint64_t next_key_ = 1;
  std::vector<std::weak_ptr<EmuAllocation>> allocs_;
  std::map<std::pair<int, uint64_t>, ShmSegment> peer_maps_;  // by (owner rank, key)
  Registrations table_;
  mutable std::mutex mu_;
};

}  // namespace emu
}  // namespace pycoll
