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
  allocs_.erase(std::remove_if(allocs_.begin(), allocs_.end(),
                               [](const std::weak_ptr<EmuAllocation>& w) { return w.expired(); }),
                allocs_.end());
  allocs_.push_back(a);
  return a;
}

RegisterHandle Registry::handle(const void* p, size_t bytes) {
  std::lock_guard<std::mutex> g(mu_);
  const uint8_t* q = static_cast<const uint8_t*>(p);
  for (const auto& w : allocs_) {
    const std::shared_ptr<EmuAllocation> a = w.lock();
    if (!a || q < a->data() || q + bytes > a->data() + a->bytes()) continue;
    RegisterHandle h;
    h.key = a->key();
    h.handle = a->sent_ ? std::string() : a->name();
    h.alloc_bytes = a->bytes();
    h.offset = static_cast<uint64_t>(q - a->data());
    h.bytes = bytes;
    a->sent_ = true;
    return h;
  }
  throw InvalidArgument(
      "register: the array is not memory of the emulated device (allocate it with "
      "device_array, empty or zeros)");
}

uint64_t Registry::add(const void* p, size_t bytes, const std::vector<RegisterHandle>& all) {
  if (static_cast<int>(all.size()) != size_)
    throw InvalidArgument("register: one handle per rank expected");
  std::lock_guard<std::mutex> g(mu_);
  const uint8_t* ptr = static_cast<const uint8_t*>(p);
  std::vector<uint8_t*> at(size_, nullptr);
  std::vector<size_t> extent(size_, 0);
  for (int q = 0; q < size_; ++q) {
    const RegisterHandle& h = all[q];
    extent[q] = h.bytes;
    if (q == rank_) {
      at[q] = const_cast<uint8_t*>(ptr);
      continue;
    }
    if (h.offset + h.bytes > h.alloc_bytes)
      throw InvalidArgument(str_cat("register: rank ", q, "'s range leaves its allocation"));
    auto key = std::make_pair(q, h.key);
    auto it = peer_maps_.find(key);
    if (it == peer_maps_.end()) {
      if (h.handle.empty())
        throw CollectiveError(str_cat("register: rank ", q, "'s allocation ", h.key,
                                      " was sent before but is not mapped here"));
      it = peer_maps_.emplace(key, ShmSegment::open(h.handle, std::max<uint64_t>(h.alloc_bytes, 1)))
               .first;
    }
    at[q] = it->second.data() + h.offset;
  }
  std::shared_ptr<EmuAllocation> mine;
  for (const auto& w : allocs_)
    if (const auto a = w.lock(); a && a->data() <= ptr && ptr + bytes <= a->data() + a->bytes())
      mine = a;
  if (!mine) throw InvalidArgument("register: the array's allocation is gone");
  return table_.add(p, bytes, std::move(at), std::move(extent), std::shared_ptr<const void>(mine));
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
