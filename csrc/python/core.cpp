// pybind11 module pycollectives._C: argument checks at the edge, then C++ with the GIL released.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cctype>
#include <climits>
#include <cstring>
#include <exception>
#include <memory>
#include <numeric>
#include <optional>
#include <stdexcept>
#include <tuple>
#include <utility>
#include <vector>

#include "algo/messages.h"
#include "algo/schedule.h"
#include "common/coverage.h"
#include "common/errors.h"
#include "common/reduce.h"
#include "host/host_capi.h"
#include "host/host_comm.h"
#include "python/array_memory.h"
#include "python/call_args.h"
#include "python/device_route.h"

namespace pycoll {
const pycoll_host_api* host_api();  // host_capi.cpp
}

namespace py = pybind11;
using namespace pycoll;
using namespace pycoll::pyargs;

namespace {

// pycollectives.ReduceOp (made by bind_codes from the core's op table) and the names a caller
// may give its members (name -> member, "SUM" and "sum"). run_now takes members of that exact
// type, not other integers, and names found in that table.
PyTypeObject* reduce_op_type = nullptr;
PyObject* op_names = nullptr;

// The algorithm code of `algorithm` as run_now takes it: None (automatic) or a name; -1 for
// anything else, which the general path converts or rejects.
int algo_code_of(py::handle algorithm) {
  if (algorithm.is_none()) return 0;
  if (!PyUnicode_Check(algorithm.ptr())) return -1;
  for (int a = 0; a < kNumAlgos; ++a)
    if (PyUnicode_CompareWithASCIIString(algorithm.ptr(), algo_name(static_cast<Algo>(a))) == 0)
      return a;
  return -1;
}

// The op code of `op` as run_now takes it: a ReduceOp, or a name in the package's table; -1
// for anything else, which the general path converts or rejects.
int op_code_of(py::handle op) {
  PyObject* member = op.ptr();
  if (Py_TYPE(member) != reduce_op_type) {
    if (!PyUnicode_Check(member) || op_names == nullptr) return -1;
    member = PyDict_GetItemWithError(op_names, member);  // borrowed; str keys: no error
    if (member == nullptr) return -1;
  }
  return static_cast<int>(PyLong_AsLong(member));
}

// torch CPU tensors, once the package has met torch (set_torch_tensors): their exact type, the
// DType codes of the torch dtypes the host moves (dtype -> int), and torch.strided. Kept for
// good, as torch is.
PyTypeObject* torch_tensor_type = nullptr;
PyObject* torch_dtypes = nullptr;
PyObject* torch_strided = nullptr;

// A torch CPU tensor's memory as runtime/arrays.host_view sees it (strided, contiguous, a dtype
// the host moves, no lazy negation); false for anything else.
bool torch_cpu_memory(PyObject* t, ArrayMemory& m) {
  static PyObject* const kIsCpu = interned("is_cpu");
  static PyObject* const kLayout = interned("layout");
  static PyObject* const kIsContiguous = interned("is_contiguous");
  static PyObject* const kIsNeg = interned("is_neg");
  static PyObject* const kDtype = interned("dtype");
  static PyObject* const kDataPtr = interned("data_ptr");
  static PyObject* const kNumel = interned("numel");
  if (attr_or_null(t, kIsCpu).ptr() != Py_True || attr_or_null(t, kLayout).ptr() != torch_strided ||
      call_or_null(t, kIsContiguous).ptr() != Py_True || call_or_null(t, kIsNeg).ptr() != Py_False)
    return false;
  const py::object dtype = attr_or_null(t, kDtype);
  PyObject* code = dtype ? PyDict_GetItemWithError(torch_dtypes, dtype.ptr()) : nullptr;
  if (code == nullptr) {
    PyErr_Clear();
    return false;
  }
  m.dtype = static_cast<int>(PyLong_AsLong(code));
  return as_u64(call_or_null(t, kDataPtr), m.ptr) && as_u64(call_or_null(t, kNumel), m.count);
}

// Holds the GIL released for its lifetime (what py::gil_scoped_release does, without pybind11's
// bookkeeping: run_now's calls are the smallest there are).
struct NoGil {
  PyThreadState* state = PyEval_SaveThread();
  NoGil() = default;
  NoGil(const NoGil&) = delete;
  NoGil& operator=(const NoGil&) = delete;
  ~NoGil() { PyEval_RestoreThread(state); }
};

// What a run_now function is bound to: a host communicator (kept alive by `owner`), and the
// device transport its calls on device arrays go to, once one is attached (run_now_via).
struct RunNow {
  HostComm* comm;
  PyObject* owner;
  std::unique_ptr<DeviceRoute> route;
  ~RunNow() {
    route.reset();
    Py_XDECREF(owner);
  }
};

// run_now(code, x, out, op, root, algorithm, async_op, stream): the common call in one step from
// the Python layer. numpy arrays, op a ReduceOp or its name, root an int, algorithm None or a
// name, run now: returns True once done. With a device route, arrays of the route's type go
// to the device transport instead (queued on the stream, as a blocking GPU call is). Anything
// else returns False before anything is looked at further, and the Python layer takes its
// general path (conversions, other array types, Work, its own error messages).
bool run_now(RunNow& s, PyObject* const* a) {
  const py::handle x(a[1]), out(a[2]), op(a[3]), root(a[4]), algorithm(a[5]);
  const auto* ndarray = py::detail::npy_api::get().PyArray_Type_;
  const bool host = Py_TYPE(x.ptr()) == ndarray &&
                    (out.is_none() || Py_TYPE(out.ptr()) == ndarray) && a[7] == Py_None;
  const bool tensors =
      !host && torch_tensor_type != nullptr && Py_TYPE(x.ptr()) == torch_tensor_type &&
      (out.is_none() || Py_TYPE(out.ptr()) == torch_tensor_type) && a[7] == Py_None;
  if ((!host && !tensors && s.route == nullptr) || !PyLong_CheckExact(a[0]) || a[6] != Py_False ||
      !PyLong_CheckExact(root.ptr()))
    return false;
  int overflow = 0;
  const long code = PyLong_AsLongAndOverflow(a[0], &overflow);
  if (overflow != 0 || code < 0 || code >= kNumCollectives) return false;
  const auto coll = static_cast<Collective>(code);
  const int op_code = carries_partials(coll) ? op_code_of(op) : 0;
  const int algo = algo_code_of(algorithm);
  const long r = PyLong_AsLongAndOverflow(root.ptr(), &overflow);
  if (op_code < 0 || algo < 0 || overflow != 0 || r < INT_MIN || r > INT_MAX) return false;
  HostComm& c = *s.comm;
  if (tensors) {  // torch CPU tensors: on the host, as numpy views of them would be
    const bool single = out.is_none();
    ArrayMemory xm, om;
    if (!one_step_form(coll, single) || !torch_cpu_memory(x.ptr(), xm) ||
        (!single && !torch_cpu_memory(out.ptr(), om)) || !output_of(xm, single, om))
      return false;
    const CollectiveCall call = described_call(
        coll, reinterpret_cast<const void*>(xm.ptr), xm.count, reinterpret_cast<void*>(om.ptr),
        om.count, xm.dtype, static_cast<int>(r), op_code, algo, c.rank(), c.size());
    NoGil nogil;
    c.run(call);
    return true;
  }
  if (!host)
    return s.route->run(coll, x.ptr(), out.ptr(), op_code, static_cast<int>(r), algo, a[7]);
  const CollectiveCall call =
      parse_call(coll, x, out, static_cast<int>(r), op_code, algo, c.rank(), c.size());
  NoGil nogil;
  c.run(call);
  return true;
}

// A C++ exception on its way to Python from a plain CPython function: raise_pending (bound by
// pybind11 in the module) rethrows it, so that pybind11 translates it as for any binding.
thread_local std::exception_ptr pending_error;
PyObject* raise_pending = nullptr;

PyObject* raise_as_python(std::exception_ptr e) {
  pending_error = std::move(e);
  Py_XDECREF(PyObject_CallNoArgs(raise_pending));  // NULL, with the Python exception set
  return nullptr;
}

constexpr const char* kRunNowCapsule = "pycollectives._C.run_now";

PyObject* run_now_fast(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 8) {
    PyErr_SetString(PyExc_TypeError, "run_now takes 8 positional arguments");
    return nullptr;
  }
  auto* s = static_cast<RunNow*>(PyCapsule_GetPointer(self, kRunNowCapsule));
  if (s == nullptr) return nullptr;
  try {
    return PyBool_FromLong(run_now(*s, args));
  } catch (...) {
    return raise_as_python(std::current_exception());
  }
}

