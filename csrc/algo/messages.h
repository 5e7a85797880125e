// What a step does on the wire, and the slot protocol every transport follows: defined once,
// for the host executor, the MPI executor, the CUDA kernel (and its host-compiled emulation),
// the CUDA planner and stepped mode, and, through _C.schedule, the cost model and
// the schedule simulator.
//
// Channels. Each rank has a channel of `nslots` staging slots towards every peer, and one
// broadcast channel that every peer reads. Each side of a channel keeps a monotonic counter
// (never reset, so no ABA):
//   posted    messages the sender has put in the channel        (written by the sender)
//   consumed  messages a receiver has taken out of the channel  (written by the receiver)
// Message m (1-based) uses slot (m - 1) % nslots. A receiver may read it once posted >= m; a
// sender may write it once consumed >= m - nslots (on a broadcast channel, every reader's).
#pragma once

#include <cstdint>

#include "algo/step.h"
#include "common/hd.h"

namespace pycoll {

// Whether a step of this kind takes messages in, sends messages out, reduces what it takes.
PYCOLL_HD_INLINE constexpr bool step_receives(StepKind k) {
  return k != StepKind::Send && k != StepKind::Copy;
}
PYCOLL_HD_INLINE constexpr bool step_sends(StepKind k) {
  return k == StepKind::Send || k == StepKind::RecvReduceSend ||
         k == StepKind::RecvReduceCopySend || k == StepKind::RecvCopySend;
}
PYCOLL_HD_INLINE constexpr bool step_reduces(StepKind k) {
  return k == StepKind::RecvReduceSend || k == StepKind::RecvReduceCopy ||
         k == StepKind::RecvReduceCopySend;
}

// The peers of one step, whatever the step's storage (Step on the host, DevStep on the GPU).
struct StepPeers {
  StepKind kind;
  int from, from2, to, to2;
  bool recv_bcast;  // incoming messages come from the senders' broadcast channels
};

// Calls recv(q) for every peer the step takes a message from, in the order the step consumes
// them (kAllPeers: every other rank in rank order), then send(t) for every channel it puts a
// message in (t == kAllPeers: its own broadcast channel; then `to2`).
template <class Recv, class Send>
PYCOLL_HD_INLINE void for_each_message(const StepPeers& s, int rank, int size, Recv&& recv,
                                       Send&& send) {
  if (step_receives(s.kind)) {
    if (s.from == kAllPeers) {
      for (int q = 0; q < size; ++q)
        if (q != rank) recv(q);
    } else {
      recv(s.from);
      if (s.from2 != kNoPeer) recv(s.from2);
    }
  }
  if (step_sends(s.kind)) {
    send(s.to);
    if (s.to2 != kNoPeer) send(s.to2);
  }
}

inline StepPeers peers_of(const Step& s) {
  return StepPeers{s.kind, s.from, s.from2, s.to, s.to2, s.recv_bcast};
}

namespace channel {

// Slot of message m (1-based) on a channel of `nslots` slots.
PYCOLL_HD_INLINE uint64_t slot_index(uint64_t m, int nslots) {
  return (m - 1) % static_cast<uint64_t>(nslots);
}
// The receiver may read message m once the sender's posted counter has reached this.
PYCOLL_HD_INLINE uint64_t posted_needed(uint64_t m) { return m; }
// The sender may write message m once the receiver's consumed counter has reached this (0:
// the slot has never been used, nothing to wait for).
PYCOLL_HD_INLINE uint64_t consumed_needed(uint64_t m, int nslots) {
  const uint64_t k = static_cast<uint64_t>(nslots);
  return m > k ? m - k : 0;
}

}  // namespace channel

// Messages moved on each channel, by peer: what a rank has sent to / received from each peer
// and on broadcast channels. The next message on a channel is its counter + 1.
// (An aggregate, so that the device may keep one in shared memory: zero it explicitly.)
template <class Vec>
struct MessageCounts {
  Vec sent, received, bcast_received;
  uint64_t bcast_sent;

  PYCOLL_HD uint64_t next_in(int q, bool bcast) const {
    return (bcast ? bcast_received[q] : received[q]) + 1;
  }
  PYCOLL_HD uint64_t next_out(int t) const { return (t == kAllPeers ? bcast_sent : sent[t]) + 1; }
  PYCOLL_HD uint64_t take_in(int q, bool bcast) {
    return bcast ? ++bcast_received[q] : ++received[q];
  }
  PYCOLL_HD uint64_t put_out(int t) { return t == kAllPeers ? ++bcast_sent : ++sent[t]; }
  // Counts the messages of step `s` as moved.
  PYCOLL_HD void advance(const StepPeers& s, int rank, int size) {
    for_each_message(
        s, rank, size, [&](int q) { take_in(q, s.recv_bcast); }, [&](int t) { put_out(t); });
  }
};

}  // namespace pycoll
