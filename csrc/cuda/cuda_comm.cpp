#include "cuda/cuda_comm.h"

#include <cstdio>
#include <cstring>

#include "common/errors.h"
#include "cuda/cuda_check.h"
#include "cuda/launch.h"

namespace pycoll {
namespace cuda {

// ---- CudaWork --------------------------------------------------------------------------------

CudaWork::CudaWork(int device, uint64_t seq) : device_(device), seq_(seq) {
  PYCOLL_CUDA_CHECK(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming));
}

CudaWork::~CudaWork() {
  if (event_ != nullptr) cudaEventDestroy(event_);
}

bool CudaWork::is_completed() const {
  const cudaError_t e = cudaEventQuery(event_);
  if (e == cudaErrorNotReady) return false;
  PYCOLL_CUDA_CHECK(e);
  return true;
}

void CudaWork::wait_on(cudaStream_t stream) const {
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
  for (auto& kv : plans_) cudaFree(kv.second.device_steps);
  plans_.clear();
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
  ready_ = step_done_ = nullptr;
  stream_ = nullptr;
  if (previous >= 0 && previous != device_) cudaSetDevice(previous);
}

// ---- CudaComm: collectives -------------------------------------------------------------------

Algo CudaComm::choose(Collective c, size_t bytes) const {
  if (bytes <= opts_.direct_max_bytes && algo_supports(Algo::Direct, c)) return Algo::Direct;
  return Algo::Ring;
}

const CudaComm::CachedPlan& CudaComm::plan_for(const CollectiveCall& call, Algo algo) {
  // The steps depend on the element sizes, not on the op.
  const PlanKey key{static_cast<int>(call.collective), call.count, static_cast<int>(algo),
                    static_cast<int>(call.dtype),      0,          call.root};
  auto it = plans_.find(key);
  if (it != plans_.end()) return it->second;
  if (plans_.size() >= 256) {
    // Queued launches may still read the old plans.
    WaitContext w = wait_context("plan cache", seq_);
    PYCOLL_CUDA_CHECK(cudaEventRecord(step_done_, stream_));
    wait_event(step_done_, w);
    for (auto& kv : plans_) cudaFree(kv.second.device_steps);
    plans_.clear();
  }
  const bool partials = carries_partials(call.collective);
  ScheduleParams p;
  p.rank = rank_;
  p.size = size_;
  p.count = call.count;
  p.root = call.root;
  p.piece = opts_.slot_bytes / (partials ? acc_size(call.dtype) : dtype_size(call.dtype));
  p.acc_bytes = acc_size(call.dtype);
  p.oneshot_max_bytes = opts_.oneshot_max_bytes;
  CachedPlan cp;
  cp.plan = build_plan(algo, call.collective, p);
  const size_t bytes = cp.plan.steps.size() * sizeof(DevStep);
  if (bytes != 0) {
    PYCOLL_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&cp.device_steps), bytes));
    PYCOLL_CUDA_CHECK(cudaMemcpy(cp.device_steps, cp.plan.steps.data(), bytes, cudaMemcpyDefault));
  }
  return plans_.emplace(key, std::move(cp)).first->second;
}

KernelArgs CudaComm::kernel_args(const CollectiveCall& call, const CachedPlan& cp) const {
  KernelArgs a{};
  a.steps = cp.device_steps;
  a.first_step = 0;
  a.end_step = static_cast<uint32_t>(cp.plan.steps.size());
  a.use_flags = mode_ == SyncMode::Kernel;
  a.rank = rank_;
  a.op = static_cast<int>(call.op);
  a.divisor = size_;
  a.input = static_cast<const uint8_t*>(call.in);
  a.output = static_cast<uint8_t*>(call.out);
  for (int r = 0; r < size_; ++r) a.segments[r] = segments_[r];
  a.layout = layout_;
  for (int r = 0; r < size_; ++r) {
    a.counters.sent[r] = counters_.sent[r];
    a.counters.received[r] = counters_.received[r];
    a.counters.bcast_received[r] = counters_.bcast_received[r];
  }
  a.counters.bcast_sent = counters_.bcast_sent;
  a.status = status_dev_;
  a.error_claim = error_claim_;
  const double t = timeout_s_.load();
  a.timeout_ns = static_cast<uint64_t>(t * 1e9);
  // Far more polls than fit in the timeout: the clock, not the count, normally ends a wait.
  a.max_spins = static_cast<uint64_t>(t * 1e9);
  return a;
}

void CudaComm::run_kernel_mode(const CollectiveCall& call, const CachedPlan& cp) {
  const KernelArgs a = kernel_args(call, cp);
  PYCOLL_CUDA_CHECK(launch_steps(call.dtype, a, stream_));
  const Plan& p = cp.plan;
  for (int r = 0; r < size_; ++r) {
    counters_.sent[r] += p.sent[r];
    counters_.received[r] += p.received[r];
    counters_.bcast_received[r] += p.bcast_received[r];
  }
  counters_.bcast_sent += p.bcast_sent;
}

std::shared_ptr<CudaWork> CudaComm::run(const CollectiveCall& call, cudaStream_t stream,
                                        bool async_op) {
  std::lock_guard<std::mutex> g(run_mu_);
  const char* name = collective_name(call.collective);
  check_usable(name);
  DeviceGuard dg(device_);
  check_device_status(name);
  const uint64_t seq = ++seq_;
  const int esize = static_cast<int>(dtype_size(call.dtype));
  size_t in_count = call.count;
  if (call.collective == Collective::ReduceScatter) in_count *= size_;
  const Algo algo = call.algo == Algo::Auto ? choose(call.collective, in_count * esize) : call.algo;
  if (opts_.debug)
    std::fprintf(stderr,
                 "pycollectives INFO rank %d/%d cuda:%d %s #%llu count=%zu %s %s root=%d algo=%s%s "
                 "sync=%s\n",
                 rank_, size_, device_, name, static_cast<unsigned long long>(seq), call.count,
                 dtype_name(call.dtype), redop_name(call.op), call.root, algo_name(algo),
                 call.algo == Algo::Auto ? " (auto)" : "",
                 mode_ == SyncMode::Kernel ? "kernel" : "host");
  FingerprintGuard guard(shm_, Fingerprint::of_call(seq, call.collective, algo, call.count,
                                                    call.dtype, call.op, call.root));
  WaitContext w = wait_context(name, seq);
  try {
    if (opts_.check_mismatch) {
      w.fingerprints = &guard;
      guard.publish();
      guard.finish(w);  // every peer runs this very call: only now may anything be queued
    }
    auto work = std::make_shared<CudaWork>(device_, seq);
    PYCOLL_CUDA_CHECK(cudaEventRecord(ready_, stream));
    PYCOLL_CUDA_CHECK(cudaStreamWaitEvent(stream_, ready_, 0));
    if (call.count != 0) {
      const CachedPlan& cp = plan_for(call, algo);
      if (mode_ == SyncMode::Kernel)
        run_kernel_mode(call, cp);
      else
        run_host_mode(call, cp, w);
    }
    PYCOLL_CUDA_CHECK(cudaEventRecord(work->event(), stream_));
    if (!async_op) PYCOLL_CUDA_CHECK(cudaStreamWaitEvent(stream, work->event(), 0));
    {
      std::lock_guard<std::mutex> w(watch_mu_);
      last_work_ = work;
    }
    return work;
  } catch (const CollectiveError& e) {
    abort(e.what());  // peers' counters no longer match ours
    throw;
  }
}

}  // namespace cuda
}  // namespace pycoll
