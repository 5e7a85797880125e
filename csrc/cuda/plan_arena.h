// The plans' steps on a GPU (device/plan_arena.h): chunks of device memory with page-locked
// mirrors, retired chunks freed once nothing is in flight (registry.h, defer_free).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

#include "device/plan_arena.h"

namespace pycoll {
namespace cuda {

struct CudaPlanMemory {
  int device;
  ArenaChunk alloc(size_t bytes);
  void copy(uint8_t* dev, const uint8_t* host, size_t bytes, cudaStream_t stream);
  void retire(const ArenaChunk& c);
  void free(const ArenaChunk& c);
};

}  // namespace cuda
}  // namespace pycoll
