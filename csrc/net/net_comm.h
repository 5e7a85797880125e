// The inter-node transport: the same schedules, executed over MPI point-to-point messages.
//
// Between machines we use the MPI the job was launched with (one process per rank, any
// network MPI supports) instead of a network layer of our own. A collective runs among a
// `group` of MPI ranks, schedule rank i being group[i]; messages are chunked by the schedule's
// piece size and pipelined: receives are posted ahead into a pool of buffers, sends are
// non-blocking, and every wait is bounded by the timeout.
//
// Every message of one collective carries the same tag, a hash of its fingerprint (sequence
// number, collective, count, dtype, op, root, algorithm); receivers accept any tag and compare,
// so ranks that run different collectives get CollectiveMismatch instead of wrong data.
#pragma once

#include <mpi.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "algo/call.h"
#include "algo/schedule.h"
#include "common/dtypes.h"

namespace pycoll {

struct NetOptions {
  size_t piece_bytes = size_t{1} << 20;  // largest message
  int window = 8;                        // receives posted ahead, and sends in flight
  double timeout_s = 300.0;
};

// One collective among a group of MPI ranks: the call as every transport takes it (its root a
// schedule rank, an index into `group`), and where and as which call it runs.
struct NetCall : CollectiveCall {
  std::vector<int> group;  // MPI ranks of the communicator, in schedule-rank order
  int divisor = 1;         // avg divides by this
  uint64_t seq = 0;
};

// A message buffer shared by a posted receive and the sends that forward it.
struct NetBuffer {
  std::unique_ptr<uint8_t[]> data;
  int refs = 0;
};

class NetComm {
 public:
  // `comm` must outlive this object; errors on it are returned, not fatal (the caller sets
  // MPI_ERRORS_RETURN).
  NetComm(MPI_Comm comm, const NetOptions& opts);
  ~NetComm();

  int rank() const { return rank_; }
  int size() const { return size_; }
  double timeout() const { return timeout_s_.load(); }
  void set_timeout(double s) { timeout_s_.store(s); }
  bool poisoned() const { return poisoned_; }

  void run(const NetCall& call);

 private:
  friend class NetExecutor;
  MPI_Comm comm_;
  NetOptions opts_;
  int rank_ = 0, size_ = 1;
  int tag_ub_ = 32767;
  std::atomic<double> timeout_s_;
  bool poisoned_ = false;
  std::string poison_reason_;
  std::vector<NetBuffer> pool_;  // 2 * window + 4 buffers of piece_bytes (the largest message)
};

}  // namespace pycoll
