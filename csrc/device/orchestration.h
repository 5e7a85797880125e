// One orchestration of a device communicator's collectives, for the GPU (cuda/cuda_comm.h) and
// the emulated device (emu/emu_comm.h): the decision tree from a call to its launches, copies,
// fences and host waits, written once over a device `D` (CRTP), as the kernel is written once
// over its Threads policy. So the emulated suite runs the code a GPU runs, down to each call of
// a device primitive; only the primitives differ.
//
// The plans' steps live in a PlanArena over the device's `Memory` (device/plan_arena.h).
// What a device D provides (its `Stream` type: cudaStream_t, or the emulated device's number):
//   Stream own_stream()                    the communicator's own stream (async, captured and
//                                          stepped-mode work go there)
//   void queue_behind(Stream s)            our stream's later work waits for `s`'s work so far
//   void launch(call, args, Stream s, w)   queues one launch of `args` (launches_of) on `s`
//   void copy(dst, src, bytes)             queues a device-to-device copy on our stream
//   void write_counter(epoch, w)           queues on our stream: our fence counter := epoch
//   void wait_counter(q, epoch, w)         queues on our stream: wait for q's counter >= epoch
//   void record_fence_event(k)             queues on our stream: a record of our event k
//   void wait_fence_event(q, k, w)         queues on our stream: a wait on q's event k
//   void stream_waits_launch(Stream s, w)  `s` waits for this rank's last eager launch's end
//   void launch_ended(Stream s, seq)       after eager launch `seq` on `s` (its end's marker)
//   void replay_waits_launch(Stream s, w)  captured on `s`: a replay waits for the end of the
//                                          eager launch before it (its marker at replay time)
//   void replay_ended(Stream s)            captured on `s`: a replay marks its end
//   void stream_waits_replays(Stream s)    `s` waits for the end of the replays issued so far
//   void wait_stream(w)                    the host waits (bounded) for our stream's work so far
//   void wait_queued(w)                    ... for that and every eager launch's end
//   void wait_launch(seq, w)               ... for the barrier's launch on our stream
//   DeviceStatus* host_status()            the status as the host reads it (null: none yet)
//   LaunchSetup launch_setup(use_flags)    the device's pointers a launch needs
//   uint32_t* finished_word()              KernelArgs::finished
//   RegisteredCall registered_of(call, a)  the call over registered buffers, or off
//   BufferRecord buffer_of(p, bytes, sent) where [p, p + bytes) lies, for registration on
//                                          first use (first_use.h; key 0: not shareable)
//   uint8_t* map_peer(q, record)           rank q's allocation of `record`, mapped here once
//   void shared_everywhere(key)            our allocation `key` is mapped by every peer
//   void stop_device()                     after abort: every device wait gives up
//   void stop_peers()                      a mismatch found on the host: peers' waits stop
//   bool closed()                          calls fail once the communicator is closed
//   void trace(call, seq, algo)            debug line of a call
//   void drill(w, FaultPoint, step)        fault drills (the emulated device's tests)
//   void drill_launch(args, w)             ... of an eager kernel-mode launch
#pragma once

#include <atomic>
#include <cstdint>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "algo/call.h"
#include "common/errors.h"
#include "device/first_use.h"
#include "device/kernel_args.h"
#include "device/plan.h"
#include "device/plan_arena.h"
#include "device/stepped.h"
#include "host/executor.h"
#include "host/shm_transport.h"
#include "runtime/fingerprint.h"
#include "runtime/flight_recorder.h"
#include "runtime/splits.h"
#include "runtime/wait.h"

