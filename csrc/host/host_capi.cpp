// The host communicator's C interface (host/host_capi.h), built into _C.
#include "host/host_capi.h"

#include <memory>

#include "host/host_comm.h"
#include "runtime/capi_guard.h"

namespace pycoll {
namespace {

struct Handle {
  std::shared_ptr<Work> work;
};

int api_run(void* comm, const pycoll_call* call, pycoll_status* st) {
  return capi::guarded(st, [&] {
    auto& c = *static_cast<HostComm*>(comm);
    c.run(capi::to_call(*call, c.rank(), c.size()));
    return PYCOLL_OK;
  });
}

int api_submit(void* comm, const pycoll_call* call, void** work, pycoll_status* st) {
  *work = nullptr;
  return capi::guarded(st, [&] {
    auto& c = *static_cast<HostComm*>(comm);
    *work = new Handle{c.submit(capi::to_call(*call, c.rank(), c.size()))};
    return PYCOLL_OK;
  });
}

int api_wait(void* work, double timeout_s, pycoll_status* st) {
  return capi::guarded(st, [&] {
    return static_cast<Handle*>(work)->work->wait(timeout_s) ? PYCOLL_OK : PYCOLL_PENDING;
  });
}

int api_done(void* work) { return static_cast<Handle*>(work)->work->is_completed() ? 1 : 0; }

void api_release(void* work) { delete static_cast<Handle*>(work); }

}  // namespace

const pycoll_host_api* host_api() {
  static const pycoll_host_api api = {
      PYCOLL_HOST_API_VERSION,
      sizeof(pycoll_host_api),
      api_run,
      api_submit,
      api_wait,
      api_done,
      api_release,
  };
  return &api;
}

}  // namespace pycoll
