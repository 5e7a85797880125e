// Device memory for the plans' steps (DeviceComm::plan_for's uploads): chunks of device memory,
// each with a page-locked mirror on the host, filled front to back. A new call shape costs a
// copy into the mirror and one asynchronous copy on the stream of the launch that first reads
// it: no cudaMalloc per shape (it may synchronise), no copy from pageable memory (which the
// driver stages, synchronously). A mirror's bytes are written once, so no copy still pending
// reads bytes written after it was queued. When the plan cache is emptied, the chunks that hold
// no pinned plan (a graph's) are freed once nothing of ours is in flight (registry.h,
// defer_free): the host never waits for the GPU for them.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "device/kernel_args.h"

namespace pycoll {
namespace cuda {

class PlanArena {
 public:
  static constexpr size_t kChunkBytes = 256 * 1024;  // 8192 steps

  explicit PlanArena(int device) : device_(device) {}
  ~PlanArena() { release(); }
  PlanArena(const PlanArena&) = delete;
  PlanArena& operator=(const PlanArena&) = delete;

  // `steps` in device memory, copied there on `stream` (null for no steps).
  DevStep* upload(const std::vector<DevStep>& steps, cudaStream_t stream);
  // The cache dropped every plan but `keep` (those of graphs, by device address): the chunks
  // that hold none of them are freed once quiet, and the next upload starts a new chunk.
  void retire_except(const std::vector<const DevStep*>& keep);
  // Frees every chunk now (the communicator has waited for its work, or gives up on it).
  void release();
  size_t chunks() const { return chunks_.size(); }

 private:
  struct Chunk {
    uint8_t* dev = nullptr;
    uint8_t* host = nullptr;  // page-locked mirror
    size_t bytes = 0, used = 0;
  };
  int device_;
  std::vector<Chunk> chunks_;
  bool open_ = false;  // the last chunk takes new plans
};

}  // namespace cuda
}  // namespace pycoll
