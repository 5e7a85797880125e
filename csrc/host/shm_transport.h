// Shared-memory transport: one segment per rank, every rank maps every segment.
//
// A rank's segment holds, for each peer p, a channel of `nslots` staging slots that carries
// messages to p, a broadcast channel that every peer reads, the counters of the channels it
// takes part in (posted/consumed, see algo/messages.h for the protocol; every rank writes only
// its own segment, each counter in its own cache line), a ring of fingerprints of its
// recent collectives (see fingerprint.h), and the split area of its latest all-to-all with
// per-rank splits (see splits.h), and the fault-tolerant board (host/fault_board.h): a
// revoked flag, and two alternating slots of the rank's latest agreement rounds.
//
// A host communicator's segment also holds point-to-point channels (host/p2p.h), apart from the
// collective ones so that the two never interfere: for each peer p, a ring of
// kP2PRequestSlots small requests (recvs this rank has posted with p as the source) and a ring
// of `nslots` data slots towards p, each a kP2PHeaderBytes header then `slot_bytes` of payload;
// and their posted/consumed counters, in flag lines after the collective ones.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "runtime/fingerprint.h"
#include "runtime/shm_segment.h"

namespace pycoll {

constexpr size_t kCacheLine = 64;

struct alignas(kCacheLine) FlagLine {
  std::atomic<uint64_t> value;
  char pad[kCacheLine - sizeof(std::atomic<uint64_t>)];
};
static_assert(sizeof(FlagLine) == kCacheLine, "flag line");
static_assert(std::atomic<uint64_t>::is_always_lock_free, "shared counters need lock-free atomics");

constexpr int kP2PRequestSlots = 64;
constexpr size_t kP2PRequestBytes = kCacheLine;
constexpr size_t kP2PHeaderBytes = kCacheLine;

struct SegmentHeader {
  uint64_t magic;
  uint32_t version;
  uint32_t nranks;
  uint32_t rank;
  uint32_t nslots;
  uint64_t slot_bytes;
  uint64_t total_bytes;
  int64_t pid;
  // Non-zero once the owner's process writes its flight record on SIGUSR1 (a process without
  // that handler would die of the signal).
  std::atomic<uint64_t> flight_signal;
};

// One of a rank's two fault-tolerant board slots (host/fault_board.h): the round it belongs
// to, the rank's value for it, and `bytes` of payload.
constexpr size_t kFtSlotBytes = 4096;
// A call's row (ShmTransport::row) holds at least this much, whatever the size.
constexpr size_t kMinRowBytes = 256;
struct FtSlot {
  uint64_t round;
  uint64_t value;
  uint64_t bytes;
  uint8_t payload[kFtSlotBytes - 3 * sizeof(uint64_t)];
};
static_assert(sizeof(FtSlot) == kFtSlotBytes, "board slot");

class ShmTransport {
 public:
  // `p2p`: also lay out point-to-point channels (the host communicator's segments).
  ShmTransport(int rank, int size, size_t slot_bytes, int nslots, bool p2p = false);
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
  // The number that messages give rank r: its rank in the communicator this transport is the
  // node-local part of (set_names), or r itself.
  int name_of(int r) const { return names_.empty() ? r : names_[static_cast<size_t>(r)]; }
  void set_names(std::vector<int> names) { names_ = std::move(names); }
  // Where everything lies in a rank's segment, and its size (`total`), for `size` ranks.
  struct Layout {
    size_t flags = 0, fingerprints = 0, splits = 0, ft = 0, data = 0, p2p_req = 0, p2p_data = 0;
    size_t total = 0;
  };
  static Layout layout(int size, size_t slot_bytes, int nslots, bool p2p);

