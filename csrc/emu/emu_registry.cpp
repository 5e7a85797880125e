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
    h.name = a->sent_ ? std::string() : a->name();
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
  Registration r;
  r.id = next_id_++;
  r.ptr = static_cast<const uint8_t*>(p);
  r.bytes = bytes;
  r.at.assign(size_, nullptr);
  r.extent.assign(size_, 0);
  for (int q = 0; q < size_; ++q) {
    const RegisterHandle& h = all[q];
    r.extent[q] = h.bytes;
    if (q == rank_) {
      r.at[q] = const_cast<uint8_t*>(r.ptr);
      continue;
    }
    auto key = std::make_pair(q, h.key);
    auto it = peer_maps_.find(key);
    if (it == peer_maps_.end()) {
      if (h.name.empty())
        throw CollectiveError(str_cat("register: rank ", q, "'s allocation ", h.key,
                                      " was sent before but is not mapped here"));
      it = peer_maps_.emplace(key, ShmSegment::open(h.name, std::max<uint64_t>(h.alloc_bytes, 1)))
               .first;
    }
    if (h.offset + h.bytes > h.alloc_bytes)
      throw InvalidArgument(str_cat("register: rank ", q, "'s range leaves its allocation"));
    r.at[q] = it->second.data() + h.offset;
  }
  for (const auto& w : allocs_)
    if (const auto a = w.lock(); a && a->data() <= r.ptr && r.ptr + bytes <= a->data() + a->bytes())
      r.alloc = a;
  regs_.erase(std::remove_if(regs_.begin(), regs_.end(),
                             [](const Registration& x) { return x.alloc.expired(); }),
              regs_.end());
  regs_.push_back(std::move(r));
  return regs_.back().id;
}

void Registry::unlink_exchanged() {
  std::lock_guard<std::mutex> g(mu_);
  for (const auto& w : allocs_)
    if (const auto a = w.lock(); a && a->sent_ && !a->unlinked_) {
      a->seg_.unlink();
      a->unlinked_ = true;
    }
}

Registered Registry::find(const void* p, size_t bytes) const {
  std::lock_guard<std::mutex> g(mu_);
  const uint8_t* q = static_cast<const uint8_t*>(p);
  Registered out;
  for (auto it = regs_.rbegin(); it != regs_.rend(); ++it) {
    const Registration& r = *it;
    if (r.alloc.expired() || q < r.ptr || q + bytes > r.ptr + r.bytes) continue;
    const size_t delta = static_cast<size_t>(q - r.ptr);
    for (int k = 0; k < size_; ++k)
      if (delta + bytes > r.extent[k]) return out;
    out.on = true;
    out.id = r.id;
    out.delta = delta;
    for (int k = 0; k < size_; ++k) out.at.push_back(r.at[k] + delta);
    return out;
  }
  return out;
}

size_t Registry::live() const {
  std::lock_guard<std::mutex> g(mu_);
  return static_cast<size_t>(std::count_if(
      regs_.begin(), regs_.end(), [](const Registration& r) { return !r.alloc.expired(); }));
}

}  // namespace emu
}  // namespace pycoll
