#include "cuda/cuda_comm.h"

#include <cstdio>
#include <cstring>

#include "common/errors.h"
#include "cuda/cuda_check.h"
#include "cuda/launch.h"
#include "device/host_steps.h"
#include "runtime/fingerprint.h"
#include "runtime/splits.h"

namespace pycoll {
namespace cuda {

// ---- CudaWork --------------------------------------------------------------------------------

EventPool::~EventPool() {
  for (cudaEvent_t e : free_) cudaEventDestroy(e);
}

cudaEvent_t EventPool::take() {
  {
    std::lock_guard<std::mutex> g(mu_);
    if (!free_.empty()) {
      cudaEvent_t e = free_.back();
      free_.pop_back();
      return e;
    }
  }
  DeviceGuard dg(device_);
  cudaEvent_t e = nullptr;
  PYCOLL_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  return e;
}

void EventPool::give(cudaEvent_t e) {
  std::lock_guard<std::mutex> g(mu_);
  free_.push_back(e);
}

CudaWork::CudaWork(std::shared_ptr<EventPool> pool, int device, uint64_t seq, bool captured)
    : pool_(std::move(pool)),
      device_(device),
      event_(pool_->take()),
      seq_(seq),
      captured_(captured) {}

// Re-recording an event that others still wait on is safe: a wait uses the state of the event
// at the time it was queued.
CudaWork::~CudaWork() {
  if (event_ != nullptr) pool_->give(event_);
}

bool CudaWork::is_completed() const {
  if (captured_) return true;  // an event recorded in a capture cannot be queried
  // A query is one of the calls a capture in the default (global) mode forbids to every thread,
  // and would invalidate it: the capturing thread's own pruning of finished work, or the
  // watchdog's. This event was recorded outside any capture, so the query is safe: it runs in
  // relaxed mode, the thread's mode restored after.
  cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  PYCOLL_CUDA_CHECK(cudaThreadExchangeStreamCaptureMode(&mode));
  const cudaError_t e = cudaEventQuery(event_);
  PYCOLL_CUDA_CHECK(cudaThreadExchangeStreamCaptureMode(&mode));
  if (e == cudaErrorNotReady) return false;
  PYCOLL_CUDA_CHECK(e);
  return true;
}

void CudaWork::wait_on(cudaStream_t stream) const {
  if (captured_) return;  // the capture joined the caller's stream already
  DeviceGuard g(device_);
  PYCOLL_CUDA_CHECK(cudaStreamWaitEvent(stream, event_, 0));
}

// ---- CudaComm: setup -------------------------------------------------------------------------

namespace {

void check_options(int size, const CudaCommOptions& o) {
  if (size < 1 || size > kMaxRanks)
    throw InvalidArgument(
        str_cat("the CUDA transport holds 1 to ", kMaxRanks, " ranks, got ", size));
  if (o.slot_bytes < 4096 || o.slot_bytes % 256 != 0)
    throw InvalidArgument(str_cat(
        "CUDA staging slots must be a multiple of 256 bytes, at least 4096, got ", o.slot_bytes));
  if (o.nslots < 2 || o.nslots > 64)
    throw InvalidArgument(str_cat("CUDA staging slot count must be in [2, 64], got ", o.nslots));
  if (o.nblocks < 1 || o.nblocks > 128)
    throw InvalidArgument(
        str_cat("CUDA blocks per collective must be in [1, 128], got ", o.nblocks));
}

}  // namespace

CudaComm::CudaComm(int rank, int size, int device, const CudaCommOptions& opts)
    : rank_(rank),
      size_(size),
      device_(device),
      opts_((check_options(size, opts), opts)),
      shm_(rank, size, 64, opts.nslots),  // flags only: host-mode steps, barrier, liveness
      counters_(size),
      events_(std::make_shared<EventPool>(device)),
      timeout_s_(opts.timeout_s) {
  layout_ = make_layout(size, opts.nslots, opts.nblocks, opts.slot_bytes);
  try {
    DeviceGuard g(device_);
    PYCOLL_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&segment_), layout_.total_bytes()));
    PYCOLL_CUDA_CHECK(cudaMemset(segment_, 0, layout_.flags_bytes));
    PYCOLL_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&status_host_), sizeof(DeviceStatus),
                                    cudaHostAllocMapped));
    std::memset(status_host_, 0, sizeof(DeviceStatus));
    PYCOLL_CUDA_CHECK(
        cudaHostGetDevicePointer(reinterpret_cast<void**>(&status_dev_), status_host_, 0));
    PYCOLL_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&error_claim_), sizeof(uint32_t)));
    PYCOLL_CUDA_CHECK(cudaMemset(error_claim_, 0, sizeof(uint32_t)));
    PYCOLL_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    PYCOLL_CUDA_CHECK(cudaStreamCreateWithFlags(&side_, cudaStreamNonBlocking));
    PYCOLL_CUDA_CHECK(cudaEventCreateWithFlags(&ready_, cudaEventDisableTiming));
    PYCOLL_CUDA_CHECK(cudaEventCreateWithFlags(&step_done_, cudaEventDisableTiming));
    PYCOLL_CUDA_CHECK(cudaDeviceSynchronize());  // the zeroed flags are in place before export
  } catch (...) {
    release();
    throw;
  }
}

