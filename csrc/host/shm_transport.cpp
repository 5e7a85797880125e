#include "host/shm_transport.h"

#include <poll.h>
#include <signal.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <new>

#include "algo/messages.h"
#include "common/errors.h"

namespace pycoll {
namespace {

constexpr uint64_t kMagic = 0x4c4c4f4359434c50ull;  // "PYCOLLL" little-endian tag
constexpr uint32_t kVersion = 8;
constexpr size_t kPage = 4096;

size_t round_up(size_t v, size_t a) { return (v + a - 1) / a * a; }

// posted/consumed per peer, barrier, bcast_posted, bcast_consumed per peer, splits_seq,
// splits_read, revoked, ft_round; then, with p2p channels, four counters per peer and the
// closed flag.
int collective_flag_lines(int size) { return 3 * size + 6; }
int flag_lines(int size, bool p2p) {
  return collective_flag_lines(size) + (p2p ? 4 * size + 1 : 0);
}

// The fingerprint ring follows the flag lines.
size_t fingerprint_bytes() { return kFingerprintHistory * sizeof(FingerprintSlot); }

// A file descriptor that becomes readable when `pid` exits, or -1.
int open_pidfd(int64_t pid) {
#ifdef SYS_pidfd_open
  return static_cast<int>(syscall(SYS_pidfd_open, static_cast<pid_t>(pid), 0));
#else
  (void)pid;
  return -1;
#endif
}

}  // namespace

ShmTransport::~ShmTransport() {
  for (int fd : pidfds_)
    if (fd >= 0) close(fd);
}

bool ShmTransport::peer_alive(int r) const {
  if (r < 0 || r >= size_ || r == rank_ || pids_[r] <= 0) return true;
  if (pidfds_[r] >= 0) {
    struct pollfd p{pidfds_[r], POLLIN, 0};
    return poll(&p, 1, 0) == 0;
  }
  return !(kill(static_cast<pid_t>(pids_[r]), 0) != 0 && errno == ESRCH);
}

int ShmTransport::write_into(int r, const uint8_t* local, uint64_t remote, size_t bytes,
                             size_t& done) const {
  done = 0;
  while (done < bytes) {
    iovec mine{const_cast<uint8_t*>(local) + done, bytes - done};
    iovec theirs{reinterpret_cast<void*>(remote + done), bytes - done};
    const ssize_t w = process_vm_writev(static_cast<pid_t>(pids_[r]), &mine, 1, &theirs, 1, 0);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return w < 0 ? errno : EIO;
    done += static_cast<size_t>(w);
  }
  return 0;
}

ShmTransport::Layout ShmTransport::layout(int size, size_t slot_bytes, int nslots, bool p2p) {
  Layout l;
  l.flags = kPage;
  l.fingerprints = l.flags + static_cast<size_t>(flag_lines(size, p2p)) * kCacheLine;
  l.splits = l.fingerprints + fingerprint_bytes();
  l.ft = round_up(l.splits + row_bytes(size), kCacheLine);
  l.data = round_up(l.ft + 2 * kFtSlotBytes, kPage);
  // One channel per peer (none to ourselves), then the broadcast channel.
  l.total = l.data + static_cast<size_t>(size) * nslots * slot_bytes;
  if (p2p) {  // request rings, then data rings, one of each per rank (ours unused)
    l.p2p_req = round_up(l.total, kPage);
    l.p2p_data = round_up(
        l.p2p_req + static_cast<size_t>(size) * kP2PRequestSlots * kP2PRequestBytes, kPage);
    l.total = l.p2p_data + static_cast<size_t>(size) * nslots * (kP2PHeaderBytes + slot_bytes);
  }
  return l;
}

ShmTransport::ShmTransport(int rank, int size, size_t slot_bytes, int nslots, bool p2p)
    : rank_(rank),
      size_(size),
      nslots_(nslots),
      slot_bytes_(slot_bytes),
      p2p_flags_(collective_flag_lines(size)) {
  if (size < 1 || rank < 0 || rank >= size)
    throw InvalidArgument(str_cat("rank ", rank, " out of range for size ", size));
  if (slot_bytes < kCacheLine || slot_bytes % kCacheLine != 0)
    throw InvalidArgument(str_cat("staging slot size must be a positive multiple of ", kCacheLine,
                                  " bytes, got ", slot_bytes));
  // A step may hold an incoming slot while it waits for an outgoing one; with a single slot
  // per channel two neighbours doing that wait for each other forever.
  if (nslots < 2 || nslots > 64)
    throw InvalidArgument(str_cat("staging slot count must be in [2, 64], got ", nslots));
  const Layout l = layout(size, slot_bytes, nslots, p2p);
  flags_offset_ = l.flags;
  fingerprints_offset_ = l.fingerprints;
  splits_offset_ = l.splits;
  ft_offset_ = l.ft;
  data_offset_ = l.data;
  p2p_req_offset_ = l.p2p_req;
  p2p_data_offset_ = l.p2p_data;
  total_bytes_ = l.total;
  const int nflags = flag_lines(size, p2p);

  own_ = ShmSegment::create("pycoll", total_bytes_);
  uint8_t* b = own_.data();
  auto* h = reinterpret_cast<SegmentHeader*>(b);
  std::memset(b, 0, data_offset_);
  for (int i = 0; i < nflags; ++i)
    new (b + flags_offset_ + static_cast<size_t>(i) * kCacheLine) FlagLine{{0}, {}};
  h->version = kVersion;
  h->nranks = static_cast<uint32_t>(size);
  h->rank = static_cast<uint32_t>(rank);
  h->nslots = static_cast<uint32_t>(nslots);
  h->slot_bytes = slot_bytes;
  h->total_bytes = total_bytes_;
  h->pid = static_cast<int64_t>(getpid());
  std::atomic_thread_fence(std::memory_order_release);
  h->magic = kMagic;

  base_.assign(size, nullptr);
  base_[rank] = b;
  pids_.assign(size, 0);
  pids_[rank] = h->pid;
  pidfds_.assign(size, -1);
}

void ShmTransport::attach(const std::vector<std::string>& names) {
  if (static_cast<int>(names.size()) != size_)
    throw InvalidArgument(str_cat("expected ", size_, " segment names, got ", names.size()));
  peers_.clear();
  peers_.resize(size_);
  for (int r = 0; r < size_; ++r) {
    if (r == rank_) continue;
    ShmSegment seg = ShmSegment::open(names[r], total_bytes_);
    const auto* h = reinterpret_cast<const SegmentHeader*>(seg.data());
    // Never trust a peer's header: everything must match what we computed ourselves.
    if (h->magic != kMagic || h->version != kVersion || h->nranks != static_cast<uint32_t>(size_) ||
        h->rank != static_cast<uint32_t>(r) || h->nslots != static_cast<uint32_t>(nslots_) ||
        h->slot_bytes != slot_bytes_ || h->total_bytes != total_bytes_)
      throw CollectiveError(str_cat("shared memory ", names[r], " of rank ", r,
                                    " has an unexpected header (version, rank or staging sizes "
                                    "differ from this rank's)"));
    base_[r] = seg.data();
    pids_[r] = h->pid;
    pidfds_[r] = open_pidfd(h->pid);
    peers_[r] = std::move(seg);
  }
}

void ShmTransport::set_flight_signal() const {
  reinterpret_cast<SegmentHeader*>(base_[rank_])->flight_signal.store(1, std::memory_order_release);
}

void ShmTransport::ask_peers_for_flight_records() const {
  for (int r = 0; r < size_; ++r) {
    if (r == rank_ || base_[r] == nullptr || !peer_alive(r)) continue;
    const auto* h = reinterpret_cast<const SegmentHeader*>(base_[r]);
    if (h->flight_signal.load(std::memory_order_acquire) != 0)
      kill(static_cast<pid_t>(pids_[r]), SIGUSR1);
  }
}

size_t ShmTransport::channel_offset(int owner, int to) const {
  const int c = to < owner ? to : to - 1;
  return data_offset_ + static_cast<size_t>(c) * nslots_ * slot_bytes_;
}

uint8_t* ShmTransport::slot(int from, int to, uint64_t m) const {
  return base_[from] + channel_offset(from, to) +
         static_cast<size_t>(channel::slot_index(m, nslots_)) * slot_bytes_;
}

uint8_t* ShmTransport::bcast_slot(int from, uint64_t m) const {
  return base_[from] + data_offset_ + static_cast<size_t>(size_ - 1) * nslots_ * slot_bytes_ +
         static_cast<size_t>(channel::slot_index(m, nslots_)) * slot_bytes_;
}

uint8_t* ShmTransport::p2p_request(int from, int to, uint64_t m) const {
  const size_t i = static_cast<size_t>(to) * kP2PRequestSlots + (m - 1) % kP2PRequestSlots;
  return base_[from] + p2p_req_offset_ + i * kP2PRequestBytes;
}

uint8_t* ShmTransport::p2p_slot(int from, int to, uint64_t m) const {
  const size_t i = static_cast<size_t>(to) * nslots_ + channel::slot_index(m, nslots_);
  return base_[from] + p2p_data_offset_ + i * (kP2PHeaderBytes + slot_bytes_);
}

FingerprintSlot& ShmTransport::fingerprint(int owner, uint64_t seq) const {
  return reinterpret_cast<FingerprintSlot*>(base_[owner] +
                                            fingerprints_offset_)[seq % kFingerprintHistory];
}

int ShmTransport::revoker() const {
  for (int r = 0; r < size_; ++r)
    if (r != rank_ && revoked(r).load(std::memory_order_relaxed) != 0) return r;
  return -1;
}

FtSlot& ShmTransport::ft_slot(int owner, uint64_t round) const {
  return *reinterpret_cast<FtSlot*>(base_[owner] + ft_offset_ + (round % 2) * kFtSlotBytes);
}

std::atomic<uint64_t>& ShmTransport::flag(int owner, int index) const {
  return *reinterpret_cast<std::atomic<uint64_t>*>(base_[owner] + flags_offset_ +
                                                   static_cast<size_t>(index) * kCacheLine);
}

}  // namespace pycoll
