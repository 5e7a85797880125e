// Registration on first use: a collective on device arrays that no one registered (a cupy array
// from cupy's pool, a torch tensor from its caching allocator) runs zero-copy over every rank's
// buffers all the same, as registered buffers do (run_registered), once each rank has mapped the
// allocations its peers' buffers lie in.
//
// A call that may (first_use_eligible: a function of the call alone, so every rank decides
// alike) trades, per rank, where its input and output lie: which allocation (its key, unique in
// the process for as long as it runs: CUDA's buffer id, the emulated device's allocation number),
// its base and size, the buffer's offset in it, and the allocation's handle (a CUDA IPC handle, a
// segment's name) the first time that allocation goes out. The rows go through the host
// (runtime/splits.h, exchange_rows), after the fingerprints. From the same rows every rank makes
// the same decision: zero-copy where every rank's buffers lie in allocations it can share, else
// the staged path everywhere. A rank then maps each peer's allocation once (PeerMappings, keyed
// by rank and key) and keeps the mapping for later calls.
//
// Allocations are freed and made again at the same address all the time (an allocator's segment
// released and reserved again): the key, not the address, names an allocation. A new key for an
// allocation of a rank that overlaps a mapping of that rank means the mapped one was freed: the
// mapping is dropped. What this rank has sent is remembered by base and key
// (SentAllocations), so that a new allocation at an old address goes out with its handle.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "algo/call.h"
#include "common/errors.h"
#include "device/stepped.h"

namespace pycoll {
namespace cuda {

// The fingerprint's first "where" word of a call registered on first use (a collective
// registration's number is never this), so that ranks that disagree on trading rows raise
// CollectiveMismatch instead of waiting for rows that never come.
constexpr uint64_t kFirstUseWhere = ~uint64_t{0};

constexpr size_t kHandleMax = 64;  // a cudaIpcMemHandle_t, a segment's name

// Where one rank's buffer lies, as it tells its peers.
struct BufferRecord {
  uint64_t key = 0;  // its allocation's (0: not an allocation peers can map)
  uint64_t base = 0;
  uint64_t alloc_bytes = 0;
  uint64_t offset = 0;        // of the buffer in the allocation
  uint32_t handle_bytes = 0;  // 0: sent before
  uint32_t unused = 0;
  uint8_t handle[kHandleMax] = {};

  std::string handle_string() const {
    return std::string(reinterpret_cast<const char*>(handle), handle_bytes);
  }
};

// One rank's row of a call: its input's and its output's records.
struct FirstUseRow {
  BufferRecord in, out;
};
static_assert(sizeof(FirstUseRow) <= 256, "a row must fit ShmTransport's (kMinRowBytes)");

// Whether `call` trades rows to run over buffers registered on first use: a call that would run
// over registered buffers where they are (registered_eligible) of at least `min_bytes` (0: off),
// outside a capture (a graph replays pointers it cannot trade anew).
inline bool first_use_eligible(const CollectiveCall& call, Algo algo, size_t min_bytes,
                               bool capturing) {
  return min_bytes != 0 && !capturing && registered_eligible(call, algo) &&
         call.bytes() >= min_bytes;
}

// Which of a call's buffers must lie in a shared allocation on every rank: its input always; its
// output unless only its own rank writes it (reduce-scatter, all-gather).
inline bool first_use_needs_output(const CollectiveCall& call) {
  return call.collective != Collective::ReduceScatter && call.collective != Collective::AllGather;
}

// The allocations this rank has sent the handle of, by base: a key at a base is sent once.
class SentAllocations {
 public:
  bool sent(uint64_t base, uint64_t key) const {
    const auto it = by_base_.find(base);
    return it != by_base_.end() && it->second == key;
  }
  // Every peer has it now (a call over it ran zero-copy: each mapped it).
  void add(uint64_t base, uint64_t key) { by_base_[base] = key; }
  size_t size() const { return by_base_.size(); }