CudaComm::~CudaComm() {
  try {
    close();
  } catch (...) {
    release();
  }
}

std::string CudaComm::ipc_handle() const {
  cudaIpcMemHandle_t h;
  PYCOLL_CUDA_CHECK(cudaIpcGetMemHandle(&h, segment_));
  return std::string(reinterpret_cast<const char*>(&h), sizeof(h));
}

std::string CudaComm::device_uuid() const {
  cudaDeviceProp prop;
  PYCOLL_CUDA_CHECK(cudaGetDeviceProperties(&prop, device_));
  return std::string(reinterpret_cast<const char*>(prop.uuid.bytes), sizeof(prop.uuid.bytes));
}

void CudaComm::attach(const std::vector<std::string>& handles,
                      const std::vector<std::string>& shm_names, SyncMode mode) {
  if (static_cast<int>(handles.size()) != size_ || static_cast<int>(shm_names.size()) != size_)
    throw InvalidArgument("attach: one IPC handle and one flag segment per rank expected");
  DeviceGuard g(device_);
  mode_ = mode;
  segments_.assign(size_, nullptr);
  for (int r = 0; r < size_; ++r) {
    if (r == rank_) {
      segments_[r] = segment_;
      continue;
    }
    if (handles[r].size() != sizeof(cudaIpcMemHandle_t))
      throw InvalidArgument(str_cat("attach: IPC handle of rank ", r, " has the wrong size"));
    cudaIpcMemHandle_t h;
    std::memcpy(&h, handles[r].data(), sizeof(h));
    void* p = nullptr;
    const cudaError_t e = cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess);
    if (e != cudaSuccess)
      throw CollectiveError(str_cat("cannot map the device memory of rank ", r, " on device ",
                                    device_, ": ", cudaGetErrorString(e),
                                    " (the GPUs need peer access to each other)"));
    segments_[r] = static_cast<uint8_t*>(p);
  }
  shm_.attach(shm_names);
  if (mode_ == SyncMode::Kernel) watchdog_ = std::thread([this] { watchdog_loop(); });
}

void CudaComm::release() {
  int previous = -1;
  if (cudaGetDevice(&previous) != cudaSuccess) previous = -1;
  cudaSetDevice(device_);
  for (int r = 0; r < static_cast<int>(segments_.size()); ++r)
    if (r != rank_ && segments_[r] != nullptr) cudaIpcCloseMemHandle(segments_[r]);
  segments_.clear();
  for (auto& kv : plans_.entries()) cudaFree(kv.second.device_steps);
  plans_.entries().clear();
  for (auto& kv : plans_.pinned_entries()) cudaFree(kv.second.device_steps);  // graphs' plans
  plans_.pinned_entries().clear();
  if (segment_ != nullptr) cudaFree(segment_);
  segment_ = nullptr;
  if (error_claim_ != nullptr) cudaFree(error_claim_);
  error_claim_ = nullptr;
  if (status_host_ != nullptr) cudaFreeHost(status_host_);
  status_host_ = nullptr;
  status_dev_ = nullptr;
  if (ready_ != nullptr) cudaEventDestroy(ready_);
  if (step_done_ != nullptr) cudaEventDestroy(step_done_);
  if (stream_ != nullptr) cudaStreamDestroy(stream_);
  if (side_ != nullptr) cudaStreamDestroy(side_);
  ready_ = step_done_ = nullptr;
  stream_ = side_ = nullptr;
  if (previous >= 0 && previous != device_) cudaSetDevice(previous);
}

