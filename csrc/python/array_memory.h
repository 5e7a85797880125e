// What the one-step path (run_now, python/core.cpp) reads of arrays that are not numpy's: torch
// CPU tensors there, cupy arrays through a device route (python/device_route.h). Both read the
// array's own attributes, take the same forms of the same collectives, and leave everything
// else to the Python layer's general path, which says what is wrong.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>

#include "algo/schedule.h"

namespace pycoll {

// One array's memory: where, how many elements, of which DType code (-1: none we move).
struct ArrayMemory {
  uint64_t ptr = 0, count = 0;
  int dtype = -1;
};

// `text` as an interned str, for a static of the call site (a lookup by C string makes a str
// on every call).
inline PyObject* interned(const char* text) {
  PyObject* s = PyUnicode_InternFromString(text);
  if (s == nullptr) throw pybind11::error_already_set();
  return s;
}

// An attribute of `obj`, or a null object (the error cleared) where it has none.
inline pybind11::object attr_or_null(PyObject* obj, PyObject* name) {
  PyObject* v = PyObject_GetAttr(obj, name);
  if (v == nullptr) PyErr_Clear();
  return pybind11::reinterpret_steal<pybind11::object>(v);
}

// What method `name` of `obj` returns, or a null object (the error cleared) where it fails.
inline pybind11::object call_or_null(PyObject* obj, PyObject* name) {
  PyObject* v = PyObject_CallMethodNoArgs(obj, name);
  if (v == nullptr) PyErr_Clear();
  return pybind11::reinterpret_steal<pybind11::object>(v);
}

// A Python int as an unsigned 64-bit value; false (the error cleared) for anything else.
inline bool as_u64(const pybind11::object& v, uint64_t& out) {
  if (!v || !PyLong_Check(v.ptr())) return false;
  out = PyLong_AsUnsignedLongLong(v.ptr());
  if (out == static_cast<uint64_t>(-1) && PyErr_Occurred()) {
    PyErr_Clear();
    return false;
  }
  return true;
}

// Whether the one-step path takes `coll` in this form (`single`: no `out`): all-reduce and
// reduce either way, broadcast without `out`, reduce-scatter and all-gather with it.
inline bool one_step_form(Collective coll, bool single) {
  switch (coll) {
    case Collective::AllReduce:
    case Collective::Reduce:
      return true;
    case Collective::Broadcast:
      return single;
    case Collective::ReduceScatter:
    case Collective::AllGather:
      return !single;
    default:
      return false;
  }
}

// The output of a one-step call: `x` itself in the single-array forms, else `out`, which must
// hold x's dtype (false: the general path names both).
inline bool output_of(const ArrayMemory& x, bool single, ArrayMemory& out) {
  if (single) out = x;
  return out.dtype == x.dtype;
}

}  // namespace pycoll
