// Point-to-point messages between nodes, over MPI, that progress on their own.
//
// Every send and receive is posted the moment it is issued and moves as soon as its peer's
// side is posted, whatever order the program waits in (MPI's progress rule: a cycle of sends
// never blocks). Each kind of MPI message has a communicator of its own (so they never meet
// the collectives' traffic), and a message's carry the caller's tag:
//   header  (count, dtype, inline)  sender -> receiver, posted with the send; a message of at
//                                   most `inline_bytes` rides in it, after the three numbers;
//   data    (the bytes)             sender -> receiver, posted with a larger send;
//   verdict (fits, count, dtype)    receiver -> sender, once the receiver has read a larger
//                                   send's header;
//   poison  (who, tag, both shapes) receiver -> sender, only where an inline message did not
//                                   fit (tag 0).
// A receive posts its header receive at once, with room for the largest inline message. An
// inline message is copied into the caller's array when count and dtype agree: its send
// completes once MPI has it, with no answer awaited (a small message costs one MPI message,
// as MPI's own eager send). Where it does not fit, the receiver raises CollectiveMismatch and
// poisons the sender, whose engine fails every operation from then on with the same
// description (its send had already completed, as an MPI send whose receive is truncated).
// A larger send's header makes the receiver post the data receive: into the caller's array
// when count and dtype agree, else into scratch space, so a mismatch corrupts nothing; that
// send completes with its verdict (both ends raise CollectiveMismatch), the receive with its
// data. Between one pair with one tag, messages match in issue order: MPI's non-overtaking
// rule for headers and data, and data receives posted in the order their headers were posted.
// Different tags complete in any order.
//
// Progress: the core of runtime/p2p_core.h, as within a node. A thread waiting on a batch
// progresses while it waits; otherwise the progress thread does, once the program has made no
// call for a moment (it covers the time the program spends elsewhere: computing, inside a
// collective), sleeping between passes. Each batch has a deadline (the timeout when it was
// issued). An error (timeout, mismatch, abort, MPI failure) poisons the engine and fails every
// pending operation.
#pragma once

#include <mpi.h>

#include <atomic>
#include <cstdint>
#include <deque>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "common/dtypes.h"
#include "runtime/p2p_core.h"
#include "runtime/wait.h"

namespace pycoll {

// The operations' `peer` is an MPI rank of the engine's communicator.
class NetP2P : P2PProgress<NetP2P, Sleeper> {
 public:
  // Collective over `comm` (which must outlive this engine): duplicates it four times.
  // Messages of more than `block_bytes` are described to MPI as blocks of that size and a tail
  // (MPI counts are ints).
  // Messages of at most `inline_bytes` ride in their header.
  NetP2P(MPI_Comm comm, double timeout_s, size_t block_bytes = size_t{1} << 30,
         size_t inline_bytes = kDefaultInlineBytes);
  static constexpr size_t kDefaultInlineBytes = 4096;
  ~NetP2P();
  NetP2P(const NetP2P&) = delete;
  NetP2P& operator=(const NetP2P&) = delete;

  int tag_ub() const { return tag_ub_; }
  double timeout() const { return timeout_s_.load(); }
  void set_timeout(double s) { timeout_s_.store(s); }

  // Posts `ops`, every one checked first (InvalidArgument: nothing is posted). `waited`: the
  // caller waits for them next, progressing them itself, so the progress thread stays asleep.
  std::shared_ptr<P2PBatch> start(const std::vector<P2POp>& ops, bool waited = false);
  // Waits for `b` up to `timeout_s` (< 0: until it completes or fails, which its deadline
  // bounds), progressing every pending operation meanwhile. False if still pending; rethrows
  // the batch's error.
  bool wait(P2PBatch& b, double timeout_s);
  // Poisons the engine: every pending operation fails with CollectiveError(reason).
  void abort(const std::string& reason);
  // Why the engine is unusable, or "".
  std::string poison_reason() const;
  // Fails what is pending, stops the progress thread and frees the communicators. Idempotent.
  void close();

