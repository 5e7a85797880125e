#include "emu/emu_comm.h"

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstring>
#include <exception>
#include <functional>
#include <thread>
#include <utility>

#include "common/errors.h"
#include "device/stepped.h"
#include "emu/emu_device.h"
#include "runtime/fingerprint.h"
#include "runtime/splits.h"

namespace pycoll {
namespace emu {

// Kernel mode's block threads, started at the first launch and kept for the next ones: a launch
// hands every thread its block by bumping a generation number that they sleep on, instead of
// starting a thread per block (a clone, a stack and an exit per block per call: 18k of each in
// one 4-rank test case). The launching thread waits for them, watching the peers every 2 ms
// meanwhile.
class BlockThreads {
 public:
  explicit BlockThreads(int n) {
    for (int b = 0; b < n; ++b) threads_.emplace_back([this, b] { loop(b); });
  }
  ~BlockThreads() {
    stop_.store(true);
    gen_.fetch_add(1);
    wake(&gen_);
    for (std::thread& t : threads_) t.join();
  }

  // Runs body(b) on block b's thread for every b; returns when all have returned.
  void run(const std::function<void(int)>& body, const std::function<void()>& watch) {
    body_ = &body;
    running_.store(static_cast<uint32_t>(threads_.size()));
    gen_.fetch_add(1);  // seq_cst: body_ and running_ are seen by whoever sees the new number
    wake(&gen_);
    for (uint32_t left; (left = running_.load()) != 0;) {
      const struct timespec two_ms{0, 2000000};
      futex(&running_, FUTEX_WAIT_PRIVATE, left, &two_ms);
      if (running_.load() != 0) watch();
    }
    body_ = nullptr;
  }

 private:
  static long futex(std::atomic<uint32_t>* word, int op, uint32_t value,
                    const struct timespec* timeout = nullptr) {
    return syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), op, value, timeout, nullptr, 0);
  }
  static void wake(std::atomic<uint32_t>* word) { futex(word, FUTEX_WAKE_PRIVATE, INT_MAX); }

  void loop(int b) {
    for (uint32_t seen = 0;;) {
      uint32_t now;
      while ((now = gen_.load()) == seen) futex(&gen_, FUTEX_WAIT_PRIVATE, seen);
      seen = now;
      if (stop_.load()) return;
      (*body_)(b);
      if (running_.fetch_sub(1) == 1) wake(&running_);
    }
  }

  std::vector<std::thread> threads_;
  std::atomic<uint32_t> gen_{0};
  std::atomic<uint32_t> running_{0};
  std::atomic<bool> stop_{false};
  const std::function<void(int)>* body_ = nullptr;
};

namespace {

// Where a segment's EmuEvents lie: after the layout, aligned.
size_t events_at(const cuda::SegmentLayout& L) { return (L.total_bytes() + 63) / 64 * 64; }
// ... and the SMs of the GPU (EmuSms), after the events; the segment ends there.
size_t sms_at(const cuda::SegmentLayout& L) { return events_at(L) + 64; }
size_t segment_bytes_of(const cuda::SegmentLayout& L) { return sms_at(L) + sizeof(EmuSms); }
static_assert(sizeof(EmuEvents) <= 64, "the events fit their line");

const EmuOptions& checked(int size, const EmuOptions& opts) {
  if (size > cuda::kMaxRanks)
    throw InvalidArgument(
        str_cat("the device transport holds at most ", cuda::kMaxRanks, " ranks"));
  if (opts.nblocks < 1 || opts.nblocks > 128 || opts.threads < 1 || opts.nslots < 2)
    throw InvalidArgument("emulated device: bad blocks, threads or slot count");
  if (opts.sms < 0) throw InvalidArgument("emulated device: negative SM count");
  return opts;
}

}  // namespace

