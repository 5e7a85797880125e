#include "cuda/plan_arena.h"

#include <algorithm>
#include <cstring>

#include "cuda/cuda_check.h"
#include "cuda/registry.h"

namespace pycoll {
namespace cuda {

DevStep* PlanArena::upload(const std::vector<DevStep>& steps, cudaStream_t stream) {
  const size_t bytes = steps.size() * sizeof(DevStep);
  if (bytes == 0) return nullptr;
  const size_t need = (bytes + 255) / 256 * 256;
  if (!open_ || chunks_.back().used + need > chunks_.back().bytes) {
    Chunk c;
    c.bytes = std::max(kChunkBytes, need);
    PYCOLL_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&c.dev), c.bytes));
    const cudaError_t e =
        cudaHostAlloc(reinterpret_cast<void**>(&c.host), c.bytes, cudaHostAllocDefault);
    if (e != cudaSuccess) {
      cudaFree(c.dev);
      PYCOLL_CUDA_CHECK(e);
    }
    chunks_.push_back(c);
    open_ = true;
  }
  Chunk& c = chunks_.back();
  std::memcpy(c.host + c.used, steps.data(), bytes);
  PYCOLL_CUDA_CHECK(
      cudaMemcpyAsync(c.dev + c.used, c.host + c.used, bytes, cudaMemcpyHostToDevice, stream));
  DevStep* at = reinterpret_cast<DevStep*>(c.dev + c.used);
  c.used += need;
  return at;
}

void PlanArena::retire_except(const std::vector<const DevStep*>& keep) {
  std::vector<Chunk> kept;
  for (const Chunk& c : chunks_) {
    const bool holds = std::any_of(keep.begin(), keep.end(), [&](const DevStep* p) {
      const auto* b = reinterpret_cast<const uint8_t*>(p);
      return b >= c.dev && b < c.dev + c.bytes;
    });
    if (holds) {
      kept.push_back(c);
      continue;
    }
    defer_free(device_, c.dev);  // launches queued before may still read it
    defer_free_host(c.host);     // ... and copies still pending read the mirror
  }
  chunks_ = std::move(kept);
  open_ = false;
}

void PlanArena::release() {
  for (const Chunk& c : chunks_) {
    cudaFree(c.dev);
    cudaFreeHost(c.host);
  }
  chunks_.clear();
  open_ = false;
}

}  // namespace cuda
}  // namespace pycoll
