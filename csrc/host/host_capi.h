// The host communicator's C interface, for extensions built apart from pycollectives._C (the
// torch backend): plain C types only, so that a module compiled against another pybind11 or
// another standard library calls the very code that _C runs, on the communicator _C made.
//
// _C publishes one `pycoll_host_api` table as the capsule `pycollectives._C.host_api`
// (capsule name PYCOLL_HOST_API_NAME); a HostComm's address is its `address` property. Every
// call checks its arguments exactly as _C's Python calls do and reports any failure through
// `pycoll_status` instead of throwing.
#pragma once

#include <cstddef>
#include <cstdint>

extern "C" {

#define PYCOLL_HOST_API_NAME "pycollectives._C.host_api"
#define PYCOLL_HOST_API_VERSION 1

// Result codes; the message in pycoll_status says more.
enum pycoll_code {
  PYCOLL_OK = 0,
  PYCOLL_PENDING = 1,        // wait: the time ran out before the call completed
  PYCOLL_INVALID_TYPE = 2,   // bad element type (Python: TypeError)
  PYCOLL_INVALID_VALUE = 3,  // bad argument (Python: ValueError)
  PYCOLL_FAILED = 4,         // the collective failed (CollectiveError)
  PYCOLL_TIMEOUT = 5,        // a bounded wait ran out (CollectiveTimeout)
  PYCOLL_MISMATCH = 6,       // ranks disagree on the collective (CollectiveMismatch)
};

struct pycoll_status {
  int code;
  char message[1024];
};

// One collective on host memory. `collective`, `dtype` and `op` are _C's codes
// (pycollectives._C.COLLECTIVES order, the DType and RedOp numbering); `algo` as algo_code.
// Counts are elements. Arrays a rank does not use (gather's out, scatter's x off the root)
// may be null with count 0; in-place forms pass the same pointer twice.
struct pycoll_call {
  int collective;
  int barrier;  // nonzero: a barrier (the other fields are ignored)
  const void* in;
  size_t in_count;
  void* out;
  size_t out_count;
  int dtype;
  int op;
  int root;
  int algo;
};

struct pycoll_host_api {
  uint32_t version;      // PYCOLL_HOST_API_VERSION
  uint32_t struct_size;  // sizeof(pycoll_host_api)
  // Runs the call now (behind any queued work) and returns its code.
  int (*run)(void* comm, const pycoll_call* call, pycoll_status* status);
  // Queues the call on the progress thread; *work receives a handle to release.
  int (*submit)(void* comm, const pycoll_call* call, void** work, pycoll_status* status);
  // Waits up to timeout_s (< 0: until the call completes, which its own waits bound by the
  // communicator's timeout): OK, PENDING, or the call's error.
  int (*wait)(void* work, double timeout_s, pycoll_status* status);
  int (*done)(void* work);  // nonzero once the call has completed (successfully or not)
  void (*release)(void* work);
};

}  // extern "C"
