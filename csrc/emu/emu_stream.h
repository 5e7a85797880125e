// The emulated device's stream: calls queued on it run in order on a thread of its own, as a
// CUDA stream runs launches, while the host goes on. It is the emulated transport behind
// device/device_capi.h (the torch backend's device path), so that what follows a queued call
// (its end, its error, a future marked once it has ended, tensors kept until then) runs here
// as on a GPU.
#pragma once

#include <atomic>
#include <exception>
#include <memory>

#include "algo/call.h"
#include "emu/emu_comm.h"
#include "emu/op_queue.h"

namespace pycoll {
namespace emu {

// A call queued on an EmuStream: `error` (if it failed) is set before `ended`.
struct StreamWork {
  std::atomic<bool> ended{false};
  std::exception_ptr error;
};

class EmuStream {
 public:
  // `delay_ms` (tests): each call starts this much after the one before it has ended, so that
  // a host that reads results without waiting for the call sees them unfinished.
  EmuStream(EmuComm& comm, int delay_ms);
  ~EmuStream() = default;  // runs what is queued, then stops
  EmuStream(const EmuStream&) = delete;
  EmuStream& operator=(const EmuStream&) = delete;

  int rank() const { return comm_.rank(); }
  int size() const { return comm_.size(); }
  // Queues `call` (arguments already checked; its arrays live until it has ended).
  std::shared_ptr<StreamWork> queue(const CollectiveCall& call);

 private:
  EmuComm& comm_;
  int delay_ms_;
  OpQueue ops_;  // last: its thread stops first
};

}  // namespace emu
}  // namespace pycoll
