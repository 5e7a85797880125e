// The host communicator: collectives on host memory over the shared-memory transport.
//
// Arguments are validated by the caller (the bindings); this layer checks only invariants.
#pragma once

#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "algo/ops.h"
#include "common/dtypes.h"
#include "host/executor.h"
#include "host/shm_transport.h"

namespace pycoll {

enum class Algo : int { Auto = 0, Ring = 1 };

struct HostCommOptions {
  size_t slot_bytes = 256 * 1024;
  int nslots = 4;
  double timeout_s = 300.0;
  // Outputs of at least this many bytes bypass the cache (non-temporal stores).
  size_t stream_bytes = size_t{256} << 10;
};

class HostComm {
 public:
  HostComm(int rank, int size, const HostCommOptions& opts);

  const std::string& segment_name() const { return transport_.name(); }
  void attach(const std::vector<std::string>& names) { transport_.attach(names); }
  void unlink() { transport_.unlink(); }

  int rank() const { return transport_.rank(); }
  int size() const { return transport_.size(); }
  uint64_t seq() const { return seq_; }
  double timeout() const { return timeout_s_; }
  void set_timeout(double seconds) { timeout_s_ = seconds; }
  const HostCommOptions& options() const { return opts_; }

  // Poisons the communicator: waits in progress stop, later calls fail at once.
  void abort(const std::string& reason);
  bool poisoned() const { return aborted_.load(); }
  std::string poison_reason() const;

  void all_reduce(const void* in, void* out, size_t count, DType t, RedOp op, Algo a);
  void reduce_scatter(const void* in, void* out, size_t count, DType t, RedOp op, Algo a);
  void all_gather(const void* in, void* out, size_t count, DType t, Algo a);
  void broadcast(void* buf, size_t count, DType t, int root, Algo a);
  void reduce(const void* in, void* out, size_t count, DType t, RedOp op, int root, Algo a);
  void barrier();

 private:
  template <class Schedule>
  void run(const char* name, CallBuffers call, Schedule&& schedule);
  WaitContext begin(const char* name);
  size_t piece_elems(DType t, bool acc_wire) const;

  HostCommOptions opts_;
  ShmTransport transport_;
  std::vector<uint64_t> sent_, received_;
  uint64_t seq_ = 0;
  uint64_t barrier_epoch_ = 0;
  double timeout_s_;
  std::atomic<bool> aborted_{false};
  std::mutex mu_;                 // one collective at a time
  mutable std::mutex reason_mu_;  // guards poison_reason_
  std::string poison_reason_;
};

}  // namespace pycoll
