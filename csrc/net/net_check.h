// The check across nodes: one exchange among the ranks of a column (one rank per node, those
// with the same local rank) that tells every rank what every node called.
//
// A collective over several nodes compares its ranks' calls in two steps that ride on steps it
// takes anyway. Inside a node, the node-local phase's fingerprints carry the record of the
// whole call (runtime/fingerprint.h), so each rank learns its node's status: one record that
// every rank of the node called, or, when they differ, each one's. Between nodes, each rank
// sends its node's status to the other members of its column and receives theirs: since every
// node is in every column, every rank then holds every node's status, the same set on every
// rank, and reaches the same verdict before any byte of the user's arrays is written. A rank
// whose node disagreed still takes part, so that no rank waits for one that gave up.
//
// The status may carry data that every member sends to every other anyway (a small all-reduce's
// shards between nodes): then the check costs no round trip of its own.
#pragma once

#include <mpi.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace pycoll {

class NetCheck {
 public:
  // Collective over `comm` (it duplicates it): its messages never meet a collective's.
  NetCheck(MPI_Comm comm, double timeout_s);
  ~NetCheck();
  NetCheck(const NetCheck&) = delete;
  NetCheck& operator=(const NetCheck&) = delete;
  // Frees the duplicate, if MPI still runs and no exchange failed (then messages may be left
  // in it: it is kept). Later exchanges raise.
  void close();

  int rank() const { return rank_; }
  double timeout() const { return timeout_s_.load(); }
  void set_timeout(double s) { timeout_s_.store(s); }

  // Sends `status`, then `payload_bytes` of `payload`, to every other member of `group` (ranks
  // of the communicator, in node order; this rank among them), and receives theirs. Returns
  // every member's status, ours at our place. A member's payload lands at
  // recv + k * payload_bytes when it is exactly payload_bytes long; `sizes_ok` says whether
  // every one was. `what` names the call in errors ("all_reduce #5"). Bounded by the timeout;
  // after a failure every later exchange raises.
  std::vector<std::string> exchange(const std::vector<int>& group, const std::string& what,
                                    const std::string& status, const void* payload,
                                    size_t payload_bytes, void* recv, bool* sizes_ok);

 private:
  void fail(const std::string& why);

  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0, size_ = 1;
  std::atomic<double> timeout_s_;
  std::string poison_;
  std::vector<uint8_t> out_;              // the message we send
  std::vector<std::vector<uint8_t>> in_;  // the messages we received, by member
  std::vector<MPI_Request> sends_;
};

}  // namespace pycoll
