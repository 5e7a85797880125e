// pybind11 module pycollectives._cuda: the CUDA transport (private; see
// pycollectives/backends/cuda/).
//
// Kept apart from _C so that importing pycollectives never needs CUDA; the CUDA runtime is
// linked statically, so importing this module needs only the driver, and not even that until a
// communicator is made. Arrays arrive described by Python (pycollectives/backends/cuda/args.py:
// pointer, count, dtype code) and each call is checked here, as the host path checks its calls
// (python/call_args.h); pointers and streams arrive as integers.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "algo/schedule.h"
#include "common/errors.h"
#include "cuda/cuda_check.h"
#include "cuda/cuda_comm.h"
#include "cuda/launch.h"
#include "cuda/staging.h"
#include "device/device_capi_impl.h"
#include "device/plan.h"
#include "python/call_args.h"
#include "python/core_errors.h"
#include "python/registrations.h"

namespace py = pybind11;
using namespace pycoll;
using namespace pycoll::cuda;

namespace {

cudaStream_t stream_of(uintptr_t s) { return reinterpret_cast<cudaStream_t>(s); }

// The CUDA transport behind device/device_capi.h (the torch backend's CUDA tensors).
struct CudaDevice {
  using Comm = CudaComm;
  using Work = CudaWork;
  static std::shared_ptr<CudaWork> run(CudaComm& c, const CollectiveCall& call, uintptr_t stream,
                                       bool async_op) {
    return c.run(call, stream_of(stream), async_op);
  }
  static bool done(const CudaWork& w) { return w.is_completed(); }
  static void check(CudaComm& c) { c.check("wait"); }
  static void wait_on(const CudaWork& w, uintptr_t stream) { w.wait_on(stream_of(stream)); }
};

Collective collective_code(int c) {
  if (c < 0 || c >= kNumCollectives) throw InvalidArgument(str_cat("unknown collective ", c));
  return static_cast<Collective>(c);
}

Algo algo_code(Collective c, int a) {
  if (a < 0 || a >= kNumAlgos) throw InvalidArgument(str_cat("unknown algorithm code ", a));
  const Algo algo = static_cast<Algo>(a);
  if (algo != Algo::Auto && !algo_supports(algo, c))
    throw InvalidArgument(str_cat(collective_name(c), ": algorithm ", algo_name(algo),
                                  " is not available for ", collective_name(c)));
  return algo;
}

// Per-rank lists of a planned call (None: even).
using CountList = std::optional<std::vector<uint64_t>>;

// Puts the uneven forms' lists into a call to plan (there are no arrays to check them
// against): counts sum to its count, and all-to-all splits come as a pair (their lengths are
// checked with the call).
void set_counts(CollectiveCall& call, const CountList& counts, const CountList& in_splits,
                const CountList& out_splits) {
  const char* fn = collective_name(call.collective);
  if (counts) {
    if (call.collective != Collective::AllGather && call.collective != Collective::ReduceScatter)
      throw InvalidArgument(str_cat(fn, ": counts apply to all_gather and reduce_scatter only"));
    if (sum_of(*counts) != call.count)
      throw InvalidArgument(str_cat(fn, ": count ", call.count, " is not the sum of counts"));
    call.counts = *counts;
  }
  if (in_splits || out_splits) {
    if (call.collective != Collective::AllToAll || !in_splits || !out_splits)
      throw InvalidArgument(str_cat(fn, ": in_splits and out_splits go together, on all_to_all"));
    call.send_counts = *in_splits;
    call.recv_counts = *out_splits;
  }
}

SyncMode mode_arg(const std::string& m) {
  if (m == "kernel") return SyncMode::Kernel;
  if (m == "stepped") return SyncMode::Stepped;
  throw InvalidArgument(str_cat("sync mode must be 'kernel' or 'stepped', got '", m, "'"));
}

py::dict plan_dict(const Plan& p) {
  py::list steps;
  for (const DevStep& d : p.steps)
    steps.append(py::make_tuple(step_kind_name(static_cast<StepKind>(d.kind)), d.flags, d.src_buf,
                                d.dst_buf, d.from, d.from2, d.to, d.to2, d.count, d.src_off,
                                d.dst_off));
  py::dict r;
  r["steps"] = steps;
  r["sent"] = p.moved.sent;
  r["received"] = p.moved.received;
  r["bcast_received"] = p.moved.bcast_received;
  r["bcast_sent"] = p.moved.bcast_sent;
  r["grid"] = p.grid;
  return r;
}

void bind_planning(py::module_& m) {
  m.def(
      "plan",
      [](int collective, int algorithm, int rank, int size, size_t count, int root, int dtype,
         size_t slot_bytes, size_t oneshot_max_bytes, const CountList& counts,
         const CountList& send_counts, const CountList& recv_counts, int nblocks, int nslots,
         size_t ll_max_bytes, bool lookahead) {
        const Collective c = collective_code(collective);
        const Algo a = algo_code(c, algorithm);
        if (a == Algo::Auto) throw InvalidArgument("plan: name an algorithm");
        if (!valid_dtype(dtype)) throw InvalidArgument("plan: bad dtype code");
        if (size < 1 || rank < 0 || rank >= size || root < 0 || root >= size)
          throw InvalidArgument("plan: bad rank, size or root");
        CollectiveCall call;
        call.collective = c;
        call.count = count;
        call.root = root;
        call.dtype = static_cast<DType>(dtype);
        set_counts(call, counts, send_counts, recv_counts);
        check_device_call(call, size);
        call.algo = a;
        const ResolvedCall rc = resolve_call(call, rank, size, false, [](Collective, size_t) {
          return AlgoChoice{Algo::Auto, Reason::Asked};  // never: the algorithm is named
        });
        if (plan_params(rc, slot_bytes, oneshot_max_bytes).piece == 0)
          throw InvalidArgument("plan: staging slot smaller than one element");
        if (nblocks < 1 || nslots < 2) throw InvalidArgument("plan: bad block or slot count");
        // As a communicator builds it on a segment of this layout: with its grid, and the
        // messages in the LL format (flags kRecvLL, kSendLL) for a limit of ll_max_bytes.
        const SegmentLayout L = make_layout(size, nslots, nblocks, slot_bytes, ll_max_bytes);
        return plan_dict(plan_call(rc, L, slot_bytes, oneshot_max_bytes, ll_max_bytes, lookahead));
      },
      py::arg("collective"), py::arg("algorithm"), py::arg("rank"), py::arg("size"),
      py::arg("count"), py::arg("root"), py::arg("dtype"), py::arg("slot_bytes"),
      py::arg("oneshot_max_bytes") = CudaCommOptions{}.oneshot_max_bytes, py::kw_only(),
      py::arg("counts") = py::none(), py::arg("send_counts") = py::none(),
      py::arg("recv_counts") = py::none(), py::arg("nblocks") = CudaCommOptions{}.nblocks,
      py::arg("nslots") = CudaCommOptions{}.nslots, py::arg("ll_max_bytes") = 0,
      py::arg("lookahead") = false);
  m.def(
      "block_slice",
      [](size_t n, int nblocks, int block) {
        const Slice s = block_slice(n, nblocks, block);
        return py::make_tuple(s.lo, s.hi);
      },
      py::arg("n"), py::arg("nblocks"), py::arg("block"));
  // The two-shot over registered buffers (device/plan.h): rank `rank`'s shard, and the blocks
  // a launch runs on a layout of `nblocks` blocks and `slot_bytes` slots for `size` ranks.
  m.def(
      "twoshot_shard",
      [](size_t count, int size, int rank) {
        const Slice s = twoshot_shard(count, size, rank);
        return py::make_tuple(s.lo, s.hi);
      },
      py::arg("count"), py::arg("size"), py::arg("rank"));
  m.def(
      "twoshot_grid",
      [](size_t count, int size, int nblocks, size_t slot_bytes) {
        return twoshot_grid(count, make_layout(size, 2, nblocks, slot_bytes));
      },
      py::arg("count"), py::arg("size"), py::arg("nblocks"), py::arg("slot_bytes"));
  m.def("kernel_args_bytes", []() { return sizeof(KernelArgs); });
  m.def(
      "channel_slice",
      [](size_t n, int nblocks, size_t slot_bytes, int block) {
        const Slice s = channel_slice(n, make_layout(2, 2, nblocks, slot_bytes), block);
        return py::make_tuple(s.lo, s.hi);
      },
      py::arg("n"), py::arg("nblocks"), py::arg("slot_bytes"), py::arg("block"));
  m.def(
      "segment_layout",
      [](int size, int nslots, int nblocks, size_t slot_bytes, size_t ll_max_bytes) {
        const SegmentLayout l = make_layout(size, nslots, nblocks, slot_bytes, ll_max_bytes);
        py::dict d;
        d["sub_slot_bytes"] = l.sub_slot_bytes;
        d["flags_bytes"] = l.flags_bytes;
        d["ll_offset"] = l.ll_offset;
        d["ll_sub_slot_bytes"] = l.ll_sub_slot_bytes;
        d["ll_blocks"] = l.ll_blocks;
        d["total_bytes"] = l.total_bytes();
        return d;
      },
      py::arg("size"), py::arg("nslots"), py::arg("nblocks"), py::arg("slot_bytes"),
      py::arg("ll_max_bytes") = 0);
  m.attr("MAX_RANKS") = kMaxRanks;
  m.attr("LL_MAX_BYTES") = CudaCommOptions{}.ll_max_bytes;
  // DevStep flags (device/kernel_args.h), as plan() reports them.
  m.attr("RECV_ACC") = kRecvAcc;
  m.attr("SEND_ACC") = kSendAcc;
  m.attr("RECV_BCAST") = kRecvBcast;
  m.attr("RECV_LL") = kRecvLL;
  m.attr("SEND_LL") = kSendLL;
}

// run's checks without a communicator: the call is checked before the CUDA transport is set up
// (Communicator's first GPU collective). Returns the call's count.
void bind_checks(py::module_& m) {
  m.def(
      "check_args",
      [](const py::tuple& call, const pyargs::Described& x, const pyargs::Described& out, int rank,
         int size) {
        const CollectiveCall cc = pyargs::described_call(call, x, out, rank, size);
        check_device_call(cc, size);
        return cc.count;
      },
      py::arg("call"), py::arg("x"), py::arg("out"), py::arg("rank"), py::arg("size"));
}

void bind_runtime(py::module_& m) {
  // (count, "") or (0, why not): never raises, so callers can report the reason.
  m.def("device_count", []() -> std::pair<int, std::string> {
    int n = 0;
    const cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) {
      cudaGetLastError();  // not sticky: clear it
      return {0, std::string(cudaGetErrorName(e)) + ": " + cudaGetErrorString(e)};
    }
    return {n, n == 0 ? "no CUDA device" : ""};
  });
  // The device's multiprocessors (PYCOLL_CUDA_BLOCKS=auto).
  m.def("sm_count", [](int device) {
    int n = 0;
    PYCOLL_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device));
    return n;
  });
  // The device's UUID (16 bytes): which ranks share a GPU, whatever their device numbers.
  m.def("device_uuid", [](int device) {
    cudaDeviceProp prop;
    PYCOLL_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
    return py::bytes(reinterpret_cast<const char*>(prop.uuid.bytes), sizeof(prop.uuid.bytes));
  });
  // Frees of registered arrays put off while a collective was in flight (cuda/registry.h).
  m.def("frees_deferred", []() { return frees_deferred(); });
  // Whether `device` offers the 64-bit stream memory operations of stepped mode's fence counters.
  m.def("has_stream_value_ops",
        [](int device) { return static_cast<bool>(stream_value_ops(device)); });
  // Blocks of the step kernel one SM of `device` holds at once (cuda/launch.h).
  m.def("resident_blocks_per_sm", [](int device) {
    DeviceGuard g(device);
    return resident_blocks_per_sm();
  });
  // The CUDA runtime this module links (e.g. 13000), and the newest CUDA the driver supports
  // (0: no driver). Never raise: they explain why CUDA cannot be used.
  m.def("runtime_version", []() {
    int v = 0;
    if (cudaRuntimeGetVersion(&v) != cudaSuccess) {
      cudaGetLastError();
      return 0;
    }
    return v;
  });
  m.def("driver_version", []() {
    int v = 0;
    if (cudaDriverGetVersion(&v) != cudaSuccess) {
      cudaGetLastError();
      return 0;
    }
    return v;
  });
  // The device a pointer's memory is on, or -1 for host memory the runtime does not know.
  m.def(
      "pointer_device",
      [](uintptr_t ptr) {
        cudaPointerAttributes attr;
        const cudaError_t e = cudaPointerGetAttributes(&attr, reinterpret_cast<void*>(ptr));
        if (e != cudaSuccess) {
          cudaGetLastError();
          return -1;
        }
        return attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeManaged ? attr.device
                                                                                       : -1;
      },
      py::arg("ptr"));
}

