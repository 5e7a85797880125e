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

#include "common/errors.h"
#include "device/host_steps.h"
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

}  // namespace

EmuComm::EmuComm(int rank, int size, const EmuOptions& opts)
    : rank_(rank),
      size_(size),
      opts_(opts),
      shm_(rank, size, 64, opts.nslots),
      counters_(size),
      registry_(rank, size) {
  if (size > cuda::kMaxRanks)
    throw InvalidArgument(
        str_cat("the device transport holds at most ", cuda::kMaxRanks, " ranks"));
  if (opts.nblocks < 1 || opts.nblocks > 128 || opts.threads < 1 || opts.nslots < 2)
    throw InvalidArgument("emulated device: bad blocks, threads or slot count");
  layout_ = cuda::make_layout(size, opts.nslots, opts.nblocks, opts.slot_bytes, opts.ll_max_bytes,
                              opts.ll_flag_bits);
  if (opts.sms < 0) throw InvalidArgument("emulated device: negative SM count");
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
  if (opts_.sms > 0 && opts_.kernel_mode) {
    int first = rank_;  // the lowest rank on our GPU holds its SMs
    for (int r = 0; r < size_ && !gpus.empty(); ++r)
      if (gpus[r] == gpus[rank_]) {
        first = r;
        break;
      }
    sms_ = reinterpret_cast<EmuSms*>(segments_[first] + sms_at(layout_));
  }
  shm_.attach(flags);
  if (!opts_.kernel_mode && opts_.host_events) queue_ = std::make_unique<OpQueue>();
}

void EmuComm::unlink() {
  segment_.unlink();
  shm_.unlink();
}

Algo EmuComm::choose(Collective c, size_t bytes) const {
  return cuda::device_choose(c, bytes, opts_.direct_max_bytes);
}

void EmuComm::abort(const std::string& reason) {
  if (poison_reason_.empty()) poison_reason_ = reason;
  aborted_.store(true);
  __atomic_store_n(&status_.abort, 1u, __ATOMIC_RELEASE);
}

WaitContext EmuComm::wait_context(const char* name, uint64_t seq) const {
  return WaitContext::start(name, seq, opts_.timeout_s, &shm_, &aborted_);
}

// The plan of a call that moves nothing on this rank: its launch only compares the call.
const cuda::Plan EmuComm::kNoSteps{};

const cuda::Plan& EmuComm::plan_for(const CollectiveCall& call, Algo algo) {
  return plans_.get(
      call, algo,
      [&] {
        ++plans_built_;
        return cuda::plan_call(algo, call, rank_, size_, layout_, opts_.slot_bytes,
                               opts_.oneshot_max_bytes, ll_max_bytes(), opts_.lookahead);
      },
      [](auto&) {});  // launches here are synchronous: nothing still reads a plan
}

// The buffers the device code may touch in this call.
Regions EmuComm::launch_regions(const CollectiveCall& call) const {
  const CallExtents ext = call_extents(call, rank_, size_);
  const size_t esize = dtype_size(call.dtype);
  Regions r;
  for (int q = 0; q < size_; ++q)
    r.list.push_back({segments_[q], layout_.total_bytes(), q == rank_, "device segment", q});
  r.list.push_back({static_cast<const uint8_t*>(call.in), ext.in * esize, false, "input", -1});
  r.list.push_back({static_cast<const uint8_t*>(call.out), ext.out * esize, true, "output", -1});
  r.list.push_back(
      {reinterpret_cast<const uint8_t*>(&status_), sizeof(status_), true, "device status", -1});
  r.self = rank_;
  r.traffic = const_cast<Traffic*>(&traffic_);
  r.weak_stores = opts_.weak_stores;
  return r;
}

cuda::RegisteredCall EmuComm::registered_of(const CollectiveCall& call, Algo algo) const {
  return cuda::registered_call(call, algo, rank_, size_, [&](const void* p, size_t bytes) {
    return registry_.find(p, bytes);
  });
}

// The host's end of a call that queued work reading its locals: the queue has run before they
// go, also when the host gives up (the communicator then aborted, so that queued waits end).
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

