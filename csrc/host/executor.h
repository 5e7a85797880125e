// Runs a schedule's steps over the shared-memory transport.
#pragma once

#include <cstdint>
#include <vector>

#include "algo/ops.h"
#include "common/dtypes.h"
#include "common/reduce.h"
#include "host/shm_transport.h"
#include "host/wait.h"

namespace pycoll {

// The buffers and element format of one collective call.
struct CallBuffers {
  const uint8_t* input = nullptr;
  size_t input_count = 0;  // elements
  uint8_t* output = nullptr;
  size_t output_count = 0;
  DType dtype = DType::Float32;
  RedOp op = RedOp::Sum;
  int divisor = 1;  // avg divides by this when a reduction completes
  // Outputs of at least this many bytes are written with non-temporal stores.
  size_t stream_bytes = size_t{256} << 10;
};

class HostExecutor final : public StepSink {
 public:
  // `sent` / `received` count messages per peer over the communicator's lifetime.
  HostExecutor(const ShmTransport& t, std::vector<uint64_t>& sent, std::vector<uint64_t>& received,
               const WaitContext& wait, const CallBuffers& call);

  void step(const Step& s) override;
  // Makes streamed stores visible to other cores; call once the schedule has run.
  void finish();

 private:
  // dst = incoming (elements) ; streamed for large outputs.
  void write_out(uint8_t* dst, const uint8_t* src, size_t n);
  // dst = finalised op(a_acc, b); also into dst2 when not null.
  void reduce_out(uint8_t* dst, uint8_t* dst2, const uint8_t* a, const uint8_t* b, size_t n);

  const uint8_t* src_ptr(const Step& s) const;
  uint8_t* dst_ptr(const Step& s) const;
  const uint8_t* begin_recv(const Step& s);
  void end_recv(int from);
  uint8_t* begin_send(const Step& s);
  void end_send(int to);

  const ShmTransport& t_;
  std::vector<uint64_t>& sent_;
  std::vector<uint64_t>& received_;
  const WaitContext& wait_;
  const CallBuffers& call_;
  const ReduceKernels* kernels_;
  size_t elem_size_, acc_size_;
  bool streaming_;
};

}  // namespace pycoll
