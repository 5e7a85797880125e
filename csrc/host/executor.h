// Runs a schedule's steps over the shared-memory transport.
#pragma once

#include <cstdint>
#include <vector>

#include "algo/messages.h"
#include "algo/step.h"
#include "algo/step_io.h"
#include "common/dtypes.h"
#include "common/reduce.h"
#include "host/shm_transport.h"
#include "runtime/wait.h"

namespace pycoll {

// Out-of-place outputs from this size are written with non-temporal stores, by default.
// Below it they stay in cache, where the next call or the caller finds them: on 2 ranks of a
// 2-core EPYC (L3 32 MiB) cached writes made all-reduce and all-gather 1.5-2x faster from
// 256 KiB to 4 MiB and still 1.1-1.2x at 8 MiB; streaming won from 16 MiB of output
// (all-reduce 1.2x, all-gather 1.3x at 64 MiB). In-place outputs are never streamed: the
// call has just read them, and streaming evicts what the next reader wants (in-place
// all-reduce 1.3-1.6x faster cached at 16-64 MiB).
constexpr size_t kDefaultStreamBytes = size_t{16} << 20;

// The buffers and element format of one collective call.
struct CallBuffers {
  const uint8_t* input = nullptr;
  size_t input_count = 0;  // elements
  uint8_t* output = nullptr;
  size_t output_count = 0;
  DType dtype = DType::Float32;
  size_t elem = 4;        // bytes per element (ResolvedCall::elem)
  size_t acc = 4;         // ... of the accumulation type (ResolvedCall::acc)
  bool in_place = false;  // the input lies within the output (ResolvedCall::in_place)
  RedOp op = RedOp::Sum;
  int divisor = 1;  // avg divides by this when a reduction completes
  // Out-of-place outputs of at least this many bytes are written with non-temporal stores.
  size_t stream_bytes = kDefaultStreamBytes;
  // Staging slots are written with non-temporal stores (host/slot_stores.h).
  bool stream_slots = false;

  // Whether writes into the output bypass the cache.
  bool streams() const { return !in_place && output_count * elem >= stream_bytes; }
};

// Messages moved on each channel over the communicator's lifetime.
struct ChannelCounters : MessageCounts<std::vector<uint64_t>> {
  explicit ChannelCounters(int size) {
    sent.assign(size, 0);
    received.assign(size, 0);
    bcast_received.assign(size, 0);
    bcast_sent = 0;
  }
};

class HostExecutor final : public StepSink {
 public:
  // `scratch` holds at least one staging slot's worth of bytes.
  HostExecutor(const ShmTransport& t, ChannelCounters& counters, uint8_t* scratch,
               const WaitContext& wait, const CallBuffers& call);

  void step(const Step& s) override;
  // Makes streamed stores visible to other cores; call once the schedule has run.
  void finish();
  // Sends `bytes` (at most a slot) from `mine` to every peer and receives each peer's message
  // of the same length into theirs + q * bytes: a small all-to-all of control words.
  void exchange(const void* mine, size_t bytes, uint8_t* theirs);
  // Whether every rank passed true (an exchange of one word each); with true on every rank,
  // also a barrier: each peer has done what it did before calling.
  bool all_agree(bool mine);
  // Whether this call has received a message from any peer.
  bool received_any() const { return received_any_; }

 private:
  const uint8_t* src_ptr(const Step& s) const;
  uint8_t* dst_ptr(const Step& s) const;
  size_t wire_bytes(Wire w, size_t n) const {
    return n * (w == Wire::Acc ? acc_size_ : elem_size_);
  }

  const uint8_t* wait_recv(int from, bool bcast, size_t bytes);
  void release_recv(int from, bool bcast);
  uint8_t* wait_send(int to, size_t bytes);
  void post_send(int to);
  // Copies a message into a slot, with the stores the call chose for slots.
  void write_slot(uint8_t* slot, const uint8_t* src, size_t bytes);
  // Fills the `to` slots with `bytes` already in `first` (the slot of `to`), then posts.
  void send_to_all(const Step& s, uint8_t* first, size_t bytes);

  // acc = op over the step's incoming messages and src, in the step's order.
  void reduce_into(uint8_t* acc, const Step& s);
  // dst (and dst2, a slot) = finalised acc; streamed for large outputs (and streamed slots).
  void finalize_out(uint8_t* dst, uint8_t* dst2, const uint8_t* acc, size_t n);
  // A step's reduction over every rank (from kAllPeers), written out: every peer's message
  // and our input folded in rank order a cache-resident tile at a time and finalized into dst
  // (and, with `send`, the step's outgoing slot, then sent): one pass over memory where
  // reduce_into then finalize_out make three.
  void reduce_all_out(uint8_t* dst, const Step& s, bool send);
  // dst (and dst2) = finalised op(in_acc, b): the one-input fast path.
  void reduce_out(uint8_t* dst, uint8_t* dst2, const uint8_t* in, const uint8_t* b, size_t n);
  void write_out(uint8_t* dst, const uint8_t* src, size_t n);
  template <class Produce>
  void produce_out(uint8_t* dst, uint8_t* dst2, size_t n, Produce&& produce);

  const ShmTransport& t_;
  ChannelCounters& c_;
  uint8_t* scratch_;
  const WaitContext& wait_;
  const CallBuffers& call_;
  const ReduceKernels* kernels_;
  StepArrays arrays_;
  size_t elem_size_, acc_size_;
  bool streaming_;
  bool slot_stream_;
  bool received_any_ = false;
};

}  // namespace pycoll
