// Shared-memory transport: one segment per rank, every rank maps every segment.
//
// A rank's segment holds, for each peer p, a channel of `nslots` staging slots that carries
// messages to p, a broadcast channel that every peer reads, the counters of the channels it
// takes part in (posted/consumed, see algo/messages.h for the protocol; every rank writes only
// its own segment, each counter in its own cache line), a ring of fingerprints of its
// recent collectives (see fingerprint.h), and the split area of its latest all-to-all with
// per-rank splits (see splits.h).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "host/fingerprint.h"
#include "host/shm_segment.h"

namespace pycoll {

constexpr size_t kCacheLine = 64;

struct alignas(kCacheLine) FlagLine {
  std::atomic<uint64_t> value;
  char pad[kCacheLine - sizeof(std::atomic<uint64_t>)];
};
static_assert(sizeof(FlagLine) == kCacheLine, "flag line");
static_assert(std::atomic<uint64_t>::is_always_lock_free, "shared counters need lock-free atomics");

struct SegmentHeader {
  uint64_t magic;
  uint32_t version;
  uint32_t nranks;
  uint32_t rank;
  uint32_t nslots;
  uint64_t slot_bytes;
  uint64_t total_bytes;
  int64_t pid;
};

class ShmTransport {
 public:
  ShmTransport(int rank, int size, size_t slot_bytes, int nslots);
  ~ShmTransport();
  ShmTransport(const ShmTransport&) = delete;
  ShmTransport& operator=(const ShmTransport&) = delete;

  const std::string& name() const { return own_.name(); }
  // Maps every peer's segment (names indexed by rank) and validates its header.
  void attach(const std::vector<std::string>& names);
  // Removes our segment's name; call once every peer has attached.
  void unlink() { own_.unlink(); }

  int rank() const { return rank_; }
  int size() const { return size_; }
  int nslots() const { return nslots_; }
  size_t slot_bytes() const { return slot_bytes_; }
  int64_t pid_of(int r) const { return pids_[r]; }
  // False once rank r's process has exited (zombies included).
  bool peer_alive(int r) const;

  // Slot of message `m` (1-based) on the channel from -> to.
  uint8_t* slot(int from, int to, uint64_t m) const;
  // Slot of message `m` on `from`'s broadcast channel.
  uint8_t* bcast_slot(int from, uint64_t m) const;
  std::atomic<uint64_t>& posted(int owner, int peer) const { return flag(owner, peer * 2); }
  std::atomic<uint64_t>& consumed(int owner, int peer) const { return flag(owner, peer * 2 + 1); }
  std::atomic<uint64_t>& barrier(int owner) const { return flag(owner, size_ * 2); }
  std::atomic<uint64_t>& bcast_posted(int owner) const { return flag(owner, size_ * 2 + 1); }
  std::atomic<uint64_t>& bcast_consumed(int owner, int peer) const {
    return flag(owner, size_ * 2 + 2 + peer);
  }
  // `owner`'s fingerprint entry for collective #seq (a ring of recent entries).
  FingerprintSlot& fingerprint(int owner, uint64_t seq) const;
  // `owner`'s split area: the collective its splits were published for, the latest collective
  // for which `owner` has read every peer's area, and 2 * size counts (its send row, then its
  // receive column).
  std::atomic<uint64_t>& splits_seq(int owner) const { return flag(owner, size_ * 3 + 2); }
  std::atomic<uint64_t>& splits_read(int owner) const { return flag(owner, size_ * 3 + 3); }
  uint64_t* splits(int owner) const {
    return reinterpret_cast<uint64_t*>(base_[owner] + splits_offset_);
  }

 private:
  std::atomic<uint64_t>& flag(int owner, int index) const;
  size_t channel_offset(int owner, int to) const;

  int rank_, size_, nslots_;
  size_t slot_bytes_;
  size_t flags_offset_, fingerprints_offset_, splits_offset_, data_offset_, total_bytes_;
  ShmSegment own_;
  std::vector<ShmSegment> peers_;  // by rank; our own slot stays empty
  std::vector<uint8_t*> base_;     // every rank's mapping, ours included
  std::vector<int64_t> pids_;
  std::vector<int> pidfds_;  // -1 where the kernel has no pidfd_open
};

}  // namespace pycoll
