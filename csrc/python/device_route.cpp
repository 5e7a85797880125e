#include "python/device_route.h"

#include "common/errors.h"
#include "python/array_memory.h"
#include "python/call_args.h"
#include "runtime/capi_guard.h"

namespace py = pybind11;

namespace pycoll {
namespace {

// `a` as runtime/arrays.py's _from_cupy reads it, when it is a C-contiguous array of a dtype
// we move on `device`; false otherwise.
bool describe(PyObject* a, int device, ArrayMemory& m) {
  static PyObject* const kData = interned("data");
  static PyObject* const kPtr = interned("ptr");
  static PyObject* const kDeviceId = interned("device_id");
  static PyObject* const kSize = interned("size");
  static PyObject* const kDtype = interned("dtype");
  static PyObject* const kFlags = interned("flags");
  static PyObject* const kContiguous = interned("c_contiguous");
  const py::object data = attr_or_null(a, kData);
  if (!data) return false;
  uint64_t dev = 0;
  if (!as_u64(attr_or_null(data.ptr(), kPtr), m.ptr) ||
      !as_u64(attr_or_null(data.ptr(), kDeviceId), dev) || static_cast<int64_t>(dev) != device ||
      !as_u64(attr_or_null(a, kSize), m.count))
    return false;
  const py::object dtype = attr_or_null(a, kDtype);
  m.dtype = dtype ? pyargs::dtype_code_of(dtype) : -1;
  if (m.dtype < 0) return false;
  const py::object flags = attr_or_null(a, kFlags);
  const py::object contiguous = flags ? attr_or_null(flags.ptr(), kContiguous) : py::object();
  return contiguous && contiguous.ptr() == Py_True;
}

// A stream as runtime/arrays.py's stream_handle reads it: an int, or an object with `ptr`
// (cupy) or `cuda_stream` (torch); false for anything else.
bool stream_handle(const py::object& s, uint64_t& out) {
  static PyObject* const kPtr = interned("ptr");
  static PyObject* const kCudaStream = interned("cuda_stream");
  if (as_u64(s, out)) return true;
  if (!s) return false;
  return as_u64(attr_or_null(s.ptr(), kPtr), out) ||
         as_u64(attr_or_null(s.ptr(), kCudaStream), out);
}

}  // namespace

DeviceRoute::DeviceRoute(py::handle api, uintptr_t comm, py::object keep, py::object array_type,
                         py::object current_stream, int device)
    : api_(static_cast<const pycoll_device_api*>(
          PyCapsule_GetPointer(api.ptr(), PYCOLL_DEVICE_API_NAME))),
      comm_(reinterpret_cast<void*>(comm)),
      keep_(std::move(keep)),
      array_type_(std::move(array_type)),
      current_stream_(std::move(current_stream)),
      device_(device) {
  if (api_ == nullptr) throw py::error_already_set();
  if (api_->version != PYCOLL_DEVICE_API_VERSION || api_->struct_size < sizeof(pycoll_device_api))
    throw InvalidArgument("device route: the device_api table is of another version");
  if (comm_ == nullptr) throw InvalidArgument("device route: no communicator");
  if (!PyType_Check(array_type_.ptr()))
    throw InvalidType("device route: array_type must be a type");
  if (!PyCallable_Check(current_stream_.ptr()))
    throw InvalidType("device route: current_stream must be callable");
}

DeviceRoute::~DeviceRoute() {
  for (const Held& h : held_) release(h);
}

void DeviceRoute::release(const Held& h) {
  api_->release(h.work);
  Py_XDECREF(h.x);
  Py_XDECREF(h.out);
}

void DeviceRoute::release_finished() {
  while (!held_.empty() && api_->done(held_.front().work) != 0) {
    const Held h = held_.front();
    held_.pop_front();
    release(h);
  }
}

bool DeviceRoute::run(Collective coll, PyObject* x, PyObject* out, int op, int root, int algo,
                      PyObject* stream) {
  const bool single = out == Py_None;
  if (!one_step_form(coll, single)) return false;
  const auto type = reinterpret_cast<PyTypeObject*>(array_type_.ptr());
  if (Py_TYPE(x) != type || (!single && Py_TYPE(out) != type)) return false;
  ArrayMemory xa, oa;
  if (!describe(x, device_, xa) || (!single && !describe(out, device_, oa)) ||
      !output_of(xa, single, oa))
    return false;
  uint64_t s = 0;
  if (stream == Py_None) {
    const py::object current =
        py::reinterpret_steal<py::object>(PyObject_CallNoArgs(current_stream_.ptr()));
    if (!current) PyErr_Clear();
    if (!stream_handle(current, s)) return false;
  } else if (!stream_handle(py::reinterpret_borrow<py::object>(stream), s)) {
    return false;
  }

  pycoll_call k{};
  k.collective = static_cast<int>(coll);
  k.in = reinterpret_cast<const void*>(xa.ptr);
  k.in_count = xa.count;
  k.out = reinterpret_cast<void*>(oa.ptr);
  k.out_count = oa.count;
  k.dtype = xa.dtype;
  k.op = op;
  k.root = root;
  k.algo = algo;
  void* work = nullptr;
  pycoll_status st{};
  int rc;
  {
    py::gil_scoped_release nogil;
    rc = api_->run(comm_, &k, s, 0, &work, &st);
  }
  if (rc != PYCOLL_OK) capi::rethrow(st);
  release_finished();
  Py_INCREF(x);
  if (!single) Py_INCREF(out);
  held_.push_back({work, x, single ? nullptr : out});
  return true;
}

}  // namespace pycoll
