#include "cuda/registry.h"

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <mutex>
#include <utility>
#include <vector>

#include "common/errors.h"
#include "cuda/cuda_check.h"

namespace pycoll {
namespace cuda {

namespace {

// cuMemGetAddressRange (driver API, driver_entry). CUresult and CUdeviceptr spelled as their
// ABI.
using GetAddressRange = int (*)(unsigned long long* base, size_t* size, unsigned long long ptr);

GetAddressRange address_range_fn() {
  static GetAddressRange fn =
      reinterpret_cast<GetAddressRange>(driver_entry("cuMemGetAddressRange"));
  return fn;
}

// cuPointerGetAttributes, its attribute enum spelled as int.
using GetAttributes = int (*)(unsigned count, int* attributes, void** data, unsigned long long ptr);

GetAttributes attributes_fn() {
  static GetAttributes fn = reinterpret_cast<GetAttributes>(driver_entry("cuPointerGetAttributes"));
  return fn;
}

}  // namespace

CudaAllocation::CudaAllocation(int device, size_t bytes) : device_(device), bytes_(bytes) {
  DeviceGuard dg(device);
  PYCOLL_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&data_), std::max<size_t>(bytes, 1)));
}

namespace {

struct Deferred {
  std::mutex mu;
  std::vector<std::pair<int, void*>> frees;              // (device, pointer; host: -1)
  std::vector<std::pair<int, void*>> closes;             // (device, IPC-mapped pointer)
  std::vector<std::pair<const void*, QuietHook>> hooks;  // live communicators
};

Deferred& deferred() {
  static Deferred* d = new Deferred;  // never destroyed: frees may come at exit
  return *d;
}

bool all_quiet(Deferred& d) {
  for (const auto& [comm, quiet] : d.hooks)
    if (!quiet(comm)) return false;
  return true;
}

void free_on(int device, void* p) {
  if (device < 0) {
    cudaFreeHost(p);
    return;
  }
  int previous = -1;
  if (cudaGetDevice(&previous) != cudaSuccess) previous = -1;
  cudaSetDevice(device);
  cudaFree(p);
  if (previous >= 0 && previous != device) cudaSetDevice(previous);
}

// Frees what waits where every communicator is quiet (d.mu held); returns how many.
size_t free_if_quiet(Deferred& d) {
  if ((d.frees.empty() && d.closes.empty()) || !all_quiet(d)) return 0;
  for (const auto& [dev, q] : d.frees) free_on(dev, q);
  for (const auto& [dev, q] : d.closes) {
    DeviceGuard dg(dev);
    cudaIpcCloseMemHandle(q);
  }
  const size_t n = d.frees.size() + d.closes.size();
  d.frees.clear();
  d.closes.clear();
  return n;
}

}  // namespace

void add_quiet_hook(const void* comm, QuietHook hook) {
  Deferred& d = deferred();
  std::lock_guard<std::mutex> g(d.mu);
  d.hooks.emplace_back(comm, hook);
}

void remove_quiet_hook(const void* comm) {
  Deferred& d = deferred();
  std::lock_guard<std::mutex> g(d.mu);
  d.hooks.erase(std::remove_if(d.hooks.begin(), d.hooks.end(),
                               [&](const auto& h) { return h.first == comm; }),
                d.hooks.end());
}

void defer_free(int device, void* p) {
  Deferred& d = deferred();
  std::lock_guard<std::mutex> g(d.mu);
  d.frees.emplace_back(device, p);
  free_if_quiet(d);
}

void defer_free_host(void* p) { defer_free(-1, p); }
void defer_close_ipc(int device, void* p) {
  // Only queued: a mapping goes in the middle of a call (a newer allocation of its rank came),
  // whose communicator's quiet hook must not be asked from within it; the next call's start or
  // a close runs it (free_deferred).
  Deferred& d = deferred();
  std::lock_guard<std::mutex> g(d.mu);
  d.closes.emplace_back(device, p);
}

size_t free_deferred() {
  Deferred& d = deferred();
  std::lock_guard<std::mutex> g(d.mu);
  return free_if_quiet(d);
}

size_t frees_deferred() {
  Deferred& d = deferred();
  std::lock_guard<std::mutex> g(d.mu);
  return d.frees.size() + d.closes.size();
}

CudaAllocation::~CudaAllocation() {
  if (data_ != nullptr) defer_free(device_, data_);
}

std::shared_ptr<CudaAllocation> IpcRegistry::alloc(size_t bytes) {
  auto a = std::make_shared<CudaAllocation>(device_, bytes);
  std::lock_guard<std::mutex> g(mu_);
  add_live(allocs_, a);
  return a;
}

RegisterHandle IpcRegistry::handle(const void* p, size_t bytes) {
  const GetAddressRange range = address_range_fn();
  if (range == nullptr)
    throw CollectiveError("register: the CUDA driver has no cuMemGetAddressRange");
  DeviceGuard dg(device_);
  unsigned long long base = 0;
  size_t size = 0;
  if (range(&base, &size, reinterpret_cast<uintptr_t>(p)) != 0)
    throw InvalidArgument("register: the array is not device memory of this process");
  const uintptr_t at = reinterpret_cast<uintptr_t>(p);
  if (at + bytes > base + size) throw InvalidArgument("register: the range leaves its allocation");
  cudaIpcMemHandle_t h;
  PYCOLL_CUDA_CHECK(cudaIpcGetMemHandle(&h, reinterpret_cast<void*>(base)));
  const std::string bytes_of(reinterpret_cast<const char*>(&h), sizeof(h));
  std::lock_guard<std::mutex> g(mu_);
  RegisterHandle out;
  out.key = base;
  auto it = sent_.find(base);
  out.handle = it != sent_.end() && it->second == bytes_of ? std::string() : bytes_of;
  sent_[base] = bytes_of;
  out.alloc_bytes = size;
  out.offset = at - base;
  out.bytes = bytes;
  return out;
}

