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

double SlotStorePolicy::Class::median() const {
  std::array<double, 3> r = recent;
  if (r[2] == 0) return r[1] == 0 ? r[0] : (r[0] + r[1]) / 2;
  std::sort(r.begin(), r.end());
  return r[1];
}

SlotStorePolicy::Class* SlotStorePolicy::find(uint32_t kind, size_t bytes) {
  if (mode_ != SlotStores::Auto || bytes < kMinBytes) return nullptr;
  return &classes_[kind << 8 | size_class(bytes)];
}

bool SlotStorePolicy::choose(uint32_t kind, size_t bytes) {
  if (mode_ != SlotStores::Auto) return mode_ == SlotStores::Streamed;
  Class* k = find(kind, bytes);
  if (k == nullptr) return false;
  if (k->recent[0] == 0) return k->streamed;  // the kept way first
  const bool probe = k->other == 0 || k->probe_now || k->since_probe + 1 >= k->probe_every;
  return probe ? !k->streamed : k->streamed;
}

void SlotStorePolicy::record(uint32_t kind, size_t bytes, bool streamed, double seconds) {
  Class* k = find(kind, bytes);
  if (k == nullptr || seconds <= 0) return;
  if (streamed == k->streamed) {
    k->recent[k->next] = seconds;
    k->next = (k->next + 1) % k->recent.size();
    ++k->since_probe;
    if (k->at_probe > 0 && k->median() > kDrift * k->at_probe) k->probe_now = true;
    return;
  }
  // A probe of the other way (the first: its first measurement).
  const double kept = k->median();
  const bool first = k->other == 0;
  k->other = seconds;
  k->probe_now = false;
  k->since_probe = 0;
  if (seconds < kWin * kept) {
    k->streamed = streamed;
    k->other = kept;
    k->recent = {seconds, 0, 0};
    k->next = 1;
    k->probe_every = kFirstProbe;
    k->at_probe = seconds;
  } else {
    if (!first) k->probe_every = std::min(2 * k->probe_every, kMaxProbe);
    k->at_probe = kept;
  }
}

}  // namespace pycoll
