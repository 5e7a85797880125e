// For the extensions beside _C (_net, _cuda): their C++ errors surface as the Python classes
// that pycollectives._C defines, so callers catch one set of exceptions whichever module
// raised.
#pragma once

#include <pybind11/pybind11.h>

#include "common/errors.h"

namespace pycoll {

inline void translate_errors_as_core() {
  namespace py = pybind11;
  py::module_ core = py::module_::import("pycollectives._C");
  // Held for the life of the process (released, so never destroyed after the interpreter).
  static py::handle error = py::object(core.attr("CollectiveError")).release();
  static py::handle timeout = py::object(core.attr("CollectiveTimeout")).release();
  static py::handle mismatch = py::object(core.attr("CollectiveMismatch")).release();
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const CollectiveTimeout& e) {
      py::set_error(timeout, e.what());
    } catch (const CollectiveMismatch& e) {
      py::set_error(mismatch, e.what());
    } catch (const CollectiveError& e) {
      py::set_error(error, e.what());
    } catch (const InvalidType& e) {
      py::set_error(PyExc_TypeError, e.what());
    }
  });
}

}  // namespace pycoll
