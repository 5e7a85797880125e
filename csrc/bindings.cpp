// pybind11 module pycollectives._C: argument checks at the edge, then C++ with the GIL released.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>
#include <optional>
#include <tuple>

#include "algo/messages.h"
#include "algo/schedule.h"
#include "common/errors.h"
#include "emu/emu_comm.h"
#include "host/host_comm.h"

namespace py = pybind11;
using namespace pycoll;

namespace {

// A validated host array: where it is, how many elements, of what type.
struct ArrayArg {
  uint8_t* ptr = nullptr;
  size_t count = 0;
  DType dtype = DType::Float32;
  size_t bytes() const { return count * dtype_size(dtype); }
};

int dtype_code(const py::dtype& dt) {
  if (dt.byteorder() == '>') return -1;  // not native on the little-endian hosts we run on
  const auto size = dt.itemsize();
  switch (dt.kind()) {
    case 'i':
      return size == 1 ? 0 : size == 4 ? 2 : size == 8 ? 3 : -1;
    case 'u':
      return size == 1 ? 1 : -1;
    case 'f':
      return size == 2 ? 4 : size == 4 ? 6 : size == 8 ? 7 : -1;
    default:
      // bfloat16 comes from extension dtypes (ml_dtypes).
      if (size == 2 && py::str(dt.attr("name")).cast<std::string>() == "bfloat16") return 5;
      return -1;
  }
}

ArrayArg array_arg(py::handle obj, const char* fn, const char* name, bool writable) {
  if (!py::isinstance<py::array>(obj))
    throw InvalidType(str_cat(fn, ": ", name, " must be a numpy.ndarray, got ",
                              py::str(py::type::of(obj).attr("__name__")).cast<std::string>()));
  auto a = py::reinterpret_borrow<py::array>(obj);
  const int code = dtype_code(a.dtype());
  if (code < 0)
    throw InvalidType(str_cat(fn, ": ", name, " has unsupported dtype ",
                              py::str(a.dtype()).cast<std::string>(),
                              " (supported: int8, uint8, int32, int64, float16, bfloat16, "
                              "float32, float64 in native byte order)"));
  if (!(a.flags() & py::array::c_style))
    throw InvalidArgument(str_cat(fn, ": ", name, " must be C-contiguous"));
  if (writable && !a.writeable()) throw InvalidArgument(str_cat(fn, ": ", name, " is read-only"));
  ArrayArg r;
  r.ptr = static_cast<uint8_t*>(const_cast<void*>(a.data()));
  r.count = static_cast<size_t>(a.size());
  r.dtype = static_cast<DType>(code);
  return r;
}

void check_same_dtype(const char* fn, const ArrayArg& x, const ArrayArg& out) {
  if (x.dtype != out.dtype)
    throw InvalidType(str_cat(fn, ": out has dtype ", dtype_name(out.dtype), ", expected ",
                              dtype_name(x.dtype), " (the dtype of x)"));
}

void check_count(const char* fn, const char* name, size_t got, size_t want, const char* why) {
  if (got != want)
    throw InvalidArgument(
        str_cat(fn, ": ", name, " has ", got, " elements, expected ", want, " (", why, ")"));
}

bool overlap(const uint8_t* a, size_t an, const uint8_t* b, size_t bn) {
  return an != 0 && bn != 0 && a < b + bn && b < a + an;
}

// `x` and `out` must either sit exactly where the collective's in-place form puts them
// (`in_place`) or not overlap at all.
void check_aliasing(const char* fn, const ArrayArg& x, const ArrayArg& out, bool in_place) {
  if (!in_place && overlap(x.ptr, x.bytes(), out.ptr, out.bytes()))
    throw InvalidArgument(str_cat(fn, ": x and out overlap without being the in-place layout"));
}

RedOp op_arg(const char* fn, int op, DType t) {
  if (!valid_redop(op)) throw InvalidArgument(str_cat(fn, ": unknown op ", op));
  const RedOp r = static_cast<RedOp>(op);
  if (r == RedOp::Avg && !is_floating(t))
    throw InvalidArgument(str_cat(fn, ": op avg is not supported for integer dtype ", dtype_name(t),
                                  " (use sum and divide)"));
  return r;
}

int root_arg(const char* fn, int root, int size) {
  if (root < 0 || root >= size)
    throw InvalidArgument(str_cat(fn, ": root ", root, " is out of range for ", size, " ranks"));
  return root;
}

Algo algo_arg(Collective c, int algo) {
  const char* fn = collective_name(c);
  if (algo < 0 || algo >= kNumAlgos)
    throw InvalidArgument(str_cat(fn, ": unknown algorithm code ", algo));
  const Algo a = static_cast<Algo>(algo);
  if (a != Algo::Auto && !algo_supports(a, c)) {
    std::string avail;
    for (int k = 1; k < kNumAlgos; ++k)
      if (algo_supports(static_cast<Algo>(k), c))
        avail += str_cat(avail.empty() ? "" : ", ", algo_name(static_cast<Algo>(k)));
    throw InvalidArgument(str_cat(fn, ": algorithm ", algo_name(a), " is not available for ", fn,
                                  " (available: ", avail, ")"));
  }
  return a;
}

Collective collective_arg(const std::string& name) {
  for (int k = 0; k < kNumCollectives; ++k)
    if (name == collective_name(static_cast<Collective>(k))) return static_cast<Collective>(k);
  throw InvalidArgument(str_cat("unknown collective ", name));
}

Algo algo_by_name(const std::string& name) {
  for (int k = 0; k < kNumAlgos; ++k)
    if (name == algo_name(static_cast<Algo>(k))) return static_cast<Algo>(k);
  throw InvalidArgument(str_cat("unknown algorithm ", name));
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

CollectiveCall make_call(Collective coll, const ArrayArg& x, const ArrayArg& out, int algo,
                         size_t count) {
  CollectiveCall call;
  call.collective = coll;
  call.algo = algo_arg(coll, algo);
  call.in = x.ptr;
  call.out = out.ptr;
  call.count = count;
  call.dtype = x.dtype;
  return call;
}

// The checks that depend on the collective, on arrays already described (numpy here, GPU
// arrays in pycollectives/cuda_args.py): the errors a caller sees before any byte moves.
// `out` is `x` in the in-place forms of all_reduce and reduce, and for broadcast. Returns the
// call to run.
CollectiveCall checked_call(Collective c, const ArrayArg& x, const ArrayArg& out, int root,
                            int op_code, int algo, int rank, int size) {
  const char* fn = collective_name(c);
  CollectiveCall call;
  switch (c) {
    case Collective::AllReduce:
    case Collective::Reduce:
      check_same_dtype(fn, x, out);
      check_count(fn, "out", out.count, x.count, "the size of x");
      check_aliasing(fn, x, out, x.ptr == out.ptr && x.count == out.count);
      call = make_call(c, x, out, algo, x.count);
      break;
    case Collective::ReduceScatter:
      check_same_dtype(fn, x, out);
      check_count(fn, "x", x.count, out.count * size, "size * out.size");
      check_aliasing(fn, x, out, out.ptr == x.ptr + rank * out.bytes());
      call = make_call(c, x, out, algo, out.count);
      break;
    case Collective::AllGather:
      check_same_dtype(fn, x, out);
      check_count(fn, "out", out.count, x.count * size, "size * x.size");
      check_aliasing(fn, x, out, x.ptr == out.ptr + rank * x.bytes());
      call = make_call(c, x, out, algo, x.count);
      break;
    case Collective::Broadcast:
      call = make_call(c, x, x, algo, x.count);
      break;
  }
  if (c == Collective::Broadcast || c == Collective::Reduce) call.root = root_arg(fn, root, size);
  if (carries_partials(c)) call.op = op_arg(fn, op_code, x.dtype);
  return call;
}

// A call on numpy arrays: each array checked (type, dtype, layout, writability), then the
// collective's own checks. `out_obj` None: in place (all_reduce, reduce); broadcast has none.
CollectiveCall parse_call(Collective c, py::handle x_obj, py::handle out_obj, int root, int op,
                          int algo, int rank, int size) {
  const char* fn = collective_name(c);
  const bool reduces_in_place =
      (c == Collective::AllReduce || c == Collective::Reduce) && out_obj.is_none();
  const bool one_array = c == Collective::Broadcast || reduces_in_place;
  const ArrayArg x = array_arg(x_obj, fn, "x", one_array);
  const ArrayArg out = one_array ? x : array_arg(out_obj, fn, "out", true);
  return checked_call(c, x, out, root, op, algo, rank, size);
}

// The same checks for a communicator whose collectives are composed in Python (several
// nodes); returns (count, dtype code) of the call.
std::pair<size_t, int> check_args(const std::string& collective, py::handle x, py::handle out,
                                  int root, int op, int algo, int rank, int size) {
  const CollectiveCall call =
      parse_call(collective_arg(collective), x, out, root, op, algo, rank, size);
  return {call.count, static_cast<int>(call.dtype)};
}

// The collective's checks on arrays described elsewhere, as (pointer, element count, dtype
// code), `out` None in the single-array forms; returns the call's count.
size_t check_described_args(const std::string& collective, std::tuple<uintptr_t, size_t, int> x,
                            std::optional<std::tuple<uintptr_t, size_t, int>> out, int root, int op,
                            int algo, int rank, int size) {
  auto described = [](const std::tuple<uintptr_t, size_t, int>& t) {
    if (!valid_dtype(std::get<2>(t))) throw InvalidArgument("unknown dtype code");
    ArrayArg a;
    a.ptr = reinterpret_cast<uint8_t*>(std::get<0>(t));
    a.count = std::get<1>(t);
    a.dtype = static_cast<DType>(std::get<2>(t));
    return a;
  };
  const ArrayArg xa = described(x);
  const ArrayArg oa = out ? described(*out) : xa;
  return checked_call(collective_arg(collective), xa, oa, root, op, algo, rank, size).count;
}

// p2p ops as ("send"|"recv", array, peer, tag), every one checked before anything moves.
// `arrays` collects the arrays, to keep them alive as long as an asynchronous batch.
std::vector<P2POp> parse_p2p(py::handle ops_obj, int rank, int size, py::list& arrays) {
  const char* fn = "p2p";
  if (!py::isinstance<py::list>(ops_obj) && !py::isinstance<py::tuple>(ops_obj))
    throw InvalidType(str_cat(fn, ": ops must be a list of (kind, array, peer, tag) tuples"));
  std::vector<P2POp> ops;
  std::vector<ArrayArg> args;
  size_t i = 0;
  for (py::handle item : py::reinterpret_borrow<py::sequence>(ops_obj)) {
    const std::string where = str_cat("ops[", i++, "]");
    if (!py::isinstance<py::tuple>(item) || py::len(item) != 4)
      throw InvalidType(str_cat(fn, ": ", where, " must be a (kind, array, peer, tag) tuple"));
    auto t = py::reinterpret_borrow<py::tuple>(item);
    if (!py::isinstance<py::str>(t[0]))
      throw InvalidType(str_cat(fn, ": ", where, " kind must be \"send\" or \"recv\""));
    const std::string kind = t[0].cast<std::string>();
    if (kind != "send" && kind != "recv")
      throw InvalidArgument(
          str_cat(fn, ": ", where, " kind must be \"send\" or \"recv\", got \"", kind, "\""));
    P2POp op;
    op.kind = kind == "send" ? P2PKind::Send : P2PKind::Recv;
    const ArrayArg a =
        array_arg(t[1], fn, str_cat(where, " array").c_str(), op.kind == P2PKind::Recv);
    for (const char* field : {"peer", "tag"}) {
      py::handle v = t[field[0] == 'p' ? 2 : 3];
      if (!py::isinstance<py::int_>(v) || py::isinstance<py::bool_>(v))
        throw InvalidType(str_cat(fn, ": ", where, " ", field, " must be an int"));
    }
    const long long peer = t[2].cast<long long>();
    if (peer < 0 || peer >= size || peer == rank)
      throw InvalidArgument(str_cat(fn, ": ", where, " peer ", peer, " is not another rank of ",
                                    size, " (this is rank ", rank, ")"));
    const py::int_ tag_obj = t[3];
    if (tag_obj < py::int_(0) || tag_obj > py::int_(INT64_MAX))
      throw InvalidArgument(str_cat(fn, ": ", where, " tag must be in [0, 2**63), got ",
                                    py::str(tag_obj).cast<std::string>()));
    op.buf = a.ptr;
    op.count = a.count;
    op.dtype = a.dtype;
    op.peer = static_cast<int>(peer);
    op.tag = tag_obj.cast<uint64_t>();
    // A receive must not land on bytes another op of the batch reads or writes.
    for (size_t j = 0; j < args.size(); ++j)
      if ((op.kind == P2PKind::Recv || ops[j].kind == P2PKind::Recv) &&
          overlap(a.ptr, a.bytes(), args[j].ptr, args[j].bytes()))
        throw InvalidArgument(str_cat(fn, ": ", where, " array overlaps the array of ops[", j,
                                      "] and one of them is received into"));
    ops.push_back(op);
    args.push_back(a);
    arrays.append(t[1]);
  }
  return ops;
}

void bind_host_comm(py::module_& m) {
  py::class_<HostCommOptions>(m, "HostCommOptions")
      .def(py::init<>())
      .def_readwrite("slot_bytes", &HostCommOptions::slot_bytes)
      .def_readwrite("nslots", &HostCommOptions::nslots)
      .def_readwrite("timeout", &HostCommOptions::timeout_s)
      .def_readwrite("stream_bytes", &HostCommOptions::stream_bytes)
      .def_readwrite("debug", &HostCommOptions::debug)
      .def_readwrite("oneshot_max_bytes", &HostCommOptions::oneshot_max_bytes)
      .def_readwrite("check_mismatch", &HostCommOptions::check_mismatch)
      .def_readwrite("p2p_cma_min_bytes", &HostCommOptions::p2p_cma_min_bytes)
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
          });

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
      .def_property_readonly("seq", &Work::seq);

