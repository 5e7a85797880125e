#include "runtime/registrations.h"

#include <algorithm>
#include <utility>

#include "common/errors.h"

namespace pycoll {

uint64_t Registrations::add(const void* p, size_t bytes, std::vector<uint8_t*> at,
                            std::vector<size_t> extent, std::weak_ptr<const void> alive) {
  if (static_cast<int>(at.size()) != size_ || static_cast<int>(extent.size()) != size_)
    throw InvalidArgument("register: one range per rank expected");
  std::lock_guard<std::mutex> g(mu_);
  entries_.erase(std::remove_if(entries_.begin(), entries_.end(),
                                [](const Entry& e) { return e.alive.expired(); }),
                 entries_.end());
  entries_.push_back(Entry{next_id_++, static_cast<const uint8_t*>(p), bytes, std::move(alive),
                           std::move(at), std::move(extent)});
  return entries_.back().id;
}

void Registrations::drop(uint64_t id) {
  std::lock_guard<std::mutex> g(mu_);
  entries_.erase(
      std::remove_if(entries_.begin(), entries_.end(), [&](const Entry& e) { return e.id == id; }),
      entries_.end());
}

Registered Registrations::find(const void* p, size_t bytes) const {
  std::lock_guard<std::mutex> g(mu_);
  const uint8_t* q = static_cast<const uint8_t*>(p);
  Registered out;
  for (auto it = entries_.rbegin(); it != entries_.rend(); ++it) {
    const Entry& e = *it;
    if (e.alive.expired() || q < e.ptr || q + bytes > e.ptr + e.bytes) continue;
    const size_t delta = static_cast<size_t>(q - e.ptr);
    for (int k = 0; k < size_; ++k)
      if (delta + bytes > e.extent[k]) return out;
    out.on = true;
    out.id = e.id;
    out.delta = delta;
    for (int k = 0; k < size_; ++k) out.at.push_back(e.at[k] + delta);
    return out;
  }
  return out;
}

size_t Registrations::live() const {
  std::lock_guard<std::mutex> g(mu_);
  return static_cast<size_t>(std::count_if(entries_.begin(), entries_.end(),
                                           [](const Entry& e) { return !e.alive.expired(); }));
}

}  // namespace pycoll
