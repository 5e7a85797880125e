#include "cuda/registry.h"

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

}  // namespace

CudaAllocation::CudaAllocation(int device, size_t bytes) : device_(device), bytes_(bytes) {
  DeviceGuard dg(device);
  PYCOLL_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&data_), std::max<size_t>(bytes, 1)));
}

namespace {

struct Deferred {
  std::mutex mu;
  std::vector<std::pair<int, void*>> frees;              // (device, pointer; host: -1)
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
  if (d.frees.empty() || !all_quiet(d)) return 0;
  for (const auto& [dev, q] : d.frees) free_on(dev, q);
  const size_t n = d.frees.size();
  d.frees.clear();
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

size_t free_deferred() {
  Deferred& d = deferred();
  std::lock_guard<std::mutex> g(d.mu);
  return free_if_quiet(d);
}

size_t frees_deferred() {
  Deferred& d = deferred();
  std::lock_guard<std::mutex> g(d.mu);
  return d.frees.size();
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

void IpcRegistry::close() {
  std::lock_guard<std::mutex> g(mu_);
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
