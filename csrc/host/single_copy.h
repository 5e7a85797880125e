// Large all-gather on 2 ranks in a single copy, over cross-memory attach.
//
// The staged schedules move every byte twice, into a staging slot and out of it. For
// all-gather blocks from `HostCommOptions::single_copy_min_bytes` up, the direct algorithm
// instead trades the output buffers' addresses through the slots, and each rank writes its
// input block straight into block r of its peer's output with process_vm_writev (and copies
// it into its own): 2 copies per rank out of place, 1 in place, where the staged ring makes 3
// and 2. Each rank writes only its own block of every output, so an in-place call
// needs no further ordering; a last exchange tells every rank that its peers have finished
// writing into its output.
//
// Whether the kernel lets every rank write its peers (ptrace rules, PID namespaces, seccomp) is
// probed on the first eligible call and agreed on in a second exchange; where any rank is
// refused, every rank runs the staged schedule from then on.
//
// A kernel copy pins every page it touches: on a 2-core EPYC guest process_vm_readv moved
// 6.6 GB/s between cache-resident buffers where memcpy moved 29 GB/s (3.8 and 5.8 GB/s from
// memory). So the saved copy pays only where it replaces a user copy one for one:
//   - all-gather on 2 ranks, from 4 MiB blocks: 1.2x faster than the staged ring at 8 and
//     16 MiB of output, even from 32 MiB. Below that the staged ring's cached writes win
//     (1.5x at 1-2 MiB blocks);
//   - not from 3 ranks: the staged direct schedule copies n+1 times per rank, this n, but n-1
//     of them in the kernel;
//   - not all-reduce: reading the peer's input and writing the result back into its output
//     lost to the staged ring at every size (1.5x slower at 1 MiB and at 64 MiB).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "algo/call.h"
#include "host/executor.h"
#include "host/p2p.h"
#include "host/shm_transport.h"

namespace pycoll {

class SingleCopy {
 public:
  SingleCopy(const ShmTransport& t, CmaMode mode, size_t min_bytes, bool debug)
      : t_(t), mode_(mode), min_bytes_(min_bytes), debug_(debug) {}

  // Whether `c` with `algo` (Auto: whatever the communicator picks) over `bytes` (what the
  // tuning table compares: the per-rank block for all-gather) takes this path; every rank
  // decides the same.
  bool eligible(Collective c, Algo algo, size_t bytes) const;
  // Runs the all-gather of `buf` (`count` elements per rank); false when cross-memory attach
  // is refused (then nothing moved and the caller runs the staged schedule).
  bool all_gather(HostExecutor& ex, const CallBuffers& buf, size_t count);

  // Bytes written at a time: the local copy leaves them in cache for the peers' copies.
  static constexpr size_t kBlockBytes = size_t{256} << 10;

 private:
  enum class State { Unknown, Usable, Refused };
  bool agree(HostExecutor& ex, const CallBuffers& buf, std::vector<uint64_t>& outputs);
  void write(int q, const uint8_t* local, uint64_t remote, size_t bytes) const;

  const ShmTransport& t_;
  const CmaMode mode_;
  const size_t min_bytes_;
  const bool debug_;
  State state_ = State::Unknown;
};

}  // namespace pycoll
