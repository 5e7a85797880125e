// What the C interfaces (host/host_capi.h, device/device_capi.h) share: a pycoll_call turned
// into a checked CollectiveCall, and the C++ exceptions of a call turned into a status code
// and message instead of crossing the C boundary (and back, on the caller's side).
#pragma once

#include <cstdio>
#include <exception>
#include <stdexcept>

#include "algo/call.h"
#include "common/errors.h"
#include "host/host_capi.h"
#include "python/call_args.h"

namespace pycoll {
namespace capi {

inline int fail(pycoll_status* st, int code, const char* what) {
  st->code = code;
  std::snprintf(st->message, sizeof(st->message), "%s", what);
  return code;
}

// Runs `fn` (which returns a code), turning what it throws into a status (most derived first).
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

// A failed status as the C++ error `guarded` turned into it (the error classes of
// common/errors.h; the status keeps only the message).
[[noreturn]] inline void rethrow(const pycoll_status& st) {
  switch (st.code) {
    case PYCOLL_INVALID_TYPE:
      throw InvalidType(st.message);
    case PYCOLL_INVALID_VALUE:
      throw InvalidArgument(st.message);
    case PYCOLL_TIMEOUT:
      throw CollectiveTimeout(st.message);
    case PYCOLL_MISMATCH:
      throw CollectiveMismatch(st.message);
    default:
      throw CollectiveError(st.message);
  }
}

// `k` as a checked call of a communicator of `size` ranks where this one is `rank`: the checks
// the Python calls make (sizes, dtype, op, root, algorithm, overlap).
inline CollectiveCall to_call(const pycoll_call& k, int rank, int size) {
  if (k.barrier) {
    CollectiveCall call;
    call.barrier = true;
    return call;
  }
  if (k.collective < 0 || k.collective >= kNumCollectives)
    throw InvalidArgument(str_cat("unknown collective code ", k.collective));
  return pyargs::described_call(static_cast<Collective>(k.collective), k.in, k.in_count, k.out,
                                k.out_count, k.dtype, k.root, k.op, k.algo, rank, size);
}

}  // namespace capi
}  // namespace pycoll