// ---- CudaComm: collectives -------------------------------------------------------------------

Algo CudaComm::choose(Collective c, size_t bytes) const {
  return device_choose(c, bytes, opts_.direct_max_bytes);
}

// The steps are uploaded on the communicator's stream, so the launches queued behind them on
// that stream read them only once they are in place (a synchronous copy on the legacy stream
// is not ordered with a non-blocking stream's kernels, and may return before its DMA ends).
const CudaComm::CachedPlan& CudaComm::plan_for(const CollectiveCall& call, Algo algo) {
  return plans_.get(
      call, algo,
      [&] {
        CachedPlan cp;
        cp.plan =
            plan_call(algo, call, rank_, size_, layout_, opts_.slot_bytes, opts_.oneshot_max_bytes);
        const size_t bytes = cp.plan.steps.size() * sizeof(DevStep);
        if (bytes != 0) {
          PYCOLL_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&cp.device_steps), bytes));
          PYCOLL_CUDA_CHECK(cudaMemcpyAsync(cp.device_steps, cp.plan.steps.data(), bytes,
                                            cudaMemcpyHostToDevice, stream_));
        }
        return cp;
      },
      [&](auto& entries) {
        // Queued launches may still read the old plans.
        WaitContext w = wait_context("plan cache", seq_);
        PYCOLL_CUDA_CHECK(cudaEventRecord(step_done_, stream_));
        wait_event(step_done_, w);
        for (auto& kv : entries) cudaFree(kv.second.device_steps);
      });
}

KernelArgs CudaComm::kernel_args(const CollectiveCall& call, const CachedPlan& cp) const {
  LaunchSetup setup;
  setup.rank = rank_;
  setup.size = size_;
  setup.layout = layout_;
  setup.segments = segments_.data();
  setup.status = status_dev_;
  setup.error_claim = error_claim_;
  setup.timeout_s = timeout_s_.load();
  setup.use_flags = mode_ == SyncMode::Kernel;
  return make_kernel_args(setup, call, cp.device_steps, cp.plan.steps.size(), cp.plan.grid,
                          counters_);
}

void CudaComm::run_kernel_mode(const CollectiveCall& call, const CachedPlan* cp,
                               const Fingerprint& f) {
  // Each block counts its messages on its own flags (step_kernel.h): no host counts to keep.
  static const CachedPlan no_steps{};
  KernelArgs a = kernel_args(call, cp != nullptr ? *cp : no_steps);
  check_on_device(a, f);
  PYCOLL_CUDA_CHECK(launch_steps(call.dtype, a, stream_));
}

void CudaComm::watch(std::shared_ptr<CudaWork> work) {
  std::lock_guard<std::mutex> g(watch_mu_);
  last_work_ = std::move(work);
}

void CudaComm::stop_peers_on_mismatch() {
  if (mode_ != SyncMode::Kernel || segment_ == nullptr || side_ == nullptr) return;
  static const uint64_t word = fail_word(rank_, rank_);
  // Not part of any graph a thread may be capturing (relaxed mode), on a stream of its own:
  // stream_ may hold a launch that waits for a peer that waits for this word.
  cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  PYCOLL_CUDA_CHECK(cudaThreadExchangeStreamCaptureMode(&mode));
  cudaMemcpyAsync(segment_ + layout_.fail_offset(), &word, sizeof(word), cudaMemcpyHostToDevice,
                  side_);
  cudaStreamSynchronize(side_);
  PYCOLL_CUDA_CHECK(cudaThreadExchangeStreamCaptureMode(&mode));
}

