#include "host/slot_stores.h"

#include <algorithm>

#include "common/errors.h"

namespace pycoll {

const char* slot_stores_name(SlotStores s) {
  return s == SlotStores::Auto ? "auto" : s == SlotStores::Cached ? "cached" : "streamed";
}

SlotStores parse_slot_stores(const std::string& name) {
  for (SlotStores s : {SlotStores::Auto, SlotStores::Cached, SlotStores::Streamed})
    if (name == slot_stores_name(s)) return s;
  throw InvalidArgument(
      str_cat("slot stores must be \"auto\", \"cached\" or \"streamed\", got \"", name, "\""));
}

namespace {

constexpr double kWin = 0.9;    // a probe must beat the kept way by 10%
constexpr double kDrift = 1.3;  // the kept way slowed by 30% since the last probe

// Size classes are powers of two: a call of `bytes` falls in class floor(log2(bytes)).
uint32_t size_class(size_t bytes) {
  uint32_t c = 0;
  while (bytes >>= 1) ++c;
  return c;
}

}  // namespace

double SlotStorePolicy::Times::fastest() const {
  const uint32_t n = std::min<uint32_t>(count, t.size());
  return n == 0 ? 0 : *std::min_element(t.begin(), t.begin() + n);
}

SlotStorePolicy::Class* SlotStorePolicy::find(uint32_t kind, size_t bytes) {
  if (mode_ != SlotStores::Auto || bytes < kMinBytes) return nullptr;
  return &classes_[kind << 8 | size_class(bytes)];
}

bool SlotStorePolicy::choose(uint32_t kind, size_t bytes) {
  if (mode_ != SlotStores::Auto) return mode_ == SlotStores::Streamed;
  const Class* k = find(kind, bytes);
  return k != nullptr && k->next_streamed();
}

void SlotStorePolicy::record(uint32_t kind, size_t bytes, bool streamed, double seconds) {
  Class* k = find(kind, bytes);
  if (k == nullptr || seconds <= 0 || streamed != k->next_streamed()) return;
  if (!k->probing) {
    k->kept.add(seconds);
    ++k->since_probe;
    const bool slowed = k->probed && k->kept.full() && k->kept.fastest() > kDrift * k->at_probe;
    k->probing = k->kept.full() && (!k->probed || slowed || k->since_probe >= k->probe_every);
    return;
  }
  k->probe.add(seconds);
  if (!k->probe.full()) return;
  const double kept = k->kept.fastest(), other = k->probe.fastest();
  if (other < kWin * kept) {
    k->streamed = !k->streamed;
    k->kept = k->probe;
    k->probe_every = kFirstProbe;
    k->at_probe = other;
  } else {
    if (k->probed) k->probe_every = std::min(2 * k->probe_every, kMaxProbe);
    k->at_probe = kept;
  }
  k->probe = Times{};
  k->probing = false;
  k->probed = true;
  k->since_probe = 0;
}

}  // namespace pycoll
