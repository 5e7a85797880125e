// pycollectives._torch: the "pycollectives" torch.distributed backend as a c10d::Backend.
//
// The collectives a training loop calls most (all_reduce, broadcast, reduce, all_gather and
// reduce_scatter into one tensor, their coalesced forms, barrier) go from torch's dispatcher
// straight to a communicator without Python, the GIL or a copy: on CPU tensors the host
// communicator, through _C's C interface (host/host_capi.h); on CUDA tensors the CUDA
// transport, through _cuda's (device/device_capi.h). all_gather and reduce_scatter on lists of
// one tensor per rank go the same way through a flat tensor (one copy). Everything else (other
// lists, all-to-all, gather, scatter, send/recv, communicators over several nodes) goes to the
// Python backend (pycollectives.torch.backend.ProcessGroup), which this object wraps. Every
// operation, whichever runs it, returns this file's Work.
//
// Host: as there, calls on fewer than `async_bytes` run on the calling thread; larger ones are
// queued on the communicator's progress thread. Device: every call is queued on the device
// after the work on torch's current stream of the tensors' device, without the host waiting;
// calls of `async_bytes` and more go on the transport's own stream (later work on the current
// stream does not wait for them: Work.wait() makes it), smaller ones on the current stream
// itself. On a GPU the future is marked at once, its CUDA events behind the calls (no host
// waits for the GPU); on the host (and the emulated device) a completion thread of this backend
// marks the futures once the calls have ended (so a future's callbacks never run on the
// progress thread, and may issue collectives). The completion thread releases the tensors.
//
// The device path's transport is made by the first call on device tensors (collective, as the
// Python backend's first CUDA call): `device(index)` returns its device_api capsule and its
// native communicator. The tests run the same path on the emulated device, whose "device
// tensors" are CPU tensors (pycollectives.torch.backend, PYCOLL_TORCH_DEVICE=emulated).
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/csrc/utils/pybind.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <utility>
#include <vector>

#include "algo/schedule.h"
#include "common/coverage.h"
#include "common/dtypes.h"
#include "device/device_capi.h"
#include "host/host_capi.h"

namespace py = pybind11;

