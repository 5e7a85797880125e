// device_capi.h's table over one transport, for the module that publishes it. `T` says how
// that transport runs a call and follows it:
//
//   using Comm = ...; using Work = ...;
//   static std::shared_ptr<Work> run(Comm&, const CollectiveCall&, uintptr_t stream, bool async);
//   static bool done(const Work&);             // the call has ended on the device
//   static void check(Comm&);                  // throws what an earlier device wait left
//   static void wait_on(const Work&, uintptr_t stream);
#pragma once

#include <memory>

#include "device/device_capi.h"
#include "runtime/capi_guard.h"
#include "runtime/wait.h"

namespace pycoll {

template <class T>
struct DeviceApi {
  using Comm = typename T::Comm;
  using Work = typename T::Work;

  struct Handle {
    Comm* comm;
    std::shared_ptr<Work> work;
  };

  static int run(void* comm, const pycoll_call* call, uintptr_t stream, int async_op, void** work,
                 pycoll_status* st) {
    *work = nullptr;
    return capi::guarded(st, [&] {
      auto& c = *static_cast<Comm*>(comm);
      const CollectiveCall cc = capi::to_call(*call, c.rank(), c.size());
      *work = new Handle{&c, T::run(c, cc, stream, async_op != 0)};
      return PYCOLL_OK;
    });
  }

  static int wait_on(void* work, uintptr_t stream, pycoll_status* st) {
    return capi::guarded(st, [&] {
      auto& h = *static_cast<Handle*>(work);
      T::check(*h.comm);
      T::wait_on(*h.work, stream);
      return PYCOLL_OK;
    });
  }

  static int wait(void* work, double timeout_s, pycoll_status* st) {
    return capi::guarded(st, [&] {
      auto& h = *static_cast<Handle*>(work);
      const auto until = timeout_s < 0 ? Clock::time_point::max() : deadline_after(timeout_s);
      Backoff backoff;
      for (;;) {
        const bool ended = T::done(*h.work);
        // What the device reported: a launch that found a mismatch, or gave up waiting,
        // ends too; and a failure elsewhere ends this wait.
        T::check(*h.comm);
        if (ended) return PYCOLL_OK;
        if (Clock::now() >= until) return PYCOLL_PENDING;
        backoff.pause();
      }
    });
  }

  static int done(void* work) {
    try {
      return T::done(*static_cast<Handle*>(work)->work) ? 1 : 0;
    } catch (const std::exception&) {
      return 1;  // it will not end any other way: wait() says why
    }
  }

  static void release(void* work) { delete static_cast<Handle*>(work); }

  static const pycoll_device_api* table() {
    static const pycoll_device_api api = {
        PYCOLL_DEVICE_API_VERSION, sizeof(pycoll_device_api), run, wait_on, wait, done, release,
    };
    return &api;
  }
};

}  // namespace pycoll
