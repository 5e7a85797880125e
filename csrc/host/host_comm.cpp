#include "host/host_comm.h"

#include "algo/ring.h"
#include "common/errors.h"

namespace pycoll {

HostComm::HostComm(int rank, int size, const HostCommOptions& opts)
    : opts_(opts),
      transport_(rank, size, opts.slot_bytes, opts.nslots),
      sent_(size, 0),
      received_(size, 0),
      timeout_s_(opts.timeout_s) {}

void HostComm::abort(const std::string& reason) {
  {
    std::lock_guard<std::mutex> g(reason_mu_);
    if (poison_reason_.empty()) poison_reason_ = reason;
  }
  aborted_.store(true);
}

std::string HostComm::poison_reason() const {
  std::lock_guard<std::mutex> g(reason_mu_);
  return poison_reason_;
}

WaitContext HostComm::begin(const char* name) {
  if (aborted_.load())
    throw CollectiveError(
        str_cat(name, ": communicator is unusable after an earlier error: ", poison_reason()));
  WaitContext w;
  w.collective = name;
  w.seq = ++seq_;
  w.timeout_s = timeout_s_;
  w.deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                  std::chrono::duration<double>(timeout_s_));
  w.transport = &transport_;
  w.abort = &aborted_;
  return w;
}

size_t HostComm::piece_elems(DType t, bool acc_wire) const {
  return opts_.slot_bytes / (acc_wire ? acc_size(t) : dtype_size(t));
}

template <class Schedule>
void HostComm::run(const char* name, CallBuffers call, Schedule&& schedule) {
  std::lock_guard<std::mutex> g(mu_);
  call.stream_bytes = opts_.stream_bytes;
  const WaitContext w = begin(name);
  try {
    HostExecutor exec(transport_, sent_, received_, w, call);
    schedule(exec);
    exec.finish();
  } catch (const CollectiveError& e) {
    abort(e.what());  // peers' counters no longer match ours
    throw;
  }
}

void HostComm::all_reduce(const void* in, void* out, size_t count, DType t, RedOp op, Algo) {
  CallBuffers c{
      static_cast<const uint8_t*>(in), count, static_cast<uint8_t*>(out), count, t, op, size()};
  RingParams p{rank(), size(), count, 0, piece_elems(t, true)};
  run("all_reduce", c, [&](StepSink& s) { ring_allreduce(p, s); });
}

void HostComm::reduce_scatter(const void* in, void* out, size_t count, DType t, RedOp op, Algo) {
  CallBuffers c{static_cast<const uint8_t*>(in),
                count * size(),
                static_cast<uint8_t*>(out),
                count,
                t,
                op,
                size()};
  RingParams p{rank(), size(), count, 0, piece_elems(t, true)};
  run("reduce_scatter", c, [&](StepSink& s) { ring_reduce_scatter(p, s); });
}

void HostComm::all_gather(const void* in, void* out, size_t count, DType t, Algo) {
  CallBuffers c{static_cast<const uint8_t*>(in),
                count,
                static_cast<uint8_t*>(out),
                count * size(),
                t,
                RedOp::Sum,
                1};
  RingParams p{rank(), size(), count, 0, piece_elems(t, false)};
  run("all_gather", c, [&](StepSink& s) { ring_allgather(p, s); });
}

void HostComm::broadcast(void* buf, size_t count, DType t, int root, Algo) {
  CallBuffers c{
      static_cast<const uint8_t*>(buf), count, static_cast<uint8_t*>(buf), count, t, RedOp::Sum, 1};
  RingParams p{rank(), size(), count, root, piece_elems(t, false)};
  run("broadcast", c, [&](StepSink& s) { ring_broadcast(p, s); });
}

void HostComm::reduce(const void* in, void* out, size_t count, DType t, RedOp op, int root, Algo) {
  // Only the root writes its output; elsewhere `out` may be null.
  CallBuffers c{static_cast<const uint8_t*>(in),
                count,
                static_cast<uint8_t*>(out),
                rank() == root ? count : 0,
                t,
                op,
                size()};
  RingParams p{rank(), size(), count, root, piece_elems(t, true)};
  run("reduce", c, [&](StepSink& s) { ring_reduce(p, s); });
}

void HostComm::barrier() {
  std::lock_guard<std::mutex> g(mu_);
  const WaitContext w = begin("barrier");
  try {
    const uint64_t epoch = ++barrier_epoch_;
    transport_.barrier(rank()).store(epoch, std::memory_order_release);
    for (int r = 0; r < size(); ++r) {
      if (r == rank()) continue;
      auto& flag = transport_.barrier(r);
      wait_until([&] { return flag.load(std::memory_order_acquire) >= epoch; }, w, r,
                 WaitFor::Barrier);
    }
  } catch (const CollectiveError& e) {
    abort(e.what());
    throw;
  }
}

}  // namespace pycoll