namespace pycoll_torch {
namespace {

using pycoll::Collective;
using pycoll::DType;
using pycoll::RedOp;

const pycoll_host_api* g_api = nullptr;

// How the calls of one operation end: the host interface's functions or a device's (the same
// three on either).
struct Ending {
  int (*wait)(void* work, double timeout_s, pycoll_status* status);
  int (*done)(void* work);
  void (*release)(void* work);
};
Ending g_host_ending{};  // g_api's, set at import
// pycollectives' exception classes (held for the life of the process).
PyObject* g_error = nullptr;
PyObject* g_timeout = nullptr;
PyObject* g_mismatch = nullptr;

// A failed status as the exception the Python API raises for it: ValueError / TypeError for
// bad arguments (torch maps c10's), pycollectives' own classes for failed collectives.
[[noreturn]] void raise(const pycoll_status& st) {
  const std::string msg = st.message;
  switch (st.code) {
    case PYCOLL_INVALID_TYPE:
      TORCH_CHECK_TYPE(false, msg);
      break;
    case PYCOLL_INVALID_VALUE:
      TORCH_CHECK_VALUE(false, msg);
      break;
    default:
      break;
  }
  if (Py_IsInitialized()) {
    py::gil_scoped_acquire gil;
    PyObject* cls = st.code == PYCOLL_TIMEOUT    ? g_timeout
                    : st.code == PYCOLL_MISMATCH ? g_mismatch
                                                 : g_error;
    PyErr_SetString(cls, msg.c_str());
    throw py::error_already_set();
  }
  throw c10::DistBackendError(msg, {});
}

// Lets Python objects go from C++ code that may not hold the GIL (destructors): under the GIL,
// or, once the interpreter is gone, by forgetting them (nothing is left to free them with).
template <class... O>
void drop_python(O&... objs) {
  if (!Py_IsInitialized()) {
    (objs.release(), ...);
    return;
  }
  py::gil_scoped_acquire gil;
  ((objs = py::object()), ...);
}

// The element type of `t` as _C codes it; false when the host path does not carry it.
bool dtype_code(const at::Tensor& t, int* code) {
  switch (t.scalar_type()) {
    case at::kChar:
      *code = static_cast<int>(DType::Int8);
      return true;
    case at::kByte:
    case at::kBool:
      *code = static_cast<int>(DType::UInt8);
      return true;
    case at::kInt:
      *code = static_cast<int>(DType::Int32);
      return true;
    case at::kLong:
      *code = static_cast<int>(DType::Int64);
      return true;
    case at::kHalf:
      *code = static_cast<int>(DType::Float16);
      return true;
    case at::kBFloat16:
      *code = static_cast<int>(DType::BFloat16);
      return true;
    case at::kFloat:
      *code = static_cast<int>(DType::Float32);
      return true;
    case at::kDouble:
      *code = static_cast<int>(DType::Float64);
      return true;
    default:
      return false;
  }
}

// A torch reduction as _C's op code. bool tensors travel as uint8: SUM and MAX are a logical
// or (max), MIN and PRODUCT a logical and (min).
int op_code(const c10d::ReduceOp& op, const at::Tensor& t) {
  using R = c10d::ReduceOp::RedOpType;
  const bool boolean = t.scalar_type() == at::kBool;
  switch (op.op_) {
    case R::SUM:
      return static_cast<int>(boolean ? RedOp::Max : RedOp::Sum);
    case R::AVG:
      return static_cast<int>(boolean ? RedOp::Max : RedOp::Avg);
    case R::PRODUCT:
      return static_cast<int>(boolean ? RedOp::Min : RedOp::Prod);
    case R::MIN:
      return static_cast<int>(RedOp::Min);
    case R::MAX:
      return static_cast<int>(RedOp::Max);
    default:
      break;
  }
  static const char* names[] = {"SUM",  "AVG", "PRODUCT", "MIN",        "MAX",
                                "BAND", "BOR", "BXOR",    "PREMUL_SUM", "UNUSED"};
  const auto k = static_cast<size_t>(op.op_);
  TORCH_CHECK_VALUE(false,
                    "the pycollectives backend reduces with SUM, AVG, PRODUCT, MIN or MAX, not ",
                    k < 10 ? names[k] : "an unknown op");
  return -1;  // not reached
}

// torch's current stream on `device`, as the device interface takes it (0 on the CPU: the
// emulated device's tensors).
uintptr_t current_stream(const c10::Device& device) {
  if (device.is_cpu()) return 0;
  const c10::impl::VirtualGuardImpl impl(device.type());
  return reinterpret_cast<uintptr_t>(impl.getStream(device).native_handle());
}

// The asynchronous calls of one torch operation: their handles, the tensors they use (alive
// until they complete), and the future torch sees (of `device`'s type: a CUDA future for
// CUDA tensors, which later work waits for on its own streams).
struct Pending {
  Pending(const Ending* ending, const pycoll_device_api* device_api, c10::Device device)
      : ending(ending),
        device_api(device_api),
        device(device),
        future(c10::make_intrusive<c10::ivalue::Future>(
            c10::ListType::create(c10::TensorType::get()),
            device.is_cpu() ? std::vector<c10::Device>{} : std::vector<c10::Device>{device})) {}
  Pending(const Pending&) = delete;
  Pending& operator=(const Pending&) = delete;
  ~Pending() {
    for (void* h : handles) ending->release(h);
  }

  const Ending* ending;
  const pycoll_device_api* device_api;  // null: the host's calls
  c10::Device device;                   // the tensors'
  std::vector<void*> handles;
  std::vector<at::Tensor> keep;
  std::vector<at::Tensor> outputs;
  c10::intrusive_ptr<c10::ivalue::Future> future;
  // What runs on the host once every call has ended, before anyone is told the operation is
  // complete (the copies out of a list-form all-gather's flat output, which only it holds): by
  // whoever sees the end first (a wait, a completion test, the completion thread), once, and
  // then let go. Not `keep`: letting the caller's tensors go may take the GIL, which a caller
  // that polls is_completed() holds while it waits here for the completion thread.
  mutable std::function<void()> finish;

  // Waits on the host for every call, up to `timeout_s` each (< 0: until it completes): the
  // first status that is not OK, else OK (the finishing step run).
  pycoll_status wait(double timeout_s) const {
    pycoll_status st{PYCOLL_OK, {0}};
    for (void* h : handles)
      if (ending->wait(h, timeout_s, &st) != PYCOLL_OK) break;
    if (st.code == PYCOLL_OK) finished();
    return st;
  }
  // Device calls on GPU tensors: later work on the current stream waits for every call (the
  // host does not). Otherwise as wait().
  pycoll_status wait_for_use(double timeout_s) const {
    if (device_api == nullptr || device.is_cpu()) return wait(timeout_s);
    pycoll_status st{PYCOLL_OK, {0}};
    const uintptr_t stream = current_stream(device);
    for (void* h : handles)
      if (device_api->wait_on(h, stream, &st) != PYCOLL_OK) break;
    return st;
  }
  bool done() const {
    for (void* h : handles)
      if (!ending->done(h)) return false;
    wait(-1.0);  // every call has ended: the finishing step runs here if it has not yet
    return true;
  }