uint64_t IpcRegistry::add(const void* p, size_t bytes, const std::vector<RegisterHandle>& all) {
  DeviceGuard dg(device_);
  std::lock_guard<std::mutex> g(mu_);
  const uint8_t* ptr = static_cast<const uint8_t*>(p);
  std::vector<uint8_t*> at;
  std::vector<size_t> extent;
  ranges_of(
      p, all, rank_, size_,
      [&](int q, const RegisterHandle& h) {
        const auto key = std::make_pair(q, h.key);
        if (!h.handle.empty()) {
          if (h.handle.size() != sizeof(cudaIpcMemHandle_t))
            throw InvalidArgument(str_cat("register: rank ", q, "'s IPC handle is malformed"));
          const auto which = std::make_pair(q, h.handle);
          auto it = opened_.find(which);
          if (it == opened_.end()) {
            cudaIpcMemHandle_t handle;
            std::copy(h.handle.begin(), h.handle.end(), reinterpret_cast<char*>(&handle));
            void* mapped = nullptr;
            PYCOLL_CUDA_CHECK(
                cudaIpcOpenMemHandle(&mapped, handle, cudaIpcMemLazyEnablePeerAccess));
            it = opened_.emplace(which, static_cast<uint8_t*>(mapped)).first;
          }
          by_key_[key] = it->second;
        }
        auto k = by_key_.find(key);
        if (k == by_key_.end())
          throw CollectiveError(str_cat("register: rank ", q, "'s allocation ", h.key,
                                        " was sent before but is not open here"));
        return k->second;
      },
      at, extent);
  std::shared_ptr<const void> alive = holding(allocs_, ptr, bytes);
  const bool ours = alive != nullptr;
  if (!ours) alive = std::make_shared<int>(0);  // memory not ours: kept until release()
  const uint64_t id = table_.add(p, bytes, std::move(at), std::move(extent), alive);
  if (!ours) external_[id] = std::move(alive);
  return id;
}

void IpcRegistry::release(uint64_t id) {
  std::lock_guard<std::mutex> g(mu_);
  external_.erase(id);
  table_.drop(id);
}

BufferRecord IpcRegistry::buffer_of(const void* p, size_t bytes, const SentAllocations& sent) {
  const GetAttributes attributes = attributes_fn();
  if (attributes == nullptr || p == nullptr) return BufferRecord{};
  // One driver call: the allocation's id (never reused in the process), its range, and
  // whether cudaIpcGetMemHandle can export it (not memory of the virtual memory management
  // API, as torch's expandable segments are).
  unsigned long long id = 0, start = 0;
  size_t range_bytes = 0;
  int ipc_capable = 0, ordinal = -1;
  int which[] = {CU_POINTER_ATTRIBUTE_BUFFER_ID, CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
                 CU_POINTER_ATTRIBUTE_RANGE_SIZE, CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE,
                 CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL};
  void* data[] = {&id, &start, &range_bytes, &ipc_capable, &ordinal};
  if (attributes(5, which, data, reinterpret_cast<uintptr_t>(p)) != 0 || ipc_capable == 0 ||
      ordinal != device_)
    return BufferRecord{};
  return buffer_record(p, bytes, id, start, range_bytes, sent, [&] {
    DeviceGuard dg(device_);
    cudaIpcMemHandle_t h;
    if (cudaIpcGetMemHandle(&h, reinterpret_cast<void*>(start)) != cudaSuccess) {
      cudaGetLastError();  // not sticky: clear it
      return std::string();
    }
    return std::string(reinterpret_cast<const char*>(&h), sizeof(h));
  });
}

uint8_t* IpcRegistry::map_peer(int q, const BufferRecord& r) {
  std::lock_guard<std::mutex> g(mu_);
  return first_use_.map(q, r, [&](const std::string& handle, uint64_t) {
    if (handle.size() != sizeof(cudaIpcMemHandle_t))
      throw CollectiveError(str_cat("rank ", q, "'s IPC handle is malformed"));
    cudaIpcMemHandle_t h;
    std::copy(handle.begin(), handle.end(), reinterpret_cast<char*>(&h));
    DeviceGuard dg(device_);
    void* mapped = nullptr;
    PYCOLL_CUDA_CHECK(cudaIpcOpenMemHandle(&mapped, h, cudaIpcMemLazyEnablePeerAccess));
    return std::make_pair(IpcMapping(device_, mapped), static_cast<uint8_t*>(mapped));
  });
}

IpcMapping::~IpcMapping() {
  if (p_ != nullptr) defer_close_ipc(device_, p_);
}

void IpcRegistry::close() {
  std::lock_guard<std::mutex> g(mu_);
  first_use_.clear();
  if (opened_.empty() && external_.empty()) return;
  int previous = -1;
  if (cudaGetDevice(&previous) != cudaSuccess) previous = -1;
  cudaSetDevice(device_);
  for (auto& kv : opened_) cudaIpcCloseMemHandle(kv.second);
  opened_.clear();
  by_key_.clear();
  for (auto& kv : external_) table_.drop(kv.first);
  external_.clear();
  if (previous >= 0 && previous != device_) cudaSetDevice(previous);
}

}  // namespace cuda
}  // namespace pycoll
