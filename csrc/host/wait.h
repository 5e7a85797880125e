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
  Clock::time_point deadline;
  double timeout_s = 0;
  const ShmTransport* transport = nullptr;
  const std::atomic<bool>* abort = nullptr;
  FingerprintGuard* fingerprints = nullptr;  // checked while a wait drags on

  // The context of collective #seq, whose waits may last `timeout_s` from now.
  static WaitContext start(const char* collective, uint64_t seq, double timeout_s,
                           const ShmTransport* transport, const std::atomic<bool>* abort) {
    WaitContext w;
    w.collective = collective;
    w.seq = seq;
    w.timeout_s = timeout_s;
    w.deadline = deadline_after(timeout_s);
    w.transport = transport;
    w.abort = abort;
    return w;
  }
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
  // Back to the shortest sleep.
  void reset() { ns_ = max_ns_ < 2000 ? max_ns_ : 2000; }

 private:
  long max_ns_;
  long ns_;
  long saved_slack_ = -1;
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
    if (now < yield_until_)
      sched_yield();
    else
      sleeper_.sleep();
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
// waiting; only then do we sleep, for at most `max_sleep_ns` at a time. The deadline and peer
// liveness are checked every 10 ms.
template <class Ready>
inline void wait_until(Ready&& ready, const WaitContext& ctx, int peer, WaitFor what,
                       long max_sleep_ns = 200000) {
  constexpr int kSpins = 256;
  for (int i = 0; i < kSpins; ++i) {
    if (ready()) return;
    PYCOLL_CPU_RELAX();
  }
  const auto start = Clock::now();
  const auto yield_until = start + std::chrono::milliseconds(1);
  auto next_check = start + std::chrono::milliseconds(10);
  Sleeper sleeper(max_sleep_ns);
  for (unsigned i = 0;; ++i) {
    if (ready()) return;
    if ((i & 15) != 0) {
      sched_yield();
      continue;
    }
    const auto now = Clock::now();
    if (now >= next_check) {
      check_wait(ctx, peer);
      if (now >= ctx.deadline) {
        if (ready()) return;
        throw_timeout(ctx, peer, what);
      }
      next_check = now + std::chrono::milliseconds(10);
    }
    if (now < yield_until)
      sched_yield();
    else
      sleeper.sleep();
  }
}

}  // namespace pycoll
