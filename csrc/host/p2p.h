// Point-to-point send/recv with tags over the shared-memory transport's p2p channels.
//
// Matching rule: the k-th send of tag t from rank a to rank b pairs with the k-th recv of tag
// t that b posts with source a (MPI's non-overtaking rule without wildcards), so both ends
// can tell which message meets which receive from sequence numbers alone, and different tags
// complete in any order.
//
// Every recv posts a request (tag, count, dtype, receive id, buffer address) on its request
// ring towards the source; the receive id is the request's number on that ring. The sender
// pairs requests with its sends of the same tag, oldest first. Data then moves one of two ways:
//   Eager (at most `eager_max_bytes`, issued before its request arrived): the sender puts
//     header (tag, ordinal k, count, dtype) and payload into one data slot at once, without
//     waiting for the request. The receiver matches it to its k-th recv of that tag, or, when
//     that recv is not posted yet, copies it to a per-peer unexpected queue so the ring keeps
//     flowing (a recv claims eager messages only once its request is out). The send completes once
//     written AND its request has arrived: the request carries the receive's count and dtype, so
//     the sender reaches the same verdict as the receiver without another message, and a mismatch
//     raises CollectiveMismatch on both.
//   Rendezvous (larger, or the request was already there): data streams in pieces whose
//     header names the receive id, offset and length; the receiver copies each piece into the
//     posted buffer. Messages of at least `cma_min_bytes` are instead written straight into
//     the receiver's buffer with process_vm_writev (one copy instead of two), then announced by
//     a header-only piece; where the kernel refuses (EPERM, ENOSYS) that peer falls back to the
//     slots. A mismatch is sent to the receiver as a piece of its own; both sides raise.
// A receiver always drains its data ring (every piece belongs to a posted recv or goes to the
// unexpected queue, at most one slot's payload per message), and a sender only waits for room
// in it, so progress of both ranks suffices for every op to complete.
//
// Progress: the core of runtime/p2p_core.h, as between nodes. A blocking call progresses on the
// calling thread until its own batch is done; asynchronous batches are progressed by the thread
// (no quiet period here: it pauses as a wait does, spinning briefly first).
#pragma once

#include <cstdint>
#include <deque>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "common/dtypes.h"
#include "host/shm_transport.h"
#include "runtime/p2p_core.h"
#include "runtime/wait.h"

namespace pycoll {

class HostComm;
class Work;

// How to use cross-memory attach: Off never, Fail pretend the kernel refused (which exercises
// the fallback to slots).
enum class CmaMode { Use, Off, Fail };

class P2PEngine : P2PProgress<P2PEngine, Backoff> {
 public:
  // Tags from kInternalTag up are the communicator's own (collectives moving large blocks
  // through this engine); users' tags stay below it.
  static constexpr uint64_t kInternalTag = uint64_t{1} << 63;

  // Sends of at most `eager_max_bytes` (capped to one slot) go eagerly.
  P2PEngine(HostComm& comm, const ShmTransport& t, size_t eager_max_bytes, size_t cma_min_bytes,
            CmaMode cma);
  ~P2PEngine();
  P2PEngine(const P2PEngine&) = delete;
  P2PEngine& operator=(const P2PEngine&) = delete;

  // Runs `ops` to completion (rethrows the first error).
  void run(const std::vector<P2POp>& ops);
  // Starts `ops`; the returned Work completes when all of them have.
  std::shared_ptr<Work> start(const std::vector<P2POp>& ops);