 private:
  friend class P2PProgress<NetP2P, Sleeper>;
  static constexpr size_t kHeaderBytes = 3 * sizeof(int64_t);
  struct Op {
    P2POp io;
    std::shared_ptr<P2PBatch> batch;
    int64_t mine[2] = {0, 0};                 // this end's (count, dtype)
    int64_t theirs[3] = {0, 0, 0};            // recv: the sender's header; send: the verdict
    int64_t verdict[6] = {0, 0, 0, 0, 0, 0};  // or the poison
    MPI_Request req[3] = {MPI_REQUEST_NULL, MPI_REQUEST_NULL, MPI_REQUEST_NULL};
    std::vector<uint8_t> box;      // the header as sent or received, and an inline message
    std::vector<uint8_t> scratch;  // a message that does not fit drains here
    bool fits = true;
    bool inlined = false;  // the message rides in its header
    size_t bytes() const { return io.bytes(); }
    std::string describe() const { return io.describe(); }
  };
  using OpPtr = std::shared_ptr<Op>;
  using Key = std::pair<int, uint64_t>;  // (peer, tag)

  void post_send(const OpPtr& o);
  void post_data_recv(const OpPtr& o);
  // The progress core's (runtime/p2p_core.h): one pass over every request in flight, true if
  // anything moved; an operation past its deadline (every 10 ms); a failure of every pending
  // operation (the culprit's batch gets the error), which poisons the engine.
  bool busy() const { return pending_ != 0 || !answering_.empty(); }
  size_t pending() const { return pending_; }
  bool move();
  void check_stalled(Clock::time_point now);
  void fail_pending(std::exception_ptr e);
  bool test_all();
  void advance_sends();
  void advance_headers();
  void advance_receives();
  void advance_verdicts();
  // The header of receive `o` is in: an inline message lands (or poisons its sender), a
  // larger one's data receive is posted.
  void take_header(const OpPtr& o);
  // A receiver found that an inline message from this rank did not fit (poison_in_).
  [[noreturn]] void poisoned_by_peer();
  void complete(const OpPtr& o);
  void finish(P2PBatch& b, std::exception_ptr error);
  template <class E>
  [[noreturn]] void raise(const OpPtr& o, const std::string& msg) {
    culprit_ = o;
    throw E(msg);
  }
  void fail_all(const OpPtr& culprit, std::exception_ptr e);
  // The MPI description of `bytes` bytes: (datatype, count); a derived type is freed by
  // the caller once the operation is posted.
  std::pair<MPI_Datatype, int> bytes_type(size_t bytes) const;

  MPI_Comm headers_ = MPI_COMM_NULL, data_ = MPI_COMM_NULL, verdicts_ = MPI_COMM_NULL;
  MPI_Comm poison_ = MPI_COMM_NULL;
  int rank_ = 0, size_ = 1, tag_ub_ = 32767;
  const size_t block_bytes_;
  const size_t inline_bytes_;
  // The one poison receive, always posted: (receiver, tag, the send's count and dtype, the
  // receive's count and dtype).
  int64_t poison_in_[6] = {0, 0, 0, 0, 0, 0};
  MPI_Request poison_req_ = MPI_REQUEST_NULL;
  std::atomic<double> timeout_s_;

  std::vector<OpPtr> sends_;                // posted, verdict not yet in
  std::map<Key, std::deque<OpPtr>> heads_;  // receives awaiting their header, in issue order
  std::vector<OpPtr> receiving_;            // data receive posted
  std::vector<OpPtr> answering_;            // received; verdict still on its way back
  std::vector<MPI_Request> reqs_;           // test_all's scratch: every request in flight,
  std::vector<MPI_Request*> slots_;         // where each lives,
  std::vector<int> done_;                   // and the indices of those completed
  size_t pending_ = 0;                      // operations not yet complete
  OpPtr culprit_;                           // the op whose failure is being thrown
  std::string poisoned_;
  std::atomic<bool> failed_{false};  // poisoned_ is set
  bool closed_ = false;
};

}  // namespace pycoll
