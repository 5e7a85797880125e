// Entry points of the device code (kernels.cu), callable from host-compiled code.
#pragma once

#include <cuda_runtime_api.h>

#include "common/dtypes.h"
#include "device/kernel_args.h"

namespace pycoll {
namespace cuda {

constexpr int kThreadsPerBlock = 512;

// Runs steps [args.first_step, args.end_step) of args.steps, one block per channel that the
// steps use (args.grid of args.layout.nblocks), on `stream`. Returns the launch error, if any.
cudaError_t launch_steps(DType dtype, const KernelArgs& args, cudaStream_t stream);

}  // namespace cuda
}  // namespace pycoll
