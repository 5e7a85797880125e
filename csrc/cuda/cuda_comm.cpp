// CudaComm's lifetime: the device segment and host-mapped status made, peers' segments mapped,
// queued work waited for and everything released.
#include "cuda/cuda_comm.h"

#include <chrono>
#include <cstring>

#include "common/errors.h"
#include "cuda/cuda_check.h"

namespace pycoll {
namespace cuda {

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
    : DeviceComm(rank, size, (check_options(size, opts), opts.nslots), orchestration_of(opts),
                 opts.timeout_s, CudaPlanMemory{device}),
      device_(device),
      opts_(opts),
      registry_(rank, size, device),
      events_(std::make_shared<EventPool>(device)) {
  layout_ = make_layout(size, opts.nslots, opts.nblocks, opts.slot_bytes, opts.ll_max_bytes);
  layout_.push = opts.push;
  try {
    DeviceGuard g(device_);
    PYCOLL_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&segment_), layout_.total_bytes()));
    PYCOLL_CUDA_CHECK(cudaMemset(segment_, 0, layout_.flags_bytes));
    // The LL area too: a word never written must hold no message's flag (cudaMalloc may hand
    // back an earlier communicator's memory, LL words and all).
    PYCOLL_CUDA_CHECK(
        cudaMemset(segment_ + layout_.ll_offset, 0, layout_.total_bytes() - layout_.ll_offset));
    PYCOLL_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&status_host_), sizeof(DeviceStatus),
                                    cudaHostAllocMapped));
    std::memset(status_host_, 0, sizeof(DeviceStatus));
    // Works of blocking calls read its done word; they may outlive the communicator.
    status_keep_ = std::shared_ptr<const DeviceStatus>(
        status_host_, [](const DeviceStatus* p) { cudaFreeHost(const_cast<DeviceStatus*>(p)); });
    PYCOLL_CUDA_CHECK(
        cudaHostGetDevicePointer(reinterpret_cast<void**>(&status_dev_), status_host_, 0));
    PYCOLL_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&error_claim_), sizeof(uint32_t)));
    PYCOLL_CUDA_CHECK(cudaMemset(error_claim_, 0, sizeof(uint32_t)));
    PYCOLL_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&finished_), sizeof(uint32_t)));
    PYCOLL_CUDA_CHECK(cudaMemset(finished_, 0, sizeof(uint32_t)));
    PYCOLL_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    PYCOLL_CUDA_CHECK(cudaStreamCreateWithFlags(&side_, cudaStreamNonBlocking));
    PYCOLL_CUDA_CHECK(cudaEventCreateWithFlags(&ready_, cudaEventDisableTiming));
    PYCOLL_CUDA_CHECK(cudaEventCreateWithFlags(&step_done_, cudaEventDisableTiming));
    PYCOLL_CUDA_CHECK(cudaEventCreateWithFlags(&launch_end_, cudaEventDisableTiming));
    PYCOLL_CUDA_CHECK(cudaEventCreateWithFlags(&replay_end_, cudaEventDisableTiming));
    if (opts_.stepped_events && opts_.fence_counters) {
      value_ops_ = stream_value_ops(device_);
      if (!value_ops_)
        throw CollectiveError(str_cat("device ", device_,
                                      " has no 64-bit stream memory operations for stepped mode's "
                                      "fence counters"));
    }
    if (uses_events(opts_))
      for (cudaEvent_t& e : fence_events_)
        PYCOLL_CUDA_CHECK(
            cudaEventCreateWithFlags(&e, cudaEventDisableTiming | cudaEventInterprocess));
    PYCOLL_CUDA_CHECK(cudaDeviceSynchronize());  // the zeroed flags are in place before export
  } catch (...) {
    release();
    throw;
  }
  add_quiet_hook(this, [](const void* c) {
    return const_cast<CudaComm*>(static_cast<const CudaComm*>(c))->quiet();
  });
}

bool CudaComm::quiet() {
  // A call being launched now (it holds run_mu_) is not quiet; nor is one on its way there
  // after this answer, which frees nothing: the frees run under the registry's lock, taken
  // before run() takes run_mu_ (free_deferred).
  std::unique_lock<std::mutex> g(run_mu_, std::try_to_lock);
  if (!g.owns_lock()) return false;
  if (stream_ == nullptr) return true;
  const uint64_t last = last_launch_.load();
  if (last != 0 && status_host_ != nullptr &&
      __atomic_load_n(&status_host_->done, __ATOMIC_ACQUIRE) < last)
    return false;
  DeviceGuard dg(device_);
  const cudaError_t e = cudaStreamQuery(stream_);
  if (e == cudaSuccess) return true;
  cudaGetLastError();  // not ready (or failed: the frees wait for the close)
  return false;
}

CudaComm::~CudaComm() {
  try {
    close();
  } catch (...) {
    release();
  }
  remove_quiet_hook(this);
  free_deferred();  // what waited for this communicator's collectives
}

namespace {

size_t handle_bytes(const CudaCommOptions& o) {
  return sizeof(cudaIpcMemHandle_t) + (uses_events(o) ? 2 * sizeof(cudaIpcEventHandle_t) : 0);
}

}  // namespace

