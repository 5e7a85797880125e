// The host communicator's C interface (host/host_capi.h), built into _C.
#include "host/host_capi.h"

#include <cstdio>
#include <cstring>
#include <exception>
#include <memory>

#include "common/errors.h"
#include "host/host_comm.h"
#include "python/call_args.h"

namespace pycoll {
namespace {

struct Handle {
  std::shared_ptr<Work> work;
};

int fail(pycoll_status* st, int code, const char* what) {
  st->code = code;
  std::snprintf(st->message, sizeof(st->message), "%s", what);
  return code;
}

// Runs `fn`, turning what it throws into a status code (most derived first).
template <class F>
int guarded(pycoll_status* st, F&& fn) {
  st->code = PYCOLL_OK;
  st->message[0] = '\0';
  try {
    st->code = fn();
    return st->code;
  } catch (const CollectiveTimeout& e) {
    return fail(st, PYCOLL_TIMEOUT, e.what());
  } catch (const CollectiveMismatch& e) {
    return fail(st, PYCOLL_MISMATCH, e.what());
  } catch (const CollectiveError& e) {
    return fail(st, PYCOLL_FAILED, e.what());
  } catch (const InvalidType& e) {
    return fail(st, PYCOLL_INVALID_TYPE, e.what());
  } catch (const std::invalid_argument& e) {
    return fail(st, PYCOLL_INVALID_VALUE, e.what());
  } catch (const std::exception& e) {
    return fail(st, PYCOLL_FAILED, e.what());
  }
}

CollectiveCall to_call(HostComm& c, const pycoll_call& k) {
  if (k.barrier) {
    CollectiveCall call;
    call.barrier = true;
    return call;
  }
  if (k.collective < 0 || k.collective >= kNumCollectives)
    throw InvalidArgument(str_cat("unknown collective code ", k.collective));
  return pyargs::described_call(static_cast<Collective>(k.collective), k.in, k.in_count, k.out,
                                k.out_count, k.dtype, k.root, k.op, k.algo, c.rank(), c.size());
}

int api_run(void* comm, const pycoll_call* call, pycoll_status* st) {
  return guarded(st, [&] {
    auto& c = *static_cast<HostComm*>(comm);
    c.run(to_call(c, *call));
    return PYCOLL_OK;
  });
}

int api_submit(void* comm, const pycoll_call* call, void** work, pycoll_status* st) {
  *work = nullptr;
  return guarded(st, [&] {
    auto& c = *static_cast<HostComm*>(comm);
    *work = new Handle{c.submit(to_call(c, *call))};
    return PYCOLL_OK;
  });
}

int api_wait(void* work, double timeout_s, pycoll_status* st) {
  return guarded(st, [&] {
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
