// The CUDA communicator: collectives on device memory over CUDA IPC.
//
// Each rank owns one device segment (flags, then staging slots; see SegmentLayout) and exports
// it with an IPC handle; every rank maps every peer's segment. A rank writes only its own
// segment: a message goes into the sender's slot, the receiver reads it from there. Channels
// and their posted/consumed counters follow algo/messages.h, one set of flags per block.
//
// Two ways to order the steps across processes:
//   Kernel: one launch runs the whole collective; device threads wait on the peers' device
//           flags (bounded, abortable). Needs every rank's kernel to run at the same time:
//           distinct GPUs, or one GPU shared under MPS.
//   Host:   one short launch per step; the host waits for the peers between launches, on
//           counters in POSIX shared memory. No kernel ever waits for another process, so
//           ranks that time-slice one GPU cannot deadlock.
// Every call is compared with every peer's before anything moves (runtime/fingerprint.h): in
// kernel mode by the launch itself, on the device (step_kernel.h, match_calls); in stepped mode,
// for all-to-all and in captures, on the host flags (device/stepped.h, meets_on_host). Ranks that
// disagree get CollectiveMismatch, and no kernel runs with counters its peers do not share.
//
// The decision tree from a call to its launches, fences and waits is device/orchestration.h's,
// which the emulated device runs too; this class gives it CUDA's primitives. Files:
// cuda_comm.cpp (lifetime), collectives.cpp (entry points and primitives), failures.cpp
// (bounded waits, the watchdog, the failure word), work.cpp (completions).
// A blocking collective in kernel mode is one launch on the caller's stream, no event: the
// last block to end writes the call's number into the host-mapped status (DeviceStatus::done),
// which the host reads instead of querying an event; a launch on another stream than the call
// before is queued behind an event recorded after that call's launch, so a rank's collectives
// still run one at a time, in issue order, and never hold SMs while waiting for each other. Other
// calls (async, captured, stepped mode, the barrier) are queued on the communicator's own stream,
// behind the caller's, which then waits for them (or, for async work, when asked).
#pragma once

#include <cuda.h>  // the types of the driver's stream memory operations (no link to libcuda)
#include <cuda_runtime_api.h>

#include <array>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "algo/call.h"
#include "algo/schedule.h"
#include "common/dtypes.h"
#include "cuda/plan_arena.h"
#include "cuda/registry.h"
#include "device/kernel_args.h"
#include "device/orchestration.h"
#include "device/plan.h"
#include "device/stepped.h"
#include "host/executor.h"
#include "host/shm_transport.h"
#include "runtime/fingerprint.h"
#include "runtime/wait.h"

namespace pycoll {
namespace cuda {

enum class SyncMode { Kernel, Stepped };

struct CudaCommOptions {
  size_t slot_bytes = size_t{1} << 20;
  int nslots = 4;
  int nblocks = 16;  // channels: blocks per launch (a message uses as few as hold it)
  double timeout_s = 300.0;
  size_t oneshot_max_bytes = 64 * 1024;  // direct all-reduce: one-shot up to here
  size_t direct_max_bytes = 256 * 1024;  // automatic choice: direct up to here, ring above
  // Kernel mode: messages of up to this many bytes (in their wire type) travel in the LL format,
  // data and flag in one store, where a block's slice fits (device/plan.h, ll_message); 0: none.
  // Stepped mode never uses it: the host has waited for every message before the launch that
  // reads it, so there is no wait for the format to save.
  size_t ll_max_bytes = 32 * 1024;
  bool debug = false;
  bool check_mismatch = true;  // every call's fingerprint checked before anything is queued
  // Stepped mode: all-reduces, reduces, broadcasts, all-gathers, reduce-scatters, gathers, scatters
  // and all-to-alls through scratch (run_scratch, stepped_scratch_eligible), two fences per
  // chunk, not a host round trip per step.
  bool stepped_twoshot = true;
  // Registration on first use (device/first_use.h): calls of at least this many bytes whose
  // buffers no one registered trade where they lie and run over them zero-copy where every
  // rank's can be shared; 0: off (off until measured on a GPU).
  size_t register_on_use_bytes = 0;
  // Messages between two ranks travel by writes into the receiver's segment, each rank polling
  // its own memory (SegmentLayout::push), instead of the receiver reading the sender's; the
  // same on every rank. Off until measured on a GPU (a remote read costs most over PCIe).
  bool push = false;
  // Stepped mode: an all-gather or broadcast over registered buffers (or registered on first use)
  // by cudaMemcpyAsync copies between its two fences (copy engines, no SM) instead of a
  // launch. Off until measured on a GPU.
  bool copy_engines = false;
  // Ring all-reduces: two messages in flight per channel (plan_params; off until measured).
  bool lookahead = false;
  // Stepped mode's registered calls and scratch fence on interprocess events (event_fence): the
  // host queues a whole call without waiting for the GPU. Off: the host waits for the GPU and
  // meets the peers at every fence.
  bool stepped_events = true;
  // ... on fence counters (counter_fence: cuStreamWriteValue64 / cuStreamWaitValue64) instead
  // of interprocess events; set where every rank's GPU offers 64-bit stream memory operations
  // (stream_value_ops), the same on every rank.
  bool fence_counters = false;
  size_t flight_entries = 1024;  // the flight recorder's ring (0: none)
  // Every reduction runs a rank-order schedule (rank_ordered, algo/schedule.h).
  bool reproducible = false;
  Algo forced = Algo::Auto;  // PYCOLL_ALGO (DeviceComm::choose_fastest)
};
// Stepped mode's fences on interprocess events: stepped_events without fence_counters.
inline bool uses_events(const CudaCommOptions& o) { return o.stepped_events && !o.fence_counters; }

// The driver's 64-bit stream memory operations (cuStreamWriteValue64, cuStreamWaitValue64),
// reached through the runtime (no link to libcuda). Null where `device` lacks them or the
// driver does not offer them.
struct StreamValueOps {
  using Fn = CUresult (*)(CUstream, CUdeviceptr, cuuint64_t, unsigned int);
  Fn write = nullptr;
  Fn wait = nullptr;
  explicit operator bool() const { return write != nullptr && wait != nullptr; }
};
StreamValueOps stream_value_ops(int device);

// Events for CudaWork, reused: creating one per collective costs a driver call each time.
class EventPool {
 public:
  explicit EventPool(int device) : device_(device) {}
  ~EventPool();
  cudaEvent_t take();
  void give(cudaEvent_t e);

