// The fault-tolerant board: what the ranks of a communicator still do together after some of
// them died (Communicator.revoke, agree, shrink).
//
// Revoking: a rank sets the revoked flag of its own segment; every peer's waits and calls check
// the flags (ShmTransport::revoker) and fail with CollectiveError at once, instead of waiting
// out a timeout for a rank that gave up.
//
// Agreeing: round k of the board (every surviving rank runs the same sequence of rounds) posts
// each rank's value and payload in its slot for k (two alternate: a rank finishes round k only
// once every live peer has posted k, so it can be at most one round ahead of any reader), then
// publishes k in its round flag. A rank takes part in round k when it posted k; it is left out
// when its process has exited without posting k. Posting is never undone and an exited rank's
// segment no longer changes, so every survivor sees the same ranks take part and the same
// values: a peer's liveness is read before its round flag, so "exited, not posted" is final.
// A rank that posted and then died takes part in that round and is left out of the next.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "host/shm_transport.h"
#include "runtime/wait.h"

namespace pycoll {

struct BoardEntry {
  int rank;
  uint64_t value;
  std::string payload;
};

// Payload bytes one rank may post in a round.
constexpr size_t kBoardPayloadBytes = sizeof(FtSlot::payload);

class FaultBoard {
 public:
  explicit FaultBoard(const ShmTransport& t) : t_(t) {}

  // Posts (value, payload) for the next round and waits until every peer has posted it or
  // exited; the entries of the ranks that took part, by rank. Waits at most `timeout_s` for a
  // live peer (CollectiveTimeout naming it); never fails because the communicator was revoked
  // or poisoned.
  std::vector<BoardEntry> exchange(uint64_t value, const std::string& payload, double timeout_s);

  // Sets this rank's revoked flag.
  void revoke() const;

 private:
  const ShmTransport& t_;
};

}  // namespace pycoll