EmuComm::EmuComm(int rank, int size, const EmuOptions& opts)
    : DeviceComm(rank, size, checked(size, opts).nslots, cuda::orchestration_of(opts),
                 opts.timeout_s, EmuPlanMemory{}),
      opts_(opts),
      registry_(rank, size),
      peer_maps_(size) {
  kernel_ = opts.kernel_mode;
  layout_ = cuda::make_layout(size, opts.nslots, opts.nblocks, opts.slot_bytes, opts.ll_max_bytes,
                              opts.ll_flag_bits);
  layout_.push = opts.push;
  segment_ = ShmSegment::create("pycoll-emu", segment_bytes_of(layout_));
  // The flags, and the LL area: a word that was never written holds no message's flag.
  std::memset(segment_.data(), 0, layout_.flags_bytes);
  std::memset(segment_.data() + layout_.ll_offset, 0,
              segment_bytes_of(layout_) - layout_.ll_offset);
  reinterpret_cast<EmuSms*>(segment_.data() + sms_at(layout_))->free =
      static_cast<uint32_t>(opts.sms);
  segments_.assign(size, nullptr);
  segments_[rank] = segment_.data();
  status_.abort = 0;
}

EmuComm::~EmuComm() {
  late_stop_.store(true);
  if (late_writer_.joinable()) late_writer_.join();
}

void EmuComm::attach(const std::vector<std::string>& segments,
                     const std::vector<std::string>& flags, const std::vector<int>& gpus) {
  if (static_cast<int>(segments.size()) != size_ || static_cast<int>(flags.size()) != size_)
    throw InvalidArgument("attach: one device segment and one flag segment per rank expected");
  if (!gpus.empty() && static_cast<int>(gpus.size()) != size_)
    throw InvalidArgument("attach: one GPU per rank expected");
  peers_.clear();
  peers_.resize(size_);
  for (int r = 0; r < size_; ++r) {
    if (r == rank_) continue;
    peers_[r] = ShmSegment::open(segments[r], segment_bytes_of(layout_));
    segments_[r] = peers_[r].data();
  }
  if (opts_.sms > 0 && kernel_) {
    int first = rank_;  // the lowest rank on our GPU holds its SMs
    for (int r = 0; r < size_ && !gpus.empty(); ++r)
      if (gpus[r] == gpus[rank_]) {
        first = r;
        break;
      }
    sms_ = reinterpret_cast<EmuSms*>(segments_[first] + sms_at(layout_));
  }
  shm_.attach(flags);
  if (!kernel_ && opts_.stepped_events) queue_ = std::make_unique<OpQueue>();
}

void EmuComm::unlink() {
  segment_.unlink();
  shm_.unlink();
}

// The host's end of a call that queued work reading its buffers: the queue has run before the
// call returns, also when the host gives up (the communicator then aborted, so that queued
// waits end).
class EmuComm::QueueScope {
 public:
  explicit QueueScope(EmuComm& c) : c_(c), unwinding_(std::uncaught_exceptions()) {}
  ~QueueScope() noexcept(false) {
    if (std::uncaught_exceptions() == unwinding_) {
      c_.drain_queue();
      return;
    }
    c_.aborted_.store(true);
    try {
      c_.drain_queue();
    } catch (...) {  // the error on its way out says what went wrong
    }
  }

 private:
  EmuComm& c_;
  int unwinding_;
};

int EmuComm::caller_stream() const {
  return opts_.previous_late_ms > 0 && last_stream_ == 1 ? 2 : 1;
}

void EmuComm::run(const CollectiveCall& call) {
  if (call.barrier) return barrier();
  std::lock_guard<std::mutex> g(run_mu_);
  drill_now_ = false;
  const QueueScope scope(*this);  // on an error: the queue is stopped and emptied
  issue(call, caller_stream(), false, false, [&](const cuda::Issued&) {
    drain_queue();  // the call's end, its errors raised within the call
    return 0;
  });
}

void EmuComm::barrier() {
  std::lock_guard<std::mutex> g(run_mu_);
  drill_now_ = false;
  const QueueScope scope(*this);
  barrier_call();
}

std::shared_ptr<EmuGraph> EmuComm::capture(const CollectiveCall& call) {
  std::lock_guard<std::mutex> g(run_mu_);
  auto graph = std::make_shared<EmuGraph>();
  graph->owner = this;
  graph->name = collective_name(call.collective);
  struct Recording {
    EmuComm& c;
    ~Recording() { c.capturing_ = nullptr; }
  } recording{*this};
  capturing_ = graph.get();
  graph->seq =
      issue(call, caller_stream(), true, false, [](const cuda::Issued& is) { return is.seq; });
  return graph;
}