 private:
  void finished() const {
    std::call_once(finish_once_, [&] {
      if (finish) finish();
      finish = nullptr;
    });
  }
  mutable std::once_flag finish_once_;
};

// A Python exception object as a C++ exception that carries it (under the GIL): raised again
// in Python as itself, wherever torch hands it back (Work.wait, a future's value).
std::exception_ptr python_error(const py::handle& error) {
  PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(error.ptr())), error.ptr());
  return std::make_exception_ptr(py::error_already_set());
}

// The one Work torch sees for an operation of this backend, whoever runs it:
// - natively: its calls (`pending`; none: they ran on the calling thread, and it is complete);
// - by the Python backend: the package's pycollectives.Work over the communicator's calls
//   (`python`), whose wait, completion test, error and future it answers with (under the GIL).
// The Python backend makes it (as `Work(work, outputs)`) when it serves this one; alone
// (PYCOLL_TORCH_NATIVE=0, or no _torch built) it answers with a Python face of its own.
class Work : public c10d::Work {
 public:
  Work(int rank, c10d::OpType type, std::vector<at::Tensor> outputs,
       std::shared_ptr<Pending> pending)
      : c10d::Work(rank, type), outputs_(std::move(outputs)), pending_(std::move(pending)) {}
  Work(py::object python, std::vector<at::Tensor> outputs)
      : outputs_(std::move(outputs)), python_(std::move(python)) {}
  ~Work() override {
    if (python_) drop_python(python_);
  }

  bool isCompleted() override {
    if (python_) return ask("is_completed");
    return !pending_ || pending_->done();
  }
  bool isSuccess() const override {
    if (python_) return ask("is_success");
    return !pending_ || (pending_->future->completed() && !pending_->future->hasError());
  }
  std::exception_ptr exception() const override {
    if (python_) {
      py::gil_scoped_acquire gil;
      const py::object error = python_.attr("exception")();
      return error.is_none() ? nullptr : python_error(error);
    }
    return pending_ && pending_->future->completed() && pending_->future->hasError()
               ? pending_->future->exception_ptr()
               : nullptr;
  }
  std::vector<at::Tensor> result() override { return outputs_; }

  // As torch's own backends: on CPU tensors the host waits; on GPU tensors later work on the
  // current stream does. The timeout's 0 (torch's default) is none.
  bool wait(std::chrono::milliseconds timeout) override {
    const double seconds = timeout.count() <= 0 ? -1.0 : timeout.count() / 1000.0;
    if (python_) {
      py::gil_scoped_acquire gil;
      python_.attr("wait")(seconds < 0 ? py::none() : py::cast(seconds));
      return true;
    }
    if (!pending_) return true;
    pycoll_status st = pending_->wait_for_use(seconds);
    if (st.code == PYCOLL_PENDING) {
      st.code = PYCOLL_TIMEOUT;
      std::snprintf(st.message, sizeof(st.message),
                    "Work.wait: not complete after %.3f s (the collective goes on)", seconds);
    }
    if (st.code != PYCOLL_OK) raise(st);
    return true;
  }

  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override {
    if (pending_) return pending_->future;
    const auto tensors_future = [] {
      return c10::make_intrusive<c10::ivalue::Future>(
          c10::ListType::create(c10::TensorType::get()));
    };
    if (!python_) {
      auto fut = tensors_future();
      fut->markCompleted(c10::IValue(outputs_));
      return fut;
    }
    // Marked by a callback on the Python Work's future (once: later calls get the same one).
    py::gil_scoped_acquire gil;
    if (future_) return future_;
    auto fut = future_ = tensors_future();
    auto mark = [fut, outputs = outputs_](const py::object& done) {
      const py::object error = done.attr("exception")();
      if (error.is_none())
        fut->markCompleted(c10::IValue(outputs));
      else
        fut->setError(python_error(error));
    };
    python_.attr("get_future")().attr("add_done_callback")(py::cpp_function(mark));
    return fut;
  }

 private:
  // python_'s answer to `name`() (a bool), read under the GIL (the answer is let go there too).
  bool ask(const char* name) const {
    py::gil_scoped_acquire gil;
    return python_.attr(name)().cast<bool>();
  }

  std::vector<at::Tensor> outputs_;
  std::shared_ptr<Pending> pending_;
  py::object python_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;  // python_'s, made under the GIL
};

