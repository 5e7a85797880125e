// The flight recorder: a ring of a communicator's last calls, always on, written out when the
// communicator fails (a timeout, a mismatch, a lost peer, an abort) or when the process gets
// SIGUSR1, and read by `python -m pycollectives.trace analyze DIR`.
//
// Each call takes one entry: what was called (collective or point-to-point, count, dtype, op,
// root or peer, tag, the call across nodes it is a phase of), its state (queued, started,
// ended, failed) and when each state began. Writing an entry is a few relaxed stores and two
// reads of the time-stamp counter, no lock, so it stays on for every call; a reader (the dump,
// possibly on another thread while calls go on) takes an entry only if its id reads the same
// before and after, so it never reports a half-written one as another call.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "algo/call.h"

namespace pycoll {

enum class FlightState : uint32_t { Empty = 0, Queued = 1, Started = 2, Ended = 3, Failed = 4 };
// What an entry records beyond the collectives (whose codes are Collective's, 0-7).
constexpr uint32_t kFlightBarrier = 100, kFlightSend = 101, kFlightRecv = 102;

// The fixed facts of one call.
struct FlightCall {
  uint32_t kind = 0;  // Collective code, or kFlightBarrier / kFlightSend / kFlightRecv
  uint32_t dtype = 0, op = 0, algo = 0;
  int32_t root = 0;  // root of a rooted collective, peer of a send or receive
  uint64_t count = 0;
  uint64_t tag = 0;
  uint64_t seq = 0;        // the collective's sequence number on its communicator (0: p2p)
  uint64_t outer_seq = 0;  // the call across nodes this is a node-local phase of (0: none)
};

// The facts of `call`, collective #seq, running `algo` (a node-local phase names the call
// across nodes it belongs to: CollectiveCall::outer).
inline FlightCall flight_call_of(const CollectiveCall& call, uint64_t seq, Algo algo) {
  FlightCall f;
  f.kind = call.barrier ? kFlightBarrier : static_cast<uint32_t>(call.collective);
  f.dtype = static_cast<uint32_t>(call.dtype);
  f.op = static_cast<uint32_t>(call.op);
  f.algo = static_cast<uint32_t>(algo);
  f.root = call.root;
  f.count = call.count;
  f.seq = seq;
  f.outer_seq = call.outer[0];
  return f;
}

// One entry as read back, times in steady-clock nanoseconds (0: not reached).
struct FlightRecord {
  uint64_t id = 0;
  FlightCall call;
  FlightState state = FlightState::Empty;
  int64_t queued_ns = 0, started_ns = 0, ended_ns = 0;
};

class FlightRecorder {
 public:
  // A ring of `entries` (rounded up to a power of two; 0: records nothing).
  explicit FlightRecorder(size_t entries);
  ~FlightRecorder();
  FlightRecorder(const FlightRecorder&) = delete;
  FlightRecorder& operator=(const FlightRecorder&) = delete;

  bool on() const { return mask_ != ~uint64_t{0}; }
  size_t capacity() const { return on() ? static_cast<size_t>(mask_ + 1) : 0; }

  // Records a new call in `state` (Queued or Started) and returns its id (0 when off).
  uint64_t begin(const FlightCall& call, FlightState state);
  // The algorithm call `id` runs (chosen after it began).
  void set_algo(uint64_t id, uint32_t algo);
  // Moves call `id` to `state` (Started, Ended or Failed), stamped now.
  void mark(uint64_t id, FlightState state);

  // The entries still in the ring, oldest first.
  std::vector<FlightRecord> snapshot() const;

  // Where `dump` writes (a JSON file; empty: nowhere) and what it says about this
  // communicator (its rank, size, the id every rank shares). With a path, SIGUSR1 writes it
  // too (install_signal_handler).
  void set_dump(const std::string& path, int rank, int size, const std::string& comm_id);
  const std::string& dump_path() const { return path_; }
  // What an error message adds to point at the dump: "" without a dump path, else
  // "; flight record: PATH (all ranks: python -m pycollectives.trace analyze DIR)".
  std::string pointer() const;
  // Writes the ring to the dump path (atomically: a temporary file renamed over it) with
  // `reason`; returns false when there is no path or the file cannot be written. A later
  // call replaces the file, but only the first `failure` writes, and SIGUSR1's (dump_all)
  // no longer once one has: the first failure's record, which says why, stays.
  bool dump(const std::string& reason, bool failure = false) const;

  // Writes every live recorder's ring (the SIGUSR1 handler's thread does this).
  static void dump_all(const std::string& reason);
  // SIGUSR1 makes every live recorder with a dump path write its ring (from a thread of its
  // own, so a process blocked in a call, or in its own code, still writes). Installed once per
  // process; a handler already there is still called after ours.
  static void install_signal_handler();

  static int64_t now_ns();

 private:
  struct Entry {
    std::atomic<uint64_t> id{0};  // 0 while empty or being rewritten
    std::atomic<uint32_t> kind{0}, dtype{0}, op{0}, algo{0}, state{0};
    std::atomic<int32_t> root{0};
    std::atomic<uint64_t> count{0}, tag{0}, seq{0}, outer_seq{0};
    std::atomic<uint64_t> queued{0}, started{0}, ended{0};  // ticks
  };
  static uint64_t ticks();
  long double ns_per_tick() const;
  bool write_locked(const std::string& reason) const;  // dump's work, dump_mu_ held
  int64_t ticks_to_ns(uint64_t t, long double rate) const;

  uint64_t mask_ = ~uint64_t{0};
  std::unique_ptr<Entry[]> ring_;
  std::atomic<uint64_t> next_{1};
  // Time-stamp counter and clock read together at creation: ticks convert to ns with the
  // rate measured between that pair and another read when the ring is read back.
  uint64_t tick0_ = 0;
  int64_t ns0_ = 0;

  std::string path_, comm_id_;
  int rank_ = 0, size_ = 0;
  mutable std::mutex dump_mu_;
  mutable bool failed_ = false;  // a failure's record was written (under dump_mu_)
};

}  // namespace pycoll