 private:
  int device_;
  std::mutex mu_;
  std::vector<cudaEvent_t> free_;
};

// Completion of one queued collective: an event on the communicator's stream, or, for a
// blocking call launched on the caller's stream, the device's done word (DeviceStatus::done).
class CudaWork {
 public:
  // `captured`: queued into a CUDA graph being captured, not run: it completes each time the
  // graph is launched, so there is nothing to query or wait for here.
  CudaWork(std::shared_ptr<EventPool> pool, int device, uint64_t seq, bool captured = false);
  // Launched on `stream` with no event: complete once `status`'s done word reaches `seq`.
  CudaWork(std::shared_ptr<const DeviceStatus> status, std::shared_ptr<EventPool> pool, int device,
           uint64_t seq, cudaStream_t stream);
  ~CudaWork();
  CudaWork(const CudaWork&) = delete;
  CudaWork& operator=(const CudaWork&) = delete;
  cudaEvent_t event() const { return event_; }
  uint64_t seq() const { return seq_; }
  // A call with no event whose launch was skipped (runs_anything: nothing to run): complete
  // once `previous`, the launch before it on the device (0: none), has reported its end.
  void not_launched(uint64_t previous) { done_at_ = previous; }
  bool captured() const { return captured_; }
  bool is_completed() const;
  // Makes work queued later on `stream` wait for this collective.
  void wait_on(cudaStream_t stream) const;

 private:
  std::shared_ptr<EventPool> pool_;
  int device_;
  cudaEvent_t event_ = nullptr;
  uint64_t seq_;
  uint64_t done_at_;  // with no event: the done word's value that completes it
  bool captured_;
  std::shared_ptr<const DeviceStatus> status_;  // with no event: its done word
  cudaStream_t stream_ = nullptr;               // ... and the stream it was launched on
};

class CudaComm : public DeviceComm<CudaComm, cudaStream_t, CudaPlanMemory> {
 public:
  CudaComm(int rank, int size, int device, const CudaCommOptions& opts);
  ~CudaComm();
  CudaComm(const CudaComm&) = delete;
  CudaComm& operator=(const CudaComm&) = delete;

  int device() const { return device_; }
  SyncMode mode() const { return kernel_ ? SyncMode::Kernel : SyncMode::Stepped; }
  const CudaCommOptions& options() const { return opts_; }

  // What the rendezvous exchanges: the segment's IPC handle (and stepped mode's fence events':
  // stepped_events), the host flags' name, the GPU.
  std::string ipc_handle() const;
  std::string device_uuid() const;
  const std::string& shm_name() const { return shm_.name(); }
  // Maps every peer's segment and host flags (ours included in the lists, ignored).
  void attach(const std::vector<std::string>& handles, const std::vector<std::string>& shm_names,
              SyncMode mode);
  void unlink() { shm_.unlink(); }

  // Queues `call` behind `stream`'s work; `stream` waits for it unless `async_op`
  // (DeviceComm::issue). On a stream being captured into a CUDA graph, the launch is captured
  // instead (kernel mode only, and only for a call shape run once before), and every launch of
  // the graph runs the collective again, the flags advancing on the device.
  std::shared_ptr<CudaWork> run(const CollectiveCall& call, cudaStream_t stream, bool async_op);
  // Registered buffers (cuda/registry.h). A call whose buffers are registered as
  // registered_call needs them, with the algorithm automatic or direct, runs over them
  // (device/twoshot_kernel.h, run_registered; an all-reduce: the two-shot; in stepped mode
  // between two fences); the fingerprint says so, and where they lie.
  IpcRegistry& registry() { return registry_; }
  // Waits for this rank's queued collectives, then for every rank to arrive.
  void barrier();
  // Waits (bounded) for queued work and releases every resource; later calls fail.
  void close();

