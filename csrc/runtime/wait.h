// Bounded waiting with back-off: spin briefly, then yield, then sleep.
//
// Ranks may outnumber cores (5 ranks on 2 cores in CI), so a waiter must give its core away
// quickly; but two ranks on two idle cores should see each other within a few hundred ns.
#pragma once

#include <sched.h>
#include <time.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define PYCOLL_CPU_RELAX() _mm_pause()
#elif defined(__aarch64__)
#define PYCOLL_CPU_RELAX() asm volatile("yield" ::: "memory")
#else
#define PYCOLL_CPU_RELAX() std::atomic_signal_fence(std::memory_order_seq_cst)
#endif

namespace pycoll {

class ShmTransport;
class FingerprintGuard;
class FlightRecorder;
using Clock = std::chrono::steady_clock;

// The time point `seconds` from now.
inline Clock::time_point deadline_after(double seconds) {
  return Clock::now() +
         std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
}

// Why we wait (for the error message if the wait fails).
enum class WaitFor { Data, Space, Barrier, Arrival };

// Everything a wait needs to know to give up properly.
struct WaitContext {
  const char* collective = "";
  uint64_t seq = 0;
  double timeout_s = 0;
  const ShmTransport* transport = nullptr;
  const std::atomic<bool>* abort = nullptr;
  FingerprintGuard* fingerprints = nullptr;  // checked while a wait drags on
  // Earlier calls' fingerprints still to check (HostComm::deferred_): also checked while a
  // wait drags on, and against a peer as soon as data from it arrives.
  std::vector<FingerprintGuard>* deferred = nullptr;
  // Where this rank's flight recorder writes its ring, named in a timeout's message.
  const FlightRecorder* flight = nullptr;

  // The context of collective #seq, whose waits may last `timeout_s`.
  static WaitContext start(const char* collective, uint64_t seq, double timeout_s,
                           const ShmTransport* transport, const std::atomic<bool>* abort) {
    WaitContext w;
    w.collective = collective;
    w.seq = seq;
    w.timeout_s = timeout_s;
    w.transport = transport;
    w.abort = abort;
    return w;
  }

  // The call's deadline: `timeout_s` after the first of its waits that outlasted the spin
  // (`now`, when this is first asked). Most small calls never wait that long, and so never read
  // the clock for it.
  Clock::time_point deadline(Clock::time_point now) const {
    if (deadline_ == Clock::time_point{})
      deadline_ = now + std::chrono::duration_cast<Clock::duration>(
                            std::chrono::duration<double>(timeout_s));
    return deadline_;
  }
  void set_deadline(Clock::time_point t) { deadline_ = t; }

 private:
  mutable Clock::time_point deadline_{};
};

// Throws if waiting on `peer` no longer makes sense: it died, the communicator was aborted, or
// a peer turned out to run a different collective.
void check_wait(const WaitContext& ctx, int peer);
[[noreturn]] void throw_timeout(const WaitContext& ctx, int peer, WaitFor what);

// Sleeps for a short, exponentially growing time with a tight timer slack (the default 50 us
// slack would otherwise dominate).
class Sleeper {
 public:
  explicit Sleeper(long max_ns = 200000) : max_ns_(max_ns), ns_(max_ns < 2000 ? max_ns : 2000) {}
  ~Sleeper();
  void sleep();
  void pause() { sleep(); }  // as Backoff's, where either may wait
  // Back to the shortest sleep.
  void reset() { ns_ = max_ns_ < 2000 ? max_ns_ : 2000; }

 private:
  long max_ns_;
  long ns_;
  long saved_slack_ = -1;
};

// Gives the core away for a moment, the yield phase of every wait. sched_yield() hands the core
// to another runnable thread until that thread gives it back; a peer rank does so within
// microseconds, but a busy compute thread beside the ranks (a training job's) keeps it for a
// whole time slice, milliseconds. A yield that took longer than kSlowYield shows such a thread:
// for the next kNoYieldFor this thread then sleeps instead, at most kBusySleepNs at a time
// (the scheduler runs a thread that wakes from sleep ahead of one that has been busy all
// along), and probes again after that. Returns false instead of yielding while that lasts.
class Yield {
 public:
  static constexpr auto kSlowYield = std::chrono::microseconds(100);
  static constexpr auto kNoYieldFor = std::chrono::milliseconds(200);
  // Sleeps are kept this short meanwhile: each one ends the busy thread's turn on the core.
  static constexpr long kBusySleepNs = 20000;
  static bool contended(Clock::time_point t) { return t < no_yield_until_; }
  static bool now(Clock::time_point t) {
    if (t < no_yield_until_) return false;
    sched_yield();
    const auto after = Clock::now();
    if (after - t > kSlowYield) no_yield_until_ = after + kNoYieldFor;
    return true;
  }

 private:
  static inline thread_local Clock::time_point no_yield_until_{};
};

// Back-off for a loop that makes progress itself between checks (point-to-point): the same
// spin, yield, sleep ladder as wait_until, restarted by reset() whenever something moved.
class Backoff {
 public:
  explicit Backoff(long max_sleep_ns = 200000) : sleeper_(max_sleep_ns) {}
  void pause() {
    if (spins_ < 256) {
      ++spins_;
      PYCOLL_CPU_RELAX();
      return;
    }
    const auto now = Clock::now();
    if (spins_ == 256) {
      ++spins_;
      yield_until_ = now + std::chrono::milliseconds(1);
    }
    if (now >= yield_until_ || !Yield::now(now)) sleeper_.sleep();
  }
  void reset() {
    spins_ = 0;
    sleeper_.reset();
  }

 private:
  unsigned spins_ = 0;
  Clock::time_point yield_until_{};
  Sleeper sleeper_;
};

// Waits until `ready()` is true; `peer` is the rank being waited on.
//
// Spinning costs a core, so it lasts ~1 us; yielding lets an oversubscribed core run a peer
// and, on an idle machine, still answers within a microsecond, so it lasts up to 1 ms of
// waiting (unless a busy thread beside the ranks makes yielding costly: see Yield); only then
// do we sleep, for at most `max_sleep_ns` at a time. The deadline and peer liveness are
// checked every 10 ms.
template <class Ready>
inline void wait_until(Ready&& ready, const WaitContext& ctx, int peer, WaitFor what,
                       long max_sleep_ns = 200000) {
  constexpr int kSpins = 256;
  for (int i = 0; i < kSpins; ++i) {
    if (ready()) return;
    PYCOLL_CPU_RELAX();
  }
  const auto start = Clock::now();
  const auto deadline = ctx.deadline(start);
  const auto yield_until = start + std::chrono::milliseconds(1);
  auto next_check = start + std::chrono::milliseconds(10);
  Sleeper sleeper(max_sleep_ns);
  for (unsigned i = 0;; ++i) {
    if (ready()) return;
    const auto now = Clock::now();
    if ((i & 15) != 0 && now < yield_until) {
      if (Yield::now(now)) continue;
    }
    if (now >= next_check) {
      check_wait(ctx, peer);
      if (now >= deadline) {
        if (ready()) return;
        throw_timeout(ctx, peer, what);
      }
      next_check = now + std::chrono::milliseconds(10);
    }
    if (now >= yield_until || !Yield::now(now)) sleeper.sleep();
  }
}

}  // namespace pycoll
