// EmuStream: the emulated device's stream (emu_stream.h).
#include "emu/emu_stream.h"

namespace pycoll {
namespace emu {

EmuStream::EmuStream(EmuComm& comm, int delay_ms) : comm_(comm), delay_ms_(delay_ms) {}

std::shared_ptr<StreamWork> EmuStream::queue(const CollectiveCall& call) {
  auto work = std::make_shared<StreamWork>();
  ops_.push(
      [this, call, work] {
        try {
          comm_.run(call);
        } catch (...) {
          work->error = std::current_exception();
        }
        work->ended.store(true, std::memory_order_release);
      },
      delay_ms_);
  return work;
}

}  // namespace emu
}  // namespace pycoll
