// Registered buffers, whatever maps them: which range every rank registered, as this process
// maps it. Shared by the CUDA transport (cuda/registry.h: CUDA IPC) and the emulated device
// (emu/emu_registry.h: POSIX shared memory), whose registries map the peers' memory and keep
// one of these tables of what has been registered.
//
// Registering is collective: every rank registers a range of its own memory, in the same order
// as its peers, so a registration has the same number everywhere. A call's buffer may lie
// anywhere in a registration (the same offset on every rank: the call's fingerprint says which
// registration and offset, so ranks that disagree raise CollectiveMismatch).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "common/errors.h"

namespace pycoll {

// What one rank tells the others when it registers a range.
struct RegisterHandle {
  uint64_t key = 0;    // its allocation's, unique in its process
  std::string handle;  // what maps the allocation (an IPC handle, a name); empty when sent before
  uint64_t alloc_bytes = 0;  // the whole allocation's
  uint64_t offset = 0;       // of the range in the allocation
  uint64_t bytes = 0;        // of the range
};

// Where a call's buffer lies in every rank's registered memory.
struct Registered {
  bool on = false;
  uint64_t id = 0;           // the registration's number, the same on every rank
  uint64_t delta = 0;        // of the buffer from the registration's start
  std::vector<uint8_t*> at;  // every rank's buffer as mapped here (ours at our rank)
};

// A registry's own allocations (weak: each lives as long as an array over it), of a type with
// data() and bytes(): `add` forgets the expired ones and keeps `a`; `holding` is the live one
// that holds [p, p + bytes), or null.
template <class A>
void add_live(std::vector<std::weak_ptr<A>>& list, std::shared_ptr<A> a) {
  list.erase(std::remove_if(list.begin(), list.end(),
                            [](const std::weak_ptr<A>& w) { return w.expired(); }),
             list.end());
  list.push_back(std::move(a));
}
template <class A>
std::shared_ptr<A> holding(const std::vector<std::weak_ptr<A>>& list, const void* p, size_t bytes) {
  const uint8_t* q = static_cast<const uint8_t*>(p);
  for (const auto& w : list)
    if (auto a = w.lock(); a && a->data() <= q && q + bytes <= a->data() + a->bytes()) return a;
  return nullptr;
}

// Every rank's registered range as mapped here (`at`, `extent`), from every rank's handle:
// ours at `p`, a peer's at `map(q, h)` (the base of its allocation as mapped here, opened or
// mapped by the transport when the handle carries one) plus its offset. The handles are
// checked first: one per rank, each range inside its allocation.
template <class Map>
void ranges_of(const void* p, const std::vector<RegisterHandle>& all, int rank, int size, Map&& map,
               std::vector<uint8_t*>& at, std::vector<size_t>& extent) {
  if (static_cast<int>(all.size()) != size)
    throw InvalidArgument("register: one handle per rank expected");
  at.assign(size, nullptr);
  extent.assign(size, 0);
  for (int q = 0; q < size; ++q) {
    const RegisterHandle& h = all[q];
    extent[q] = h.bytes;
    if (q == rank) {
      at[q] = const_cast<uint8_t*>(static_cast<const uint8_t*>(p));
      continue;
    }
    if (h.offset + h.bytes > h.alloc_bytes)
      throw InvalidArgument(str_cat("register: rank ", q, "'s range leaves its allocation"));
    at[q] = map(q, h) + h.offset;
  }
}

class Registrations {
 public:
  explicit Registrations(int size) : size_(size) {}
  // Records a registration of [p, p + bytes) here, at `at[q]` (extent[q] bytes) on rank q as
  // mapped here; it lapses when `alive` expires (or on drop). Returns its number.
  uint64_t add(const void* p, size_t bytes, std::vector<uint8_t*> at, std::vector<size_t> extent,
               std::weak_ptr<const void> alive);
  void drop(uint64_t id);
  // The latest live registration holding [p, p + bytes) here, and every rank's buffer at the
  // same offset; off when there is none, or when a peer's range is shorter.
  Registered find(const void* p, size_t bytes) const;
  size_t live() const;

 private:
  struct Entry {
    uint64_t id;
    const uint8_t* ptr;
    size_t bytes;
    std::weak_ptr<const void> alive;
    std::vector<uint8_t*> at;
    std::vector<size_t> extent;
  };
  int size_;
  uint64_t next_id_ = 1;
  std::vector<Entry> entries_;
  mutable std::mutex mu_;
};

}  // namespace pycoll
