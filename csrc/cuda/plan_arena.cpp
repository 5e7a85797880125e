#include "cuda/plan_arena.h"

#include "cuda/cuda_check.h"
#include "cuda/registry.h"

namespace pycoll {
namespace cuda {

ArenaChunk CudaPlanMemory::alloc(size_t bytes) {
  ArenaChunk c;
  c.bytes = bytes;
  PYCOLL_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&c.dev), bytes));
  const cudaError_t e =
      cudaHostAlloc(reinterpret_cast<void**>(&c.host), bytes, cudaHostAllocDefault);
  if (e != cudaSuccess) {
    cudaFree(c.dev);
    PYCOLL_CUDA_CHECK(e);
  }
  return c;
}

void CudaPlanMemory::copy(uint8_t* dev, const uint8_t* host, size_t bytes, cudaStream_t stream) {
  PYCOLL_CUDA_CHECK(cudaMemcpyAsync(dev, host, bytes, cudaMemcpyHostToDevice, stream));
}

void CudaPlanMemory::retire(const ArenaChunk& c) {
  defer_free(device, c.dev);  // launches queued before may still read it
  defer_free_host(c.host);    // ... and copies still pending read the mirror
}

void CudaPlanMemory::free(const ArenaChunk& c) {
  cudaFree(c.dev);
  cudaFreeHost(c.host);
}

}  // namespace cuda
}  // namespace pycoll
