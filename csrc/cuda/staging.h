// Host staging for send/recv of device arrays (pycollectives/cuda_p2p.py): page-locked host
// buffers, copies queued on a caller's stream, and marks that say when the work queued on a
// stream so far has finished (bounded waits: no wait on the GPU outlasts the timeout).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace pycoll {
namespace cuda {

// Page-locked host memory (the GPU copies it at full speed, asynchronously).
class PinnedBuffer {
 public:
  explicit PinnedBuffer(size_t bytes);
  ~PinnedBuffer();
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  uint8_t* data() const { return data_; }
  size_t bytes() const { return bytes_; }

 private:
  uint8_t* data_ = nullptr;
  size_t bytes_;
};

// Queues a copy of `bytes` between any two of host and device memory on `stream` (`device`:
// the stream's device).
void copy_async(void* dst, const void* src, size_t bytes, int device, cudaStream_t stream);

// An event recorded on a stream: everything queued there before it.
class StreamMark {
 public:
  StreamMark(int device, cudaStream_t stream);
  ~StreamMark();
  StreamMark(const StreamMark&) = delete;
  StreamMark& operator=(const StreamMark&) = delete;
  bool done() const;
  // Waits until done, at most `timeout_s` (CollectiveTimeout after that).
  void wait(double timeout_s, const char* what) const;

 private:
  int device_;
  cudaEvent_t event_ = nullptr;
};

}  // namespace cuda
}  // namespace pycoll