namespace pycoll {
namespace cuda {

// What the orchestration reads of a device's options.
struct OrchestrationOptions {
  size_t slot_bytes = size_t{1} << 20;
  size_t oneshot_max_bytes = 64 * 1024;
  size_t direct_max_bytes = 256 * 1024;
  size_t ll_max_bytes = 32 * 1024;   // kernel mode's LL limit (stepped mode: none)
  bool check_mismatch = true;        // stepped mode compares every call on the host
  bool stepped_twoshot = true;       // stepped mode through scratch (stepped_scratch_eligible)
  size_t register_on_use_bytes = 0;  // registration on first use from this size (0: off)
  bool copy_engines = false;         // stepped mode: registered pure moves by copies
  bool lookahead = false;            // plan_params
  bool stepped_events = true;        // stepped mode fences without the host waiting for the GPU
  bool fence_counters = false;       // ... on counters (counter_fence), else events (event_fence)
  size_t flight_entries = 1024;      // the flight recorder's ring (0: none)
  bool reproducible = false;         // reductions in rank order (rank_ordered)
  Algo forced = Algo::Auto;          // PYCOLL_ALGO: automatic calls run it where it exists
};

// The orchestration's options out of a device's (CudaCommOptions, EmuOptions: the same names).
template <class O>
OrchestrationOptions orchestration_of(const O& o) {
  OrchestrationOptions r;
  r.slot_bytes = o.slot_bytes;
  r.oneshot_max_bytes = o.oneshot_max_bytes;
  r.direct_max_bytes = o.direct_max_bytes;
  r.ll_max_bytes = o.ll_max_bytes;
  r.check_mismatch = o.check_mismatch;
  r.stepped_twoshot = o.stepped_twoshot;
  r.register_on_use_bytes = o.register_on_use_bytes;
  r.copy_engines = o.copy_engines;
  r.lookahead = o.lookahead;
  r.stepped_events = o.stepped_events;
  r.fence_counters = o.fence_counters;
  r.flight_entries = o.flight_entries;
  r.reproducible = o.reproducible;
  r.forced = o.forced;
  return r;
}

// A cached plan: its steps, and where a launch reads them (device memory on a GPU).
struct CachedPlan {
  Plan plan;
  DevStep* device_steps = nullptr;
};

// Where the emulated device's fault drills may strike (D::drill): before a call's first fence
// (stepped mode), before step `step` (stepped mode's launches per step), at the end of a chunk's
// work (through scratch, over registered buffers).
enum class FaultPoint { CallStart, Step, ChunkEnd };

// A call as issued: its number, whether its launch went on the caller's stream (a blocking
// kernel-mode call outside a capture: no event), and whether anything was launched then.
struct Issued {
  uint64_t seq;
  bool direct;
  bool launched;
};

template <class D, class Stream, class Memory>
class DeviceComm {
 public:
  int rank() const { return rank_; }
  int size() const { return size_; }
  uint64_t seq() const { return seq_; }
  bool kernel_mode() const { return kernel_; }
  double timeout() const { return timeout_s_.load(); }
  void set_timeout(double s) { timeout_s_.store(s); }
  Algo choose(Collective c, size_t bytes) const {
    const Algo a = choose_fastest(c, bytes).algo;
    return o_.reproducible ? rank_ordered(c, a) : a;
  }
  size_t plans_cached() const { return plans_.size(); }
  size_t plans_pinned() const { return plans_.pinned(); }
  uint64_t plans_built() const { return plans_built_; }
  uint64_t twoshot_runs() const { return twoshot_runs_; }
  // Registration on first use (first_use.h): calls that ran over buffers registered so, the
  // peers' allocations mapped here (ever, and now), and our allocations every peer has mapped.
  uint64_t first_use_runs() const { return first_use_runs_; }
  // Registered all-gathers and broadcasts moved by copies instead of a launch (copy_registered).
  uint64_t copy_engine_runs() const { return copy_engine_runs_; }
  uint64_t first_use_opened() const { return d_const().peer_mappings().opened(); }
  size_t first_use_mapped() const { return d_const().peer_mappings().live(); }
  size_t first_use_sent() const { return first_use_sent_.size(); }
  uint64_t scratch_runs() const { return scratch_runs_; }
  uint64_t scratch_chunks() const { return scratch_chunks_; }
  bool poisoned() const { return aborted_.load(); }
  // The ring of this communicator's last calls (runtime/flight_recorder.h): a GPU call is
  // "queued" once issued to its stream (the host does not follow it further), "failed" when
  // its issue or a device wait failed; a barrier, which the host waits for, "ended".
  FlightRecorder& flight() { return flight_; }
  void set_flight_dump(const std::string& path, int rank, int size, const std::string& comm) {
    flight_.set_dump(path, rank, size, comm);
    if (!path.empty() && flight_.on()) shm_.set_flight_signal();
  }
  std::string poison_reason() const {
    std::lock_guard<std::mutex> g(reason_mu_);
    return poison_reason_;
  }
  void abort(const std::string& reason) {
    {
      std::lock_guard<std::mutex> g(reason_mu_);
      if (poison_reason_.empty()) poison_reason_ = reason;
    }
    aborted_.store(true);
    d().stop_device();
    flight_.dump(reason, /*failure=*/true);
  }
  // Raises the error an earlier device wait or a dead peer left behind, if any.
  void check(const char* name) {
    check_usable(name);
    check_device(name);
  }

