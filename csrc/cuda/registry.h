// Registered (symmetric) buffers of the CUDA transport: device memory that every rank of the
// machine maps through CUDA IPC, so that the two-shot all-reduce (device/twoshot_kernel.h)
// reads every rank's input and writes every rank's output directly.
//
// CudaAllocation is what CudaComm.empty / zeros hand out: cudaMalloc'd memory, freed when the
// last array over it goes (its registrations lapse with it). Registering a range (collective:
// every rank registers its own, in the same order) finds the allocation that holds it
// (cuMemGetAddressRange), and sends the peers its IPC handle (cudaIpcGetMemHandle of the
// allocation's base) the first time, afterwards only its key (the base address) and the range's
// offset. The handle is read again at every registration, so an allocation freed and made
// again at the same address goes out anew. Each peer opens each handle once
// (cudaIpcOpenMemHandle) and keeps it open until the communicator closes
// (cudaIpcCloseMemHandle). A range of memory that is not ours (a cupy or torch array) stays
// registered until release() (Python calls it when the array's memory goes) or the close.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "device/first_use.h"
#include "runtime/registrations.h"

namespace pycoll {
namespace cuda {

// Frees put off (CudaAllocation's, when its last reference goes): cudaFree waits for every
// kernel of the process on the device, and a collective of ours may be waiting on the device
// for a peer that waits for this host, which would then never come. A free is made at once
// where every communicator of the process is quiet on its device (quiet_hook: no launch in
// flight, its stream idle), else put off until one is: at a call's start, a barrier's end, a
// close (free_deferred).
void defer_free(int device, void* p);
// ... of page-locked host memory (cudaFreeHost), put off alike.
void defer_free_host(void* p);
// ... of a peer's allocation mapped here (cudaIpcCloseMemHandle unmaps it), put off until the
// next free_deferred.
void defer_close_ipc(int device, void* p);
// Frees what was put off where the quiet hook says every communicator is quiet; returns how
// many it freed.
size_t free_deferred();
size_t frees_deferred();  // how many wait
// Registered by each CudaComm while it lives: whether it has nothing in flight on the device.
using QuietHook = bool (*)(const void* comm);
void add_quiet_hook(const void* comm, QuietHook hook);
void remove_quiet_hook(const void* comm);

class CudaAllocation {
 public:
  CudaAllocation(int device, size_t bytes);
  ~CudaAllocation();
  CudaAllocation(const CudaAllocation&) = delete;
  CudaAllocation& operator=(const CudaAllocation&) = delete;
  uint8_t* data() const { return data_; }
  size_t bytes() const { return bytes_; }
  int device() const { return device_; }

 private:
  int device_;
  size_t bytes_;
  uint8_t* data_ = nullptr;
};

// A peer's allocation mapped here (registration on first use), closed (put off, as a free) when
// this goes.
class IpcMapping {
 public:
  IpcMapping(int device, void* p) : device_(device), p_(p) {}
  IpcMapping(IpcMapping&& o) noexcept : device_(o.device_), p_(o.p_) { o.p_ = nullptr; }
  IpcMapping& operator=(IpcMapping&& o) noexcept {
    std::swap(device_, o.device_);
    std::swap(p_, o.p_);
    return *this;
  }
  ~IpcMapping();

 private:
  int device_;
  void* p_;
};

class IpcRegistry {
 public:
  IpcRegistry(int rank, int size, int device)
      : rank_(rank), size_(size), device_(device), table_(size) {}
  ~IpcRegistry() { close(); }
  IpcRegistry(const IpcRegistry&) = delete;
  IpcRegistry& operator=(const IpcRegistry&) = delete;

  std::shared_ptr<CudaAllocation> alloc(size_t bytes);
  // Our handle for [p, p + bytes) (device memory of this rank's device).
  RegisterHandle handle(const void* p, size_t bytes);
  // Records the registration with every rank's handle (ours included), opening the peers' new
  // handles; returns its number.
  uint64_t add(const void* p, size_t bytes, const std::vector<RegisterHandle>& all);
  // Ends a registration of memory that is not one of our allocations.
  void release(uint64_t id);
  Registered find(const void* p, size_t bytes) const { return table_.find(p, bytes); }
  size_t live() const { return table_.live(); }
  // Registration on first use (device/first_use.h): where [p, p + bytes) lies (the
  // allocation's buffer id as its key; key 0 where cudaIpcGetMemHandle cannot export it), and
  // rank q's allocation of a record, opened once and kept until a newer allocation of q
  // overlaps it, or the close.
  BufferRecord buffer_of(const void* p, size_t bytes, const SentAllocations& sent);
  uint8_t* map_peer(int q, const BufferRecord& r);
  const PeerMappings<IpcMapping>& peer_mappings() const { return first_use_; }
  // Closes every peer handle opened here; registrations end.
  void close();

 private:
  int rank_, size_, device_;
  std::map<uintptr_t, std::string> sent_;                   // our base -> the handle sent
  std::map<std::pair<int, std::string>, uint8_t*> opened_;  // (rank, handle) -> mapped base
  std::map<std::pair<int, uint64_t>, uint8_t*> by_key_;     // (rank, key) -> mapped base
  std::vector<std::weak_ptr<CudaAllocation>> allocs_;
  std::map<uint64_t, std::shared_ptr<const void>> external_;  // registrations kept for release
  Registrations table_;
  PeerMappings<IpcMapping> first_use_{size_};
  std::mutex mu_;
};

}  // namespace cuda
}  // namespace pycoll