// Where an operation's tensors go.
enum class Route { Python, Host, Device };

class Backend : public c10d::Backend {
 public:
  // `fallback`: the Python backend; `host`: its communicator's pycollectives._C.HostComm, or
  // None where calls must go through Python (several nodes); `device`: None, or what makes
  // the device path's transport for tensors of `device_type` (see the top of this file).
  Backend(py::object fallback, py::object host, int rank, int size, size_t async_bytes,
          py::object device, const std::string& device_type)
      : c10d::Backend(rank, size),
        fallback_(std::move(fallback)),
        async_bytes_(async_bytes),
        device_type_(c10::Device(device_type).type()) {
    if (!host.is_none()) {
      comm_ = reinterpret_cast<void*>(host.attr("address").cast<uintptr_t>());
      host_ = std::move(host);
      if (!device.is_none()) make_device_ = std::move(device);
    }
  }

  ~Backend() override {
    stop_completer();
    drop_python(host_, fallback_, make_device_, device_);
  }

  const std::string getBackendName() const override { return "pycollectives"; }
  py::object fallback() const { return fallback_; }
  bool native() const { return comm_ != nullptr; }
  uint64_t device_calls() const { return device_calls_.load(); }
  uint64_t host_calls() const { return host_calls_.load(); }

  // -- natively run ---------------------------------------------------------------------------

  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override {
    const Route r = route(tensors);
    if (r == Route::Python) return fallback_call("allreduce", tensors, opts);
    return all_reduce_each(r, c10d::OpType::ALLREDUCE, tensors, opts.reduceOp);
  }

  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(
      std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) override {
    const Route r = route(tensors);
    if (r == Route::Python) return fallback_call("allreduce_coalesced", tensors, opts);
    return all_reduce_each(r, c10d::OpType::ALLREDUCE_COALESCED, tensors, opts.reduceOp);
  }

  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors,
                                        const c10d::ReduceOptions& opts) override {
    const Route r = tensors.size() == 1 ? route(tensors) : Route::Python;
    if (r == Route::Python) return fallback_call("reduce", tensors, opts);
    auto& t = tensors[0];
    std::vector<pycoll_call> calls{
        call(Collective::Reduce, t, t, op_code(opts.reduceOp, t), opts.rootRank)};
    return start(r, c10d::OpType::REDUCE, calls, tensors, tensors);
  }

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override {
    const Route r = route(tensors);
    if (r == Route::Python) return fallback_call("broadcast", tensors, opts);
    std::vector<pycoll_call> calls;
    for (auto& t : tensors) calls.push_back(call(Collective::Broadcast, t, t, 0, opts.rootRank));
    return start(r, c10d::OpType::BROADCAST, calls, tensors, tensors);
  }

  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& out, at::Tensor& in,
                                                 const c10d::AllgatherOptions& opts) override {
    std::vector<at::Tensor> outs{out}, ins{in};
    return allgather_into_tensor_coalesced(outs, ins, opts);
  }

  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(
      std::vector<at::Tensor>& outs, std::vector<at::Tensor>& ins,
      const c10d::AllgatherOptions& opts) override {
    const Route r = outs.size() == ins.size() ? route(outs, ins) : Route::Python;
    if (r == Route::Python)
      return outs.size() == 1 ? fallback_call("_allgather_base", outs[0], ins[0], opts)
                              : fallback_call("allgather_into_tensor_coalesced", outs, ins, opts);
    std::vector<pycoll_call> calls;
    for (size_t i = 0; i < outs.size(); ++i)
      calls.push_back(call(Collective::AllGather, ins[i], outs[i]));
    return start(r, c10d::OpType::_ALLGATHER_BASE, calls, outs, ins);
  }

  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(
      at::Tensor& out, at::Tensor& in, const c10d::ReduceScatterOptions& opts) override {
    std::vector<at::Tensor> outs{out}, ins{in};
    return reduce_scatter_tensor_coalesced(outs, ins, opts);
  }

  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(
      std::vector<at::Tensor>& outs, std::vector<at::Tensor>& ins,
      const c10d::ReduceScatterOptions& opts) override {
    const Route r = outs.size() == ins.size() ? route(outs, ins) : Route::Python;
    if (r == Route::Python)
      return outs.size() == 1 ? fallback_call("_reduce_scatter_base", outs[0], ins[0], opts)
                              : fallback_call("reduce_scatter_tensor_coalesced", outs, ins, opts);
    std::vector<pycoll_call> calls;
    for (size_t i = 0; i < outs.size(); ++i)
      calls.push_back(
          call(Collective::ReduceScatter, ins[i], outs[i], op_code(opts.reduceOp, ins[i])));
    return start(r, c10d::OpType::_REDUCE_SCATTER_BASE, calls, outs, ins);
  }

  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override {
    if (!comm_) return fallback_call("barrier", opts);
    pycoll_call b{};
    b.barrier = 1;
    std::vector<at::Tensor> none;
    return start(Route::Host, c10d::OpType::BARRIER, {b}, none, none);
  }

  // The list forms, natively where the list holds one tensor per rank of as many elements as
  // the other side (dense, contiguous, of its type and device): through a flat tensor.
  // all_gather: into a flat output, then copied into the list (on the host once the call has
  // ended; on a GPU queued on the current stream, which then waits for the call).
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outs,
                                           std::vector<at::Tensor>& ins,
                                           const c10d::AllgatherOptions& opts) override {
    const Route r = outs.size() == 1 && ins.size() == 1 && one_per_rank(outs[0], ins[0])
                        ? route(outs[0], ins)
                        : Route::Python;
    if (r == Route::Python) return fallback_call("allgather", outs, ins, opts);
    const int64_t n = ins[0].numel();
    const at::Tensor flat = flat_tensor(size_ * n, ins[0]);
    std::vector<pycoll_call> calls{call(Collective::AllGather, ins[0], flat)};
    auto copy_out = [all = flat, list = outs[0], n] {
      for (size_t q = 0; q < list.size(); ++q)
        list[q].copy_(all.narrow(0, static_cast<int64_t>(q) * n, n).view(list[q].sizes()));
    };
    return start(r, c10d::OpType::ALLGATHER, calls, outs[0], ins, std::move(copy_out));
  }
  // reduce_scatter: the list concatenated (on a GPU, on the current stream, ahead of the call).
  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outs,
                                                std::vector<std::vector<at::Tensor>>& ins,
                                                const c10d::ReduceScatterOptions& opts) override {
    const Route r = outs.size() == 1 && ins.size() == 1 && one_per_rank(ins[0], outs[0])
                        ? route(outs, ins[0])
                        : Route::Python;
    if (r == Route::Python) return fallback_call("reduce_scatter", outs, ins, opts);
    std::vector<at::Tensor> pieces;
    for (const auto& t : ins[0]) pieces.push_back(t.reshape({-1}));
    std::vector<at::Tensor> flat{flat_tensor(size_ * outs[0].numel(), outs[0])};
    at::cat_out(flat[0], pieces);
    std::vector<pycoll_call> calls{
        call(Collective::ReduceScatter, flat[0], outs[0], op_code(opts.reduceOp, outs[0]))};
    return start(r, c10d::OpType::REDUCE_SCATTER, calls, outs, flat);
  }

  // -- through the Python backend -------------------------------------------------------------

  c10::intrusive_ptr<c10d::Work> allgather_coalesced(std::vector<std::vector<at::Tensor>>& outs,
                                                     std::vector<at::Tensor>& ins,
                                                     const c10d::AllgatherOptions& opts) override {
    return fallback_call("allgather_coalesced", outs, ins, opts);
  }
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outs,
                                        std::vector<at::Tensor>& ins,
                                        const c10d::GatherOptions& opts) override {
    return fallback_call("gather", outs, ins, opts);
  }
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outs,
                                         std::vector<std::vector<at::Tensor>>& ins,
                                         const c10d::ScatterOptions& opts) override {
    return fallback_call("scatter", outs, ins, opts);
  }
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& out, at::Tensor& in,
                                               std::vector<int64_t>& out_splits,
                                               std::vector<int64_t>& in_splits,
                                               const c10d::AllToAllOptions& opts) override {
    return fallback_call("alltoall_base", out, in, out_splits, in_splits, opts);
  }
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outs,
                                          std::vector<at::Tensor>& ins,
                                          const c10d::AllToAllOptions& opts) override {
    return fallback_call("alltoall", outs, ins, opts);
  }
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst, int tag) override {
    return fallback_call("send", tensors, dst, tag);
  }
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src, int tag) override {
    return fallback_call("recv", tensors, src, tag);
  }
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override {
    return fallback_call("recv_anysource", tensors, tag);
  }

  void shutdown() override {
    stop_completer();  // every queued call done (their waits are bounded)
    py::gil_scoped_acquire gil;
    comm_ = nullptr;  // from here on the Python backend answers, and says it is closed
    host_ = py::object();
    make_device_ = device_ = py::object();
    device_comm_.store(nullptr);
    {
      std::lock_guard<std::mutex> g(flat_mu_);
      flat_ = at::Tensor();
    }
    fallback_.attr("shutdown")();
  }

 private:
  // Where the tensors go: straight to a communicator when every one is dense, contiguous, of
  // one element type the communicators carry and on one device: the device path's (made on
  // the first such call) or the CPU (the host's). Otherwise the Python backend answers (with
  // the error the case calls for, where there is one).
  Route route(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b = {}) {
    int code;
    if (!comm_ || a.empty() || !dtype_code(a[0], &code)) return Route::Python;
    const auto type = a[0].scalar_type();
    const c10::Device device = a[0].device();
    for (const auto* list : {&a, &b})
      for (const auto& t : *list)
        if (t.device() != device || t.layout() != at::kStrided || !t.is_contiguous() ||
            t.scalar_type() != type)
          return Route::Python;
    if (device.type() == device_type_ && make_device_ && device_ready(device)) return Route::Device;
    return device.is_cpu() ? Route::Host : Route::Python;
  }

  // A flat tensor of `numel` elements of `like`'s type and device for a list form. On the CPU,
  // the one the last list form used where nothing holds it any more (a pending call keeps its
  // own; a new one of megabytes is faulted in page by page at every call): else a new one.
  at::Tensor flat_tensor(int64_t numel, const at::Tensor& like) {
    if (!like.device().is_cpu()) return at::empty({numel}, like.options());
    std::lock_guard<std::mutex> g(flat_mu_);
    if (!flat_.defined() || flat_.numel() != numel || flat_.scalar_type() != like.scalar_type() ||
        flat_.use_count() != 1 || flat_.storage().use_count() != 1)  // handles, views
      flat_ = at::empty({numel}, like.options());
    return flat_;
  }

  // Whether `list` holds one tensor per rank, each of `t`'s element count.
  bool one_per_rank(const std::vector<at::Tensor>& list, const at::Tensor& t) const {
    if (static_cast<int>(list.size()) != size_) return false;
    for (const auto& x : list)
      if (x.numel() != t.numel()) return false;
    return true;
  }

  // Whether the device path's transport is there, making it on the first call (collective:
  // every rank's first call on device tensors makes it). Its failure is the Python error.
  bool device_ready(const c10::Device& device) {
    if (device_comm_.load() != nullptr) return true;
    py::gil_scoped_acquire gil;  // also keeps a second first call out
    if (device_comm_.load() != nullptr) return true;
    const py::tuple made = make_device_(device.has_index() ? device.index() : 0);
    auto* api = static_cast<const pycoll_device_api*>(
        PyCapsule_GetPointer(made[0].ptr(), PYCOLL_DEVICE_API_NAME));
    if (api == nullptr) throw py::error_already_set();
    if (api->version != PYCOLL_DEVICE_API_VERSION || api->struct_size < sizeof(pycoll_device_api))
      throw std::runtime_error("pycollectives._torch was built for another device transport");
    device_ = made[1];
    device_api_ = api;
    device_ending_ = Ending{api->wait, api->done, api->release};
    device_comm_.store(reinterpret_cast<void*>(device_.attr("address").cast<uintptr_t>()));
    return true;
  }

  pycoll_call call(Collective c, const at::Tensor& in, const at::Tensor& out, int op = 0,
                   int root = 0) const {
    pycoll_call k{};
    k.collective = static_cast<int>(c);
    k.in = in.data_ptr();
    k.in_count = static_cast<size_t>(in.numel());
    k.out = out.data_ptr();
    k.out_count = static_cast<size_t>(out.numel());
    dtype_code(in, &k.dtype);
    k.op = op;
    k.root = root;
    return k;
  }

  // all_reduce of each tensor in place (the plain and the coalesced form alike).
  c10::intrusive_ptr<c10d::Work> all_reduce_each(Route r, c10d::OpType type,
                                                 std::vector<at::Tensor>& tensors,
                                                 const c10d::ReduceOp& op) {
    std::vector<pycoll_call> calls;
    for (auto& t : tensors) calls.push_back(call(Collective::AllReduce, t, t, op_code(op, t)));
    return start(r, type, calls, tensors, tensors);
  }

  // Runs `calls` on the host (small: here and now; else queued on the progress thread) or
  // queues them on the device (see the top of this file). `then`: what must follow the calls
  // before the operation is complete (copies out of a flat output, which it holds while the
  // calls use it): on the host once they have ended, on a GPU queued on the current stream
  // after them.
  c10::intrusive_ptr<c10d::Work> start(Route r, c10d::OpType type,
                                       const std::vector<pycoll_call>& calls,
                                       std::vector<at::Tensor>& outputs,
                                       std::vector<at::Tensor>& inputs,
                                       std::function<void()> then = {}) {
    size_t bytes = 0;
    for (const auto& t : outputs) bytes += t.nbytes();
    for (const auto& t : inputs) bytes = std::max<size_t>(bytes, t.nbytes());
    const bool async_op = bytes >= async_bytes_;
    pycoll_status st;
    if (r == Route::Host && !async_op) {
      for (const auto& k : calls) {
        if (g_api->run(comm_, &k, &st) != PYCOLL_OK) raise(st);
        host_calls_.fetch_add(1);
      }
      if (then) then();
      return c10::make_intrusive<Work>(rank_, type, outputs, nullptr);
    }
    const bool on_device = r == Route::Device;
    const c10::Device device = on_device ? outputs[0].device() : c10::Device(c10::kCPU);
    auto p = std::make_shared<Pending>(on_device ? &device_ending_ : &g_host_ending,
                                       on_device ? device_api_ : nullptr, device);
    p->outputs = outputs;
    p->keep = inputs;
    p->keep.insert(p->keep.end(), outputs.begin(), outputs.end());
    const uintptr_t stream = on_device ? current_stream(device) : 0;
    for (const auto& k : calls) {
      void* h = nullptr;
      const int code = on_device
                           ? device_api_->run(device_comm_.load(), &k, stream, async_op, &h, &st)
                           : g_api->submit(comm_, &k, &h, &st);
      if (code == PYCOLL_OK) (on_device ? device_calls_ : host_calls_).fetch_add(1);
      if (code != PYCOLL_OK) {
        if (p->handles.empty()) raise(st);  // nothing started: a plain error, as for a run
        // Later calls refused after earlier ones started (only a failing communicator does
        // this): the operation fails as a whole once those are done.
        p->future->setError(std::make_exception_ptr(c10::DistBackendError(st.message, {})));
        break;
      }
      p->handles.push_back(h);
    }
    if (on_device && !device.is_cpu()) {
      // A GPU: the future is marked now, as ProcessGroupNCCL's is, under a stream that follows
      // the calls, so that its CUDA events carry the dependency and whoever waits on it (DDP,
      // at the end of backward, for every bucket) queues a wait on the GPU instead of the host
      // waiting for the calls to end. Blocking calls are on the current stream, and so are the
      // copies that follow a list all-gather; async ones on the transport's stream, which a
      // stream of the pool follows for the marking (the current stream must not wait for them
      // before Work.wait()). An error the calls find later reaches Work.wait() and the next
      // call, no longer the future. The completion thread still lets the tensors go.
      if (p->future->completed()) raise(st);  // a call refused: nothing to follow
      const c10::impl::VirtualGuardImpl impl(device.type());
      c10::Stream mark = impl.getStream(device);
      if (then) {
        const pycoll_status w = p->wait_for_use(-1.0);
        if (w.code != PYCOLL_OK) raise(w);
        then();
      } else if (async_op) {
        mark = impl.getStreamFromGlobalPool(device);
        for (void* h : p->handles) {
          const uintptr_t on = reinterpret_cast<uintptr_t>(mark.native_handle());
          if (device_api_->wait_on(h, on, &st) != PYCOLL_OK) raise(st);
        }
      }
      const c10::StreamGuard guard(mark);
      p->future->markCompleted(c10::IValue(p->outputs));
    } else {
      p->finish = std::move(then);
    }
    track(p);
    return c10::make_intrusive<Work>(rank_, type, outputs, std::move(p));
  }

  // The completion thread: marks the futures of queued operations in order, then lets their
  // tensors go.
  void track(const std::shared_ptr<Pending>& p) {
    std::lock_guard<std::mutex> g(mu_);
    queue_.push_back(p);
    if (!completer_.joinable()) completer_ = std::thread([this] { complete_loop(); });
    cv_.notify_one();
  }

  void complete_loop() {
    for (;;) {
      std::shared_ptr<Pending> p;
      {
        std::unique_lock<std::mutex> g(mu_);
        cv_.wait(g, [&] { return !queue_.empty() || stopping_; });
        if (queue_.empty()) return;
        p = std::move(queue_.front());
        queue_.pop_front();
      }
      const pycoll_status st = p->wait(-1.0);
      if (!p->future->completed()) {  // the host's and the emulated device's (CPU) futures
        if (st.code == PYCOLL_OK)
          p->future->markCompleted(c10::IValue(p->outputs));
        else
          p->future->setError(std::make_exception_ptr(c10::DistBackendError(st.message, {})));
      }
      p->keep.clear();
    }
  }

  void stop_completer() {
    {
      std::lock_guard<std::mutex> g(mu_);
      stopping_ = true;
      cv_.notify_one();
    }
    if (completer_.joinable()) {
      if (Py_IsInitialized() && PyGILState_Check()) {
        py::gil_scoped_release nogil;  // a future's callbacks may need the GIL
        completer_.join();
      } else {
        completer_.join();
      }
    }
    std::lock_guard<std::mutex> g(mu_);
    stopping_ = false;
  }

  // The same operation on the Python backend, which answers with this file's Work.
  template <class... A>
  c10::intrusive_ptr<c10d::Work> fallback_call(const char* name, A&... args) {
    py::gil_scoped_acquire gil;
    return fallback_.attr(name)(args...).template cast<c10::intrusive_ptr<Work>>();
  }

  py::object fallback_, host_;
  void* comm_ = nullptr;  // host_'s communicator, null: everything through fallback_
  size_t async_bytes_;

  // The device path: what makes its transport, and once made, the transport (its native
  // communicator object, kept alive here; the address device_api's calls take).
  c10::DeviceType device_type_;
  py::object make_device_, device_;
  std::atomic<void*> device_comm_{nullptr};
  const pycoll_device_api* device_api_ = nullptr;
  Ending device_ending_{};
  std::atomic<uint64_t> device_calls_{0};
  std::atomic<uint64_t> host_calls_{0};  // run on the host communicator, the barrier too
  std::mutex flat_mu_;
  at::Tensor flat_;  // flat_tensor's, on the CPU

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<Pending>> queue_;
  bool stopping_ = false;
  std::thread completer_;
};

}  // namespace
}  // namespace pycoll_torch