  // False once rank r's process has exited (zombies included).
  bool peer_alive(int r) const;
  // This rank's process writes its flight record on SIGUSR1 (runtime/flight_recorder.h).
  void set_flight_signal() const;
  // Sends SIGUSR1 to every live peer whose process writes its flight record on it.
  void ask_peers_for_flight_records() const;
  // Writes `bytes` from our `local` into rank r's memory at `remote` (process_vm_writev,
  // across interrupted and partial writes). 0, or the errno of the failure, with the bytes
  // written before it in `done`.
  int write_into(int r, const uint8_t* local, uint64_t remote, size_t bytes, size_t& done) const;

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
  // Point-to-point channels (only with `p2p`). Request `m` (1-based) from `from` to `to`, in
  // `from`'s segment; data slot `m` (header, then payload) from `from` to `to`.
  uint8_t* p2p_request(int from, int to, uint64_t m) const;
  uint8_t* p2p_slot(int from, int to, uint64_t m) const;
  // Counters in `owner`'s segment of its channels with `peer`: requests it posted to / took
  // from `peer`, data slots it posted to / took from `peer`.
  std::atomic<uint64_t>& p2p_req_posted(int owner, int peer) const {
    return p2p_flag(owner, peer, 0);
  }
  std::atomic<uint64_t>& p2p_req_consumed(int owner, int peer) const {
    return p2p_flag(owner, peer, 1);
  }
  std::atomic<uint64_t>& p2p_posted(int owner, int peer) const { return p2p_flag(owner, peer, 2); }
  std::atomic<uint64_t>& p2p_consumed(int owner, int peer) const {
    return p2p_flag(owner, peer, 3);
  }
  // Non-zero once `owner` has given up its posted receives: nobody may write into them.
  std::atomic<uint64_t>& p2p_closed(int owner) const { return flag(owner, p2p_flags_ + 4 * size_); }

  // `owner`'s fingerprint entry for collective #seq (a ring of recent entries).
  FingerprintSlot& fingerprint(int owner, uint64_t seq) const;
  // `owner`'s row for a call (runtime/splits.h, exchange_rows): the collective it was
  // published for, the latest collective for which `owner` has read every peer's row, and the
  // row, row_bytes(size) bytes (an all-to-all's 2 * size split counts: its send row, then its
  // receive column; the buffers of a call registered on first use).
  std::atomic<uint64_t>& splits_seq(int owner) const { return flag(owner, size_ * 3 + 2); }
  std::atomic<uint64_t>& splits_read(int owner) const { return flag(owner, size_ * 3 + 3); }
  uint8_t* row(int owner) const { return base_[owner] + splits_offset_; }
  static size_t row_bytes(int size) {
    return std::max<size_t>(2 * static_cast<size_t>(size) * sizeof(uint64_t), kMinRowBytes);
  }

  // Non-zero once `owner` has revoked the communicator (host/fault_board.h).
  std::atomic<uint64_t>& revoked(int owner) const { return flag(owner, size_ * 3 + 4); }
  // A peer that has revoked the communicator, or -1.
  int revoker() const;
  // The latest board round `owner` has posted, and its slot for `round` (two alternate).
  std::atomic<uint64_t>& ft_round(int owner) const { return flag(owner, size_ * 3 + 5); }
  FtSlot& ft_slot(int owner, uint64_t round) const;

 private:
  std::atomic<uint64_t>& flag(int owner, int index) const;
  std::atomic<uint64_t>& p2p_flag(int owner, int peer, int which) const {
    return flag(owner, p2p_flags_ + 4 * peer + which);
  }
  size_t channel_offset(int owner, int to) const;

  int rank_, size_, nslots_;
  size_t slot_bytes_;
  int p2p_flags_;  // index of the first point-to-point flag line
  size_t flags_offset_, fingerprints_offset_, splits_offset_, ft_offset_, data_offset_,
      total_bytes_;
  size_t p2p_req_offset_ = 0, p2p_data_offset_ = 0;
  ShmSegment own_;
  std::vector<ShmSegment> peers_;  // by rank; our own slot stays empty
  std::vector<uint8_t*> base_;     // every rank's mapping, ours included
  std::vector<int64_t> pids_;
  std::vector<int> pidfds_;  // -1 where the kernel has no pidfd_open
  std::vector<int> names_;   // empty: ranks are their own names
};

}  // namespace pycoll