 protected:
  DeviceComm(int rank, int size, int nslots, const OrchestrationOptions& o, double timeout_s,
             Memory memory)
      : rank_(rank),
        size_(size),
        o_(o),
        shm_(rank, size, 64, nslots),  // flags only: stepped-mode steps, barrier, liveness
        counters_(size),
        arena_(std::move(memory)),
        timeout_s_(timeout_s),
        flight_(o.flight_entries) {}

  D& d() { return static_cast<D&>(*this); }

  // `call` (its arguments checked here), queued behind `stream`'s work: checked against every
  // peer's, then run by the branch of the tree it takes. `capturing`: into a CUDA graph (kernel
  // mode only, a call shape run once before: check_capturable). `finish(issued)` runs last,
  // within the call's error handling; its result is returned.
  template <class Finish>
  auto issue(const CollectiveCall& call, Stream stream, bool capturing, bool async_op,
             Finish&& finish) {
    const char* name = collective_name(call.collective);
    check_device_call(call, size_);
    check_usable(name);
    check_device(name);
    const ResolvedCall rc = resolve(call);
    const Algo algo = rc.algo;
    const bool kernel = kernel_;
    const bool empty = moves_nothing(call, rank_, size_);
    // The two-shot reads no plan: a graph captures its launch arguments, pointers and all.
    RegisteredCall registered = d().registered_of(call, algo);
    if (capturing)
      check_capturable(name, kernel, empty || registered.on || plans_.find(call, algo) != nullptr);
    const bool first_use = !registered.on && !empty &&
                           first_use_eligible(call, algo, o_.register_on_use_bytes, capturing);
    const uint64_t seq = ++seq_;
    d().trace(rc, seq);
    const uint64_t fid = flight_.begin(flight_call_of(call, seq, algo), FlightState::Queued);
    if (first_use) registered.where[0] = kFirstUseWhere;  // the trade below fills the rest
    Fingerprint mine = Fingerprint::of_call(seq, call, algo);
    if (registered.on || first_use) mine = registered_fingerprint(mine, registered);
    FingerprintGuard guard(shm_, mine);
    WaitContext w = wait_context(name, seq);
    try {
      // Split lists are checked whatever check_mismatch says: kernels of ranks that disagree
      // would wait for messages that never come, or write past an output. Every rank
      // publishes its fingerprint, so that one that meets on the host sees a peer that does
      // not.
      const bool meet = meets_on_host(call, kernel, capturing, o_.check_mismatch);
      w.fingerprints = &guard;
      guard.publish();
      uint64_t widest = 0;  // the largest split of every rank's (scratch counts by it)
      if (!call.send_counts.empty())
        widest = check_split_matrix(shm_, guard, w, call.send_counts, call.recv_counts);
      if (first_use) registered = trade_first_use(call, guard, w);
      if (meet) guard.finish(w);  // every peer runs this very call
      // Kernel mode, a blocking call outside a capture: one launch on the caller's stream (the
      // device reports its end in the done word). Otherwise the work goes on our stream,
      // behind the caller's: an async call's stream must not wait for it, and a capture forks
      // our stream into it (and the caller joins it back).
      const bool direct = kernel && !async_op && !capturing;
      const Stream on = direct ? stream : d().own_stream();
      if (!direct) d().queue_behind(stream);
      // In kernel mode a call that moves nothing launches too: it compares the call (unless
      // there is no peer to compare it with: runs_anything).
      bool launched = true;
      if (empty) {
        if (kernel) launched = run_kernel_mode(call, nullptr, mine, on, !capturing, w);
      } else if (registered.on) {
        run_on_registered(call, registered, mine, w, on, !capturing);
      } else if (stepped_scratch_eligible(call, algo, kernel, o_.stepped_twoshot, widest != 0)) {
        run_stepped_scratch(call, w, meet, widest);
      } else if (capturing) {
        // The graph reads the plan: never freed.
        run_kernel_mode(call, &plans_.pin(call, algo), mine, on, false, w);
      } else if (kernel) {
        launched = run_kernel_mode(call, &plan_for(rc, on), mine, on, true, w);
      } else {
        run_stepped(call, plan_for(rc, d().own_stream()), w);
      }
      return finish(Issued{seq, direct, launched});
    } catch (...) {
      rethrow_failed(fid);
    }
  }

