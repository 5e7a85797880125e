// Entry point of the step kernel compiled for the host (emu_device.cpp).
#pragma once

#include "common/dtypes.h"
#include "device/kernel_args.h"
#include "emu/emu_checks.h"

namespace pycoll {
namespace emu {

// Runs block `block` of a launch over steps [a.first_step, a.end_step) on the calling thread,
// with `threads` emulated threads. Accesses are checked against current_regions().
void run_block(DType dtype, const cuda::KernelArgs& a, int block, int threads);

}  // namespace emu
}  // namespace pycoll