void bind_comm(py::module_& m) {
  py::class_<CudaCommOptions>(m, "CudaCommOptions")
      .def(py::init<>())
      .def_readwrite("slot_bytes", &CudaCommOptions::slot_bytes)
      .def_readwrite("nslots", &CudaCommOptions::nslots)
      .def_readwrite("nblocks", &CudaCommOptions::nblocks)
      .def_readwrite("timeout", &CudaCommOptions::timeout_s)
      .def_readwrite("oneshot_max_bytes", &CudaCommOptions::oneshot_max_bytes)
      .def_readwrite("direct_max_bytes", &CudaCommOptions::direct_max_bytes)
      .def_readwrite("ll_max_bytes", &CudaCommOptions::ll_max_bytes)
      .def_readwrite("debug", &CudaCommOptions::debug)
      .def_readwrite("check_mismatch", &CudaCommOptions::check_mismatch)
      .def_readwrite("stepped_twoshot", &CudaCommOptions::stepped_twoshot)
      .def_readwrite("register_on_use_bytes", &CudaCommOptions::register_on_use_bytes)
      .def_readwrite("push", &CudaCommOptions::push)
      .def_readwrite("copy_engines", &CudaCommOptions::copy_engines)
      .def_readwrite("lookahead", &CudaCommOptions::lookahead)
      .def_readwrite("stepped_events", &CudaCommOptions::stepped_events)
      .def_readwrite("reproducible", &CudaCommOptions::reproducible)
      // PYCOLL_ALGO: the algorithm automatic calls run where the collective has it ("auto": none)
      .def_property(
          "algorithm", [](const CudaCommOptions& o) { return std::string(algo_name(o.forced)); },
          [](CudaCommOptions& o, const std::string& name) { o.forced = algo_from_name(name); })
      .def_readwrite("fence_counters", &CudaCommOptions::fence_counters)
      .def_readwrite("flight_entries", &CudaCommOptions::flight_entries);

  py::class_<CudaWork, std::shared_ptr<CudaWork>>(m, "CudaWork")
      .def("is_completed", &CudaWork::is_completed)
      .def(
          "wait_on", [](const CudaWork& w, uintptr_t s) { w.wait_on(stream_of(s)); },
          py::arg("stream"))
      .def_property_readonly("seq", &CudaWork::seq);

  py::class_<CudaAllocation, std::shared_ptr<CudaAllocation>>(m, "CudaAllocation")
      .def_property_readonly(
          "ptr", [](const CudaAllocation& a) { return reinterpret_cast<uintptr_t>(a.data()); })
      .def_property_readonly("bytes", &CudaAllocation::bytes)
      .def_property_readonly("device", &CudaAllocation::device);

  py::class_<CudaComm>(m, "CudaComm")
      .def(py::init<int, int, int, const CudaCommOptions&>(), py::arg("rank"), py::arg("size"),
           py::arg("device"), py::arg("options"))
      .def_property_readonly("ipc_handle",
                             [](const CudaComm& c) { return py::bytes(c.ipc_handle()); })
      .def_property_readonly("device_uuid",
                             [](const CudaComm& c) { return py::bytes(c.device_uuid()); })
      .def_property_readonly("shm_name", &CudaComm::shm_name)
      .def(
          "attach",
          [](CudaComm& c, const std::vector<py::bytes>& handles,
             const std::vector<std::string>& names, const std::string& mode) {
            std::vector<std::string> h;
            for (const auto& b : handles) h.push_back(std::string(b));
            c.attach(h, names, mode_arg(mode));
          },
          py::arg("handles"), py::arg("shm_names"), py::arg("sync_mode"))
      .def("unlink", &CudaComm::unlink)
      // For device_api's calls (extensions built apart: the torch backend).
      .def_property_readonly("address", [](CudaComm& c) { return reinterpret_cast<uintptr_t>(&c); })
      .def_property_readonly("rank", &CudaComm::rank)
      .def_property_readonly("size", &CudaComm::size)
      .def_property_readonly("device", &CudaComm::device)
      .def_property_readonly("seq", &CudaComm::seq)
      .def_property_readonly(
          "sync_mode",
          [](const CudaComm& c) {
            return std::string(c.mode() == SyncMode::Kernel ? "kernel" : "stepped");
          })
      .def_property("timeout", &CudaComm::timeout, &CudaComm::set_timeout)
      .def_property_readonly("poisoned", &CudaComm::poisoned)
      .def_property_readonly("poison_reason", &CudaComm::poison_reason)
      .def("abort", &CudaComm::abort, py::arg("reason"))
      .def(
          "set_flight_dump",
          [](CudaComm& c, const std::string& path, int rank, int size, const std::string& comm) {
            c.set_flight_dump(path, rank, size, comm);
          },
          py::arg("path"), py::arg("rank"), py::arg("size"), py::arg("comm"),
          "Where the flight recorder writes this communicator's ring; SIGUSR1 writes it too.")
      .def(
          "flight_dump",
          [](CudaComm& c, const std::string& reason) {
            py::gil_scoped_release nogil;
            return c.flight().dump(reason);
          },
          py::arg("reason"))
      .def("check", [](CudaComm& c) { c.check("wait"); })
      // Registered buffers (cuda/registry.h). alloc: device memory for CudaComm.empty (its
      // registrations lapse when the allocation goes); register_handle, then the rendezvous
      // trades every rank's handle, then register_add with all of them (returns the number,
      // for register_release where the memory is not ours).
      .def(
          "alloc", [](CudaComm& c, size_t bytes) { return c.registry().alloc(bytes); },
          py::arg("bytes"))
      .def(
          "register_handle",
          [](CudaComm& c, uintptr_t ptr, size_t bytes) {
            return pyargs::handle_tuple(
                c.registry().handle(reinterpret_cast<const void*>(ptr), bytes));
          },
          py::arg("ptr"), py::arg("bytes"))
      .def(
          "register_add",
          [](CudaComm& c, uintptr_t ptr, size_t bytes, const py::list& handles) {
            return c.registry().add(reinterpret_cast<const void*>(ptr), bytes,
                                    pyargs::handles_of(handles));
          },
          py::arg("ptr"), py::arg("bytes"), py::arg("handles"))
      .def(
          "register_release", [](CudaComm& c, uint64_t id) { c.registry().release(id); },
          py::arg("id"))
      .def_property_readonly("registrations", [](CudaComm& c) { return c.registry().live(); })
      .def_property_readonly("twoshot_runs", &CudaComm::twoshot_runs)
      .def_property_readonly("first_use_runs", &CudaComm::first_use_runs)
      .def_property_readonly("copy_engine_runs", &CudaComm::copy_engine_runs)
      .def_property_readonly("first_use_opened", &CudaComm::first_use_opened)
      .def_property_readonly("first_use_mapped", &CudaComm::first_use_mapped)
      .def_property_readonly("first_use_sent", &CudaComm::first_use_sent)
      .def_property_readonly("scratch_runs", &CudaComm::scratch_runs)
      .def(
          "choose",
          [](const CudaComm& c, int collective, size_t bytes) {
            return std::string(algo_name(c.choose(collective_code(collective), bytes)));
          },
          py::arg("collective"), py::arg("bytes"))
      // A backends.Call, its arrays as Python described them and its stream's handle: the
      // collective's checks (the host path's) and the launch, in one crossing.
      .def(
          "run",
          [](CudaComm& c, const py::tuple& call, const pyargs::Described& x,
             const pyargs::Described& out, uintptr_t stream) {
            bool async_op = false;
            const CollectiveCall cc =
                pyargs::described_call(call, x, out, c.rank(), c.size(), &async_op);
            py::gil_scoped_release nogil;
            return c.run(cc, stream_of(stream), async_op);
          },
          py::arg("call"), py::arg("x"), py::arg("out"), py::arg("stream"))
      .def("barrier", &CudaComm::barrier, py::call_guard<py::gil_scoped_release>())
      .def("close", &CudaComm::close, py::call_guard<py::gil_scoped_release>());
}

