// CUDA runtime errors as CollectiveError, with the call and file:line.
#pragma once

#include <cuda_runtime_api.h>

#include "common/errors.h"

#define PYCOLL_CUDA_CHECK(call)                                                               \
  do {                                                                                        \
    const cudaError_t pycoll_err_ = (call);                                                   \
    if (pycoll_err_ != cudaSuccess)                                                           \
      throw ::pycoll::CollectiveError(::pycoll::str_cat(                                      \
          __FILE__, ":", __LINE__, ": " #call " failed: ", cudaGetErrorString(pycoll_err_))); \
  } while (0)

namespace pycoll {
namespace cuda {

// A driver API function (cu...) through the runtime's entry point: the modules link the runtime
// statically and never libcuda directly. Null where the driver does not offer it.
inline void* driver_entry(const char* name) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found{};
  if (cudaGetDriverEntryPointByVersion(name, &fn, 12000, cudaEnableDefault, &found) !=
          cudaSuccess ||
      found != cudaDriverEntryPointSuccess) {
    cudaGetLastError();  // not sticky: clear it
    return nullptr;
  }
  return fn;
}

// Makes `device` current for a scope and restores the caller's device after it.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    if (cudaGetDevice(&previous_) != cudaSuccess) previous_ = -1;
    if (previous_ != device) PYCOLL_CUDA_CHECK(cudaSetDevice(device));
  }
  ~DeviceGuard() {
    int now = -1;
    if (previous_ >= 0 && cudaGetDevice(&now) == cudaSuccess && now != previous_)
      cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = -1;
};

}  // namespace cuda
}  // namespace pycoll