  py::class_<HostComm>(m, "HostComm")
      .def(py::init<int, int, const HostCommOptions&>(), py::arg("rank"), py::arg("size"),
           py::arg("options"))
      .def_property_readonly("segment_name", &HostComm::segment_name)
      .def("attach", &HostComm::attach, py::arg("names"))
      .def("unlink", &HostComm::unlink)
      .def_property_readonly("rank", &HostComm::rank)
      .def_property_readonly("size", &HostComm::size)
      .def_property_readonly("seq", &HostComm::seq)
      .def_property("timeout", &HostComm::timeout, &HostComm::set_timeout)
      .def_property_readonly("slot_bytes", [](const HostComm& c) { return c.options().slot_bytes; })
      .def_property_readonly("nslots", [](const HostComm& c) { return c.options().nslots; })
      .def_property_readonly("poisoned", &HostComm::poisoned)
      .def_property_readonly("poison_reason", &HostComm::poison_reason)
      .def("abort", &HostComm::abort, py::arg("reason"))
      .def(
          "set_tuning",
          [](HostComm& c,
             const std::vector<std::tuple<std::string, int, int, size_t, std::string>>& rules) {
            std::vector<TuningRule> out;
            for (const auto& [coll, lo, hi, max_bytes, algo] : rules)
              out.push_back({collective_arg(coll), lo, hi, max_bytes, algo_by_name(algo)});
            c.set_tuning(std::move(out));
          },
          py::arg("rules"))
      .def(
          "set_forced",
          [](HostComm& c, const std::string& algo) { c.set_forced(algo_by_name(algo)); },
          py::arg("algorithm"))
      .def(
          "choose",
          [](const HostComm& c, const std::string& coll, size_t bytes) {
            return std::string(algo_name(c.choose(collective_arg(coll), bytes)));
          },
          py::arg("collective"), py::arg("bytes"))
      .def(
          "run",
          [](HostComm& c, const std::string& collective, py::handle x, py::handle out, int root,
             int op, int algo, bool async_op, py::handle counts, py::handle in_splits,
             py::handle out_splits) {
            const Collective coll = collective_arg(collective);
            if (!counts.is_none() || !in_splits.is_none() || !out_splits.is_none())
              throw InvalidArgument(str_cat(collective, ": uneven sizes are not supported"));
            return dispatch(c, parse_call(coll, x, out, root, op, algo, c.rank(), c.size()),
                            async_op);
          },
          py::arg("collective"), py::arg("x"), py::arg("out"), py::arg("root"), py::arg("op"),
          py::arg("algorithm"), py::arg("async_op") = false, py::arg("counts") = py::none(),
          py::arg("in_splits") = py::none(), py::arg("out_splits") = py::none())
      .def(
          "all_reduce",
          [](HostComm& c, py::handle x, py::handle out, int op, int algo, bool async_op) {
            return dispatch(
                c, parse_call(Collective::AllReduce, x, out, 0, op, algo, c.rank(), c.size()),
                async_op);
          },
          py::arg("x"), py::arg("out"), py::arg("op"), py::arg("algorithm"),
          py::arg("async_op") = false)
      .def(
          "reduce_scatter",
          [](HostComm& c, py::handle x, py::handle out, int op, int algo, bool async_op) {
            return dispatch(
                c, parse_call(Collective::ReduceScatter, x, out, 0, op, algo, c.rank(), c.size()),
                async_op);
          },
          py::arg("x"), py::arg("out"), py::arg("op"), py::arg("algorithm"),
          py::arg("async_op") = false)
      .def(
          "all_gather",
          [](HostComm& c, py::handle x, py::handle out, int algo, bool async_op) {
            return dispatch(
                c, parse_call(Collective::AllGather, x, out, 0, 0, algo, c.rank(), c.size()),
                async_op);
          },
          py::arg("x"), py::arg("out"), py::arg("algorithm"), py::arg("async_op") = false)
      .def(
          "broadcast",
          [](HostComm& c, py::handle x, int root, int algo, bool async_op) {
            return dispatch(
                c,
                parse_call(Collective::Broadcast, x, py::none(), root, 0, algo, c.rank(), c.size()),
                async_op);
          },
          py::arg("x"), py::arg("root"), py::arg("algorithm"), py::arg("async_op") = false)
      .def(
          "reduce",
          [](HostComm& c, py::handle x, py::handle out, int root, int op, int algo, bool async_op) {
            return dispatch(
                c, parse_call(Collective::Reduce, x, out, root, op, algo, c.rank(), c.size()),
                async_op);
          },
          py::arg("x"), py::arg("out"), py::arg("root"), py::arg("op"), py::arg("algorithm"),
          py::arg("async_op") = false)
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
          [](HostComm& c, bool async_op) {
            CollectiveCall call;
            call.barrier = true;
            return dispatch(c, call, async_op);
          },
          py::arg("async_op") = false);
}

