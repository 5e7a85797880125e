// CudaWork: a queued collective's completion (an event on the communicator's stream), and the
// pool its events come from.
#include "cuda/cuda_check.h"
#include "cuda/cuda_comm.h"

namespace pycoll {
namespace cuda {

EventPool::~EventPool() {
  for (cudaEvent_t e : free_) cudaEventDestroy(e);
}

cudaEvent_t EventPool::take() {
  {
    std::lock_guard<std::mutex> g(mu_);
    if (!free_.empty()) {
      cudaEvent_t e = free_.back();
      free_.pop_back();
      return e;
    }
  }
  DeviceGuard dg(device_);
  cudaEvent_t e = nullptr;
  PYCOLL_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  return e;
}

void EventPool::give(cudaEvent_t e) {
  std::lock_guard<std::mutex> g(mu_);
  free_.push_back(e);
}

CudaWork::CudaWork(std::shared_ptr<EventPool> pool, int device, uint64_t seq, bool captured)
    : pool_(std::move(pool)),
      device_(device),
      event_(pool_->take()),
      seq_(seq),
      done_at_(seq),
      captured_(captured) {}

CudaWork::CudaWork(std::shared_ptr<const DeviceStatus> status, std::shared_ptr<EventPool> pool,
                   int device, uint64_t seq, cudaStream_t stream)
    : pool_(std::move(pool)),
      device_(device),
      seq_(seq),
      done_at_(seq),
      captured_(false),
      status_(std::move(status)),
      stream_(stream) {}

// Re-recording an event that others still wait on is safe: a wait uses the state of the event
// at the time it was queued.
CudaWork::~CudaWork() {
  if (event_ != nullptr) pool_->give(event_);
}

bool CudaWork::is_completed() const {
  if (captured_) return true;  // an event recorded in a capture cannot be queried
  if (status_ != nullptr) return __atomic_load_n(&status_->done, __ATOMIC_ACQUIRE) >= done_at_;
  // A query is one of the calls a capture in the default (global) mode forbids to every thread,
  // and would invalidate it: the capturing thread's own pruning of finished work, or the
  // watchdog's. This event was recorded outside any capture, so the query is safe: it runs in
  // relaxed mode, the thread's mode restored after.
  cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  PYCOLL_CUDA_CHECK(cudaThreadExchangeStreamCaptureMode(&mode));
  const cudaError_t e = cudaEventQuery(event_);
  PYCOLL_CUDA_CHECK(cudaThreadExchangeStreamCaptureMode(&mode));
  if (e == cudaErrorNotReady) return false;
  PYCOLL_CUDA_CHECK(e);
  return true;
}

void CudaWork::wait_on(cudaStream_t stream) const {
  if (captured_) return;  // the capture joined the caller's stream already
  DeviceGuard g(device_);
  if (event_ != nullptr) {
    PYCOLL_CUDA_CHECK(cudaStreamWaitEvent(stream, event_, 0));
    return;
  }
  // Launched on stream_ with no event: that stream orders it for its own later work; another
  // stream waits for what stream_ holds now (the collective and whatever followed it).
  if (stream == stream_ || is_completed()) return;
  cudaEvent_t e = pool_->take();
  PYCOLL_CUDA_CHECK(cudaEventRecord(e, stream_));
  const cudaError_t err = cudaStreamWaitEvent(stream, e, 0);
  pool_->give(e);
  PYCOLL_CUDA_CHECK(err);
}

}  // namespace cuda
}  // namespace pycoll
