// What the two point-to-point engines share: host/p2p.h (shared memory, within a node) and
// net/net_p2p.h (MPI, between nodes). The operation as the caller checked it, the batch it
// was issued in, and the progress core that moves them:
//
// One thread at a time (mu_) advances every pending operation of an engine. A caller waiting
// for its own batch progresses on its own thread (no hand-off to another thread); otherwise a
// thread started on first use does. That thread sleeps while nothing is pending, stands aside
// while a caller progresses (and, with a quiet period, until the program has made no call for
// that long), and pauses between passes instead of spinning: where ranks outnumber cores, every
// wake-up takes a core from some rank.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "common/dtypes.h"
#include "common/errors.h"
#include "runtime/wait.h"

namespace pycoll {

class Work;

enum class P2PKind { Send, Recv };

// One operation as the caller checked it: a send of, or a receive into, `count` x `dtype` at
// `buf`, with rank `peer` of the engine's communicator, under `tag`.
struct P2POp {
  P2PKind kind = P2PKind::Send;
  uint8_t* buf = nullptr;
  size_t count = 0;
  DType dtype = DType::Float32;
  int peer = 0;
  uint64_t tag = 0;

  size_t bytes() const { return count * dtype_size(dtype); }
  // "send to rank 1 (tag 3, 10 x float32)"
  std::string describe() const {
    return str_cat(kind == P2PKind::Send ? "send to" : "recv from", " rank ", peer, " (tag ", tag,
                   ", ", count, " x ", dtype_name(dtype), ")");
  }
};

// Operations issued together: complete when all of theirs are.
struct P2PBatch {
  size_t remaining = 0;
  std::atomic<bool> done{false};
  std::exception_ptr error;  // written before `done` is set
  Clock::time_point deadline;
  double timeout_s = 0;
  std::shared_ptr<Work> work;  // completed with the batch, where the caller asked for one
};

// The message of the exception `e`.
inline std::string what_of(std::exception_ptr e) {
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& x) {
    return x.what();
  }
}

// The progress core of engine `E` (CRTP), which provides, each called with mu_ held:
//   bool busy()                  whether anything is left to progress (the thread's reason)
//   bool move()                  one pass over every pending operation; true if anything moved
//   size_t pending()             operations not yet complete
//   void check_stalled(now)      a dead peer or a batch past its deadline: throws
//   void fail_pending(error)     fails every pending operation and poisons the engine
// `Pause` is how the thread waits between passes (Backoff: spin, yield, then sleep; Sleeper:
// sleep only), constructed from `pause_arg`; `quiet` the time it stands aside after the
// program's latest call (0: none).
template <class E, class Pause>
class P2PProgress {
 protected:
  P2PProgress(std::chrono::microseconds quiet, long pause_arg)
      : quiet_(quiet), pause_arg_(pause_arg) {}
  ~P2PProgress() = default;  // E calls join() first: the thread uses E's members

  // One pass (mu_ held): E's move(), and every kCheckEvery, while operations are pending, its
  // check_stalled(). A CollectiveError from either fails every pending operation
  // (fail_pending: the batch of the operation the error is about gets it, the others one that
  // names it). True if anything moved or failed.
  bool progress() {
    if (!self().busy()) return false;
    try {
      const bool moved = self().move();
      const auto now = Clock::now();
      if (self().pending() != 0 && now >= next_check_) {
        self().check_stalled(now);
        next_check_ = now + kCheckEvery;
      }
      return moved;
    } catch (const CollectiveError&) {
      self().fail_pending(std::current_exception());
      return true;
    }
  }

  // With `g` (on mu_) held: progresses until `b` is done or `until` has passed. True if done.
  bool progress_until(std::unique_lock<std::mutex>& g, const P2PBatch& b, Clock::time_point until) {
    ++waiters_;
    Backoff backoff;
    while (!b.done.load(std::memory_order_acquire)) {
      const bool moved = progress();
      if (b.done.load(std::memory_order_acquire)) break;
      g.unlock();
      if (Clock::now() >= until) {
        g.lock();
        break;
      }
      if (moved)
        backoff.reset();
      else
        backoff.pause();
      g.lock();
    }
    --waiters_;
    return b.done.load(std::memory_order_acquire);
  }

  // The end of a caller's call, `g` held: the thread is started if `b` is still pending and
  // woken if it sleeps with work left (`wake` false: the caller waits for `b` next, and
  // progresses it itself). Releases `g`.
  void end_call(std::unique_lock<std::mutex>& g, const P2PBatch& b, bool wake = true) {
    last_call_ = Clock::now();
    if (!b.done.load(std::memory_order_acquire) && !thread_.joinable())
      thread_ = std::thread([this] { loop(); });
    wake = wake && idle_ && self().busy();
    g.unlock();
    if (wake) cv_.notify_all();
  }

  // Stops the thread; `stopping_` was set with mu_ held. Idempotent.
  void join() {
    cv_.notify_all();
    if (thread_.joinable()) thread_.join();
  }

  mutable std::mutex mu_;  // one thread progresses at a time
  std::condition_variable cv_;
  bool stopping_ = false;

 private:
  E& self() { return static_cast<E&>(*this); }

  void loop() {
    Pause pause(pause_arg_);
    std::unique_lock<std::mutex> g(mu_);
    while (!stopping_) {
      if (!self().busy() || waiters_ > 0) {
        idle_ = true;
        cv_.wait(g, [&] { return stopping_ || (self().busy() && waiters_ == 0); });
        idle_ = false;
        pause.reset();
        continue;
      }
      if (quiet_.count() > 0) {
        const auto quiet = last_call_ + quiet_;
        if (Clock::now() < quiet) {
          cv_.wait_until(g, quiet);
          pause.reset();
          continue;
        }
      }
      if (progress()) pause.reset();
      g.unlock();
      pause.pause();
      g.lock();
    }
  }

  static constexpr auto kCheckEvery = std::chrono::milliseconds(10);

  const std::chrono::microseconds quiet_;
  const long pause_arg_;
  Clock::time_point next_check_ = Clock::now();
  int waiters_ = 0;                // callers progressing in progress_until
  bool idle_ = false;              // the thread waits for work (to be notified)
  Clock::time_point last_call_{};  // the program's latest call
  std::thread thread_;
};

}  // namespace pycoll