// The emulated device: the CUDA transport's device code run on the host (tests only).
void bind_emu_comm(py::module_& m) {
  py::class_<emu::EmuOptions>(m, "EmuOptions")
      .def(py::init<>())
      .def_readwrite("slot_bytes", &emu::EmuOptions::slot_bytes)
      .def_readwrite("nslots", &emu::EmuOptions::nslots)
      .def_readwrite("nblocks", &emu::EmuOptions::nblocks)
      .def_readwrite("threads", &emu::EmuOptions::threads)
      .def_readwrite("kernel_mode", &emu::EmuOptions::kernel_mode)
      .def_readwrite("timeout", &emu::EmuOptions::timeout_s)
      .def_readwrite("oneshot_max_bytes", &emu::EmuOptions::oneshot_max_bytes)
      .def_readwrite("direct_max_bytes", &emu::EmuOptions::direct_max_bytes)
      .def_readwrite("fault_seq", &emu::EmuOptions::fault_seq)
      .def_readwrite("fault_step", &emu::EmuOptions::fault_step)
      .def_readwrite("fault_exit", &emu::EmuOptions::fault_exit);
  py::class_<emu::EmuComm>(m, "EmuComm")
      .def(py::init<int, int, const emu::EmuOptions&>(), py::arg("rank"), py::arg("size"),
           py::arg("options"))
      .def_property_readonly("segment_name", &emu::EmuComm::segment_name)
      .def_property_readonly("flags_name", &emu::EmuComm::flags_name)
      .def_property_readonly("rank", &emu::EmuComm::rank)
      .def_property_readonly("size", &emu::EmuComm::size)
      .def_property_readonly("seq", &emu::EmuComm::seq)
      .def_property_readonly("plans_cached", &emu::EmuComm::plans_cached)
      .def_property_readonly("plans_built", &emu::EmuComm::plans_built)
      .def_property_readonly("segment_bytes", &emu::EmuComm::segment_bytes)
      .def_property_readonly("poisoned", &emu::EmuComm::poisoned)
      .def("attach", &emu::EmuComm::attach, py::arg("segments"), py::arg("flags"))
      .def("unlink", &emu::EmuComm::unlink)
      .def("abort", &emu::EmuComm::abort, py::arg("reason"))
      .def(
          "run",
          [](emu::EmuComm& c, const std::string& collective, py::handle x, py::handle out, int root,
             int op, int algo) {
            const CollectiveCall call =
                parse_call(collective_arg(collective), x, out, root, op, algo, c.rank(), c.size());
            py::gil_scoped_release nogil;
            c.run(call);
          },
          py::arg("collective"), py::arg("x"), py::arg("out"), py::arg("root") = 0,
          py::arg("op") = 0, py::arg("algorithm") = 0);
}