 private:
  friend class P2PProgress<P2PEngine, Backoff>;
  using Batch = P2PBatch;
  struct Op : P2POp {
    std::shared_ptr<Batch> batch;
    size_t done_bytes = 0;   // moved so far
    uint64_t ordinal = 0;    // this op is the ordinal-th of its kind, peer and tag (from 1)
    uint64_t recv_id = 0;    // recv: its request's number once posted
    uint64_t flight_id = 0;  // its entry in the communicator's flight recorder (users' ops)
    // Eager send: written into the ring; its request seen, and whether that request fits.
    bool eager = false, written = false, matched = false, mismatch = false;
    uint64_t want_count = 0;  // the matching recv's count and dtype (for the error message)
    DType want_dtype = DType::Float32;
  };
  using OpPtr = std::shared_ptr<Op>;
  struct Request {
    uint64_t id, tag, count, addr;
    DType dtype;
  };
  using Key = std::pair<uint64_t, uint64_t>;  // (tag, ordinal)
  // An eager message that arrived before its recv was posted.
  struct Unexpected {
    uint64_t count;
    DType dtype;
    std::vector<uint8_t> data;
  };
  struct Transfer {
    OpPtr send;
    Request req;
    bool mismatch;
  };
  // What this rank does with one peer.
  struct Peer {
    // As receiver: recvs waiting for room in the request ring; posted recvs by receive id.
    std::deque<OpPtr> unrequested;
    std::unordered_map<uint64_t, OpPtr> awaiting;
    uint64_t requests_posted = 0, pieces_taken = 0;
    // Requested recvs an eager message may still complete, and eager messages no requested
    // recv has claimed yet.
    std::unordered_map<uint64_t, uint64_t> recv_ordinals;  // by tag: recvs posted so far
    std::map<Key, OpPtr> unmatched_recvs;
    std::map<Key, Unexpected> unexpected;
    // As sender: unmatched sends (issue order), unmatched requests (arrival order), matched
    // transfers (streamed in match order).
    std::deque<OpPtr> sends;
    std::deque<Request> requests;
    std::deque<Transfer> transfers;
    std::unordered_map<uint64_t, uint64_t> send_ordinals;  // by tag: sends issued so far
    std::deque<OpPtr> eager_out;                           // eager sends not yet written
    uint64_t requests_taken = 0, pieces_sent = 0;
    bool cma = true;
  };

  // Engine (p2p.cpp), all with mu_ held.
  std::shared_ptr<Batch> enqueue(const std::vector<P2POp>& ops, bool async);
  // The progress core's (runtime/p2p_core.h): one pass over every peer, true if anything
  // moved; a dead peer or an op past its deadline (every 10 ms); a failure of every pending op
  // (the culprit's batch gets the error), which poisons the communicator.
  bool busy() const { return pending_ != 0; }
  size_t pending() const { return pending_; }
  bool move();
  void check_stalled(Clock::time_point now);
  void fail_pending(std::exception_ptr e);
  void complete(const OpPtr& op);
  // Throws E(msg) as the failure of `op` (progress() hands it to that op's batch).
  template <class E>
  [[noreturn]] void raise(const OpPtr& op, const std::string& msg) {
    culprit_ = op;
    throw E(msg);
  }
  void finish(Batch& b);
  void fail_all(const OpPtr& culprit, std::exception_ptr e);

  // Channels (p2p_wire.cpp).
  bool progress_peer(int q, Peer& p);
  bool post_requests(int q, Peer& p);
  bool take_pieces(int q, Peer& p);
  bool take_requests(int q, Peer& p);
  bool stream(int q, Peer& p);
  bool write_direct(int q, Peer& p, Transfer& x);
  void add_send(Peer& p, const OpPtr& send);
  void add_request(int q, Peer& p, const Request& req);

  // Eager messages (p2p_eager.cpp).
  bool write_eager(int q, Peer& p);
  void take_eager(int q, Peer& p, const uint8_t* slot);
  // Delivers an eager message (count x dtype, `data`) into recv `o`, or raises the mismatch.
  void deliver_eager(int q, Peer& p, const OpPtr& o, uint64_t count, DType dtype,
                     const uint8_t* data);
  // An eager send both written and matched completes (or raises its mismatch).
  void settle_eager(int q, const OpPtr& o);
  void complete_recv(Peer& p, const OpPtr& o);

  HostComm& comm_;
  const ShmTransport& t_;
  const size_t eager_max_bytes_;
  const size_t cma_min_bytes_;
  const CmaMode cma_mode_;
  std::vector<Peer> peers_;
  size_t pending_ = 0;  // ops not yet complete
  OpPtr culprit_;       // the op whose failure is being thrown
};

}  // namespace pycoll
