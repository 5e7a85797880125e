// Device memory for the plans' steps (DeviceComm::plan_for's uploads): chunks of device memory,
// each with a page-locked mirror on the host, filled front to back. A new call shape costs a
// copy into the mirror and one asynchronous copy on the stream of the launch that first reads
// it: no allocation per shape (cudaMalloc may synchronise), no copy from pageable memory
// (which the driver stages, synchronously). A mirror's bytes are written once, so no copy still
// pending reads bytes written after it was queued. When the plan cache is emptied, the chunks
// that hold no pinned plan (a graph's) are retired: on a GPU freed once nothing of ours is in
// flight (registry.h, defer_free), the host never waiting for the GPU for them; on the
// emulated device overwritten with garbage, so that a launch still reading one fails.
//
// `Memory` provides the device's side (cuda/cuda_comm.h, emu/emu_comm.h):
//   Chunk alloc(size_t bytes)                       device memory and its host mirror
//   void copy(uint8_t* dev, const uint8_t* host, size_t bytes, Stream s)   queued on `s`
//   void retire(const Chunk&)                       no longer used by new launches
//   void free(const Chunk&)                         at once (nothing reads it any more)
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "device/kernel_args.h"

namespace pycoll {
namespace cuda {

struct ArenaChunk {
  uint8_t* dev = nullptr;
  uint8_t* host = nullptr;  // the mirror
  size_t bytes = 0, used = 0;
};

template <class Memory>
class PlanArena {
 public:
  static constexpr size_t kChunkBytes = 256 * 1024;  // 8192 steps

  explicit PlanArena(Memory memory) : mem_(std::move(memory)) {}
  ~PlanArena() { release(); }
  PlanArena(const PlanArena&) = delete;
  PlanArena& operator=(const PlanArena&) = delete;

  // `steps` in device memory, copied there on `stream` (null for no steps).
  template <class Stream>
  DevStep* upload(const std::vector<DevStep>& steps, Stream stream) {
    const size_t bytes = steps.size() * sizeof(DevStep);
    if (bytes == 0) return nullptr;
    const size_t need = (bytes + 255) / 256 * 256;
    if (!open_ || chunks_.back().used + need > chunks_.back().bytes) {
      chunks_.push_back(mem_.alloc(std::max(kChunkBytes, need)));
      open_ = true;
    }
    ArenaChunk& c = chunks_.back();
    std::memcpy(c.host + c.used, steps.data(), bytes);
    mem_.copy(c.dev + c.used, c.host + c.used, bytes, stream);
    DevStep* at = reinterpret_cast<DevStep*>(c.dev + c.used);
    c.used += need;
    return at;
  }

  // The cache dropped every plan but `keep` (those of graphs, by device address): the chunks
  // that hold none of them are retired, and the next upload starts a new chunk.
  void retire_except(const std::vector<const DevStep*>& keep) {
    std::vector<ArenaChunk> kept;
    for (const ArenaChunk& c : chunks_) {
      const bool holds = std::any_of(keep.begin(), keep.end(), [&](const DevStep* p) {
        const auto* b = reinterpret_cast<const uint8_t*>(p);
        return b >= c.dev && b < c.dev + c.bytes;
      });
      if (holds)
        kept.push_back(c);
      else
        mem_.retire(c);
    }
    chunks_ = std::move(kept);
    open_ = false;
  }

  // Frees every chunk now (the communicator has waited for its work, or gives up on it).
  void release() {
    for (const ArenaChunk& c : chunks_) mem_.free(c);
    chunks_.clear();
    open_ = false;
  }
  size_t chunks() const { return chunks_.size(); }
  Memory& memory() { return mem_; }

 private:
  Memory mem_;
  std::vector<ArenaChunk> chunks_;
  bool open_ = false;  // the last chunk takes new plans
};

}  // namespace cuda
}  // namespace pycoll