void EmuComm::replay(const EmuGraph& graph) {
  std::lock_guard<std::mutex> g(run_mu_);
  if (graph.owner != this) throw InvalidArgument("replay: the graph was captured elsewhere");
  check_usable(graph.name.c_str());
  WaitContext w = wait_context(graph.name.c_str(), graph.seq);
  try {
    // As the GPU's graph waits on its external event node (DeviceComm::launch_kernel_mode).
    if (graph.waits_launch) stream_waits_launch(0, w);
    for (const EmuGraph::Launch& l : graph.launches)
      run_launch(l.dtype, l.args, l.regions, w, false);
  } catch (const CollectiveError& e) {
    abort(e.what());
    throw;
  }
}

EmuPlanMemory::~EmuPlanMemory() {
  for (const cuda::ArenaChunk& c : retired) free(c);
}

cuda::ArenaChunk EmuPlanMemory::alloc(size_t bytes) {
  cuda::ArenaChunk c;
  c.bytes = bytes;
  c.dev = new uint8_t[bytes];
  c.host = new uint8_t[bytes];
  return c;
}

void EmuPlanMemory::copy(uint8_t* dev, const uint8_t* host, size_t bytes, int) {
  std::memcpy(dev, host, bytes);
}

void EmuPlanMemory::retire(const cuda::ArenaChunk& c) {
  std::memset(c.dev, 0xa5, c.bytes);
  retired.push_back(c);
}

void EmuPlanMemory::free(const cuda::ArenaChunk& c) {
  delete[] c.dev;
  delete[] c.host;
}

cuda::LaunchSetup EmuComm::launch_setup(bool use_flags) const {
  return cuda::LaunchSetup{rank_,
                           size_,
                           layout_,
                           segments_.data(),
                           const_cast<cuda::DeviceStatus*>(&status_),
                           const_cast<uint32_t*>(&error_claim_),
                           timeout_s_.load(),
                           use_flags};
}

cuda::RegisteredCall EmuComm::registered_of(const CollectiveCall& call, Algo algo) const {
  return cuda::registered_call(call, algo, rank_, size_, [&](const void* p, size_t bytes) {
    return registry_.find(p, bytes);
  });
}

cuda::BufferRecord EmuComm::buffer_of(const void* p, size_t bytes,
                                      const cuda::SentAllocations& sent) {
  const std::shared_ptr<EmuAllocation> a = registry_.allocation_of(p, bytes);
  if (!a) return cuda::BufferRecord{};
  return cuda::buffer_record(p, bytes, a->key(), reinterpret_cast<uintptr_t>(a->data()), a->bytes(),
                             sent, [&] { return a->name(); });
}

uint8_t* EmuComm::map_peer(int q, const cuda::BufferRecord& r) {
  return peer_maps_.map(q, r, [](const std::string& name, uint64_t bytes) {
    ShmSegment seg = ShmSegment::open(name, std::max<uint64_t>(bytes, 1));
    uint8_t* here = seg.data();
    return std::make_pair(std::move(seg), here);
  });
}

Regions EmuComm::regions_of(const CollectiveCall& call, const cuda::KernelArgs& a) const {
  const CallExtents ext = call_extents(call, rank_, size_);
  const size_t esize = dtype_size(call.dtype);
  Regions r;
  for (int q = 0; q < size_; ++q)
    // Push: a sender writes messages and flags into its receivers' segments.
    r.list.push_back(
        {segments_[q], layout_.total_bytes(), q == rank_ || layout_.push, "device segment", q});
  r.list.push_back({static_cast<const uint8_t*>(call.in), ext.in * esize, false, "input", -1});
  r.list.push_back({static_cast<const uint8_t*>(call.out), ext.out * esize, true, "output", -1});
  r.list.push_back(
      {reinterpret_cast<const uint8_t*>(&status_), sizeof(status_), true, "device status", -1});
  if (a.reg.on) {
    // Every peer's buffers that the launch runs over, exactly its bytes (registered_bytes; the
    // two-shot through scratch: `count` elements of every scratch), peers' inputs read-only.
    CollectiveCall over = call;
    over.collective = static_cast<Collective>(a.reg.kind);
    over.count = a.reg.count;
    const cuda::RegisteredBytes bytes = cuda::registered_bytes(over, size_);
    for (int q = 0; q < size_; ++q) {
      if (q == rank_) continue;
      r.list.push_back({a.reg.in[q], bytes.in, false, "peer's input", q});
      if (a.reg.out[q] != nullptr)
        r.list.push_back({a.reg.out[q], bytes.out, true, "peer's output", q});
    }
  }
  r.self = rank_;
  r.traffic = const_cast<Traffic*>(&traffic_);
  r.weak_stores = opts_.weak_stores;
  return r;
}

