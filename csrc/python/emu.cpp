// pycollectives._emu: the emulated device, the CUDA transport's device code run on the host
// (csrc/emu/). Only the tests use it: a checkout's build has it (PYCOLL_EMULATOR=ON, set by the
// Makefile), a plain pip install leaves it out.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>
#include <string>

#include "common/coverage.h"
#include "device/device_capi_impl.h"
#include "emu/emu_comm.h"
#include "emu/emu_stream.h"
#include "python/call_args.h"
#include "python/core_errors.h"
#include "python/registrations.h"

namespace py = pybind11;
using namespace pycoll;
using namespace pycoll::pyargs;

namespace {

// The emulated device behind device/device_capi.h: calls queued on an EmuStream, which runs
// them in order while the host goes on. Its only stream is its own: ordering later work on a
// stream is the host's wait (the tensors are host memory).
struct EmuDevice {
  using Comm = emu::EmuStream;
  using Work = emu::StreamWork;
  static std::shared_ptr<Work> run(emu::EmuStream& s, const CollectiveCall& call, uintptr_t, bool) {
    return s.queue(call);
  }
  static bool done(const Work& w) {
    if (!w.ended.load(std::memory_order_acquire)) return false;
    if (w.error) std::rethrow_exception(w.error);
    return true;
  }
  static void check(emu::EmuStream&) {}
  static void wait_on(const Work&, uintptr_t) {}
};

// A device that moves nothing: each call is checked as every device checks it (capi::to_call),
// recorded, and ends once `finish` says so (held: not before). Tests follow what reaches a
// device through it, and benchmarks time the layers above a device with it.
struct NullComm {
  int rank_ = 0, size_ = 1;
  bool hold = false;      // new calls stay unfinished until finish()
  uint64_t runs = 0;      // calls run
  uint64_t finished = 0;  // calls 1..finished have ended
  CollectiveCall last;
  uintptr_t last_stream = 0;
  int rank() const { return rank_; }
  int size() const { return size_; }
};

struct NullDevice {
  struct Work {
    const NullComm* comm;
    uint64_t n;
  };
  using Comm = NullComm;
  static std::shared_ptr<Work> run(NullComm& c, const CollectiveCall& call, uintptr_t stream,
                                   bool) {
    c.last = call;
    c.last_stream = stream;
    if (!c.hold) c.finished = c.runs + 1;
    return std::make_shared<Work>(Work{&c, ++c.runs});
  }
  static bool done(const Work& w) { return w.n <= w.comm->finished; }
  static void check(NullComm&) {}
  static void wait_on(const Work&, uintptr_t) {}
};

}  // namespace

