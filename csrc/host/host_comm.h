// The host communicator: collectives on host memory over the shared-memory transport.
//
// Arguments are validated by the caller (the bindings); this layer checks only invariants.
// Collectives run on the calling thread, or, when submitted asynchronously, on a progress
// thread that runs them one at a time in submission order; a blocking call made while
// asynchronous work is pending queues behind it.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "algo/call.h"
#include "algo/schedule.h"
#include "common/dtypes.h"
#include "host/executor.h"
#include "host/fault_board.h"
#include "host/p2p.h"
#include "host/shared_buffers.h"
#include "host/shm_transport.h"
#include "host/single_copy.h"
#include "host/slot_stores.h"
#include "runtime/fingerprint.h"
#include "runtime/flight_recorder.h"

namespace pycoll {

struct HostCommOptions {
  size_t slot_bytes = 256 * 1024;
  int nslots = 4;
  double timeout_s = 300.0;
  // Out-of-place outputs of at least this many bytes bypass the cache (CallBuffers::streams).
  size_t stream_bytes = kDefaultStreamBytes;
  bool debug = false;                    // log every collective and the algorithm chosen to stderr
  size_t oneshot_max_bytes = 64 * 1024;  // direct all-reduce: one-shot up to here
  bool check_mismatch = true;            // publish and check fingerprints (off only to measure)
  // Point-to-point sends of at most this many bytes (capped to one slot) go eagerly, before
  // the receiver asks for them.
  size_t p2p_eager_max_bytes = 4096;
  // Point-to-point messages of at least this many bytes are written straight into the
  // receiver's buffer (process_vm_writev) instead of streaming through the slots. Below it
  // the slots win: sender and receiver copy at once, out of cache (2 ranks of a 2-core EPYC,
  // 1 MiB L2: slots 1.4-1.6x faster at 1-2 MiB, direct writes 8% faster from 4 MiB).
  size_t p2p_cma_min_bytes = size_t{4} << 20;
  CmaMode p2p_cma = CmaMode::Use;  // sends of at least p2p_cma_min_bytes write directly
  // All-gather blocks of at least this many bytes (per rank, 2 ranks) are written straight
  // into the peer's output (host/single_copy.h), unless p2p_cma is off or an algorithm other
  // than direct is asked for.
  size_t single_copy_min_bytes = size_t{4} << 20;
  // All-reduces of at least this many bytes (reduce-scatter, all-gather, broadcast and reduce:
  // 8 times as many), on a communicator whose ranks allocate shared buffers, trade buffer
  // descriptors first and run over mapped buffers where every rank's are shared
  // (host/shared_buffers.h); off with p2p_cma.
  size_t shared_min_bytes = size_t{16} << 10;
  // The stores that write staging slots: measured and chosen per kind of call (Auto), or
  // always one way (host/slot_stores.h).
  SlotStores slot_stores = SlotStores::Auto;
  // Entries of the flight recorder's ring (runtime/flight_recorder.h); 0: no recorder.
  size_t flight_entries = 1024;
  // Reproducible mode (PYCOLL_REPRODUCIBLE): every reduction, whatever algorithm it asks for,
  // runs a rank-order schedule (rank_ordered, algo/schedule.h), unless the call says otherwise.
  bool reproducible = false;
};

// One line of the tuning table: for `collective` on `min_ranks..max_ranks` ranks, messages of
// at most `max_bytes` use `algo`. The first matching rule wins; ring when none matches.
struct TuningRule {
  Collective collective;
  int min_ranks, max_ranks;
  size_t max_bytes;
  Algo algo;
};

// The algorithm `rules` give collective `c` of `bytes` (the automatic choice's key) on `size`
// ranks, and whether a rule gave it (else the default: ring, or direct where there is no ring).
AlgoChoice table_choice(const std::vector<TuningRule>& rules, Collective c, int size, size_t bytes);

// Completion of an asynchronous collective.
class Work {
 public:
  // Waits up to `timeout_s` (< 0: forever); true when done. Rethrows the collective's error.
  bool wait(double timeout_s);
  bool is_completed() const;
  uint64_t seq() const { return seq_; }
  // When it began to run (the progress thread took it up; for point-to-point work, when it
  // was started) and when it completed (0 before), in steady_clock nanoseconds: the clock of
  // Python's time.perf_counter_ns / time.monotonic_ns on Linux. For timelines.
  std::pair<int64_t, int64_t> times() const;

 private:
  friend class HostComm;
  friend class P2PEngine;
  void complete(std::exception_ptr error);
  static int64_t now_ns();

  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  std::exception_ptr error_;
  uint64_t seq_ = 0;
  uint64_t flight_id_ = 0;  // its entry in the flight recorder
  std::atomic<int64_t> started_ns_{now_ns()};
  int64_t completed_ns_ = 0;
};

class HostComm {
 public:
  HostComm(int rank, int size, const HostCommOptions& opts);
  ~HostComm();

  const std::string& segment_name() const { return transport_.name(); }
  void attach(const std::vector<std::string>& names) { transport_.attach(names); }
  void unlink() { transport_.unlink(); }

  int rank() const { return transport_.rank(); }
  int size() const { return transport_.size(); }
  uint64_t seq() const { return seq_.load(); }
  double timeout() const { return timeout_s_.load(); }
  void set_timeout(double seconds) { timeout_s_.store(seconds); }
  const HostCommOptions& options() const { return opts_; }
  void set_tuning(std::vector<TuningRule> rules) { tuning_ = std::move(rules); }
  // An algorithm Auto uses wherever it exists (PYCOLL_ALGO); Auto to clear.
  void set_forced(Algo a) { forced_ = a; }
  // The algorithm Auto picks for this collective and size (bytes of the element type).
  Algo choose(Collective c, size_t bytes) const;