  // In a catch block: the call whose flight entry is `fid` failed with what was caught, which
  // is thrown again. A mismatch stops the peers' device waits and aborts; another collective
  // error aborts (which writes the ring) and, after a timeout, asks the peers on this machine
  // for theirs: their counters no longer match ours. Anything else passes as it is.
  [[noreturn]] void rethrow_failed(uint64_t fid) {
    try {
      throw;
    } catch (const CollectiveMismatch& e) {
      d().stop_peers();
      abort(e.what());
      flight_.mark(fid, FlightState::Failed);
      throw;
    } catch (const CollectiveError& e) {
      abort(e.what());
      if (dynamic_cast<const CollectiveTimeout*>(&e) != nullptr)
        shm_.ask_peers_for_flight_records();
      flight_.mark(fid, FlightState::Failed);
      throw;
    }
  }

  // Kernel mode: a launch that only compares calls with every peer (match_calls) is the
  // barrier: it runs once this rank's queued work has, and ends once every peer's has reached
  // it. Stepped mode meets on the host flags.
  void barrier_call() {
    check_usable("barrier");
    const uint64_t seq = ++seq_;
    CollectiveCall none;
    none.barrier = true;
    const uint64_t fid = flight_.begin(flight_call_of(none, seq, Algo::Auto), FlightState::Started);
    Fingerprint mine;
    mine.seq = seq;
    mine.kind = kBarrierKind;
    FingerprintGuard guard(shm_, mine);
    WaitContext w = wait_context("barrier", seq);
    try {
      w.fingerprints = &guard;
      guard.publish();
      if (kernel_) {
        if (!run_kernel_mode(none, nullptr, mine, d().own_stream(), true, w))
          d().wait_queued(w);  // one rank: nobody to meet, only its queued work to wait for
        else
          d().wait_launch(seq, w);
        check_device("barrier");
      } else {
        d().wait_stream(w);
        check_device("barrier");
        host_meet(shm_, ++barrier_epoch_, w);
        if (o_.check_mismatch) guard.finish(w);
      }
    } catch (...) {
      rethrow_failed(fid);
    }
    flight_.mark(fid, FlightState::Ended);
  }

  // Raises the error a device wait left behind (kernel mode reports asynchronously).
  void check_device(const char* name) {
    const DeviceStatus* st = d().host_status();
    if (st == nullptr) return;
    const uint32_t code = __atomic_load_n(&st->code, __ATOMIC_ACQUIRE);
    if (code == kOk) return;
    if (code == kMismatch) {
      const std::string what = device_mismatch_message(name, *st, rank_);
      abort(what);
      throw CollectiveMismatch(what);
    }
    const std::string what = str_cat(
        name, ": a collective failed on the device: ", code == kTimeout ? "timed out" : "aborted",
        " waiting for ", device_wait_target(*st, rank_));
    const std::string reason = poison_reason();
    abort(what);
    if (code == kTimeout) throw CollectiveTimeout(what);
    throw CollectiveError(reason.empty() ? what : str_cat(what, ": ", reason));
  }

  void check_usable(const char* name) const {
    if (d_const().closed()) throw CollectiveError(str_cat(name, ": the communicator is closed"));
    if (aborted_.load())
      throw CollectiveError(
          str_cat(name, ": communicator is unusable after an earlier error: ", poison_reason()));
  }

  WaitContext wait_context(const char* name, uint64_t seq) const {
    return WaitContext::start(name, seq, timeout_s_.load(), &shm_, &aborted_);
  }

  // What is decided about `call` (resolve_call): the algorithm asked for, else the automatic
  // choice (device_choose); in rank order in reproducible mode (the call's own setting, else
  // the communicator's).
  ResolvedCall resolve(const CollectiveCall& call) const {
    return resolve_call(call, rank_, size_, o_.reproducible,
                        [this](Collective c, size_t bytes) { return choose_fastest(c, bytes); });
  }
  // The automatic choice without reproducible mode, and why: PYCOLL_ALGO where the collective
  // has it, else device_choose.
  AlgoChoice choose_fastest(Collective c, size_t bytes) const {
    if (o_.forced != Algo::Auto && algo_supports(o_.forced, c)) return {o_.forced, Reason::Forced};
    return device_choose(c, bytes, o_.direct_max_bytes);
  }

