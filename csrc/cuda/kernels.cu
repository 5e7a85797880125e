// The step kernel on the GPU: one kernel per element type (the reduction op is a runtime
// switch, uniform across a block), one block per channel. The executor itself is
// device/step_kernel.h (and device/twoshot_kernel.h for registered buffers), shared with the
// emulated device.
#include <cstdint>

#include "common/dtypes.h"
#include "cuda/launch.h"
#include "device/twoshot_kernel.h"

namespace pycoll {
namespace cuda {
namespace {

// The block's threads as CUDA spells them.
struct CudaThreads {
  PYCOLL_DEVICE bool leader() const { return threadIdx.x == 0; }
  PYCOLL_DEVICE void sync() const { __syncthreads(); }
  template <class F>
  PYCOLL_DEVICE void each(F&& f) const {
    f(static_cast<int>(threadIdx.x), static_cast<int>(blockDim.x));
  }
  PYCOLL_DEVICE void ending() const {}
};

// One block per SM is all a launch needs (a handful of channels): promising no more lets
// ptxas use more registers instead of 64, without which every type spilled.
template <class T>
__global__ void __launch_bounds__(kThreadsPerBlock, 1) steps_kernel(const KernelArgs a) {
  __shared__ BlockState s;
  run_launch<T>(a, s, static_cast<int>(blockIdx.x), CudaThreads{});
}

template <class T>
cudaError_t launch(const KernelArgs& args, cudaStream_t stream) {
  steps_kernel<T><<<args.grid, kThreadsPerBlock, 0, stream>>>(args);
  return cudaGetLastError();
}

cudaError_t launch_one(DType dtype, const KernelArgs& args, cudaStream_t stream) {
  switch (dtype) {
    case DType::Int8:
      return launch<int8_t>(args, stream);
    case DType::UInt8:
      return launch<uint8_t>(args, stream);
    case DType::Int32:
      return launch<int32_t>(args, stream);
    case DType::Int64:
      return launch<long long>(args, stream);
    case DType::Float16:
      return launch<DevHalf>(args, stream);
    case DType::BFloat16:
      return launch<DevBFloat16>(args, stream);
    case DType::Float32:
      return launch<float>(args, stream);
    case DType::Float64:
      return launch<double>(args, stream);
  }
  return cudaErrorInvalidValue;
}

template <class T>
int resident_of() {
  int n = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, steps_kernel<T>, kThreadsPerBlock, 0) !=
      cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
}

}  // namespace

int resident_blocks_per_sm() {
  const int each[] = {resident_of<int8_t>(),    resident_of<uint8_t>(), resident_of<int32_t>(),
                      resident_of<long long>(), resident_of<DevHalf>(), resident_of<DevBFloat16>(),
                      resident_of<float>(),     resident_of<double>()};
  int fewest = each[0];
  for (const int n : each) fewest = n < fewest ? n : fewest;
  return fewest;
}

cudaError_t launch_steps(DType dtype, const KernelArgs& args, cudaStream_t stream) {
  KernelArgs parts[2];
  const int n = launches_of(args, parts);
  for (int i = 0; i < n; ++i)
    if (const cudaError_t e = launch_one(dtype, parts[i], stream); e != cudaSuccess) return e;
  return cudaSuccess;
}

}  // namespace cuda
}  // namespace pycoll
