// The layout of point-to-point requests and data-slot headers (the protocol is in p2p.h).
#pragma once

#include <cstdint>

#include "host/shm_transport.h"

namespace pycoll {
namespace p2p_wire {

// A recv posted towards its source (one request slot).
struct Request {
  uint64_t id, tag, count, addr;
  uint32_t dtype, pad;
  uint64_t pad2[3];
};
static_assert(sizeof(Request) == kP2PRequestBytes, "request slot");

enum PieceKind : uint32_t { kData = 1, kWritten = 2, kMismatch = 3, kEager = 4 };

// The header of a data slot. kData: `length` bytes at `offset` of receive `id` follow.
// kWritten: the sender has written all `length` bytes into the receive buffer itself.
// kMismatch: the sender's send (`count` x `dtype`) does not fit receive `id`; no data follows.
// kEager: a whole message of `count` x `dtype` (`length` bytes) follows, for the
// `ordinal`-th recv of `tag` (no receive id: the sender has not seen the request).
struct PieceHeader {
  uint64_t id, offset, length, count;
  uint32_t kind, dtype;
  uint64_t tag, ordinal, pad;
};
static_assert(sizeof(PieceHeader) == kP2PHeaderBytes, "piece header");

}  // namespace p2p_wire
}  // namespace pycoll