// The collective over every rank's registered input and output (run_registered; the
// two-shot for an all-reduce), every peer's buffers regions of the launch (exactly the call's
// bytes of each; peers' inputs read-only). Kernel mode: one launch (two with several blocks:
// launches_of) that compares the call first. Host mode (the call compared on the host
// already): a fence, the blocks queued (no device wait in them), a fence, as CudaComm does.
void EmuComm::run_on_registered(const CollectiveCall& call, const cuda::RegisteredCall& t,
                                const WaitContext& w, const Fingerprint& f) {
  cuda::KernelArgs a =
      cuda::make_kernel_args(launch_setup(opts_.kernel_mode), call, nullptr, 0, 1, counters_);
  cuda::set_registered(a, call, t.in, t.out);
  Regions regions = launch_regions(call);
  const cuda::RegisteredBytes bytes = cuda::registered_bytes(call, size_);
  for (int q = 0; q < size_; ++q) {
    if (q == rank_) continue;
    regions.list.push_back({t.in[q], bytes.in, false, "registered input", q});
    if (t.out[q] != nullptr)
      regions.list.push_back({t.out[q], bytes.out, true, "registered output", q});
  }
  ++twoshot_runs_;
  const bool drill = opts_.fault_seq == w.seq;
  if (opts_.kernel_mode) {
    cuda::check_on_device(a, f);
    if (drill) a.end_step = std::min<uint32_t>(a.end_step, static_cast<uint32_t>(opts_.fault_step));
    launch_eager(call.dtype, a, regions, w, drill);
    return;
  }
  if (drill && opts_.fault_step == 0) drill_fault();
  const QueueScope scope(*this);
  fence(w);
  enqueue([&] { run_in_turn(call.dtype, a, regions); });
  if (drill) drill_fault();
  fence(w);
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

void EmuComm::fence(const WaitContext& w) {
  if (!queue_) {  // everything ran as it was queued
    cuda::host_meet(shm_, ++barrier_epoch_, w);
    return;
  }
  if (opts_.fence_counters) {
    const size_t at = layout_.fence_offset();
    cuda::counter_fence(
        shm_, ++barrier_epoch_, w,
        [&](uint64_t epoch) {
          uint64_t* mine = reinterpret_cast<uint64_t*>(segments_[rank_] + at);
          enqueue([mine, epoch] { __atomic_store_n(mine, epoch, __ATOMIC_RELEASE); });
        },
        [&](int q, uint64_t epoch) {
          const uint64_t* theirs = reinterpret_cast<const uint64_t*>(segments_[q] + at);
          enqueue([theirs, epoch, q, w] {
            wait_until([&] { return __atomic_load_n(theirs, __ATOMIC_ACQUIRE) >= epoch; }, w, q,
                       WaitFor::Barrier);
          });
        });
    return;
  }
  // The events bind the weakest way CUDA leaves open: a queued wait waits for the event's
  // record current when the queue reaches it, not when the host queued it.
  cuda::event_fence(
      shm_, ++barrier_epoch_, w,
      [&](int k) {
        EmuEvents* mine = events_of(rank_);
        const uint64_t v = __atomic_add_fetch(&mine->recorded[k], 1, __ATOMIC_ACQ_REL);
        enqueue([mine, k, v] { __atomic_store_n(&mine->completed[k], v, __ATOMIC_RELEASE); });
      },
      [&](int q, int k) {
        EmuEvents* theirs = events_of(q);
        enqueue([theirs, k, q, w] {
          const uint64_t target = __atomic_load_n(&theirs->recorded[k], __ATOMIC_ACQUIRE);
          wait_until(
              [&] { return __atomic_load_n(&theirs->completed[k], __ATOMIC_ACQUIRE) >= target; }, w,
              q, WaitFor::Barrier);
        });
      });
}

cuda::KernelArgs EmuComm::twoshot_args(const CollectiveCall& call, size_t len,
                                       const std::vector<uint8_t*>& in,
                                       const std::vector<uint8_t*>& out, bool use_flags) {
  cuda::KernelArgs a =
      cuda::make_kernel_args(launch_setup(use_flags), call, nullptr, 0, 1, counters_);
  cuda::set_twoshot(a, len, in, out);
  return a;
}

void EmuComm::run_in_turn(DType dtype, const cuda::KernelArgs& a, const Regions& regions) {
  const RegionsScope scope(&regions);
  blocks_run_ += static_cast<uint64_t>(a.grid);
  for (int b = 0; b < a.grid; ++b) run_block(dtype, a, b, opts_.threads);
}

cuda::LaunchSetup EmuComm::launch_setup(bool use_flags) {
  return cuda::LaunchSetup{rank_,    size_,         layout_,         segments_.data(),
                           &status_, &error_claim_, opts_.timeout_s, use_flags};
}

void EmuComm::check_status(const char* name, uint64_t seq) {
  const uint32_t code = __atomic_load_n(&status_.code, __ATOMIC_ACQUIRE);
  if (code == cuda::kOk) return;
  if (code == cuda::kMismatch) {
    const std::string what = cuda::device_mismatch_message(name, status_, rank_);
    abort(what);
    throw CollectiveMismatch(what);
  }
  const std::string what = str_cat(name, " #", seq, ": the emulated device ",
                                   code == cuda::kTimeout ? "timed out" : "was aborted",
                                   " waiting for ", cuda::device_wait_target(status_, rank_));
  const std::string reason = poison_reason_;
  abort(what);
  if (code == cuda::kTimeout) throw CollectiveTimeout(what);
  throw CollectiveError(reason.empty() ? what : str_cat(what, ": ", reason));
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

// Host mode through scratch (cuda::run_scratch), as CudaComm runs it: the copies are the
// queue's (a GPU's copy engines; not counted as the device code's traffic), the two-shot's
// blocks run in turn on it, the fences between them.
void EmuComm::run_host_scratch(const CollectiveCall& call, const WaitContext& w, bool met,
                               uint64_t widest) {
  const size_t cap = cuda::scratch_elems(layout_, dtype_size(call.dtype));
  Regions regions = launch_regions(call);
  const std::vector<uint8_t*> scratch = cuda::scratch_of(layout_, segments_.data());
  for (int q = 0; q < size_; ++q)  // the two-shot writes every rank's scratch
    if (q != rank_)
      regions.list.push_back({scratch[q], cap * dtype_size(call.dtype), true, "peer scratch", q});
  const bool drill = opts_.fault_seq == w.seq;
  struct Ops {
    EmuComm& c;
    const CollectiveCall& call;
    const WaitContext& w;
    const Regions& regions;
    bool drill;
    void copy(void* dst, const void* src, size_t bytes) {
      c.enqueue([dst, src, bytes] { std::memcpy(dst, src, bytes); });
    }
    void twoshot(size_t len, const std::vector<uint8_t*>& scratch) {
      c.enqueue([this, a = c.twoshot_args(call, len, scratch, scratch, false)] {
        c.run_in_turn(call.dtype, a, regions);
      });
    }
    void fence() { c.fence(w); }
    void meet() { cuda::host_meet(c.shm_, ++c.barrier_epoch_, w); }
    void chunk_done() {
      ++c.scratch_chunks_;
      if (drill) c.drill_fault();
    }
  } ops{*this, call, w, regions, drill};
  ++scratch_runs_;
  if (drill && opts_.fault_step == 0) drill_fault();
  const QueueScope scope(*this);
  cuda::run_scratch(call, layout_, segments_.data(), rank_, met, ops, widest);
}

// One launch for the whole collective: a thread per block, waiting on device flags. Block 0
// checks the call against its peers' first (cuda::check_call), as on the GPU.
void EmuComm::run_kernel_mode(const CollectiveCall& call, const cuda::Plan& plan,
                              const WaitContext& w, const Fingerprint& f) {
  cuda::KernelArgs a = cuda::make_kernel_args(launch_setup(true), call, plan.steps.data(),
                                              plan.steps.size(), plan.grid, counters_);
  cuda::check_on_device(a, f);
  for (const cuda::DevStep& d : plan.steps)
    ll_steps_run_ += (d.flags & (cuda::kRecvLL | cuda::kSendLL)) != 0;
  const bool drill = opts_.fault_seq == w.seq;
  if (drill) a.end_step = std::min<uint32_t>(a.end_step, static_cast<uint32_t>(opts_.fault_step));
  launch_eager(call.dtype, a, launch_regions(call), w, drill);
}

// An eager kernel-mode launch, as CudaComm makes it (launch_kernel_mode): call number w.seq,
// its end reported in the done word, and (previous_late_ms) queued as if on another stream
// than the call before: then it waits for that call's end before any block starts, as the
// GPU's stream waits for the event on the call before's stream (the host queued that wait, and
// no block of it is resident meanwhile). Here the host waits, bounded.
void EmuComm::launch_eager(DType dtype, cuda::KernelArgs& a, const Regions& regions,
                           const WaitContext& w, bool drill) {
  // Not launched (cuda::runs_anything): no end is reported, and the next launch waits for the
  // one before, as CudaComm::launch_kernel_mode leaves it.
  if (!cuda::runs_anything(a)) return;
  a.finished = &finished_;
  a.done_seq = w.seq;
  if (opts_.previous_late_ms > 0) wait_previous(w);
  launch(dtype, a, regions, w, drill);
  if (opts_.previous_late_ms > 0) report_late(w.seq);
}

void EmuComm::wait_previous(const WaitContext& w) {
  const auto until = std::chrono::steady_clock::now() +
                     std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                         std::chrono::duration<double>(opts_.timeout_s));
  for (uint64_t seen; (seen = completed()) < late_seq_;) {
    if (aborted_.load()) check_usable(w.collective);
    if (std::chrono::steady_clock::now() > until)
      throw CollectiveTimeout(str_cat(w.collective, " #", w.seq,
                                      ": timed out waiting for this rank's previous collective "
                                      "to end (it was queued on another stream)"));
    wait_change(&status_.done, seen, 64);
  }
}

// previous_late_ms: call `seq` has ended, but its end is taken back and reported later from
// another thread, as a launch still running on another stream would report it: the next
// launch must wait for it (wait_previous).
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

void EmuComm::launch(DType dtype, const cuda::KernelArgs& args, const Regions& regions,
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
  auto deadline = [&](double share) {
    return std::chrono::steady_clock::now() +
           std::chrono::duration_cast<std::chrono::steady_clock::duration>(
               std::chrono::duration<double>(opts_.timeout_s * share));
  };
  auto until = deadline(2.0);
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
  until = deadline(0.75);
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
  probe.after = opts_.previous_late_ms > 0 && a.done_seq != 0 ? late_seq_ : 0;
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
  check_status(w.collective, w.seq);
}

// One launch per step, its blocks in turn; the host waits for the peers between launches.
void EmuComm::run_host_mode(const CollectiveCall& call, const cuda::Plan& plan,
                            const WaitContext& w) {
  const cuda::LaunchSetup setup = launch_setup(false);
  const Regions regions = launch_regions(call);
  for (size_t i = 0; i < plan.steps.size(); ++i) {
    if (opts_.fault_seq == w.seq && i == static_cast<size_t>(opts_.fault_step)) drill_fault();
    cuda::host_wait_step(shm_, counters_, plan.steps[i], w);
    if (opts_.step_delay_ms > 0)
      std::this_thread::sleep_for(std::chrono::milliseconds(opts_.step_delay_ms));
    // As CudaComm launches it: the blocks of this step's message alone.
    cuda::KernelArgs a =
        cuda::make_kernel_args(setup, call, plan.steps.data(), plan.steps.size(),
                               cuda::active_channels(plan.steps[i].count, layout_), counters_);
    a.first_step = static_cast<uint32_t>(i);
    a.end_step = static_cast<uint32_t>(i + 1);
    run_in_turn(call.dtype, a, regions);
    cuda::host_publish_step(shm_, counters_, plan.steps[i]);
  }
}

Algo EmuComm::algo_of(const CollectiveCall& call) const {
  return call.algo == Algo::Auto
             ? choose(call.collective, choice_count(call, size_) * dtype_size(call.dtype))
             : call.algo;
}

void EmuComm::check_usable(const std::string& name) const {
  if (aborted_.load())
    throw CollectiveError(
        str_cat(name, ": communicator is unusable after an earlier error: ", poison_reason_));
}

// As on the GPU (cuda_comm.cpp): every rank publishes its fingerprint; where the ranks meet on
// the host (`meet`: cuda::meets_on_host) they compare them here before anything moves.
uint64_t EmuComm::rendezvous(const CollectiveCall& call, FingerprintGuard& guard, WaitContext& w,
                             bool meet) {
  w.fingerprints = &guard;
  guard.publish();
  if (!meet) return 0;
  uint64_t widest = 0;
  if (!call.send_counts.empty())
    widest = check_split_matrix(shm_, guard, w, call.send_counts, call.recv_counts);
  guard.finish(w);
  return widest;
}

// A mismatch found on the host: the failure word in our device segment stops the device waits
// of peers that wait for us (cuda::wait_flag), as one found on the device does.
void EmuComm::stop_peers_on_mismatch() {
  auto* fail = reinterpret_cast<uint64_t*>(segment_.data() + layout_.fail_offset());
  uint64_t expected = 0;
  __atomic_compare_exchange_n(fail, &expected, cuda::fail_word(rank_, rank_), false,
                              __ATOMIC_RELEASE, __ATOMIC_RELAXED);
}

void EmuComm::run(const CollectiveCall& call) {
  std::lock_guard<std::mutex> g(run_mu_);
  const char* name = call.barrier ? "barrier" : collective_name(call.collective);
  check_usable(name);
  cuda::check_device_call(call, size_);
  const uint64_t seq = ++seq_;
  const Algo algo = algo_of(call);
  const cuda::RegisteredCall registered = registered_of(call, algo);
  Fingerprint mine = Fingerprint::of_call(seq, call, algo);
  if (registered.on) mine = cuda::registered_fingerprint(mine, registered);
  FingerprintGuard guard(shm_, mine);
  WaitContext w = wait_context(name, seq);
  try {
    const bool meet = cuda::meets_on_host(call, opts_.kernel_mode, false, opts_.host_checks);
    const uint64_t widest = rendezvous(call, guard, w, meet);
    const bool empty = moves_nothing(call, rank_, size_);
    if (registered.on && !empty)
      run_on_registered(call, registered, w, mine);
    else if (!empty && cuda::host_scratch_eligible(call, algo, opts_.kernel_mode,
                                                   opts_.host_twoshot, widest != 0))
      run_host_scratch(call, w, meet, widest);
    else if (opts_.kernel_mode)  // a call that moves nothing launches too: it compares the call
      run_kernel_mode(call, empty ? kNoSteps : plan_for(call, algo), w, mine);
    else if (!empty)
      run_host_mode(call, plan_for(call, algo), w);
  } catch (const CollectiveMismatch& e) {
    stop_peers_on_mismatch();
    abort(e.what());
    throw;
  } catch (const CollectiveError& e) {
    abort(e.what());  // peers' counters no longer match ours
    throw;
  }
}

std::shared_ptr<EmuGraph> EmuComm::capture(const CollectiveCall& call) {
  std::lock_guard<std::mutex> g(run_mu_);
  const char* name = call.barrier ? "barrier" : collective_name(call.collective);
  check_usable(name);
  cuda::check_device_call(call, size_);
  const Algo algo = algo_of(call);
  const bool empty = moves_nothing(call, rank_, size_);
  // As CudaComm refuses it, before anything is exchanged.
  cuda::check_capturable(name, opts_.kernel_mode, empty || plans_.find(call, algo) != nullptr);
  const uint64_t seq = ++seq_;
  const Fingerprint mine = Fingerprint::of_call(seq, call, algo);
  FingerprintGuard guard(shm_, mine);
  WaitContext w = wait_context(name, seq);
  try {
    rendezvous(call, guard, w, cuda::meets_on_host(call, opts_.kernel_mode, true));
  } catch (const CollectiveError& e) {
    abort(e.what());
    throw;
  }
  auto graph = std::make_shared<EmuGraph>();
  graph->owner = this;
  graph->empty = empty;
  graph->name = name;
  graph->seq = seq;
  const cuda::Plan& plan = empty ? kNoSteps : plans_.pin(call, algo);
  graph->dtype = call.dtype;
  graph->args = cuda::make_kernel_args(launch_setup(true), call, plan.steps.data(),
                                       plan.steps.size(), plan.grid, counters_);
  cuda::check_on_device(graph->args, mine);  // every replay compares the call again
  graph->regions = launch_regions(call);
  return graph;
}

void EmuComm::replay(const EmuGraph& graph) {
  std::lock_guard<std::mutex> g(run_mu_);
  if (graph.owner != this) throw InvalidArgument("replay: the graph was captured elsewhere");
  check_usable(graph.name);
  WaitContext w = wait_context(graph.name.c_str(), graph.seq);
  try {
    launch(graph.dtype, graph.args, graph.regions, w, false);
  } catch (const CollectiveError& e) {
    abort(e.what());
    throw;
  }
}

}  // namespace emu
}  // namespace pycoll
