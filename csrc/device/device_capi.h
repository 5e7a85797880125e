// The device transports' C interface, for extensions built apart from them (the torch
// backend): the CUDA transport (pycollectives._cuda) and the emulated device (pycollectives._emu)
// each publish one `pycoll_device_api` table as the capsule `device_api` of their module
// (capsule name PYCOLL_DEVICE_API_NAME), and a communicator's address as its `address`
// property. Calls are described as on the host interface (host/host_capi.h: pycoll_call, with
// device pointers) and checked exactly as the Python calls are; every failure comes back as a
// pycoll_status instead of an exception.
#pragma once

#include <cstddef>
#include <cstdint>

#include "host/host_capi.h"

extern "C" {

#define PYCOLL_DEVICE_API_NAME "pycollectives.device_api"
#define PYCOLL_DEVICE_API_VERSION 1

struct pycoll_device_api {
  uint32_t version;      // PYCOLL_DEVICE_API_VERSION
  uint32_t struct_size;  // sizeof(pycoll_device_api)
  // Checks the call and queues it after the work on `stream` (a cudaStream_t as an integer):
  // with async_op on the communicator's own stream, so that later work on `stream` is not held
  // back by it; without, on `stream` itself. The host does not wait for the device (the
  // emulated device runs the call to completion). *work receives a handle to release.
  int (*run)(void* comm, const pycoll_call* call, uintptr_t stream, int async_op, void** work,
             pycoll_status* status);
  // Makes work queued later on `stream` wait for the call, without blocking the host; fails
  // with the error an earlier device wait or a dead peer left behind.
  int (*wait_on)(void* work, uintptr_t stream, pycoll_status* status);
  // Blocks the host until the call has ended, up to timeout_s (< 0: until it ends or the
  // communicator fails, which its device waits bound by its timeout): OK, PENDING or the
  // failure.
  int (*wait)(void* work, double timeout_s, pycoll_status* status);
  int (*done)(void* work);  // nonzero once the call has ended on the device
  void (*release)(void* work);
};

}  // extern "C"