 private:
  friend class DeviceComm<CudaComm, cudaStream_t, CudaPlanMemory>;

  // The device's primitives (device/orchestration.h).
  cudaStream_t own_stream() const { return stream_; }
  void queue_behind(cudaStream_t caller);
  void launch(const CollectiveCall& call, const KernelArgs& a, cudaStream_t stream,
              const WaitContext& w);
  void copy(void* dst, const void* src, size_t bytes);
  void write_counter(uint64_t epoch, const WaitContext& w);
  void wait_counter(int q, uint64_t epoch, const WaitContext& w);
  void record_fence_event(int k);
  void wait_fence_event(int q, int k, const WaitContext& w);
  void stream_waits_launch(cudaStream_t stream, const WaitContext& w);
  void launch_ended(cudaStream_t stream, uint64_t seq);
  void replay_waits_launch(cudaStream_t stream, const WaitContext& w);
  void replay_ended(cudaStream_t stream);
  void stream_waits_replays(cudaStream_t stream);
  // Waits (bounded) until what is queued on our stream now has run.
  void wait_stream(const WaitContext& w);
  // Waits (bounded) for everything this rank has queued: our stream, and the launches on
  // callers' streams (the done word).
  void wait_queued(const WaitContext& w);
  // The barrier's launch on our stream, looked after by the watchdog as a collective's.
  void wait_launch(uint64_t seq, const WaitContext& w);
  const DeviceStatus* host_status() const { return status_host_; }
  LaunchSetup launch_setup(bool use_flags) const;
  uint32_t* finished_word() const { return finished_; }
  // `call` over registered buffers where they are (registered_call; off otherwise), which
  // run_registered runs (the two-shot for an all-reduce).
  RegisteredCall registered_of(const CollectiveCall& call, Algo algo) const;
  // Registration on first use (device/first_use.h, the registry's).
  BufferRecord buffer_of(const void* p, size_t bytes, const SentAllocations& sent) {
    return registry_.buffer_of(p, bytes, sent);
  }
  uint8_t* map_peer(int q, const BufferRecord& r) { return registry_.map_peer(q, r); }
  void shared_everywhere(uint64_t) {}  // a handle needs no removing
  const PeerMappings<IpcMapping>& peer_mappings() const { return registry_.peer_mappings(); }
  void stop_device();
  // A mismatch found on the host: our device segment's failure word stops peers' device waits.
  void stop_peers();
  bool closed() const { return closed_; }
  void trace(const ResolvedCall& rc, uint64_t seq) const;
  void drill(const WaitContext&, FaultPoint, int) {}
  void drill_launch(KernelArgs&, const WaitContext&) {}

  void wait_device(const std::function<bool()>& reached, const WaitContext& w);
  void wait_event(cudaEvent_t ev, const WaitContext& w);
  // Work running now, queued by this rank: the watchdog stops its device waits if a peer dies.
  void watch(std::shared_ptr<CudaWork> work);
  // Nothing of ours in flight on the device: every eager launch has reported its end and our
  // stream is idle (registry.h, the quiet hook of deferred frees). Any thread.
  bool quiet();
  void watchdog_loop();
  void release();

  int device_;
  CudaCommOptions opts_;
  uint8_t* segment_ = nullptr;           // ours, cudaMalloc
  DeviceStatus* status_host_ = nullptr;  // host-mapped
  DeviceStatus* status_dev_ = nullptr;
  std::shared_ptr<const DeviceStatus> status_keep_;  // owns status_host_
  uint32_t* error_claim_ = nullptr;                  // device memory, see DeviceStatus
  uint32_t* finished_ = nullptr;                     // device memory, see KernelArgs::finished
  // Recorded on the stream of every eager kernel-mode launch right after it, which a launch on
  // another stream waits for (launch_ended, stream_waits_launch).
  cudaEvent_t launch_end_ = nullptr;
  // Recorded by every replay of a captured launch after it (an external record node), which
  // every eager launch waits for (replay_ended, stream_waits_replays).
  cudaEvent_t replay_end_ = nullptr;
  cudaStream_t stream_ = nullptr;
  cudaStream_t side_ = nullptr;  // writes the failure word while stream_ may be stuck
  cudaEvent_t ready_ = nullptr;  // the caller's stream, at the collective's issue
  cudaEvent_t step_done_ = nullptr;
  // stepped_events: ours (interprocess), and every peer's as opened here (ours: null).
  cudaEvent_t fence_events_[2] = {nullptr, nullptr};
  StreamValueOps value_ops_;  // fence_counters
  std::vector<std::array<cudaEvent_t, 2>> peer_fence_events_;
  IpcRegistry registry_;
  std::shared_ptr<EventPool> events_;

  // Kernel mode: while work is queued, a watchdog notices dead peers and stops the device.
  std::mutex watch_mu_;
  std::shared_ptr<CudaWork> last_work_;
  std::atomic<bool> stopping_{false};
  std::thread watchdog_;
  bool closed_ = false;
};

}  // namespace cuda
}  // namespace pycoll
