// Work queued in order on a thread of its own, as a CUDA stream runs what is queued on it
// while the host goes on: the emulated device's streams (emu_stream.h, and stepped mode's queue
// in EmuComm, whose fences wait on the peers' emulated events).
#pragma once

#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <utility>

namespace pycoll {
namespace emu {

class OpQueue {
 public:
  OpQueue();
  ~OpQueue();  // runs what is queued, then stops
  OpQueue(const OpQueue&) = delete;
  OpQueue& operator=(const OpQueue&) = delete;

  // Queues `op`, to start `delay_ms` after the op before it has ended (tests: a host that does
  // not wait for it sees it unfinished). An op that throws skips those queued after it, as a
  // failed launch leaves a stream, until drain.
  void push(std::function<void()> op, int delay_ms = 0);
  // Waits until everything queued has run, then rethrows the first error since the last
  // drain. Bounded as the ops are: each of their waits is.
  void drain();

 private:
  void loop();

  std::mutex mu_;
  std::condition_variable work_, idle_;
  std::deque<std::pair<std::function<void()>, int>> ops_;
  bool busy_ = false, stopping_ = false;
  std::exception_ptr error_;
  std::thread thread_;
};

}  // namespace emu
}  // namespace pycoll
