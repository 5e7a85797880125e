// EmuStream: the emulated device's stream (emu_stream.h).
#include "emu/emu_stream.h"

#include <chrono>

namespace pycoll {
namespace emu {

EmuStream::EmuStream(EmuComm& comm, int delay_ms)
    : comm_(comm), delay_ms_(delay_ms), thread_([this] { loop(); }) {}

EmuStream::~EmuStream() {
  {
    std::lock_guard<std::mutex> g(mu_);
    stopping_ = true;
  }
  cv_.notify_one();
  thread_.join();
}

std::shared_ptr<StreamWork> EmuStream::queue(const CollectiveCall& call) {
  auto work = std::make_shared<StreamWork>();
  {
    std::lock_guard<std::mutex> g(mu_);
    queued_.emplace_back(call, work);
  }
  cv_.notify_one();
  return work;
}

void EmuStream::loop() {
  for (;;) {
    std::pair<CollectiveCall, std::shared_ptr<StreamWork>> next;
    {
      std::unique_lock<std::mutex> g(mu_);
      cv_.wait(g, [&] { return !queued_.empty() || stopping_; });
      if (queued_.empty()) return;
      next = std::move(queued_.front());
      queued_.pop_front();
    }
    if (delay_ms_ > 0) std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms_));
    try {
      comm_.run(next.first);
    } catch (...) {
      next.second->error = std::current_exception();
    }
    next.second->ended.store(true, std::memory_order_release);
  }
}

}  // namespace emu
}  // namespace pycoll
