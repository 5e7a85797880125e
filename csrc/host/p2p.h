// Point-to-point send/recv with tags over the shared-memory transport's p2p channels.
//
// Protocol (receiver-driven, so nothing is ever buffered beyond the fixed slots):
//   1. A recv posts a request (tag, count, dtype, receive id, buffer address) on its request
//      ring towards the source. The receive id is the request's number on that ring.
//   2. The sender takes requests in order and matches each to its oldest unmatched send of the
//      same tag (and a new send to the oldest unmatched request of its tag), so messages of one
//      pair and tag are never overtaken, while different tags complete in any order.
//   3. A matched pair is checked (count and dtype); a mismatch is sent to the receiver as a
//      piece of its own, and both sides raise CollectiveMismatch.
//   4. Data streams through the sender->receiver data ring in pieces whose header names the
//      receive id, offset and length; the receiver copies each piece into the posted buffer.
//      Messages of at least `cma_min_bytes` are instead written straight into the receiver's
//      buffer with process_vm_writev (one copy instead of two), then announced by a header-only
//      piece; where the kernel refuses (EPERM, ENOSYS) that peer falls back to the slots.
// A receiver always drains its data ring (every piece belongs to a posted recv), and a sender
// only waits for room in it, so progress of both ranks suffices for every op to complete.
//
// Progress: one thread at a time (mu_) advances every pending op of the rank. A blocking call
// progresses until its own batch is done; asynchronous batches are progressed by a thread
// started on first use, which sleeps while nothing is pending and stands aside while a
// blocking call progresses.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "common/dtypes.h"
#include "host/shm_transport.h"
#include "host/wait.h"

namespace pycoll {

class HostComm;
class Work;

enum class P2PKind { Send, Recv };

// One operation of a batch, validated by the caller.
struct P2POp {
  P2PKind kind = P2PKind::Send;
  uint8_t* buf = nullptr;
  size_t count = 0;
  DType dtype = DType::Float32;
  int peer = 0;
  uint64_t tag = 0;
};

// How to use cross-memory attach: Off never, Fail pretend the kernel refused (which exercises
// the fallback to slots).
enum class CmaMode { Use, Off, Fail };

class P2PEngine {
 public:
  P2PEngine(HostComm& comm, const ShmTransport& t, size_t cma_min_bytes, CmaMode cma);
  ~P2PEngine();
  P2PEngine(const P2PEngine&) = delete;
  P2PEngine& operator=(const P2PEngine&) = delete;

  // Runs `ops` to completion (rethrows the first error).
  void run(const std::vector<P2POp>& ops);
  // Starts `ops`; the returned Work completes when all of them have.
  std::shared_ptr<Work> start(const std::vector<P2POp>& ops);

 private:
  // Ops submitted together; complete when all of theirs are.
  struct Batch {
    size_t remaining = 0;
    bool done = false;
    std::exception_ptr error;
    std::shared_ptr<Work> work;  // asynchronous batches only
    Clock::time_point deadline;
    double timeout_s = 0;
  };
  struct Op : P2POp {
    std::shared_ptr<Batch> batch;
    size_t done_bytes = 0;  // moved so far
    size_t bytes() const { return count * dtype_size(dtype); }
    std::string describe() const;  // "send to rank 1 (tag 3, 10 x float32)"
  };
  using OpPtr = std::shared_ptr<Op>;
  struct Request {
    uint64_t id, tag, count, addr;
    DType dtype;
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
    // As sender: unmatched sends (issue order), unmatched requests (arrival order), matched
    // transfers (streamed in match order).
    std::deque<OpPtr> sends;
    std::deque<Request> requests;
    std::deque<Transfer> transfers;
    uint64_t requests_taken = 0, pieces_sent = 0;
    bool cma = true;
  };

  // Engine (p2p.cpp), all with mu_ held.
  std::shared_ptr<Batch> enqueue(const std::vector<P2POp>& ops, bool async);
  // One pass over every peer; true if anything moved. Errors poison the communicator and fail
  // every pending op.
  bool progress();
  void complete(const OpPtr& op);
  void check_stalled();
  // Throws E(msg) as the failure of `op` (progress() hands it to that op's batch).
  template <class E>
  [[noreturn]] void raise(const OpPtr& op, const std::string& msg) {
    culprit_ = op;
    throw E(msg);
  }
  void finish(Batch& b);
  void fail_all(const OpPtr& culprit, std::exception_ptr e);
  void progress_loop();

  // Channels (p2p_wire.cpp).
  bool progress_peer(int q, Peer& p);
  bool post_requests(int q, Peer& p);
  bool take_pieces(int q, Peer& p);
  bool take_requests(int q, Peer& p);
  bool stream(int q, Peer& p);
  bool write_direct(int q, Peer& p, Transfer& x);
  void add_send(Peer& p, const OpPtr& send);
  void add_request(Peer& p, const Request& req);

  HostComm& comm_;
  const ShmTransport& t_;
  const size_t cma_min_bytes_;
  const CmaMode cma_mode_;
  std::vector<Peer> peers_;
  size_t pending_ = 0;  // ops not yet complete
  OpPtr culprit_;       // the op whose failure is being thrown
  Clock::time_point next_check_;

  std::mutex mu_;  // one thread progresses at a time
  std::condition_variable cv_;
  int blocking_ = 0;  // blocking calls progressing now
  bool stopping_ = false;
  std::thread thread_;
};

}  // namespace pycoll
