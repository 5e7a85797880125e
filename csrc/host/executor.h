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
};

class HostExecutor final : public StepSink {
 public:
  // `sent` / `received` count messages per peer over the communicator's lifetime.
  HostExecutor(const ShmTransport& t, std::vector<uint64_t>& sent, std::vector<uint64_t>& received,
               const WaitContext& wait, const CallBuffers& call);

  void step(const Step& s) override;

 private:
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
};

}  // namespace pycoll
