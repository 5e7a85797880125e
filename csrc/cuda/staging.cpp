#include "cuda/staging.h"

#include "common/errors.h"
#include "cuda/cuda_check.h"
#include "runtime/wait.h"

namespace pycoll {
namespace cuda {

PinnedBuffer::PinnedBuffer(size_t bytes) : bytes_(bytes) {
  if (bytes == 0) return;
  void* p = nullptr;
  // Portable: any device of this process may copy from it.
  PYCOLL_CUDA_CHECK(cudaHostAlloc(&p, bytes, cudaHostAllocPortable));
  data_ = static_cast<uint8_t*>(p);
}

PinnedBuffer::~PinnedBuffer() {
  if (data_ != nullptr) cudaFreeHost(data_);
}

void copy_async(void* dst, const void* src, size_t bytes, int device, cudaStream_t stream) {
  if (bytes == 0) return;
  DeviceGuard g(device);
  PYCOLL_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream));
}

StreamMark::StreamMark(int device, cudaStream_t stream) : device_(device) {
  DeviceGuard g(device);
  PYCOLL_CUDA_CHECK(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming));
  const cudaError_t e = cudaEventRecord(event_, stream);
  if (e != cudaSuccess) {
    cudaEventDestroy(event_);
    PYCOLL_CUDA_CHECK(e);
  }
}

StreamMark::~StreamMark() {
  if (event_ == nullptr) return;
  int previous = -1;
  if (cudaGetDevice(&previous) != cudaSuccess) previous = -1;
  if (previous != device_) cudaSetDevice(device_);
  cudaEventDestroy(event_);
  if (previous >= 0 && previous != device_) cudaSetDevice(previous);
}

bool StreamMark::done() const {
  const cudaError_t e = cudaEventQuery(event_);
  if (e == cudaErrorNotReady) return false;
  PYCOLL_CUDA_CHECK(e);
  return true;
}

void StreamMark::wait(double timeout_s, const char* what) const {
  const auto deadline = deadline_after(timeout_s);
  Backoff backoff;
  while (!done()) {
    if (Clock::now() > deadline)
      throw CollectiveTimeout(str_cat(what, ": the GPU did not finish the work queued before it ",
                                      "within ", timeout_s, " s"));
    backoff.pause();
  }
}

}  // namespace cuda
}  // namespace pycoll