PyMethodDef run_now_def = {
    "run_now", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(run_now_fast)),
    METH_FASTCALL, "run_now(code, x, out, op, root, algorithm, async_op, stream) -> bool"};

// run_now bound to the communicator `self` (a HostComm), which it keeps alive, and to `route`
// (may be null). pybind11's own call machinery would cost as much as the rest of an 8-byte
// call's native part.
py::object run_now_function(py::object self, std::unique_ptr<DeviceRoute> route) {
  auto state = std::make_unique<RunNow>();
  state->comm = &self.cast<HostComm&>();
  state->owner = self.inc_ref().ptr();
  state->route = std::move(route);
  PyObject* cap = PyCapsule_New(state.get(), kRunNowCapsule, [](PyObject* capsule) {
    delete static_cast<RunNow*>(PyCapsule_GetPointer(capsule, kRunNowCapsule));
  });
  if (cap == nullptr) throw py::error_already_set();
  state.release();  // the capsule's now
  auto capsule = py::reinterpret_steal<py::object>(cap);
  PyObject* fn = PyCFunction_NewEx(&run_now_def, cap, nullptr);
  if (fn == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(fn);
}

// Runs `call` now with the GIL released, or queues it and returns its Work.
py::object dispatch(HostComm& c, const CollectiveCall& call, bool async_op) {
  if (async_op) return py::cast(c.submit(call));
  {
    py::gil_scoped_release nogil;
    c.run(call);
  }
  return py::none();
}

// Tuning rules as Python holds them: (collective, min_ranks, max_ranks, max_bytes, algorithm).
using RuleTuple = std::tuple<std::string, int, int, size_t, std::string>;

std::vector<TuningRule> tuning_rules(const std::vector<RuleTuple>& rules) {
  std::vector<TuningRule> out;
  for (const auto& [coll, lo, hi, max_bytes, algo] : rules)
    out.push_back({collective_from_name(coll), lo, hi, max_bytes, algo_from_name(algo)});
  return out;
}

void bind_host_comm(py::module_& m) {
  m.def(
      "table_choice",
      [](const std::vector<RuleTuple>& rules, const std::string& collective, int size,
         size_t bytes) {
        return std::string(algo_name(
            table_choice(tuning_rules(rules), collective_from_name(collective), size, bytes).algo));
      },
      py::arg("rules"), py::arg("collective"), py::arg("size"), py::arg("bytes"),
      "The algorithm tuning `rules` give `collective` of `bytes` of input on `size` ranks, as "
      "a host communicator reads them (HostComm.choose without single copy, PYCOLL_ALGO or "
      "reproducible mode).");
  // Memory the ranks of a machine can map (Communicator.empty wraps it in a numpy array).
  py::class_<SharedBuffer>(m, "SharedBuffer", py::buffer_protocol())
      .def(py::init([](size_t bytes) { return std::make_unique<SharedBuffer>(bytes); }),
           py::arg("bytes"))
      .def_property_readonly("nbytes", &SharedBuffer::bytes)
      .def_buffer([](SharedBuffer& b) {
        return py::buffer_info(b.data(), 1, py::format_descriptor<uint8_t>::format(), 1,
                               {static_cast<py::ssize_t>(b.bytes())}, {1});
      });
  m.def(
      "is_shared",
      [](py::buffer x) {
        const py::buffer_info info = x.request();
        SharedRef ref;
        return find_shared(info.ptr, static_cast<size_t>(info.size * info.itemsize), ref);
      },
      py::arg("array"), "Whether the array's memory lies in a shared buffer (Communicator.empty).");
  py::class_<HostCommOptions>(m, "HostCommOptions")
      .def(py::init<>())
      .def_readwrite("slot_bytes", &HostCommOptions::slot_bytes)
      .def_readwrite("nslots", &HostCommOptions::nslots)
      .def_readwrite("timeout", &HostCommOptions::timeout_s)
      .def_readwrite("stream_bytes", &HostCommOptions::stream_bytes)
      .def_readwrite("debug", &HostCommOptions::debug)
      .def_readwrite("oneshot_max_bytes", &HostCommOptions::oneshot_max_bytes)
      .def_readwrite("check_mismatch", &HostCommOptions::check_mismatch)
      .def_readwrite("p2p_eager_max_bytes", &HostCommOptions::p2p_eager_max_bytes)
      .def_readwrite("p2p_cma_min_bytes", &HostCommOptions::p2p_cma_min_bytes)
      .def_readwrite("single_copy_min_bytes", &HostCommOptions::single_copy_min_bytes)
      .def_readwrite("shared_min_bytes", &HostCommOptions::shared_min_bytes)
      .def_readwrite("flight_entries", &HostCommOptions::flight_entries)
      .def_readwrite("reproducible", &HostCommOptions::reproducible)
      .def_property(
          "p2p_cma",
          [](const HostCommOptions& o) {
            return o.p2p_cma == CmaMode::Use ? "on" : o.p2p_cma == CmaMode::Off ? "off" : "fail";
          },
          [](HostCommOptions& o, const std::string& v) {
            if (v != "on" && v != "off" && v != "fail")
              throw InvalidArgument(
                  str_cat("p2p_cma must be \"on\", \"off\" or \"fail\", got \"", v, "\""));
            o.p2p_cma = v == "on" ? CmaMode::Use : v == "off" ? CmaMode::Off : CmaMode::Fail;
          })
      .def_property(
          "slot_stores", [](const HostCommOptions& o) { return slot_stores_name(o.slot_stores); },
          [](HostCommOptions& o, const std::string& v) { o.slot_stores = parse_slot_stores(v); });

  // The slot-store choice alone, fed made-up call times (tests).
  py::class_<SlotStorePolicy>(m, "SlotStorePolicy")
      .def(py::init(
               [](const std::string& mode) { return SlotStorePolicy(parse_slot_stores(mode)); }),
           py::arg("mode") = "auto")
      .def("choose", &SlotStorePolicy::choose, py::arg("kind"), py::arg("bytes"))
      .def("record", &SlotStorePolicy::record, py::arg("kind"), py::arg("bytes"),
           py::arg("streamed"), py::arg("seconds"));

  py::class_<Work, std::shared_ptr<Work>>(m, "Work")
      .def(
          "wait",
          [](Work& w, std::optional<double> timeout) {
            bool done;
            {
              py::gil_scoped_release nogil;
              done = w.wait(timeout ? *timeout : -1.0);
            }
            if (!done)
              throw CollectiveTimeout(str_cat("Work.wait: collective #", w.seq(),
                                              " not complete after ", *timeout, " s"));
            return true;
          },
          py::arg("timeout") = py::none())
      .def("is_completed", &Work::is_completed)
      .def_property_readonly("seq", &Work::seq)
      .def_property_readonly("times", &Work::times);

  py::class_<HostComm>(m, "HostComm")
      .def(py::init<int, int, const HostCommOptions&>(), py::arg("rank"), py::arg("size"),
           py::arg("options"))
      .def_property_readonly("segment_name", &HostComm::segment_name)
      .def("attach", &HostComm::attach, py::arg("names"))
      .def("unlink", &HostComm::unlink)
      // For host_api callers (the torch backend): this communicator as their `comm` argument.
      .def_property_readonly("address", [](HostComm& c) { return reinterpret_cast<uintptr_t>(&c); })
      .def_property_readonly("rank", &HostComm::rank)
      .def_property_readonly("size", &HostComm::size)
      .def_property_readonly("seq", &HostComm::seq)
      .def_property("timeout", &HostComm::timeout, &HostComm::set_timeout)
      .def_property_readonly("slot_bytes", [](const HostComm& c) { return c.options().slot_bytes; })
      .def_property_readonly("nslots", [](const HostComm& c) { return c.options().nslots; })
      .def_property_readonly("poisoned", &HostComm::poisoned)
      .def_property_readonly("poison_reason", &HostComm::poison_reason)
      // Without the GIL: abort writes the flight record (a file), and the heartbeat thread of
      // a communicator over nodes calls it while the ranks' other threads run Python.
      .def("abort", &HostComm::abort, py::arg("reason"), py::call_guard<py::gil_scoped_release>())
      .def("revoke", &HostComm::revoke)
      .def(
          "set_flight_dump",
          [](HostComm& c, const std::string& path, int rank, int size, const std::string& comm) {
            c.set_flight_dump(path, rank, size, comm);
          },
          py::arg("path"), py::arg("rank"), py::arg("size"), py::arg("comm"),
          "Where the flight recorder writes this communicator's ring (a JSON file), and the "
          "rank, size and communicator id it names; also makes SIGUSR1 write it.")
      .def(
          "flight_begin",
          [](HostComm& c, uint32_t kind, uint64_t count, uint32_t dtype, uint32_t op, int root,
             uint64_t seq, bool queued) {
            FlightCall f;
            f.kind = kind;
            f.count = count;
            f.dtype = dtype;
            f.op = op;
            f.root = root;
            f.seq = seq;
            return c.flight().begin(f, queued ? FlightState::Queued : FlightState::Started);
          },
          py::arg("kind"), py::arg("count"), py::arg("dtype"), py::arg("op"), py::arg("root"),
          py::arg("seq"), py::arg("queued"),
          "Records a call made above this communicator (a call across nodes of which this one "
          "runs the node's phases) in its flight recorder; returns its id. kind: a collective "
          "code, or 100 for a barrier.")
      .def(
          "flight_mark",
          [](HostComm& c, uint64_t id, uint32_t state) {
            c.flight().mark(id, static_cast<FlightState>(state));
          },
          py::arg("id"), py::arg("state"),
          "Moves entry `id` to state 2 (started), 3 (ended) or 4 (failed).")
      .def(
          "flight_dump",
          [](const HostComm& c, const std::string& reason) {
            py::gil_scoped_release nogil;
            return c.flight().dump(reason);
          },
          py::arg("reason"), "Writes the flight recorder's ring now; False without a path.")
      .def_property_readonly(
          "flight_records",
          [](const HostComm& c) {
            py::list out;
            for (const FlightRecord& r : c.flight().snapshot())
              out.append(py::make_tuple(r.id, r.call.seq, r.call.kind, r.call.count, r.call.dtype,
                                        r.call.op, r.call.algo, r.call.root, r.call.tag,
                                        r.call.outer_seq, static_cast<uint32_t>(r.state),
                                        r.queued_ns, r.started_ns, r.ended_ns));
            return out;
          },
          "The flight recorder's entries, oldest first: (id, seq, kind, count, dtype, op, algo, "
          "root or peer, tag, outer seq, state, queued ns, started ns, ended ns).")
      .def(
          "board_exchange",
          [](HostComm& c, uint64_t value, const py::bytes& payload) {
            std::string data = payload;
            std::vector<BoardEntry> entries;
            {
              py::gil_scoped_release nogil;
              entries = c.board_exchange(value, data);
            }
            py::list out;
            for (const BoardEntry& e : entries)
              out.append(py::make_tuple(e.rank, e.value, py::bytes(e.payload)));
            return out;
          },
          py::arg("value"), py::arg("payload") = py::bytes(),
          "One round of the fault-tolerant board: [(rank, value, payload)] of the ranks that "
          "took part (every rank still running).")
      .def("enable_shared", &HostComm::enable_shared)
      .def_property_readonly("shared_enabled", &HostComm::shared_enabled)
      .def(
          "set_tuning",
          [](HostComm& c, const std::vector<RuleTuple>& rules) {
            c.set_tuning(tuning_rules(rules));
          },
          py::arg("rules"))
      .def(
          "set_forced",
          [](HostComm& c, const std::string& algo) { c.set_forced(algo_from_name(algo)); },
          py::arg("algorithm"))
      .def(
          "choose",
          [](const HostComm& c, const std::string& coll, size_t bytes) {
            return std::string(algo_name(c.choose(collective_from_name(coll), bytes)));
          },
          py::arg("collective"), py::arg("bytes"))
      // A plain CPython function (run_now_function), bound to this communicator.
      .def_property_readonly("run_now",
                             [](py::object self) { return run_now_function(self, nullptr); })
      // run_now that also hands blocking calls on one library's device arrays to a device
      // transport (python/device_route.h): the arguments as DeviceRoute takes them.
      .def(
          "run_now_via",
          [](py::object self, py::capsule api, uintptr_t comm, py::object keep,
             py::object array_type, py::object current_stream, int device) {
            return run_now_function(self, std::make_unique<DeviceRoute>(
                                              api, comm, std::move(keep), std::move(array_type),
                                              std::move(current_stream), device));
          },
          py::arg("device_api"), py::arg("comm"), py::arg("keep"), py::arg("array_type"),
          py::arg("current_stream"), py::arg("device"))
      .def(
          "run_call",
          [](HostComm& c, const py::tuple& call, const std::optional<CallRecord>& outer) {
            bool async_op = false;
            CollectiveCall cc = parse_call(call, c.rank(), c.size(), &async_op);
            if (outer) cc.outer = *outer;
            return dispatch(c, cc, async_op);
          },
          py::arg("call"), py::arg("outer") = py::none())
      .def("set_rank_names", &HostComm::set_rank_names, py::arg("names"))
      .def(
          "outer_records",
          [](const HostComm& c, uint64_t seq) {
            py::gil_scoped_release nogil;
            return c.outer_records(seq);
          },
          py::arg("seq"))
      .def(
          "p2p",
          [](HostComm& c, py::handle ops_obj, bool async_op) -> py::object {
            py::list arrays;
            const std::vector<P2POp> ops = parse_p2p(ops_obj, c.rank(), c.size(), arrays);
            if (async_op) {
              py::object work = py::cast(c.p2p_start(ops));
              py::detail::keep_alive_impl(work, arrays);  // buffers outlive the batch
              return work;
            }
            {
              py::gil_scoped_release nogil;
              c.p2p(ops);
            }
            return py::none();
          },
          py::arg("ops"), py::arg("async_op") = false)
      .def(
          "barrier",
          [](HostComm& c, bool async_op, const std::optional<CallRecord>& outer) {
            CollectiveCall call;
            call.barrier = true;
            if (outer) call.outer = *outer;
            return dispatch(c, call, async_op);
          },
          py::arg("async_op") = false, py::arg("outer") = py::none());
}

// Schedules as plain tuples, for tests that check them without processes.
void bind_schedules(py::module_& m) {
  m.def(
      "schedule",
      [](const std::string& algorithm, const std::string& collective, int rank, int size,
         size_t count, int root, size_t piece, size_t acc_bytes, size_t oneshot_max_bytes,
         size_t shard_align, const std::optional<std::vector<uint64_t>>& counts,
         const std::optional<std::vector<uint64_t>>& send_counts,
         const std::optional<std::vector<uint64_t>>& recv_counts, bool lookahead) {
        if (size < 1 || rank < 0 || rank >= size || root < 0 || root >= size || piece == 0 ||
            shard_align == 0)
          throw InvalidArgument("schedule: bad rank, size, root, piece or shard alignment");
        const Collective c = collective_from_name(collective);
        const Algo a = algo_from_name(algorithm);
        if (a == Algo::Auto || !algo_supports(a, c))
          throw InvalidArgument(str_cat("schedule: ", algorithm, " has no ", collective));
        ScheduleParams p{rank, size, count, root, piece, acc_bytes, oneshot_max_bytes, shard_align};
        // Per-rank counts, as ScheduleParams documents them (None: even).
        auto list = [&](const std::optional<std::vector<uint64_t>>& v, const char* name) {
          if (v && v->size() != static_cast<size_t>(size))
            throw InvalidArgument(str_cat("schedule: ", name, " needs one entry per rank"));
          return v ? v->data() : nullptr;
        };
        p.counts = list(counts, "counts");
        p.send_counts = list(send_counts, "send_counts");
        p.recv_counts = list(recv_counts, "recv_counts");
        p.lookahead = lookahead;
        StepRecorder rec;
        make_schedule(a, c, p, rec);
        py::list steps;
        auto buf = [](Buf b) { return b == Buf::Input ? "in" : b == Buf::Output ? "out" : ""; };
        for (const Step& s : rec.steps) {
          py::dict d;
          d["kind"] = step_kind_name(s.kind);
          d["from"] = s.from;
          d["from2"] = s.from2;
          d["to"] = s.to;
          d["to2"] = s.to2;
          d["bcast"] = s.recv_bcast;
          d["src"] = py::make_tuple(buf(s.src.buf), s.src.offset);
          d["dst"] = py::make_tuple(buf(s.dst.buf), s.dst.offset);
          d["count"] = s.count;
          d["recv_acc"] = s.recv_wire == Wire::Acc;
          d["send_acc"] = s.send_wire == Wire::Acc;
          // What the step moves, by the one definition every executor uses.
          py::list recv_from, send_to;
          for_each_message(
              peers_of(s), rank, size, [&](int q) { recv_from.append(q); },
              [&](int t) { send_to.append(t); });
          d["recv_from"] = recv_from;
          d["send_to"] = send_to;
          d["reduces"] = step_reduces(s.kind);
          steps.append(d);
        }
        return steps;
      },
      py::arg("algorithm"), py::arg("collective"), py::arg("rank"), py::arg("size"),
      py::arg("count"), py::arg("root") = 0, py::arg("piece"), py::arg("acc_bytes") = 4,
      py::arg("oneshot_max_bytes") = ScheduleParams{}.oneshot_max_bytes, py::arg("shard_align") = 1,
      py::arg("counts") = py::none(), py::arg("send_counts") = py::none(),
      py::arg("recv_counts") = py::none(), py::arg("lookahead") = false);
  m.attr("ALL_PEERS") = kAllPeers;
  m.attr("NO_PEER") = kNoPeer;
}

// The codes of collectives, algorithms, dtypes and ops, by name in code order: the one table
// the Python layers read (a name's index is its native code).
void bind_codes(py::module_& m) {
  py::tuple colls(kNumCollectives), algos(kNumAlgos), dtypes(kNumDTypes), ops(kNumRedOps);
  py::dict algos_for;
  py::list reducing;
  for (int k = 0; k < kNumCollectives; ++k) {
    const auto c = static_cast<Collective>(k);
    colls[k] = collective_name(c);
    py::list supported;
    for (int a = 1; a < kNumAlgos; ++a)
      if (algo_supports(static_cast<Algo>(a), c)) supported.append(algo_name(static_cast<Algo>(a)));
    algos_for[collective_name(c)] = py::tuple(supported);
    if (carries_partials(c)) reducing.append(collective_name(c));
  }
  for (int k = 0; k < kNumAlgos; ++k) algos[k] = algo_name(static_cast<Algo>(k));
  py::tuple sizes(kNumDTypes);
  for (int k = 0; k < kNumDTypes; ++k) {
    dtypes[k] = dtype_name(static_cast<DType>(k));
    sizes[k] = dtype_size(static_cast<DType>(k));
  }
  for (int k = 0; k < kNumRedOps; ++k) ops[k] = redop_name(static_cast<RedOp>(k));
  m.attr("COLLECTIVES") = colls;
  m.attr("ALGORITHMS") = algos;
  m.attr("DTYPES") = dtypes;
  m.attr("DTYPE_SIZES") = sizes;  // bytes per element, by code
  m.attr("OPS") = ops;
  m.attr("ALGORITHMS_FOR") = algos_for;
  m.attr("REDUCING") = py::tuple(reducing);
  py::tuple fields(
      static_cast<size_t>(kNumCallFields));  // pycollectives.backends.Call's fields, in order
  for (int k = 0; k < kNumCallFields; ++k) fields[k] = kCallFieldNames[k];
  m.attr("CALL_FIELDS") = fields;
  // ReduceOp, an IntEnum whose values are the op codes, made here from the same table, so that
  // run_now knows its members without the core taking a type from the Python layer.
  py::list members;
  for (int k = 0; k < kNumRedOps; ++k) {
    std::string name = redop_name(static_cast<RedOp>(k));
    for (char& ch : name) ch = static_cast<char>(std::toupper(static_cast<unsigned char>(ch)));
    members.append(py::make_tuple(name, k));
  }
  py::object type = py::module_::import("enum").attr("IntEnum")(
      "ReduceOp", members, py::arg("module") = "pycollectives.ops",
      py::arg("qualname") = "ReduceOp");
  py::dict names;
  for (int k = 0; k < kNumRedOps; ++k) {
    py::object member = type(k);
    names[member.attr("name")] = member;
    names[py::str(redop_name(static_cast<RedOp>(k)))] = member;
  }
  m.attr("ReduceOp") = type;
  m.attr("OP_NAMES") = names;
  reduce_op_type = reinterpret_cast<PyTypeObject*>(type.release().ptr());  // kept for good
  op_names = names.release().ptr();
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "pycollectives native core (private; use the pycollectives package)";
  // Translators run newest first, so the subclasses are registered after their base.
  auto& base = py::register_exception<CollectiveError>(m, "CollectiveError", PyExc_RuntimeError);
  py::register_exception<CollectiveTimeout>(m, "CollectiveTimeout", base.ptr());
  py::register_exception<CollectiveMismatch>(m, "CollectiveMismatch", base.ptr());
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const InvalidType& e) {
      py::set_error(PyExc_TypeError, e.what());
    }
  });
  bind_host_comm(m);
  // The C interface of host/host_capi.h, for extensions built apart from this one.
  m.attr("host_api") = py::capsule(static_cast<const void*>(host_api()), PYCOLL_HOST_API_NAME);
  bind_schedules(m);
  bind_codes(m);
  PYCOLL_BIND_COVERAGE_DUMP(m);
  m.def("_raise_pending", [] {
    std::exception_ptr e = std::exchange(pending_error, nullptr);
    if (e == nullptr) throw std::logic_error("_raise_pending: no error pending");
    std::rethrow_exception(e);
  });
  raise_pending = py::object(m.attr("_raise_pending")).release().ptr();  // kept for good
  m.def(
      "set_torch_tensors",
      [](py::object tensor_type, py::dict dtype_codes, py::object strided) {
        if (!PyType_Check(tensor_type.ptr()))
          throw InvalidType("set_torch_tensors: tensor_type must be a type");
        for (auto item : dtype_codes)
          if (!valid_dtype(item.second.cast<int>()))
            throw InvalidArgument("set_torch_tensors: bad dtype code");
        if (torch_tensor_type != nullptr) return;  // once: torch is one per process
        torch_dtypes = dtype_codes.release().ptr();
        torch_strided = strided.release().ptr();
        torch_tensor_type = reinterpret_cast<PyTypeObject*>(tensor_type.release().ptr());
      },
      py::arg("tensor_type"), py::arg("dtype_codes"), py::arg("strided"),
      "Lets run_now take blocking calls on CPU tensors of exactly `tensor_type` (torch.Tensor), "
      "strided and contiguous, of the dtypes in `dtype_codes` (torch dtype -> DType code), as "
      "it takes numpy arrays. Once per process; later calls change nothing.");
  m.def(
      "check_p2p",
      [](py::handle ops, int rank, int size) {
        // The ops as another transport takes them: (send, address, count, dtype code, peer,
        // tag), every one checked as the host path checks it.
        py::list arrays, described;
        for (const P2POp& o : parse_p2p(ops, rank, size, arrays))
          described.append(py::make_tuple(o.kind == P2PKind::Send,
                                          reinterpret_cast<uintptr_t>(o.buf), o.count,
                                          static_cast<int>(o.dtype), o.peer, o.tag));
        return described;
      },
      py::arg("ops"), py::arg("rank"), py::arg("size"));
  m.def("check_args", &check_args, py::arg("call"), py::arg("rank"), py::arg("size"));
  m.def(
      "segment_bytes",
      [](int size, size_t slot_bytes, int nslots) {
        return ShmTransport::layout(size, slot_bytes, nslots, /*p2p=*/true).total;
      },
      py::arg("size"), py::arg("slot_bytes"), py::arg("nslots"),
      "Bytes of /dev/shm one rank's segment takes on a machine where `size` ranks share a "
      "communicator, with staging slots of `slot_bytes` and `nslots` per channel.");
  m.def(
      "fold_rows",
      [](py::array rows, py::array out, int dtype, int op, int divisor) {
        if (!valid_dtype(dtype) || !valid_redop(op))
          throw InvalidArgument("fold_rows: bad dtype or op code");
        const auto t = static_cast<DType>(dtype);
        const size_t esize = dtype_size(t);
        const size_t bytes = static_cast<size_t>(out.nbytes());
        const size_t count = bytes / esize;
        const bool c_order = py::array::c_style;
        if (!(rows.flags() & c_order) || !(out.flags() & c_order) || !out.writeable() ||
            bytes % esize != 0 || static_cast<size_t>(rows.itemsize()) != esize ||
            static_cast<size_t>(out.itemsize()) != esize ||
            (count == 0 ? rows.nbytes() != 0 : static_cast<size_t>(rows.nbytes()) % bytes != 0))
          throw InvalidArgument(
              "fold_rows: rows must be whole rows of out's size, both contiguous");
        const size_t n = count == 0 ? 0 : static_cast<size_t>(rows.nbytes()) / bytes;
        const void* from = rows.data();
        void* into = out.mutable_data();
        py::gil_scoped_release nogil;
        fold_rows(t, static_cast<RedOp>(op), from, n, count, into, divisor);
      },
      py::arg("rows"), py::arg("out"), py::arg("dtype"), py::arg("op"), py::arg("divisor"),
      "out = op over the rows of `rows` (each out's size) in row order, accumulated as the "
      "direct schedules accumulate; an average divided by `divisor` once at the end.");
  m.def(
      "call_record",
      [](const py::tuple& call, int rank, int size, uint64_t seq) {
        const CollectiveCall c = parse_call(call, rank, size);
        return py::make_tuple(c.count, static_cast<int>(c.dtype),
                              Fingerprint::of_call(seq, c, c.algo).record());
      },
      py::arg("call"), py::arg("rank"), py::arg("size"), py::arg("seq"));
  m.def(
      "barrier_record",
      [](uint64_t seq) {
        Fingerprint f;
        f.seq = seq;
        f.kind = kBarrierKind;
        return f.record();
      },
      py::arg("seq"));
  m.def(
      "describe_record", [](const CallRecord& r) { return Fingerprint::from_record(r).describe(); },
      py::arg("record"));
  m.def(
      "record_differences",
      [](const CallRecord& a, const CallRecord& b) {
        const Fingerprint fa = Fingerprint::from_record(a), fb = Fingerprint::from_record(b);
        // Calls of different collectives differ in what each of them is; their sizes and ops
        // need no comparing.
        std::string d = fa.kind != fb.kind ? "collective" : fa.differences(fb);
        if (a[0] != b[0]) d = d.empty() ? "sequence number" : "sequence number, " + d;
        return d;
      },
      py::arg("a"), py::arg("b"));
}
