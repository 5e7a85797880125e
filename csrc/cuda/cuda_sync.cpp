// CudaComm: host-synchronised steps, bounded waits, barrier, watchdog and teardown.
#include <chrono>
#include <cstdio>

#include "common/errors.h"
#include "cuda/cuda_check.h"
#include "cuda/cuda_comm.h"
#include "cuda/launch.h"
#include "device/host_steps.h"

namespace pycoll {
namespace cuda {

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
  if (code == kMismatch) {
    const std::string what = device_mismatch_message(name, *status_host_, rank_);
    abort(what);
    throw CollectiveMismatch(what);
  }
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
  Sleeper sleeper(kHostModeMaxSleepNs);
  for (unsigned i = 0;; ++i) {
    const cudaError_t e = cudaEventQuery(ev);
    if (e == cudaSuccess) return;
    if (e != cudaErrorNotReady) PYCOLL_CUDA_CHECK(e);
    if (i < 64) {
      sched_yield();
      continue;
    }
    // A kernel-mode wait gives up at its own timeout, counted from its launch, a little after
    // this wait began: give it time to report the rank it waited for before blaming our GPU.
    const auto now = Clock::now();
    if (now >= w.deadline(now) + std::chrono::seconds(5)) {
      check_device_status(w.collective);
      throw CollectiveTimeout(str_cat(w.collective, " #", w.seq, " timed out after ", w.timeout_s,
                                      " s waiting for this rank's GPU (device ", device_, ")"));
    }
    sleeper.sleep();
  }
}

// One launch per step; between launches the host waits for the peers. A launch never waits
// for another process, so ranks time-slicing one GPU make progress whatever the scheduler does.
void CudaComm::run_host_mode(const CollectiveCall& call, const CachedPlan& cp,
                             const WaitContext& w) {
  const std::vector<DevStep>& steps = cp.plan.steps;
  for (uint32_t i = 0; i < steps.size(); ++i) {
    host_wait_step(shm_, counters_, steps[i], w);
    KernelArgs a = kernel_args(call, cp);
    a.first_step = i;
    a.end_step = i + 1;
    a.grid = active_channels(steps[i].count, layout_);  // this step's message alone
    PYCOLL_CUDA_CHECK(launch_steps(call.dtype, a, stream_));
    PYCOLL_CUDA_CHECK(cudaEventRecord(step_done_, stream_));
    wait_event(step_done_, w);
    host_publish_step(shm_, counters_, steps[i]);
  }
}

// Kernel mode: a launch that only compares calls with every peer (check_call) is the barrier:
// it runs once this rank's queued work has, and ends once every peer's has reached it. Host
// mode meets on the host flags.
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
    w.fingerprints = &guard;
    guard.publish();
    if (mode_ == SyncMode::Kernel) {
      CollectiveCall none;
      none.barrier = true;
      run_kernel_mode(none, nullptr, mine);
      // The watchdog looks after this launch as after a collective's: its device waits cannot
      // see a peer that died, and the host waits on it alone.
      auto work = std::make_shared<CudaWork>(events_, device_, seq);
      PYCOLL_CUDA_CHECK(cudaEventRecord(work->event(), stream_));
      watch(work);
      wait_event(work->event(), w);
      check_device_status("barrier");
      return;
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
    if (opts_.check_mismatch) guard.finish(w);
  } catch (const CollectiveMismatch& e) {
    stop_peers_on_mismatch();
    abort(e.what());
    throw;
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
      w.set_deadline(Clock::now() + std::chrono::seconds(10));
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
