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

// How many blocks of the step kernel one SM of the current device holds at once, for the
// element type that holds fewest (its registers and shared memory decide): the residency
// check's unit (backends/cuda/residency.py). 0 when the kernel cannot run there at all.
int resident_blocks_per_sm();

}  // namespace cuda
}  // namespace pycoll