PYBIND11_MODULE(_emu, m) {
  m.doc() = "pycollectives emulated device (private; tests only)";
  translate_errors_as_core();
  PYCOLL_BIND_COVERAGE_DUMP(m);
  // device/device_capi.h over an EmuStream (see its `address`).
  m.attr("device_api") =
      py::capsule(static_cast<const void*>(DeviceApi<EmuDevice>::table()), PYCOLL_DEVICE_API_NAME);

  m.attr("null_device_api") =
      py::capsule(static_cast<const void*>(DeviceApi<NullDevice>::table()), PYCOLL_DEVICE_API_NAME);
  py::class_<NullComm>(m, "NullComm")
      .def(py::init([](int rank, int size) {
             auto c = std::make_unique<NullComm>();
             c->rank_ = rank;
             c->size_ = size;
             return c;
           }),
           py::arg("rank") = 0, py::arg("size") = 1)
      .def_property_readonly("address", [](NullComm& c) { return reinterpret_cast<uintptr_t>(&c); })
      .def_readwrite("hold", &NullComm::hold)
      .def_readonly("runs", &NullComm::runs)
      .def("finish", [](NullComm& c) { c.finished = c.runs; })
      // The last call as the device saw it: (collective, in, out, count, dtype, op, root,
      // algorithm, stream), codes as the core's.
      .def_property_readonly("last", [](const NullComm& c) {
        const CollectiveCall& k = c.last;
        return py::make_tuple(collective_name(k.collective), reinterpret_cast<uintptr_t>(k.in),
                              reinterpret_cast<uintptr_t>(k.out), k.count,
                              static_cast<int>(k.dtype), static_cast<int>(k.op), k.root,
                              algo_name(k.algo), c.last_stream);
      });
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
      .def_readwrite("ll_max_bytes", &emu::EmuOptions::ll_max_bytes)
      .def_readwrite("ll_flag_bits", &emu::EmuOptions::ll_flag_bits)
      .def_readwrite("fault_seq", &emu::EmuOptions::fault_seq)
      .def_readwrite("fault_step", &emu::EmuOptions::fault_step)
      .def_readwrite("fault_exit", &emu::EmuOptions::fault_exit)
      .def_readwrite("finish_stagger_ms", &emu::EmuOptions::finish_stagger_ms)
      .def_readwrite("previous_late_ms", &emu::EmuOptions::previous_late_ms)
      .def_readwrite("stepped_twoshot", &emu::EmuOptions::stepped_twoshot)
      .def_readwrite("register_on_use_bytes", &emu::EmuOptions::register_on_use_bytes)
      .def_readwrite("push", &emu::EmuOptions::push)
      .def_readwrite("copy_engines", &emu::EmuOptions::copy_engines)
      .def_readwrite("lookahead", &emu::EmuOptions::lookahead)
      .def_readwrite("stepped_events", &emu::EmuOptions::stepped_events)
      .def_readwrite("reproducible", &emu::EmuOptions::reproducible)
      .def_property(
          "algorithm", [](const emu::EmuOptions& o) { return std::string(algo_name(o.forced)); },
          [](emu::EmuOptions& o, const std::string& name) { o.forced = algo_from_name(name); })
      .def_readwrite("fence_counters", &emu::EmuOptions::fence_counters)
      .def_readwrite("flight_entries", &emu::EmuOptions::flight_entries)
      .def_readwrite("queue_delay_ms", &emu::EmuOptions::queue_delay_ms)
      .def_readwrite("step_delay_ms", &emu::EmuOptions::step_delay_ms)
      .def_readwrite("host_checks", &emu::EmuOptions::check_mismatch)
      .def_readwrite("sms", &emu::EmuOptions::sms)
      .def_readwrite("weak_stores", &emu::EmuOptions::weak_stores);
  py::class_<emu::EmuComm>(m, "EmuComm")
      .def(py::init<int, int, const emu::EmuOptions&>(), py::arg("rank"), py::arg("size"),
           py::arg("options"))
      .def_property_readonly("segment_name", &emu::EmuComm::segment_name)
      .def_property_readonly("flags_name", &emu::EmuComm::flags_name)
      .def_property_readonly("rank", &emu::EmuComm::rank)
      .def_property_readonly("size", &emu::EmuComm::size)
      .def_property_readonly("seq", &emu::EmuComm::seq)
      .def_property_readonly("plans_cached", &emu::EmuComm::plans_cached)
      // The algorithm an automatic call of `collective` on `bytes` runs (CudaComm.choose).
      .def(
          "choose",
          [](const emu::EmuComm& c, const std::string& collective, size_t bytes) {
            return std::string(algo_name(c.choose(collective_from_name(collective), bytes)));
          },
          py::arg("collective"), py::arg("bytes"))
      .def_property_readonly("plans_built", &emu::EmuComm::plans_built)
      .def_property_readonly("segment_bytes", &emu::EmuComm::segment_bytes)
      .def_property_readonly("segment_data_bytes", &emu::EmuComm::segment_data_bytes)
      .def_property_readonly("poisoned", &emu::EmuComm::poisoned)
      .def("attach", &emu::EmuComm::attach, py::arg("segments"), py::arg("flags"),
           py::arg("gpus") = std::vector<int>{})
      .def("unlink", &emu::EmuComm::unlink)
      .def("abort", &emu::EmuComm::abort, py::arg("reason"))
      .def(
          "set_flight_dump",
          [](emu::EmuComm& c, const std::string& path, int rank, int size,
             const std::string& comm) { c.set_flight_dump(path, rank, size, comm); },
          py::arg("path"), py::arg("rank"), py::arg("size"), py::arg("comm"))
      .def(
          "flight_dump",
          [](emu::EmuComm& c, const std::string& reason) {
            py::gil_scoped_release nogil;
            return c.flight().dump(reason);
          },
          py::arg("reason"))
      // A backends.Call on numpy arrays, as the host backend takes one (its stream and
      // async_op are not the emulator's: it runs the call to completion).
      .def(
          "run",
          [](emu::EmuComm& c, const py::tuple& call) {
            const CollectiveCall cc = parse_call(call, c.rank(), c.size());
            py::gil_scoped_release nogil;
            c.run(cc);
          },
          py::arg("call"))
      // Capture and replay, as a CUDA graph of a kernel-mode launch (emu_comm.h, EmuGraph).
      // The graph keeps the communicator alive; the arrays stay the caller's to keep.
      .def(
          "capture",
          [](emu::EmuComm& c, const py::tuple& call) {
            const CollectiveCall cc = parse_call(call, c.rank(), c.size());
            py::gil_scoped_release nogil;
            return c.capture(cc);
          },
          py::arg("call"), py::keep_alive<0, 1>())
      .def("replay", &emu::EmuComm::replay, py::arg("graph"),
           py::call_guard<py::gil_scoped_release>())
      // The barrier CudaComm runs (device/orchestration.h, barrier_call).
      .def("barrier", &emu::EmuComm::barrier, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("plans_pinned", &emu::EmuComm::plans_pinned)
      .def_property_readonly("blocks_run", &emu::EmuComm::blocks_run)
      .def_property_readonly("completed", &emu::EmuComm::completed)
      .def_property_readonly("ll_steps_run", &emu::EmuComm::ll_steps_run)
      // Registered buffers (emu/emu_registry.h). alloc: memory of the emulated device, not
      // registered (a buffer: numpy arrays over it keep it alive). register_handle, then the
      // rendezvous trades every rank's handle, then register_add with all of them (returns the
      // registration's number), then, once every rank has added, unlink_exchanged.
      .def(
          "alloc", [](emu::EmuComm& c, size_t bytes) { return c.registry().alloc(bytes); },
          py::arg("bytes"))
      .def(
          "register_handle",
          [](emu::EmuComm& c, uintptr_t ptr, size_t bytes) {
            return handle_tuple(c.registry().handle(reinterpret_cast<const void*>(ptr), bytes));
          },
          py::arg("ptr"), py::arg("bytes"))
      .def(
          "register_add",
          [](emu::EmuComm& c, uintptr_t ptr, size_t bytes, const py::list& handles) {
            return c.registry().add(reinterpret_cast<const void*>(ptr), bytes, handles_of(handles));
          },
          py::arg("ptr"), py::arg("bytes"), py::arg("handles"))
      .def("unlink_exchanged", [](emu::EmuComm& c) { c.registry().unlink_exchanged(); })
      .def_property_readonly("registrations", [](emu::EmuComm& c) { return c.registry().live(); })
      .def_property_readonly("twoshot_runs", &emu::EmuComm::twoshot_runs)
      .def_property_readonly("first_use_runs", &emu::EmuComm::first_use_runs)
      .def_property_readonly("copy_engine_runs", &emu::EmuComm::copy_engine_runs)
      .def_property_readonly("copied", &emu::EmuComm::copied)
      .def_property_readonly("first_use_opened", &emu::EmuComm::first_use_opened)
      .def_property_readonly("first_use_mapped", &emu::EmuComm::first_use_mapped)
      .def_property_readonly("first_use_sent", &emu::EmuComm::first_use_sent)
      .def_property_readonly("scratch_runs", &emu::EmuComm::scratch_runs)
      .def_property_readonly("scratch_chunks", &emu::EmuComm::scratch_chunks)
      // Bytes the device code's data loads and stores moved (emu/emu_checks.h, Traffic).
      .def_property_readonly("traffic",
                             [](const emu::EmuComm& c) {
                               const emu::Traffic& t = c.traffic();
                               py::dict d;
                               d["read_own"] = t.read_own.load();
                               d["read_peer"] = t.read_peer.load();
                               d["write_own"] = t.write_own.load();
                               d["write_peer"] = t.write_peer.load();
                               return d;
                             })
      .def("reset_traffic", &emu::EmuComm::reset_traffic);
  // A stream of `comm` (emu_stream.h) and its address, for device_api's calls.
  py::class_<emu::EmuStream>(m, "EmuStream")
      .def(py::init<emu::EmuComm&, int>(), py::arg("comm"), py::arg("delay_ms") = 0,
           py::keep_alive<1, 2>())
      .def_property_readonly("address",
                             [](emu::EmuStream& s) { return reinterpret_cast<uintptr_t>(&s); });
  py::class_<emu::EmuAllocation, std::shared_ptr<emu::EmuAllocation>>(m, "EmuAllocation",
                                                                      py::buffer_protocol())
      .def_property_readonly("bytes", &emu::EmuAllocation::bytes)
      .def_property_readonly("name", &emu::EmuAllocation::name)
      .def_buffer([](emu::EmuAllocation& a) {
        return py::buffer_info(a.data(), 1, py::format_descriptor<uint8_t>::format(), 1,
                               {static_cast<py::ssize_t>(a.bytes())}, {1});
      });
  py::class_<emu::EmuGraph, std::shared_ptr<emu::EmuGraph>>(m, "EmuGraph")
      .def_readonly("seq", &emu::EmuGraph::seq);
}
