// FNV-1a over 64-bit words, a byte at a time (low byte first): the one hash of what ranks must
// agree on (uneven counts in fingerprints, the tags of messages between nodes, the keys of
// cached GPU plans).
#pragma once

#include <cstdint>

namespace pycoll {

struct Fnv1a {
  uint64_t h = 1469598103934665603ull;
  void mix(uint64_t v) {
    for (int i = 0; i < 8; ++i, v >>= 8) h = (h ^ (v & 0xff)) * 1099511628211ull;
  }
};

}  // namespace pycoll
