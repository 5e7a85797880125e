// CudaComm: host-synchronised steps, bounded waits, barrier, watchdog and teardown.
#include <chrono>
#include <cstdio>

#include "common/errors.h"
#include "cuda/cuda_check.h"
#include "cuda/cuda_comm.h"
#include "cuda/launch.h"

namespace pycoll {
namespace cuda {

namespace {

bool receives(StepKind k) { return k != StepKind::Send && k != StepKind::Copy; }
bool sends(StepKind k) {
  return k == StepKind::Send || k == StepKind::RecvReduceSend ||
         k == StepKind::RecvReduceCopySend || k == StepKind::RecvCopySend;
}

// Calls recv(q) for every peer a step receives from and send(t) for every channel it sends on
// (t == kAllPeers: our broadcast channel).
template <class Recv, class Send>
void for_each_message(const DevStep& d, int rank, int size, Recv&& recv, Send&& send) {
  const StepKind kind = static_cast<StepKind>(d.kind);
  if (receives(kind)) {
    if (d.from == kAllPeers) {
      for (int q = 0; q < size; ++q)
        if (q != rank) recv(q);
    } else {
      recv(d.from);
      if (d.from2 != kNoPeer) recv(d.from2);
    }
  }
  if (sends(kind)) {
    send(d.to);
    if (d.to2 != kNoPeer) send(d.to2);
  }
}

}  // namespace

WaitContext CudaComm::wait_context(const char* name, uint64_t seq) const {
  return WaitContext::start(name, seq, timeout_s_.load(), &shm_, &aborted_);
}

void CudaComm::check_usable(const char* name) const {
  if (closed_) throw CollectiveError(str_cat(name, ": the communicator is closed"));
  if (aborted_.load())
    throw CollectiveError(
        str_cat(name, ": communicator is unusable after an earlier error: ", poison_reason()));
}

void CudaComm::abort(const std::string& reason) {
  {
    std::lock_guard<std::mutex> g(reason_mu_);
    if (poison_reason_.empty()) poison_reason_ = reason;
  }
  aborted_.store(true);
  if (status_host_ != nullptr) __atomic_store_n(&status_host_->abort, 1u, __ATOMIC_RELEASE);
}

std::string CudaComm::poison_reason() const {
  std::lock_guard<std::mutex> g(reason_mu_);
  return poison_reason_;
}

// Raises the error a device wait left behind (kernel mode reports asynchronously).
void CudaComm::check_device_status(const char* name) {
  if (status_host_ == nullptr) return;
  const uint32_t code = __atomic_load_n(&status_host_->code, __ATOMIC_ACQUIRE);
  if (code == kOk) return;
  const std::string what =
      str_cat(name, ": an earlier collective failed on the device: ",
              code == kTimeout ? "timed out" : "aborted", " waiting for rank ", status_host_->peer,
              " (step ", status_host_->step, ", block ", status_host_->block, ")");
  std::string reason = poison_reason();
  abort(what);
  if (code == kTimeout) throw CollectiveTimeout(what);
  throw CollectiveError(reason.empty() ? what : str_cat(what, ": ", reason));
}

// Waits for an event on our own device, up to the deadline. Our own launches never wait
// without bound: kernel-mode waits give up at the timeout or when aborted.
void CudaComm::wait_event(cudaEvent_t ev, const WaitContext& w) {
  Sleeper sleeper;
  for (unsigned i = 0;; ++i) {
    const cudaError_t e = cudaEventQuery(ev);
    if (e == cudaSuccess) return;
    if (e != cudaErrorNotReady) PYCOLL_CUDA_CHECK(e);
    if (i < 64) {
      sched_yield();
      continue;
    }
    if (Clock::now() >= w.deadline)
      throw CollectiveTimeout(str_cat(w.collective, " #", w.seq, " timed out after ", w.timeout_s,
                                      " s waiting for this rank's GPU (device ", device_, ")"));
    sleeper.sleep();
  }
}

// Host mode: waits (on the host) until the step's messages have arrived and its outgoing
// slots are free, exactly the conditions the kernel checks in kernel mode.
void CudaComm::host_wait_step(const DevStep& d, const WaitContext& w) {
  const int me = rank_;
  const uint64_t k = static_cast<uint64_t>(layout_.nslots);
  const bool bcast = (d.flags & kRecvBcast) != 0;
  for_each_message(
      d, me, size_,
      [&](int q) {
        const uint64_t m = (bcast ? counters_.bcast_received[q] : counters_.received[q]) + 1;
        auto& posted = bcast ? shm_.bcast_posted(q) : shm_.posted(q, me);
        wait_until([&] { return posted.load(std::memory_order_acquire) >= m; }, w, q,
                   WaitFor::Data);
      },
      [&](int t) {
        if (t == kAllPeers) {
          const uint64_t m = counters_.bcast_sent + 1;
          if (m <= k) return;
          for (int q = 0; q < size_; ++q) {
            if (q == me) continue;
            auto& c = shm_.bcast_consumed(q, me);
            wait_until([&] { return c.load(std::memory_order_acquire) >= m - k; }, w, q,
                       WaitFor::Space);
          }
          return;
        }
        const uint64_t m = counters_.sent[t] + 1;
        if (m <= k) return;
        auto& c = shm_.consumed(t, me);
        wait_until([&] { return c.load(std::memory_order_acquire) >= m - k; }, w, t,
                   WaitFor::Space);
      });
}

// Host mode, once the step's launch has finished: publishes its sends, frees received slots.
void CudaComm::host_publish_step(const DevStep& d) {
  const int me = rank_;
  const bool bcast = (d.flags & kRecvBcast) != 0;
  for_each_message(
      d, me, size_,
      [&](int q) {
        if (bcast)
          shm_.bcast_consumed(me, q).store(++counters_.bcast_received[q],
                                           std::memory_order_release);
        else
          shm_.consumed(me, q).store(++counters_.received[q], std::memory_order_release);
      },
      [&](int t) {
        if (t == kAllPeers)
          shm_.bcast_posted(me).store(++counters_.bcast_sent, std::memory_order_release);
        else
          shm_.posted(me, t).store(++counters_.sent[t], std::memory_order_release);
      });
}

// One launch per step; between launches the host waits for the peers. A launch never waits
// for another process, so ranks time-slicing one GPU make progress whatever the scheduler does.
void CudaComm::run_host_mode(const CollectiveCall& call, const CachedPlan& cp,
                             const WaitContext& w) {
  const std::vector<DevStep>& steps = cp.plan.steps;
  for (uint32_t i = 0; i < steps.size(); ++i) {
    host_wait_step(steps[i], w);
    KernelArgs a = kernel_args(call, cp);
    a.first_step = i;
    a.end_step = i + 1;
    PYCOLL_CUDA_CHECK(launch_steps(call.dtype, a, stream_));
    PYCOLL_CUDA_CHECK(cudaEventRecord(step_done_, stream_));
    wait_event(step_done_, w);
    host_publish_step(steps[i]);
  }
}

void CudaComm::barrier() {
  std::lock_guard<std::mutex> g(run_mu_);
  check_usable("barrier");
  DeviceGuard dg(device_);
  const uint64_t seq = ++seq_;
  Fingerprint mine;
  mine.seq = seq;
  mine.kind = kBarrierKind;
  FingerprintGuard guard(shm_, mine);
  WaitContext w = wait_context("barrier", seq);
  try {
    if (opts_.check_mismatch) {
      w.fingerprints = &guard;
      guard.publish();
    }
    PYCOLL_CUDA_CHECK(cudaEventRecord(step_done_, stream_));
    wait_event(step_done_, w);
    check_device_status("barrier");
    const uint64_t epoch = ++barrier_epoch_;
    shm_.barrier(rank_).store(epoch, std::memory_order_release);
    for (int r = 0; r < size_; ++r) {
      if (r == rank_) continue;
      auto& flag = shm_.barrier(r);
      wait_until([&] { return flag.load(std::memory_order_acquire) >= epoch; }, w, r,
                 WaitFor::Barrier);
    }
    if (w.fingerprints) guard.finish(w);
  } catch (const CollectiveError& e) {
    abort(e.what());
    throw;
  }
}

// Kernel mode: device waits cannot see that a peer process died, so while work is queued the
// host looks, and stops the device waits when one has.
void CudaComm::watchdog_loop() {
  cudaSetDevice(device_);
  while (!stopping_.load()) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    std::shared_ptr<CudaWork> work;
    {
      std::lock_guard<std::mutex> g(watch_mu_);
      work = last_work_;
    }
    if (!work || aborted_.load()) continue;
    bool done = true;
    try {
      done = work->is_completed();
    } catch (const CollectiveError&) {
      done = true;
    }
    if (done) continue;
    for (int r = 0; r < size_; ++r) {
      if (r == rank_ || shm_.peer_alive(r)) continue;
      abort(str_cat("collective #", work->seq(), ": rank ", r, " (pid ", shm_.pid_of(r),
                    ") is no longer running"));
      break;
    }
  }
}

void CudaComm::close() {
  if (closed_) return;
  stopping_.store(true);
  if (watchdog_.joinable()) watchdog_.join();
  std::lock_guard<std::mutex> g(run_mu_);
  closed_ = true;
  if (stream_ != nullptr) {
    DeviceGuard dg(device_);
    WaitContext w = wait_context("close", seq_);
    try {
      PYCOLL_CUDA_CHECK(cudaEventRecord(step_done_, stream_));
      wait_event(step_done_, w);
    } catch (const CollectiveError&) {
      // Stop the device waits, then give the launches a moment to notice.
      abort("communicator closed with collectives in flight");
      w.deadline = Clock::now() + std::chrono::seconds(10);
      try {
        wait_event(step_done_, w);
      } catch (const CollectiveError&) {
      }
    }
  }
  {
    std::lock_guard<std::mutex> w(watch_mu_);
    last_work_.reset();
  }
  release();
}

}  // namespace cuda
}  // namespace pycoll