// Host staging for send/recv of device arrays (pycollectives/cuda_p2p.py).
void bind_staging(py::module_& m) {
  py::class_<PinnedBuffer>(m, "PinnedBuffer", py::buffer_protocol())
      .def(py::init<size_t>(), py::arg("nbytes"))
      .def_property_readonly(
          "ptr", [](const PinnedBuffer& b) { return reinterpret_cast<uintptr_t>(b.data()); })
      .def_property_readonly("nbytes", &PinnedBuffer::bytes)
      .def_buffer([](PinnedBuffer& b) {
        return py::buffer_info(b.data(), 1, py::format_descriptor<uint8_t>::format(), 1,
                               {static_cast<py::ssize_t>(b.bytes())}, {py::ssize_t{1}});
      });
  m.def(
      "copy_async",
      [](uintptr_t dst, uintptr_t src, size_t nbytes, int device, uintptr_t stream) {
        copy_async(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), nbytes, device,
                   stream_of(stream));
      },
      py::arg("dst"), py::arg("src"), py::arg("nbytes"), py::arg("device"), py::arg("stream"));
  py::class_<StreamMark>(m, "StreamMark")
      .def(py::init([](int device, uintptr_t stream) {
             return std::make_unique<StreamMark>(device, stream_of(stream));
           }),
           py::arg("device"), py::arg("stream"))
      .def("done", &StreamMark::done)
      .def(
          "wait",
          [](const StreamMark& s, double timeout, const std::string& what) {
            s.wait(timeout, what.c_str());
          },
          py::arg("timeout"), py::arg("what"), py::call_guard<py::gil_scoped_release>());
}

}  // namespace

PYBIND11_MODULE(_cuda, m) {
  m.doc() = "pycollectives CUDA IPC transport (private; use pycollectives.cuda)";
  translate_errors_as_core();
  bind_planning(m);
  bind_checks(m);
  bind_runtime(m);
  bind_comm(m);
  bind_staging(m);
  // device/device_capi.h over CudaComm (see its `address`).
  m.attr("device_api") =
      py::capsule(static_cast<const void*>(DeviceApi<CudaDevice>::table()), PYCOLL_DEVICE_API_NAME);
}
