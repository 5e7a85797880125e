// OpQueue: the emulated device's stream (op_queue.h).
#include "emu/op_queue.h"

#include <chrono>

namespace pycoll {
namespace emu {

OpQueue::OpQueue() : thread_([this] { loop(); }) {}

OpQueue::~OpQueue() {
  {
    std::lock_guard<std::mutex> g(mu_);
    stopping_ = true;
  }
  work_.notify_one();
  thread_.join();
}

void OpQueue::push(std::function<void()> op, int delay_ms) {
  {
    std::lock_guard<std::mutex> g(mu_);
    ops_.emplace_back(std::move(op), delay_ms);
  }
  work_.notify_one();
}

void OpQueue::drain() {
  std::unique_lock<std::mutex> g(mu_);
  idle_.wait(g, [&] { return ops_.empty() && !busy_; });
  std::exception_ptr e = std::move(error_);
  error_ = nullptr;
  if (e) std::rethrow_exception(e);
}

void OpQueue::loop() {
  std::unique_lock<std::mutex> g(mu_);
  for (;;) {
    work_.wait(g, [&] { return !ops_.empty() || stopping_; });
    if (ops_.empty()) return;
    std::pair<std::function<void()>, int> next = std::move(ops_.front());
    ops_.pop_front();
    const bool skip = error_ != nullptr;
    busy_ = true;
    g.unlock();
    std::exception_ptr failed;
    if (!skip) {
      if (next.second > 0) std::this_thread::sleep_for(std::chrono::milliseconds(next.second));
      try {
        next.first();
      } catch (...) {
        failed = std::current_exception();
      }
    }
    next = {};  // what the op holds goes before the host hears it has run
    g.lock();
    if (failed && !error_) error_ = failed;
    busy_ = false;
    if (ops_.empty()) idle_.notify_all();
  }
}

}  // namespace emu
}  // namespace pycoll