// A launch as the GPU's stream would run it: kernel mode's at once on the block threads (or,
// capturing, recorded for replay); stepped mode's blocks in turn, on the queue (a call over
// registered buffers or scratch) or after it (a step).
void EmuComm::launch(const CollectiveCall& call, const cuda::KernelArgs& a, int,
                     const WaitContext& w) {
  Regions regions = regions_of(call, a);
  if (capturing_ != nullptr) {
    capturing_->launches.push_back({call.dtype, a, std::move(regions)});
    return;
  }
  if (a.use_flags) {
    for (uint32_t i = a.first_step; !a.reg.on && i < a.end_step; ++i)
      ll_steps_run_ += (a.steps[i].flags & (cuda::kRecvLL | cuda::kSendLL)) != 0;
    return run_launch(call.dtype, a, regions, w, std::exchange(drill_now_, false));
  }
  if (!a.reg.on) {
    // A stepped-mode step (run_stepped): it starts once the stream's earlier work has run, and
    // here runs on the host thread, which waits for the stream right after it anyway (a
    // hand-off to the queue's thread per step cost the emulated suite a fifth of its stepped-mode
    // time). step_delay_ms: its launch comes this late after the host has seen its inputs.
    drain_queue();
    if (opts_.step_delay_ms > 0)
      std::this_thread::sleep_for(std::chrono::milliseconds(opts_.step_delay_ms));
    return run_in_turn(call.dtype, a, regions);
  }
  enqueue([this, dtype = call.dtype, a, regions = std::move(regions)] {
    run_in_turn(dtype, a, regions);
  });
}

void EmuComm::copy(void* dst, const void* src, size_t bytes) {
  copied_ += bytes;
  enqueue([dst, src, bytes] { std::memcpy(dst, src, bytes); });
}

EmuEvents* EmuComm::events_of(int rank) const {
  return reinterpret_cast<EmuEvents*>(segments_[rank] + events_at(layout_));
}

void EmuComm::enqueue(std::function<void()> op) {
  if (!queue_) return op();
  const bool late = ((static_cast<uint64_t>(rank_) + seq_) & 1) != 0;
  queue_->push(std::move(op), late ? opts_.queue_delay_ms : 0);
}

void EmuComm::drain_queue() {
  if (queue_) queue_->drain();
}

namespace {

// A wait the queue makes: bounded and abortable as the host's, but it compares no fingerprints
// (a GPU's queued wait does not; and the call's, on the host's stack, may be gone by then).
WaitContext queued(const WaitContext& w) {
  WaitContext q = w;
  q.fingerprints = nullptr;
  q.deferred = nullptr;
  return q;
}

}  // namespace

// The fence counters (cuda::counter_fence), written and waited for by the queue.
void EmuComm::write_counter(uint64_t epoch, const WaitContext&) {
  uint64_t* mine = reinterpret_cast<uint64_t*>(segments_[rank_] + layout_.fence_offset());
  enqueue([mine, epoch] { __atomic_store_n(mine, epoch, __ATOMIC_RELEASE); });
}

void EmuComm::wait_counter(int q, uint64_t epoch, const WaitContext& w) {
  const uint64_t* theirs = reinterpret_cast<const uint64_t*>(segments_[q] + layout_.fence_offset());
  enqueue([theirs, epoch, q, w = queued(w)] {
    wait_until([&] { return __atomic_load_n(theirs, __ATOMIC_ACQUIRE) >= epoch; }, w, q,
               WaitFor::Barrier);
  });
}

