#include "emu/emu_registry.h"

#include <algorithm>

#include "common/errors.h"

namespace pycoll {
namespace emu {

EmuAllocation::EmuAllocation(uint64_t key, size_t bytes)
    : key_(key),
      bytes_(bytes),
      seg_(ShmSegment::create("pycoll-emureg", std::max<size_t>(bytes, 1))) {}

std::shared_ptr<EmuAllocation> Registry::alloc(size_t bytes) {
  std::lock_guard<std::mutex> g(mu_);
  auto a = std::make_shared<EmuAllocation>(next_key_++, bytes);
  add_live(allocs_, a);
  return a;
}

RegisterHandle Registry::handle(const void* p, size_t bytes) {
  std::lock_guard<std::mutex> g(mu_);
  const std::shared_ptr<EmuAllocation> a = holding(allocs_, p, bytes);
  if (!a)
    throw InvalidArgument(
        "register: the array is not memory of the emulated device (allocate it with "
        "device_array, empty or zeros)");
  RegisterHandle h;
  h.key = a->key();
  h.handle = a->sent_ ? std::string() : a->name();
  h.alloc_bytes = a->bytes();
  h.offset = static_cast<uint64_t>(static_cast<const uint8_t*>(p) - a->data());
  h.bytes = bytes;
  a->sent_ = true;
  return h;
}

uint64_t Registry::add(const void* p, size_t bytes, const std::vector<RegisterHandle>& all) {
  std::lock_guard<std::mutex> g(mu_);
  const uint8_t* ptr = static_cast<const uint8_t*>(p);
  std::vector<uint8_t*> at;
  std::vector<size_t> extent;
  ranges_of(
      p, all, rank_, size_,
      [&](int q, const RegisterHandle& h) {
        auto key = std::make_pair(q, h.key);
        auto it = peer_maps_.find(key);
        if (it == peer_maps_.end()) {
          if (h.handle.empty())
            throw CollectiveError(str_cat("register: rank ", q, "'s allocation ", h.key,
                                          " was sent before but is not mapped here"));
          it = peer_maps_
                   .emplace(key, ShmSegment::open(h.handle, std::max<uint64_t>(h.alloc_bytes, 1)))
                   .first;
        }
        return it->second.data();
      },
      at, extent);
  const std::shared_ptr<EmuAllocation> mine = holding(allocs_, ptr, bytes);
  if (!mine) throw InvalidArgument("register: the array's allocation is gone");
  return table_.add(p, bytes, std::move(at), std::move(extent), std::shared_ptr<const void>(mine));
}

std::shared_ptr<EmuAllocation> Registry::allocation_of(const void* p, size_t bytes) const {
  std::lock_guard<std::mutex> g(mu_);
  return holding(allocs_, p, bytes);
}

void Registry::unlink_key(uint64_t key) {
  std::lock_guard<std::mutex> g(mu_);
  for (const auto& w : allocs_)
    if (const auto a = w.lock(); a && a->key() == key) {
      a->seg_.unlink();
      a->unlinked_ = true;
    }
}

void Registry::unlink_exchanged() {
  std::lock_guard<std::mutex> g(mu_);
  for (const auto& w : allocs_)
    if (const auto a = w.lock(); a && a->sent_ && !a->unlinked_) {
      a->seg_.unlink();
      a->unlinked_ = true;
    }
}

}  // namespace emu
}  // namespace pycoll
