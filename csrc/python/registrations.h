// Registered buffers' handles (runtime/registrations.h) as the Python rendezvous trades them:
// (key, handle bytes, allocation bytes, offset, bytes) tuples. Shared by _cuda and _emu.
#pragma once

#include <pybind11/pybind11.h>

#include <string>
#include <vector>

#include "runtime/registrations.h"

namespace pycoll {
namespace pyargs {

inline pybind11::tuple handle_tuple(const RegisterHandle& h) {
  return pybind11::make_tuple(h.key, pybind11::bytes(h.handle), h.alloc_bytes, h.offset, h.bytes);
}

inline std::vector<RegisterHandle> handles_of(const pybind11::list& tuples) {
  std::vector<RegisterHandle> all;
  for (const pybind11::handle& t : tuples) {
    const auto v = t.cast<pybind11::tuple>();
    if (v.size() != 5) throw pybind11::value_error("register: a handle is a 5-tuple");
    all.push_back({v[0].cast<uint64_t>(), v[1].cast<std::string>(), v[2].cast<uint64_t>(),
                   v[3].cast<uint64_t>(), v[4].cast<uint64_t>()});
  }
  return all;
}

}  // namespace pyargs
}  // namespace pycoll