 private:
  std::map<uint64_t, uint64_t> by_base_;
};

// The peers' allocations mapped here, `M` being what maps one (closed when destroyed), by rank
// and key.
template <class M>
class PeerMappings {
 public:
  explicit PeerMappings(int size) : by_rank_(size) {}

  // Rank q's allocation of record `r` as mapped here: the mapping made before, else the one
  // `open(handle, bytes)` makes (returning {M, mapped base}) from the handle the record carries.
  template <class Open>
  uint8_t* map(int q, const BufferRecord& r, Open&& open) {
    std::vector<Entry>& list = by_rank_[q];
    for (const Entry& e : list)
      if (e.key == r.key) return e.here;
    if (r.handle_bytes == 0)
      throw CollectiveError(
          str_cat("rank ", q, "'s allocation ", r.key, " was sent before but is not mapped here"));
    // The allocations this one overlaps in rank q's memory were freed: their mappings go.
    list.erase(std::remove_if(list.begin(), list.end(),
                              [&](const Entry& e) {
                                return e.base < r.base + r.alloc_bytes && r.base < e.base + e.bytes;
                              }),
               list.end());
    auto [m, here] = open(r.handle_string(), r.alloc_bytes);
    list.push_back(Entry{r.key, r.base, r.alloc_bytes, here, std::move(m)});
    ++opened_;
    return here;
  }
  uint64_t opened() const { return opened_; }  // mappings made, ever
  size_t live() const {
    size_t n = 0;
    for (const auto& list : by_rank_) n += list.size();
    return n;
  }
  void clear() {
    for (auto& list : by_rank_) list.clear();
  }

 private:
  struct Entry {
    uint64_t key, base, bytes;
    uint8_t* here;
    M mapping;
  };
  std::vector<std::vector<Entry>> by_rank_;
  uint64_t opened_ = 0;
};

// The call over every rank's buffers from every rank's row (`rows`, rank after rank), or off
// where some rank's buffer lies in no allocation it can share (every rank decides alike, from
// the same rows). `map(q, record)` is rank q's allocation as mapped here.
template <class Map>
RegisteredCall first_use_call(const CollectiveCall& call, const FirstUseRow* rows, int rank,
                              int size, Map&& map) {
  RegisteredCall t;
  const bool needs_out = first_use_needs_output(call);
  for (int q = 0; q < size; ++q)
    if (rows[q].in.key == 0 || (needs_out && rows[q].out.key == 0)) return t;
  auto at = [&](int q, const BufferRecord& r, const void* ours) -> uint8_t* {
    if (q == rank) return const_cast<uint8_t*>(static_cast<const uint8_t*>(ours));
    return map(q, r) + r.offset;
  };
  t.in.resize(size);
  t.out.assign(size, nullptr);
  for (int q = 0; q < size; ++q) {
    t.in[q] = at(q, rows[q].in, call.in);
    if (needs_out) t.out[q] = at(q, rows[q].out, call.out);
  }
  t.out[rank] = static_cast<uint8_t*>(call.out);
  t.where[0] = kFirstUseWhere;
  t.on = true;
  return t;
}

// The record of [p, p + bytes) in an allocation {key, base, alloc_bytes} (key 0: none), with its
// handle from `handle()` where this rank has not sent it.
template <class Handle>
BufferRecord buffer_record(const void* p, size_t bytes, uint64_t key, uint64_t base,
                           uint64_t alloc_bytes, const SentAllocations& sent, Handle&& handle) {
  BufferRecord r;
  const uint64_t at = reinterpret_cast<uintptr_t>(p);
  if (key == 0 || p == nullptr || at < base || at + bytes > base + alloc_bytes) return r;
  r.key = key;
  r.base = base;
  r.alloc_bytes = alloc_bytes;
  r.offset = at - base;
  if (!sent.sent(base, key)) {
    const std::string h = handle();
    if (h.empty() || h.size() > kHandleMax) return BufferRecord{};  // cannot be shared
    r.handle_bytes = static_cast<uint32_t>(h.size());
    std::memcpy(r.handle, h.data(), h.size());
  }
  return r;
}

}  // namespace cuda
}  // namespace pycoll