StreamValueOps stream_value_ops(int device) {
  StreamValueOps ops;
  void* get_device = driver_entry("cuDeviceGet");
  void* get_attribute = driver_entry("cuDeviceGetAttribute");
  void* write = driver_entry("cuStreamWriteValue64");
  void* wait = driver_entry("cuStreamWaitValue64");
  if (get_device == nullptr || get_attribute == nullptr || write == nullptr || wait == nullptr)
    return ops;
  int can = 0;
  using DeviceGet = CUresult (*)(CUdevice*, int);
  using GetAttribute = CUresult (*)(int*, CUdevice_attribute, CUdevice);
  CUdevice dev = 0;
  if (reinterpret_cast<DeviceGet>(get_device)(&dev, device) != CUDA_SUCCESS ||
      reinterpret_cast<GetAttribute>(get_attribute)(
          &can, CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS, dev) != CUDA_SUCCESS ||
      can == 0)
    return ops;
  ops.write = reinterpret_cast<StreamValueOps::Fn>(write);
  ops.wait = reinterpret_cast<StreamValueOps::Fn>(wait);
  return ops;
}

std::string CudaComm::ipc_handle() const {
  cudaIpcMemHandle_t h;
  PYCOLL_CUDA_CHECK(cudaIpcGetMemHandle(&h, segment_));
  std::string s(reinterpret_cast<const char*>(&h), sizeof(h));
  if (uses_events(opts_))
    for (cudaEvent_t e : fence_events_) {
      cudaIpcEventHandle_t eh;
      PYCOLL_CUDA_CHECK(cudaIpcGetEventHandle(&eh, e));
      s.append(reinterpret_cast<const char*>(&eh), sizeof(eh));
    }
  return s;
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
  kernel_ = mode == SyncMode::Kernel;
  segments_.assign(size_, nullptr);
  for (int r = 0; r < size_; ++r) {
    if (r == rank_) {
      segments_[r] = segment_;
      continue;
    }
    if (handles[r].size() != handle_bytes(opts_))
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
  // Stepped mode's fences wait on the peers' events (event_fence).
  peer_fence_events_.assign(size_, {nullptr, nullptr});
  for (int r = 0; !kernel_ && uses_events(opts_) && r < size_; ++r) {
    if (r == rank_) continue;
    for (int k = 0; k < 2; ++k) {
      cudaIpcEventHandle_t eh;
      std::memcpy(&eh, handles[r].data() + sizeof(cudaIpcMemHandle_t) + k * sizeof(eh), sizeof(eh));
      const cudaError_t e = cudaIpcOpenEventHandle(&peer_fence_events_[r][k], eh);
      if (e != cudaSuccess)
        throw CollectiveError(str_cat("cannot open the interprocess events of rank ", r, ": ",
                                      cudaGetErrorString(e),
                                      " (PYCOLL_CUDA_STEPPED_EVENTS=0 fences without them)"));
    }
  }
  shm_.attach(shm_names);
  if (kernel_) watchdog_ = std::thread([this] { watchdog_loop(); });
}

void CudaComm::close() {
  if (closed_) return;
  remove_quiet_hook(this);
  stopping_.store(true);
  if (watchdog_.joinable()) watchdog_.join();
  {
    std::lock_guard<std::mutex> g(run_mu_);
    closed_ = true;
    if (stream_ != nullptr) {
      DeviceGuard dg(device_);
      WaitContext w = wait_context("close", seq_);
      try {
        wait_queued(w);
      } catch (const CollectiveError&) {
        // Stop the device waits, then give the launches a moment to notice.
        abort("communicator closed with collectives in flight");
        w.set_deadline(Clock::now() + std::chrono::seconds(10));
        try {
          wait_queued(w);
        } catch (const CollectiveError&) {
        }
      }
    }
    {
      std::lock_guard<std::mutex> w(watch_mu_);
      last_work_.reset();
    }
    release();
  }
  free_deferred();  // what waited for this communicator's collectives
}

void CudaComm::release() {
  int previous = -1;
  if (cudaGetDevice(&previous) != cudaSuccess) previous = -1;
  cudaSetDevice(device_);
  registry_.close();  // peers' registered buffers
  for (int r = 0; r < static_cast<int>(segments_.size()); ++r)
    if (r != rank_ && segments_[r] != nullptr) cudaIpcCloseMemHandle(segments_[r]);
  segments_.clear();
  plans_.entries().clear();
  plans_.pinned_entries().clear();  // graphs' plans too
  arena_.release();
  if (segment_ != nullptr) cudaFree(segment_);
  segment_ = nullptr;
  if (error_claim_ != nullptr) cudaFree(error_claim_);
  error_claim_ = nullptr;
  if (finished_ != nullptr) cudaFree(finished_);
  finished_ = nullptr;
  if (status_keep_ == nullptr && status_host_ != nullptr) cudaFreeHost(status_host_);
  status_keep_.reset();  // freed once no work reads it
  status_host_ = nullptr;
  status_dev_ = nullptr;
  if (ready_ != nullptr) cudaEventDestroy(ready_);
  if (step_done_ != nullptr) cudaEventDestroy(step_done_);
  if (launch_end_ != nullptr) cudaEventDestroy(launch_end_);
  if (replay_end_ != nullptr) cudaEventDestroy(replay_end_);
  for (auto& pair : peer_fence_events_)
    for (cudaEvent_t e : pair)
      if (e != nullptr) cudaEventDestroy(e);
  peer_fence_events_.clear();
  for (cudaEvent_t& e : fence_events_) {
    if (e != nullptr) cudaEventDestroy(e);
    e = nullptr;
  }
  if (stream_ != nullptr) cudaStreamDestroy(stream_);
  if (side_ != nullptr) cudaStreamDestroy(side_);
  ready_ = step_done_ = launch_end_ = replay_end_ = nullptr;
  stream_ = side_ = nullptr;
  if (previous >= 0 && previous != device_) cudaSetDevice(previous);
}

}  // namespace cuda
}  // namespace pycoll
