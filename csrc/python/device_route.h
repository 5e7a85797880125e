// The one-step path of blocking calls on device arrays: the host communicator's run_now
// (python/core.cpp) hands a call whose arrays are not numpy to a device transport through its C
// interface (device/device_capi.h), so that a cupy collective crosses from Python into C++ once,
// as a numpy one does. The Communicator attaches a route once its CUDA communicator exists.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <deque>

#include "algo/schedule.h"
#include "device/device_capi.h"

namespace pycoll {

class DeviceRoute {
 public:
  // `api` (a device_api capsule) over `comm` (the transport's address), kept alive by `keep`;
  // it takes arrays of exactly `array_type` on `device`, described by their own attributes as
  // runtime/arrays.py describes cupy's (data.ptr, data.device_id, size, dtype,
  // flags.c_contiguous); `current_stream()` gives the stream of a call with stream=None (an
  // int, or an object with a `ptr` or `cuda_stream`).
  DeviceRoute(pybind11::handle api, uintptr_t comm, pybind11::object keep,
              pybind11::object array_type, pybind11::object current_stream, int device);
  ~DeviceRoute();  // under the GIL
  DeviceRoute(const DeviceRoute&) = delete;
  DeviceRoute& operator=(const DeviceRoute&) = delete;

  // Queues the blocking collective `coll` on `x` (and `out`; None: the single-array form) on
  // `stream` (None: the current stream) and returns true; false, before anything is queued,
  // when an array or the stream is not what this route takes (another type, device, dtype or
  // layout), and the caller's general path takes the call and says what is wrong. The call's
  // own checks raise as the general path's do. The arrays stay referenced until the device
  // has finished the call. Called with the GIL held.
  bool run(Collective coll, PyObject* x, PyObject* out, int op, int root, int algo,
           PyObject* stream);

  size_t held() const { return held_.size(); }

 private:
  struct Held {
    void* work;
    PyObject* x;
    PyObject* out;
  };
  void release(const Held& h);
  void release_finished();

  const pycoll_device_api* api_;
  void* comm_;
  pybind11::object keep_, array_type_, current_stream_;
  int device_;
  std::deque<Held> held_;
};

}  // namespace pycoll