  // A new plan's steps are uploaded on `stream`, that of the launch that first reads them.
  const CachedPlan& plan_for(const ResolvedCall& rc, Stream stream) {
    return plans_.get(
        *rc.call, rc.algo,
        [&] {
          CachedPlan cp;
          cp.plan = plan_call(rc, layout_, o_.slot_bytes, o_.oneshot_max_bytes,
                              kernel_ ? o_.ll_max_bytes : 0, o_.lookahead);
          // On the stream of the launch that first reads them, so it reads them only once they
          // are in place; later launches follow that one (on its stream, or on another that
          // waits for its end: stream_waits_launch).
          cp.device_steps = arena_.upload(cp.plan.steps, stream);
          ++plans_built_;
          return cp;
        },
        [&](std::map<PlanKey, CachedPlan>&) {
          // Queued launches may still read the old plans: their chunks are retired, not
          // reused. Graphs' plans (pinned) stay.
          std::vector<const DevStep*> keep;
          for (const auto& kv : plans_.pinned_entries()) keep.push_back(kv.second.device_steps);
          arena_.retire_except(keep);
        });
  }

  // One launch's arguments: `cp`'s steps (none when null), its grid.
  KernelArgs kernel_args(const CollectiveCall& call, const CachedPlan* cp) const {
    if (cp == nullptr)
      return make_kernel_args(d_const().launch_setup(kernel_), call, nullptr, 0, 1, counters_);
    return make_kernel_args(d_const().launch_setup(kernel_), call, cp->device_steps,
                            cp->plan.steps.size(), cp->plan.grid, counters_);
  }

  // Kernel mode: one launch (two for several blocks: launches_of) on `stream` that compares
  // call `f` with every peer's on the device and runs `cp`'s steps (none when null: it only
  // compares). Returns whether anything was launched (runs_anything).
  bool run_kernel_mode(const CollectiveCall& call, const CachedPlan* cp, const Fingerprint& f,
                       Stream stream, bool eager, const WaitContext& w) {
    // Each block counts its messages on its own flags (step_kernel.h): no host counts to keep.
    KernelArgs a = kernel_args(call, cp);
    check_on_device(a, f);
    return launch_kernel_mode(call, a, f.seq, stream, eager, w);
  }

  // Launches `a` on `stream`; `eager`: as call number `seq`, reporting its end in the done
  // word, and ordered after this rank's eager launch before. Returns false, launching nothing
  // and leaving the last launch as it was, when `a` runs nothing: a launch not made never
  // reports an end, so neither a close, nor this call's completion, nor a later launch on
  // another stream may wait for one.
  bool launch_kernel_mode(const CollectiveCall& call, KernelArgs& a, uint64_t seq, Stream stream,
                          bool eager, const WaitContext& w) {
    if (!runs_anything(a)) return false;
    if (eager) {
      d().drill_launch(a, w);
      a.finished = d().finished_word();
      a.done_seq = seq;
      // This rank's launch before, on another stream, ends before this one starts: the stream
      // waits for it (on the host's side: an event, or the host's own wait), so this launch's
      // blocks take no SM while it runs, and read the counts it left. (A block spinning on
      // the device for that end would hold an SM that the launch it waits for may need.)
      if (last_launch_ != 0 && stream != last_stream_) d().stream_waits_launch(stream, w);
      // ... and after every replay of a graph captured before.
      if (captured_) d().stream_waits_replays(stream);
    } else {
      // Captured: each replay of the graph runs after this rank's eager launch before it
      // (that launch's end as marked when the graph is launched), and marks its own end for
      // the eager launches after it. Both kinds use the same per-block counters.
      d().replay_waits_launch(stream, w);
    }
    d().launch(call, a, stream, w);
    if (eager) {
      // Marked after every eager launch, not when the next call turns out to use another
      // stream: by then this stream may have been destroyed.
      d().launch_ended(stream, seq);
      last_stream_ = stream;
      last_launch_ = seq;
    } else {
      d().replay_ended(stream);
      captured_ = true;
    }
    return true;
  }