// Schedules as plain tuples, for tests that check them without processes.
void bind_schedules(py::module_& m) {
  m.def(
      "schedule",
      [](const std::string& algorithm, const std::string& collective, int rank, int size,
         size_t count, int root, size_t piece, size_t acc_bytes, size_t oneshot_max_bytes,
         size_t shard_align) {
        if (size < 1 || rank < 0 || rank >= size || root < 0 || root >= size || piece == 0 ||
            shard_align == 0)
          throw InvalidArgument("schedule: bad rank, size, root, piece or shard alignment");
        const Collective c = collective_arg(collective);
        const Algo a = algo_by_name(algorithm);
        if (a == Algo::Auto || !algo_supports(a, c))
          throw InvalidArgument(str_cat("schedule: ", algorithm, " has no ", collective));
        ScheduleParams p{rank, size, count, root, piece, acc_bytes, oneshot_max_bytes, shard_align};
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
      py::arg("oneshot_max_bytes") = ScheduleParams{}.oneshot_max_bytes,
      py::arg("shard_align") = 1);
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
  for (int k = 0; k < kNumDTypes; ++k) dtypes[k] = dtype_name(static_cast<DType>(k));
  for (int k = 0; k < kNumRedOps; ++k) ops[k] = redop_name(static_cast<RedOp>(k));
  m.attr("COLLECTIVES") = colls;
  m.attr("ALGORITHMS") = algos;
  m.attr("DTYPES") = dtypes;
  m.attr("OPS") = ops;
  m.attr("ALGORITHMS_FOR") = algos_for;
  m.attr("REDUCING") = py::tuple(reducing);
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
  bind_schedules(m);
  bind_emu_comm(m);
  bind_codes(m);
  m.def("check_args", &check_args, py::arg("collective"), py::arg("x"), py::arg("out"),
        py::arg("root"), py::arg("op"), py::arg("algorithm"), py::arg("rank"), py::arg("size"));
  m.def("check_described_args", &check_described_args, py::arg("collective"), py::arg("x"),
        py::arg("out"), py::arg("root"), py::arg("op"), py::arg("algorithm"), py::arg("rank"),
        py::arg("size"));
}
