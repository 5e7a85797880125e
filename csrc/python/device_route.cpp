#include "python/device_route.h"

#include <string>

#include "common/errors.h"
#include "python/call_args.h"

namespace py = pybind11;

namespace pycoll {
namespace {

// An attribute of `obj`, or a null object (the error cleared) where it has none.
py::object attr(PyObject* obj, const char* name) {
  PyObject* v = PyObject_GetAttrString(obj, name);
  if (v == nullptr) PyErr_Clear();
  return py::reinterpret_steal<py::object>(v);
}

// A Python int as an unsigned 64-bit value; false (the error cleared) for anything else.
bool as_u64(const py::object& v, uint64_t& out) {
  if (!v || !PyLong_Check(v.ptr())) return false;
  out = PyLong_AsUnsignedLongLong(v.ptr());
  if (out == static_cast<uint64_t>(-1) && PyErr_Occurred()) {
    PyErr_Clear();
    return false;
  }
  return true;
}

struct DeviceArray {
  uint64_t ptr = 0, count = 0;
  int dtype = -1;
};

// `a` as runtime/arrays.py's _from_cupy reads it, when it is a C-contiguous array of a dtype
// we move on `device`; false otherwise.
bool describe(PyObject* a, int device, DeviceArray& d) {
  const py::object data = attr(a, "data");
  if (!data) return false;
  uint64_t dev = 0;
  if (!as_u64(attr(data.ptr(), "ptr"), d.ptr) || !as_u64(attr(data.ptr(), "device_id"), dev) ||
      static_cast<int64_t>(dev) != device || !as_u64(attr(a, "size"), d.count))
    return false;
  const py::object dtype = attr(a, "dtype");
  d.dtype = dtype ? pyargs::dtype_code_of(dtype) : -1;
  if (d.dtype < 0) return false;
  const py::object flags = attr(a, "flags");
  const py::object contiguous = flags ? attr(flags.ptr(), "c_contiguous") : py::object();
  return contiguous && contiguous.ptr() == Py_True;
}

// A stream as runtime/arrays.py's stream_handle reads it: an int, or an object with `ptr`
// (cupy) or `cuda_stream` (torch); false for anything else.
bool stream_handle(const py::object& s, uint64_t& out) {
  if (as_u64(s, out)) return true;
  if (!s) return false;
  return as_u64(attr(s.ptr(), "ptr"), out) || as_u64(attr(s.ptr(), "cuda_stream"), out);
}

// A failed status of the C interface as the C++ error it came from.
[[noreturn]] void throw_status(const pycoll_status& st) {
  const std::string msg = st.message;
  switch (st.code) {
    case PYCOLL_INVALID_TYPE:
      throw InvalidType(msg);
    case PYCOLL_INVALID_VALUE:
      throw InvalidArgument(msg);
    case PYCOLL_TIMEOUT:
      throw CollectiveTimeout(msg);
    case PYCOLL_MISMATCH:
      throw CollectiveMismatch(msg);
    default:
      throw CollectiveError(msg);
  }
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
  for (const Held& h : held_) {
    api_->release(h.work);
    Py_XDECREF(h.x);
    Py_XDECREF(h.out);
  }
}

void DeviceRoute::release_finished() {
  while (!held_.empty() && api_->done(held_.front().work) != 0) {
    const Held h = held_.front();
    held_.pop_front();
    api_->release(h.work);
    Py_XDECREF(h.x);
    Py_XDECREF(h.out);
  }
}

bool DeviceRoute::run(Collective coll, PyObject* x, PyObject* out, int op, int root, int algo,
                      PyObject* stream) {
  const bool single = out == Py_None;
  switch (coll) {
    case Collective::AllReduce:
    case Collective::Reduce:
      break;
    case Collective::Broadcast:
      if (!single) return false;
      break;
    case Collective::ReduceScatter:
    case Collective::AllGather:
      if (single) return false;
      break;
    default:
      return false;
  }
  const auto type = reinterpret_cast<PyTypeObject*>(array_type_.ptr());
  if (Py_TYPE(x) != type || (!single && Py_TYPE(out) != type)) return false;
  DeviceArray xa, oa;
  if (!describe(x, device_, xa) || (!single && !describe(out, device_, oa))) return false;
  if (single)
    oa = xa;
  else if (oa.dtype != xa.dtype)
    return false;  // the general path names both dtypes
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
  if (rc != PYCOLL_OK) throw_status(st);
  release_finished();
  Py_INCREF(x);
  if (!single) Py_INCREF(out);
  held_.push_back({work, x, single ? nullptr : out});
  return true;
}

}  // namespace pycoll