  // Registration on first use (first_use.h): every rank's row of where its buffers lie,
  // traded on the host; the call over every rank's buffers where every rank's are shareable,
  // else off on every rank. The handles sent go on record once every peer has mapped them (the
  // call runs zero-copy); an emulated allocation's name can go once every peer has read the
  // rows of a later call (it has mapped this call's by then).
  RegisteredCall trade_first_use(const CollectiveCall& call, FingerprintGuard& guard,
                                 const WaitContext& w) {
    const RegisteredBytes bytes = registered_bytes(call, size_);
    FirstUseRow mine;
    mine.in = d().buffer_of(call.in, bytes.in, first_use_sent_);
    if (first_use_needs_output(call))
      mine.out = d().buffer_of(call.out, bytes.out, first_use_sent_);
    RegisteredCall t;
    exchange_rows(shm_, guard, w, &mine, sizeof(mine), "a call registered on first use",
                  [&](const uint8_t* raw) {
                    std::vector<FirstUseRow> rows(size_);
                    std::memcpy(static_cast<void*>(rows.data()), raw, size_ * sizeof(FirstUseRow));
                    for (uint64_t key : first_use_mapped_by_peers_) d().shared_everywhere(key);
                    first_use_mapped_by_peers_.clear();
                    t = first_use_call(
                        call, rows.data(), rank_, size_,
                        [&](int q, const BufferRecord& r) { return d().map_peer(q, r); });
                  });
    if (t.on) {
      ++first_use_runs_;
      for (const BufferRecord* r : {&mine.in, &mine.out})
        if (r->handle_bytes != 0) {
          first_use_sent_.add(r->base, r->key);
          first_use_mapped_by_peers_.push_back(r->key);
        }
    }
    return t;
  }

  // The collective over every rank's registered buffers (run_registered; the two-shot for an
  // all-reduce). Kernel mode: one launch on `stream` that compares the call with every peer's
  // first (its other blocks gated on that: launches_of), its entry synchronisation. Stepped mode
  // (the call compared on the host already): a fence (every rank's input is ready: our stream
  // follows the caller's), the launch on our stream (no device wait in it), a fence (no rank
  // touches its buffers again before every launch has ended). With copy engines, a pure move
  // (an all-gather, a broadcast) is copies between the fences instead of the launch.
  void run_on_registered(const CollectiveCall& call, const RegisteredCall& t, const Fingerprint& f,
                         const WaitContext& w, Stream stream, bool eager) {
    KernelArgs a = kernel_args(call, nullptr);
    set_registered(a, call, t.in, t.out);
    ++twoshot_runs_;
    if (kernel_) {
      check_on_device(a, f);
      launch_kernel_mode(call, a, f.seq, stream, eager, w);
      return;
    }
    d().drill(w, FaultPoint::CallStart, 0);
    fence(w);
    if (!(o_.copy_engines && copy_registered(call, t))) d().launch(call, a, d().own_stream(), w);
    d().drill(w, FaultPoint::ChunkEnd, 0);
    fence(w);
  }

  // Stepped mode, between a registered call's fences: an all-gather or a broadcast as device-to-
  // device copies on our stream (copy engines: no SM, no kernel), each byte read once from
  // where it lies and written once into this rank's output. False for a call that reduces.
  bool copy_registered(const CollectiveCall& call, const RegisteredCall& t) {
    const size_t bytes = call.bytes();
    uint8_t* const out = static_cast<uint8_t*>(call.out);
    if (call.collective == Collective::AllGather) {
      for (int q = 0; q < size_; ++q)
        if (t.in[q] != out + q * bytes) d().copy(out + q * bytes, t.in[q], bytes);
    } else if (call.collective == Collective::Broadcast) {
      if (rank_ != call.root && t.out[rank_] != t.in[call.root])
        d().copy(t.out[rank_], t.in[call.root], bytes);
    } else {
      return false;
    }
    ++copy_engine_runs_;
    return true;
  }