  // The ranks allocate shared buffers (every rank calls this at the same point of its
  // sequence of collectives): eligible all-reduces trade descriptors from the next call on.
  void enable_shared() { shared_enabled_.store(true); }
  bool shared_enabled() const { return shared_enabled_.load(); }

  // Poisons the communicator: waits in progress stop, later calls fail at once. The flight
  // recorder writes its ring out (the first reason only).
  void abort(const std::string& reason);

  // Where the flight recorder writes (FlightRecorder::set_dump); with a path, SIGUSR1 makes
  // this process write it too, and the peers may ask for it that way after a timeout.
  void set_flight_dump(const std::string& path, int rank, int size, const std::string& comm);
  // The ring of this communicator's last calls (collectives and point-to-point).
  FlightRecorder& flight() { return flight_; }
  const FlightRecorder& flight() const { return flight_; }
  // True once aborted, or once a peer has revoked the communicator (which poisons it here).
  bool poisoned() const;
  std::string poison_reason() const;

  // Revokes the communicator (host/fault_board.h): this rank's calls and every peer's, pending
  // and later, fail with CollectiveError. The board keeps working.
  void revoke();
  // One round of the fault-tolerant board among the ranks still running (FaultBoard).
  std::vector<BoardEntry> board_exchange(uint64_t value, const std::string& payload) {
    return board_.exchange(value, payload, timeout_s_.load());
  }

  // Messages name rank r as names[r] (the node-local part of a communicator over nodes).
  void set_rank_names(std::vector<int> names) { transport_.set_names(std::move(names)); }
  // Every rank's record of the call across nodes that collective #seq of this communicator
  // was a phase of (CollectiveCall::outer), in rank order; waits, bounded by the timeout, for
  // ranks that have not yet published theirs. Works on a poisoned communicator: it is how the
  // ranks of a node agree on what each of them called after a mismatch.
  std::vector<CallRecord> outer_records(uint64_t seq) const;

  // Runs `call` now (after any pending asynchronous work).
  void run(const CollectiveCall& call);
  // Queues `call` on the progress thread.
  std::shared_ptr<Work> submit(const CollectiveCall& call);

  // Point-to-point: runs `ops` to completion, or starts them and returns their Work. These
  // use their own channels and progress, independent of the collectives.
  void p2p(const std::vector<P2POp>& ops) { p2p_->run(ops); }
  std::shared_ptr<Work> p2p_start(const std::vector<P2POp>& ops) { return p2p_->start(ops); }

 private:
  void execute(const CollectiveCall& call, uint64_t seq);
  // A collective failed with `e`: poisons the communicator (abort, which writes the flight
  // record) and, after a timeout, asks the peers for theirs.
  void failed(const CollectiveError& e);
  WaitContext wait_context(const char* name, uint64_t seq) const;
  void check_usable(const char* name) const;
  void progress_loop();
  void barrier_steps(const WaitContext& w);
  // Checks the peers that earlier calls left unchecked (see execute): those that have
  // arrived at once, then waits for the oldest calls' until at most `keep` calls remain.
  void settle_deferred(size_t keep);

  HostCommOptions opts_;
  FlightRecorder flight_;
  uint64_t flight_id_ = 0;  // the running collective's entry (under exec_mu_)
  ShmTransport transport_;
  ChannelCounters counters_;
  std::vector<uint8_t> scratch_;
  SingleCopy single_copy_;
  SharedCollectives shared_;
  SlotStorePolicy slot_stores_;
  std::atomic<bool> shared_enabled_{false};
  std::vector<TuningRule> tuning_;
  Algo forced_ = Algo::Auto;
  // The automatic choice without reproducible mode, and why: PYCOLL_ALGO, single copy, the
  // tuning table, else ring (direct where there is no ring).
  AlgoChoice choose_fastest(Collective c, size_t bytes) const;
  std::atomic<uint64_t> seq_{0};
  uint64_t barrier_epoch_ = 0;
  std::atomic<double> timeout_s_;
  void poison(const std::string& reason) const;
  mutable std::atomic<bool> aborted_{false};  // set by const calls that notice a revocation
  mutable std::mutex reason_mu_;
  mutable std::string poison_reason_;
  FaultBoard board_;
  // Fingerprints of recent calls in which this rank received nothing and some peers had not
  // yet arrived when the call ended (a broadcast's root), oldest first. Checked at every
  // call's start, and against a peer whenever data from it arrives (which it sends only
  // after publishing them); a call waits for the oldest until fewer than kMaxDeferred remain.
  static constexpr size_t kMaxDeferred = 4;
  std::vector<FingerprintGuard> deferred_;

  std::mutex exec_mu_;  // one collective runs at a time
  // Progress thread, started by the first asynchronous call.
  std::mutex queue_mu_;
  std::condition_variable queue_cv_;
  std::deque<std::pair<CollectiveCall, std::shared_ptr<Work>>> queue_;
  size_t pending_ = 0;  // queued or running asynchronous calls
  bool stopping_ = false;
  std::thread progress_;

  std::unique_ptr<P2PEngine> p2p_;  // last: it uses the members above until it is gone
};

}  // namespace pycoll