std::shared_ptr<CudaWork> CudaComm::run(const CollectiveCall& call, cudaStream_t stream,
                                        bool async_op) {
  std::lock_guard<std::mutex> g(run_mu_);
  const char* name = collective_name(call.collective);
  check_device_call(call, size_);
  check_usable(name);
  DeviceGuard dg(device_);
  check_device_status(name);
  const size_t esize = dtype_size(call.dtype);
  const Algo algo = call.algo == Algo::Auto
                        ? choose(call.collective, choice_count(call, size_) * esize)
                        : call.algo;
  // A stream being captured into a CUDA graph: the launch is captured, to run at every launch
  // of the graph (its plan pinned), unless a replay could not be right (check_capturable).
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  PYCOLL_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
  const bool capturing = capture == cudaStreamCaptureStatusActive;
  if (capturing)
    check_capturable(name, mode_ == SyncMode::Kernel,
                     moves_nothing(call, rank_, size_) || plans_.find(call, algo) != nullptr);
  const uint64_t seq = ++seq_;
  if (opts_.debug)
    std::fprintf(stderr,
                 "pycollectives INFO rank %d/%d cuda:%d %s #%llu count=%zu %s %s root=%d algo=%s%s "
                 "sync=%s\n",
                 rank_, size_, device_, name, static_cast<unsigned long long>(seq), call.count,
                 dtype_name(call.dtype), redop_name(call.op), call.root, algo_name(algo),
                 call.algo == Algo::Auto ? " (auto)" : "",
                 mode_ == SyncMode::Kernel ? "kernel" : "host");
  const Fingerprint mine = Fingerprint::of_call(seq, call, algo);
  FingerprintGuard guard(shm_, mine);
  WaitContext w = wait_context(name, seq);
  const bool kernel = mode_ == SyncMode::Kernel;
  try {
    // Split lists are checked whatever check_mismatch says: kernels of ranks that disagree
    // would wait for messages that never come, or write past an output. Every rank publishes
    // its fingerprint, so that one that meets on the host sees a peer that does not.
    const bool meet = meets_on_host(call, kernel, capturing, opts_.check_mismatch);
    w.fingerprints = &guard;
    guard.publish();
    if (!call.send_counts.empty())
      check_split_matrix(shm_, guard, w, call.send_counts, call.recv_counts);
    if (meet) guard.finish(w);  // every peer runs this very call
    auto work = std::make_shared<CudaWork>(events_, device_, seq, capturing);
    // In a capture these two calls fork our stream into it, and the two at the end join it
    // back (a capture must end joined, so an async call is joined too).
    PYCOLL_CUDA_CHECK(cudaEventRecord(ready_, stream));
    PYCOLL_CUDA_CHECK(cudaStreamWaitEvent(stream_, ready_, 0));
    // In kernel mode a call that moves nothing launches too: it compares the call.
    if (moves_nothing(call, rank_, size_)) {
      if (kernel) run_kernel_mode(call, nullptr, mine);
    } else if (capturing) {
      run_kernel_mode(call, &plans_.pin(call, algo), mine);  // the graph reads it: never freed
    } else if (kernel) {
      run_kernel_mode(call, &plan_for(call, algo), mine);
    } else {
      run_host_mode(call, plan_for(call, algo), w);
    }
    PYCOLL_CUDA_CHECK(cudaEventRecord(work->event(), stream_));
    if (!async_op || capturing) PYCOLL_CUDA_CHECK(cudaStreamWaitEvent(stream, work->event(), 0));
    if (!capturing) watch(work);
    return work;
  } catch (const CollectiveMismatch& e) {
    stop_peers_on_mismatch();
    abort(e.what());
    throw;
  } catch (const CollectiveError& e) {
    abort(e.what());  // peers' counters no longer match ours
    throw;
  }
}

}  // namespace cuda
}  // namespace pycoll