  // Stepped mode through scratch (stepped.h, run_scratch): the copies and the two-shot on our
  // stream, behind the caller's, and the fences between them.
  void run_stepped_scratch(const CollectiveCall& call, const WaitContext& w, bool met,
                           uint64_t widest) {
    struct Ops {
      DeviceComm& c;
      const CollectiveCall& call;
      const WaitContext& w;
      void copy(void* dst, const void* src, size_t bytes) { c.d().copy(dst, src, bytes); }
      void twoshot(size_t len, const std::vector<uint8_t*>& scratch) {
        KernelArgs a = c.kernel_args(call, nullptr);
        set_twoshot(a, len, scratch, scratch);
        c.d().launch(call, a, c.d().own_stream(), w);
      }
      void fence() { c.fence(w); }
      void meet() { host_meet(c.shm_, ++c.barrier_epoch_, w); }
      void chunk_done() {
        ++c.scratch_chunks_;
        c.d().drill(w, FaultPoint::ChunkEnd, 0);
      }
    } ops{*this, call, w};
    ++scratch_runs_;
    d().drill(w, FaultPoint::CallStart, 0);
    run_scratch(call, layout_, segments_.data(), rank_, met, ops, widest);
  }

  // One launch per step; between launches the host waits for the peers. A launch never waits
  // for another process, so ranks time-slicing one GPU make progress whatever the scheduler
  // does.
  void run_stepped(const CollectiveCall& call, const CachedPlan& cp, const WaitContext& w) {
    const std::vector<DevStep>& steps = cp.plan.steps;
    for (uint32_t i = 0; i < steps.size(); ++i) {
      d().drill(w, FaultPoint::Step, static_cast<int>(i));
      stepped_wait_step(shm_, counters_, steps[i], w);
      KernelArgs a = kernel_args(call, &cp);
      a.first_step = i;
      a.end_step = i + 1;
      a.grid = active_channels(steps[i].count, layout_);  // this step's message alone
      d().launch(call, a, d().own_stream(), w);
      d().wait_stream(w);
      stepped_publish_step(shm_, counters_, steps[i]);
    }
  }

  // Stepped mode: what is queued on our stream after this runs once what every rank queued
  // before it has run (stepped.h: counter_fence, event_fence; without stepped_events the host
  // waits for our stream, then meets every peer).
  void fence(const WaitContext& w) {
    if (!o_.stepped_events) {
      d().wait_stream(w);
      host_meet(shm_, ++barrier_epoch_, w);
      return;
    }
    if (o_.fence_counters) {
      counter_fence(
          shm_, ++barrier_epoch_, w, [&](uint64_t epoch) { d().write_counter(epoch, w); },
          [&](int q, uint64_t epoch) { d().wait_counter(q, epoch, w); });
      return;
    }
    event_fence(
        shm_, ++barrier_epoch_, w, [&](int k) { d().record_fence_event(k); },
        [&](int q, int k) { d().wait_fence_event(q, k, w); });
  }

  int rank_, size_;
  OrchestrationOptions o_;
  bool kernel_ = true;
  SegmentLayout layout_;
  std::vector<uint8_t*> segments_;  // every rank's, as mapped here
  ShmTransport shm_;                // host flags: stepped-mode steps, fingerprints, liveness
  ChannelCounters counters_;
  PlanCache<CachedPlan> plans_;
  PlanArena<Memory> arena_;  // the plans' steps
  uint64_t plans_built_ = 0;
  uint64_t seq_ = 0;
  uint64_t barrier_epoch_ = 0;  // stepped mode's meetings and fences (host_meet)
  uint64_t twoshot_runs_ = 0;
  uint64_t first_use_runs_ = 0;
  uint64_t copy_engine_runs_ = 0;
  SentAllocations first_use_sent_;                   // our allocations every peer has mapped
  std::vector<uint64_t> first_use_mapped_by_peers_;  // ... since the last trade
  uint64_t scratch_runs_ = 0;
  uint64_t scratch_chunks_ = 0;
  // The last eager kernel-mode launch: its stream and call number (0: none yet).
  Stream last_stream_{};
  std::atomic<uint64_t> last_launch_{0};
  bool captured_ = false;  // a kernel-mode launch has been captured into a graph
  std::atomic<double> timeout_s_;
  std::atomic<bool> aborted_{false};
  FlightRecorder flight_;
  mutable std::mutex reason_mu_;
  std::string poison_reason_;
  std::mutex run_mu_;  // one call at a time

 private:
  const D& d_const() const { return static_cast<const D&>(*this); }
};

}  // namespace cuda
}  // namespace pycoll