PYBIND11_MODULE(_torch, m) {
  using pycoll_torch::Backend;
  m.doc() = "pycollectives' torch.distributed backend in C++ (private; see pycollectives.torch)";
  PYCOLL_BIND_COVERAGE_DUMP(m);
  py::module_::import("torch.distributed");  // c10d's Backend and Work types
  py::module_ core = py::module_::import("pycollectives._C");
  auto* api = static_cast<const pycoll_host_api*>(
      PyCapsule_GetPointer(core.attr("host_api").ptr(), PYCOLL_HOST_API_NAME));
  if (api == nullptr) throw py::error_already_set();
  if (api->version != PYCOLL_HOST_API_VERSION || api->struct_size < sizeof(pycoll_host_api))
    throw std::runtime_error("pycollectives._torch was built for another pycollectives._C");
  pycoll_torch::g_api = api;
  pycoll_torch::g_host_ending = {api->wait, api->done, api->release};
  pycoll_torch::g_error = py::object(core.attr("CollectiveError")).release().ptr();
  pycoll_torch::g_timeout = py::object(core.attr("CollectiveTimeout")).release().ptr();
  pycoll_torch::g_mismatch = py::object(core.attr("CollectiveMismatch")).release().ptr();

  // The Python backend's face for an operation it runs: pycollectives.Work `work` and the
  // output tensors (ProcessGroup._work reads a list of lists as one list).
  py::class_<pycoll_torch::Work, c10::intrusive_ptr<pycoll_torch::Work>, c10d::Work>(m, "Work").def(
      py::init([](py::object work, std::vector<at::Tensor> outputs) {
        return c10::make_intrusive<pycoll_torch::Work>(std::move(work), std::move(outputs));
      }),
      py::arg("work"), py::arg("outputs"));

  py::class_<Backend, c10::intrusive_ptr<Backend>, c10d::Backend>(m, "Backend")
      .def(py::init([](py::object fallback, py::object host, int rank, int size, size_t async_bytes,
                       py::object device, const std::string& device_type) {
             return c10::make_intrusive<Backend>(std::move(fallback), std::move(host), rank, size,
                                                 async_bytes, std::move(device), device_type);
           }),
           py::arg("fallback"), py::arg("host"), py::arg("rank"), py::arg("size"),
           py::arg("async_bytes"), py::arg("device") = py::none(), py::arg("device_type") = "cuda")
      .def_property_readonly("fallback", &Backend::fallback)
      .def_property_readonly("native", &Backend::native)
      // Calls queued on the device path so far, and run natively on the host.
      .def_property_readonly("device_calls", &Backend::device_calls)
      .def_property_readonly("host_calls", &Backend::host_calls);
}
