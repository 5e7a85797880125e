// How a CudaComm notices and reports failures: bounded waits on its own GPU, the status a
// device wait leaves behind, poisoning, the watchdog that sees dead peers, and the failure word
// that stops peers' device waits after a mismatch found on the host.
#include <chrono>
#include <functional>
#include <thread>

#include "common/errors.h"
#include "cuda/cuda_check.h"
#include "cuda/cuda_comm.h"
#include "device/stepped.h"

namespace pycoll {
namespace cuda {

void CudaComm::stop_device() {
  if (status_host_ != nullptr) __atomic_store_n(&status_host_->abort, 1u, __ATOMIC_RELEASE);
}

// Waits until `reached()` says our own device has got there, up to the deadline. Our own
// launches never wait without bound: kernel-mode waits give up at the timeout or when aborted.
void CudaComm::wait_device(const std::function<bool()>& reached, const WaitContext& w) {
  Sleeper sleeper(kSteppedMaxSleepNs);
  for (unsigned i = 0; !reached(); ++i) {
    if (i < 64) {
      sched_yield();
      continue;
    }
    // A kernel-mode wait gives up at its own timeout, counted from its launch, a little after
    // this wait began: give it time to report the rank it waited for before blaming our GPU.
    const auto now = Clock::now();
    if (now >= w.deadline(now) + std::chrono::seconds(5)) {
      check_device(w.collective);
      throw CollectiveTimeout(str_cat(w.collective, " #", w.seq, " timed out after ", w.timeout_s,
                                      " s waiting for this rank's GPU (device ", device_, ")"));
    }
    sleeper.sleep();
  }
}

void CudaComm::wait_event(cudaEvent_t ev, const WaitContext& w) {
  wait_device(
      [&] {
        const cudaError_t e = cudaEventQuery(ev);
        if (e != cudaErrorNotReady) PYCOLL_CUDA_CHECK(e);
        return e == cudaSuccess;
      },
      w);
}

void CudaComm::wait_stream(const WaitContext& w) {
  PYCOLL_CUDA_CHECK(cudaEventRecord(step_done_, stream_));
  wait_event(step_done_, w);
}

void CudaComm::wait_launch(uint64_t seq, const WaitContext& w) {
  auto work = std::make_shared<CudaWork>(events_, device_, seq);
  PYCOLL_CUDA_CHECK(cudaEventRecord(work->event(), stream_));
  watch(work);
  wait_event(work->event(), w);
}

void CudaComm::wait_queued(const WaitContext& w) {
  wait_stream(w);
  // The device reports every eager launch's end, in issue order: the last covers them all.
  if (last_launch_ != 0 && status_host_ != nullptr)
    wait_device(
        [&] { return __atomic_load_n(&status_host_->done, __ATOMIC_ACQUIRE) >= last_launch_; }, w);
}

void CudaComm::watch(std::shared_ptr<CudaWork> work) {
  std::lock_guard<std::mutex> g(watch_mu_);
  last_work_ = std::move(work);
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

void CudaComm::stop_peers() {
  if (!kernel_ || segment_ == nullptr || side_ == nullptr) return;
  // This communicator's rank (a static would keep the first communicator's in the process);
  // the copy from pageable memory is synchronised below, before `word` goes out of scope.
  const uint64_t word = fail_word(rank_, rank_);
  // Not part of any graph a thread may be capturing (relaxed mode), on a stream of its own:
  // stream_ may hold a launch that waits for a peer that waits for this word.
  cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  PYCOLL_CUDA_CHECK(cudaThreadExchangeStreamCaptureMode(&mode));
  cudaMemcpyAsync(segment_ + layout_.fail_offset(), &word, sizeof(word), cudaMemcpyHostToDevice,
                  side_);
  cudaStreamSynchronize(side_);
  PYCOLL_CUDA_CHECK(cudaThreadExchangeStreamCaptureMode(&mode));
}

}  // namespace cuda
}  // namespace pycoll