// The events bind the weakest way CUDA leaves open: a queued wait waits for the event's record
// current when the queue reaches it, not when the host queued it.
void EmuComm::record_fence_event(int k) {
  EmuEvents* mine = events_of(rank_);
  const uint64_t v = __atomic_add_fetch(&mine->recorded[k], 1, __ATOMIC_ACQ_REL);
  enqueue([mine, k, v] { __atomic_store_n(&mine->completed[k], v, __ATOMIC_RELEASE); });
}

void EmuComm::wait_fence_event(int q, int k, const WaitContext& w) {
  EmuEvents* theirs = events_of(q);
  enqueue([theirs, k, q, w = queued(w)] {
    const uint64_t target = __atomic_load_n(&theirs->recorded[k], __ATOMIC_ACQUIRE);
    wait_until([&] { return __atomic_load_n(&theirs->completed[k], __ATOMIC_ACQUIRE) >= target; },
               w, q, WaitFor::Barrier);
  });
}

// A launch queued on another stream than the launch before waits for that launch's end before
// any block starts, as the GPU's stream waits for the event recorded after it (no block of it
// is resident meanwhile). Here the host waits, bounded.
void EmuComm::stream_waits_launch(int, const WaitContext& w) {
  const auto until = deadline_after(timeout_s_.load());
  for (uint64_t seen; (seen = completed()) < last_launch_.load();) {
    if (aborted_.load()) check_usable(w.collective);
    if (Clock::now() > until)
      throw CollectiveTimeout(str_cat(w.collective, " #", w.seq,
                                      ": timed out waiting for this rank's previous collective "
                                      "to end (it was queued on another stream)"));
    wait_change(&status_.done, seen, 64);
  }
}

// previous_late_ms: every launch's end is reported late (report_late), as a launch still
// running on another stream would report it.
void EmuComm::launch_ended(int, uint64_t seq) {
  if (opts_.previous_late_ms > 0) report_late(seq);
}

// previous_late_ms: call `seq` has ended, but its end is taken back and reported later from
// another thread, as a launch still running on another stream would report it: the next
// launch must wait for it (stream_waits_launch).
void EmuComm::report_late(uint64_t seq) {
  if (late_writer_.joinable()) late_writer_.join();
  __atomic_store_n(&status_.done, late_seq_, __ATOMIC_RELEASE);
  late_seq_ = seq;
  late_writer_ = std::thread([this, seq] {
    const auto at =
        std::chrono::steady_clock::now() + std::chrono::milliseconds(opts_.previous_late_ms);
    while (!late_stop_.load() && std::chrono::steady_clock::now() < at)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    __atomic_store_n(&status_.done, seq, __ATOMIC_RELEASE);
    wake(&status_.done);
  });
}

void EmuComm::run_in_turn(DType dtype, const cuda::KernelArgs& a, const Regions& regions) {
  const RegionsScope scope(&regions);
  blocks_run_ += static_cast<uint64_t>(a.grid);
  for (int b = 0; b < a.grid; ++b) run_block(dtype, a, b, opts_.threads);
}

void EmuComm::run_launch(DType dtype, const cuda::KernelArgs& args, const Regions& regions,
                         const WaitContext& w, bool drill) {
  cuda::KernelArgs parts[2];  // as launch_steps runs them on the GPU
  const int n = cuda::launches_of(args, parts);
  for (int i = 0; i < n; ++i) launch_one(dtype, parts[i], regions, w, drill && i == n - 1);
}

struct EmuComm::Dispatch {
  uint64_t ticket = 0;
  std::atomic<int> admitted{0};  // blocks [0, admitted) hold an SM, or the dispatch gave up
  std::atomic<bool> failed{false};
};

bool EmuComm::take_sm(Dispatch& d, int b, int grid, const WaitContext& w) {
  // The block at the front of the dispatch gives up at 3/4 of the timeout, before the device
  // waits of blocks that became resident give up waiting for it (at the timeout), so that its
  // report is the one; blocks behind it wait twice the timeout, for its report.
  auto until = deadline_after(2.0 * opts_.timeout_s);
  enum Waited { kDone, kAborted, kTimedOut };
  auto wait_while = [&](auto&& blocked) {
    for (int spins = 0; blocked(); ++spins) {
      if (__atomic_load_n(&status_.abort, __ATOMIC_ACQUIRE) != 0 || d.failed.load())
        return kAborted;
      if (spins < 64) continue;
      if (std::chrono::steady_clock::now() > until) return kTimedOut;
      std::this_thread::sleep_for(std::chrono::microseconds(spins < 1000 ? 20 : 200));
    }
    return kDone;
  };
  // The dispatch stops: the next launch on the GPU may go on (bounded errors, not a pile-up),
  // and this launch's later blocks go by.
  auto stop = [&] {
    if (!d.failed.exchange(true) && __atomic_load_n(&sms_->serving, __ATOMIC_ACQUIRE) == d.ticket)
      __atomic_fetch_add(&sms_->serving, 1, __ATOMIC_ACQ_REL);
    d.admitted.store(grid);
  };
  // Where the launch was stopped (a failing block, a peer's failure), the block runs without
  // an SM: it sees the stop at once and ends, counted, as a GPU's block that becomes resident
  // once the others have ended would. Where the wait for an SM timed out, it says so.
  auto gave_up = [&](Waited why, const std::string& what) {
    stop();
    if (why == kTimedOut)
      throw CollectiveTimeout(str_cat(w.collective, " #", w.seq, ": emulated device: block ", b,
                                      " of rank ", rank_, "'s launch ", what));
    return false;
  };
  if (Waited x = wait_while([&] { return d.admitted.load() < b; }); x != kDone)
    return gave_up(x, "was not dispatched: a block before it never became resident");
  until = deadline_after(0.75 * opts_.timeout_s);
  if (b == 0) {
    d.ticket = __atomic_fetch_add(&sms_->tickets, 1, __ATOMIC_ACQ_REL);
    if (Waited x = wait_while(
            [&] { return __atomic_load_n(&sms_->serving, __ATOMIC_ACQUIRE) != d.ticket; });
        x != kDone)
      return gave_up(x, str_cat("could not become resident in ", 0.75 * opts_.timeout_s,
                                " s: a launch dispatched before it on its GPU never had every "
                                "block resident"));
  }
  if (Waited x = wait_while([&] {
        uint32_t n = __atomic_load_n(&sms_->free, __ATOMIC_ACQUIRE);
        return n == 0 || !__atomic_compare_exchange_n(&sms_->free, &n, n - 1, false,
                                                      __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
      });
      x != kDone)
    return gave_up(x, str_cat("could not become resident in ", 0.75 * opts_.timeout_s,
                              " s: every one of its GPU's ", opts_.sms,
                              " SMs is held by a block that waits (more blocks must be resident "
                              "at once than the GPU holds)"));
  if (b == grid - 1) __atomic_fetch_add(&sms_->serving, 1, __ATOMIC_ACQ_REL);
  d.admitted.store(b + 1);
  return true;
}

void EmuComm::give_sm() { __atomic_fetch_add(&sms_->free, 1, __ATOMIC_ACQ_REL); }

void EmuComm::launch_one(DType dtype, const cuda::KernelArgs& a, const Regions& regions,
                         const WaitContext& w, bool drill) {
  std::vector<std::exception_ptr> errors(opts_.nblocks);
  if (!blocks_) blocks_ = std::make_unique<BlockThreads>(opts_.nblocks);
  blocks_run_ += static_cast<uint64_t>(a.grid);
  LaunchProbe probe;
  probe.stagger_ms = opts_.finish_stagger_ms;
  probe.done = &status_.done;
  probe.after = opts_.previous_late_ms > 0 ? late_seq_ : 0;  // replays too
  Dispatch dispatch;
  blocks_->run(
      [&](int b) {
        if (b >= a.grid) return;  // not launched on the GPU either (plan_grid)
        const RegionsScope scope(&regions);
        const ProbeScope probing(&probe);
        try {
          const bool holds = sms_ != nullptr && take_sm(dispatch, b, a.grid, w);
          struct Held {  // the SM, until the block ends
            EmuComm* c;
            ~Held() {
              if (c != nullptr) c->give_sm();
            }
          } held{holds ? this : nullptr};
          run_block(dtype, a, b, opts_.threads);
          // cuda::finish_launch: the call's number is written by the last block to end, so a
          // block that has ended and finds it there comes after every block's end.
          if (a.done_seq != 0 && completed() == a.done_seq && probe.ended.load() < a.grid)
            fail("the launch's end was reported before every block had ended");
          // ... and one that waited for the call before did not end before it (unless its
          // wait gave up: the status says so).
          if (probe.ahead.load() && __atomic_load_n(&status_.code, __ATOMIC_ACQUIRE) == cuda::kOk)
            fail("a block ran before the call before it (on another stream) had ended");
        } catch (...) {
          errors[b] = std::current_exception();
          __atomic_store_n(&status_.abort, 1u, __ATOMIC_RELEASE);  // stop the other blocks
        }
      },
      // The watchdog: device waits cannot see that a peer process died.
      [&] {
        for (int r = 0; r < size_ && !aborted_.load(); ++r)
          if (r != rank_ && !shm_.peer_alive(r))
            abort(str_cat(w.collective, " #", w.seq, ": rank ", r, " (pid ", shm_.pid_of(r),
                          ") is no longer running"));
      });
  if (drill) drill_fault();
  for (const std::exception_ptr& e : errors) {
    if (!e) continue;
    finished_ = 0;  // a block that threw was not counted: the communicator is done for anyway
    std::rethrow_exception(e);
  }
  if (a.done_seq != 0 && (completed() != a.done_seq || finished_ != 0))
    throw CollectiveError(str_cat(w.collective, " #", w.seq,
                                  ": the emulated device's launch ended without reporting its end "
                                  "(done word ",
                                  completed(), ", blocks counted ", finished_, ")"));
  check_launch(w.collective, w.seq);
}

// A kernel-mode launch's failure, raised as the GPU's host raises it at its next call.
void EmuComm::check_launch(const char* name, uint64_t seq) {
  if (__atomic_load_n(&status_.code, __ATOMIC_ACQUIRE) == cuda::kOk) return;
  check_device(str_cat(name, " #", seq).c_str());
}

// A mismatch found on the host: the failure word in our device segment stops the device waits
// of peers that wait for us (cuda::wait_flag), as one found on the device does.
void EmuComm::stop_peers() {
  auto* fail = reinterpret_cast<uint64_t*>(segment_.data() + layout_.fail_offset());
  uint64_t expected = 0;
  __atomic_compare_exchange_n(fail, &expected, cuda::fail_word(rank_, rank_), false,
                              __ATOMIC_RELEASE, __ATOMIC_RELAXED);
}

// Fault drills (EmuOptions::fault_seq): in stepped mode the process dies before step fault_step,
// or with fault_step 0 before a queued call's first fence, else after its (first) chunk's work.
void EmuComm::drill(const WaitContext& w, cuda::FaultPoint at, int step) {
  if (opts_.fault_seq != w.seq) return;
  if (at == cuda::FaultPoint::Step ? step == opts_.fault_step
                                   : at == cuda::FaultPoint::ChunkEnd || opts_.fault_step == 0)
    drill_fault();
}

// ... in kernel mode, after fault_step steps of the call's launch have run.
void EmuComm::drill_launch(cuda::KernelArgs& a, const WaitContext& w) {
  if (opts_.fault_seq != w.seq) return;
  a.end_step = std::min<uint32_t>(a.end_step, static_cast<uint32_t>(opts_.fault_step));
  drill_now_ = true;
}

// A fault drill: this process dies, or stalls past its peers' timeout and then dies: once
// they have all gone (they end after reporting it), or 3 s after it at the latest.
void EmuComm::drill_fault() const {
  if (!opts_.fault_exit) {
    std::this_thread::sleep_for(std::chrono::duration<double>(opts_.timeout_s));
    const auto last = std::chrono::steady_clock::now() + std::chrono::seconds(3);
    auto any_peer = [&] {
      for (int r = 0; r < size_; ++r)
        if (r != rank_ && shm_.peer_alive(r)) return true;
      return false;
    };
    while (any_peer() && std::chrono::steady_clock::now() < last)
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  _exit(0);
}

}  // namespace emu
}  // namespace pycoll
