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
// kernel mode by the launch itself, on the device (step_kernel.h, check_call); in host mode, for
// all-to-all and in captures, on the host flags (device/host_steps.h, meets_on_host). Ranks that
// disagree get CollectiveMismatch, and no kernel runs with counters its peers do not share.
//
// Files: cuda_comm.cpp (lifetime), collectives.cpp (calls, launches, barrier), failures.cpp
// (bounded waits, device status, poisoning, the watchdog), work.cpp (completions).
// A blocking collective in kernel mode is one launch on the caller's stream, no event: the
// last block to end writes the call's number into the host-mapped status (DeviceStatus::done),
// which the host reads instead of querying an event; a launch on another stream than the call
// before is queued behind an event recorded after that call's launch, so a rank's collectives
// still run one at a time, in issue order, and never hold SMs while waiting for each other. Other
// calls (async, captured, host mode, the barrier) are queued on the communicator's own stream,
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
#include "cuda/registry.h"
#include "device/host_steps.h"
#include "device/kernel_args.h"
#include "device/plan.h"
#include "host/executor.h"
#include "host/shm_transport.h"
#include "runtime/fingerprint.h"
#include "runtime/wait.h"

namespace pycoll {
namespace cuda {

enum class SyncMode { Kernel, Host };

struct CudaCommOptions {
  size_t slot_bytes = size_t{1} << 20;
  int nslots = 4;
  int nblocks = 16;  // channels: blocks per launch (a message uses as few as hold it)
  double timeout_s = 300.0;
  size_t oneshot_max_bytes = 64 * 1024;  // direct all-reduce: one-shot up to here
  size_t direct_max_bytes = 256 * 1024;  // automatic choice: direct up to here, ring above
  // Kernel mode: messages of up to this many bytes (in their wire type) travel in the LL format,
  // data and flag in one store, where a block's slice fits (device/plan.h, ll_message); 0: none.
  // Host mode never uses it: the host has waited for every message before the launch that
  // reads it, so there is no wait for the format to save.
  size_t ll_max_bytes = 32 * 1024;
  bool debug = false;
  bool check_mismatch = true;  // every call's fingerprint checked before anything is queued
  // Host mode: all-reduces, reduces, broadcasts, all-gathers, reduce-scatters, gathers, scatters
  // and all-to-alls through scratch (run_scratch, host_scratch_eligible), two fences per
  // chunk, not a host round trip per step.
  bool host_twoshot = true;
  // Ring all-reduces: two messages in flight per channel (plan_params; off until measured).
  bool lookahead = false;
  // Host mode's registered calls and scratch fence on interprocess events (event_fence): the
  // host queues a whole call without waiting for the GPU. Off: the host waits for the GPU and
  // meets the peers at every fence.
  bool host_events = true;
  // ... on fence counters (counter_fence: cuStreamWriteValue64 / cuStreamWaitValue64) instead
  // of interprocess events; set where every rank's GPU offers 64-bit stream memory operations
  // (stream_value_ops), the same on every rank.
  bool fence_counters = false;
};
// Host mode's fences on interprocess events: host_events without fence_counters.
inline bool uses_events(const CudaCommOptions& o) { return o.host_events && !o.fence_counters; }

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

class CudaComm {
 public:
  CudaComm(int rank, int size, int device, const CudaCommOptions& opts);
  ~CudaComm();
  CudaComm(const CudaComm&) = delete;
  CudaComm& operator=(const CudaComm&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  int device() const { return device_; }
  uint64_t seq() const { return seq_; }
  SyncMode mode() const { return mode_; }
  const CudaCommOptions& options() const { return opts_; }
  double timeout() const { return timeout_s_.load(); }
  void set_timeout(double s) { timeout_s_.store(s); }

  // What the rendezvous exchanges: the segment's IPC handle (and host mode's fence events':
  // host_events), the host flags' name, the GPU.
  std::string ipc_handle() const;
  std::string device_uuid() const;
  const std::string& shm_name() const { return shm_.name(); }
  // Maps every peer's segment and host flags (ours included in the lists, ignored).
  void attach(const std::vector<std::string>& handles, const std::vector<std::string>& shm_names,
              SyncMode mode);
  void unlink() { shm_.unlink(); }

  Algo choose(Collective c, size_t bytes) const;
  // Queues `call` behind `stream`'s work; `stream` waits for it unless `async_op`.
  // On a stream being captured into a CUDA graph, the launch is captured instead (kernel mode
  // only, and only for a call shape run once before: see run's definition), and every launch
  // of the graph runs the collective again, the flags advancing on the device.
  std::shared_ptr<CudaWork> run(const CollectiveCall& call, cudaStream_t stream, bool async_op);
  size_t plans_pinned() const { return plans_.pinned(); }
  // Registered buffers (cuda/registry.h). A call whose buffers are registered as
  // registered_call needs them, with the algorithm automatic or direct, runs over them
  // (device/twoshot_kernel.h, run_registered; an all-reduce: the two-shot; in host mode
  // between two fences); the fingerprint says so, and where they lie.
  IpcRegistry& registry() { return registry_; }
  uint64_t twoshot_runs() const { return twoshot_runs_; }
  uint64_t scratch_runs() const { return scratch_runs_; }
  // Waits for this rank's queued collectives, then for every rank to arrive.
  void barrier();
  // Waits (bounded) for queued work and releases every resource; later calls fail.
  void close();

  void abort(const std::string& reason);
  // Raises the error an earlier device wait or a dead peer left behind, if any.
  void check(const char* name) {
    check_usable(name);
    check_device_status(name);
  }
  bool poisoned() const { return aborted_.load(); }
  std::string poison_reason() const;

 private:
  struct CachedPlan {
    Plan plan;
    DevStep* device_steps = nullptr;
  };

  // A new plan's steps are uploaded on `stream`, that of the launch that first reads them.
  const CachedPlan& plan_for(const CollectiveCall& call, Algo algo, cudaStream_t stream);
  KernelArgs kernel_args(const CollectiveCall& call, const CachedPlan& cp) const;
  // The launch of the two-shot of `len` elements over every rank's `in` and `out`.
  KernelArgs twoshot_args(const CollectiveCall& call, size_t len, const std::vector<uint8_t*>& in,
                          const std::vector<uint8_t*>& out) const;
  // Kernel mode: one launch (two for several blocks: launches_of) on `stream` that compares
  // call `f` with every peer's on the device and runs `cp`'s steps (none when null: it only
  // compares). `eager` (not captured): it reports its end in the done word, and its stream
  // waits for the call before when that was launched on another stream. Returns whether
  // anything was launched (runs_anything).
  bool run_kernel_mode(const CollectiveCall& call, const CachedPlan* cp, const Fingerprint& f,
                       cudaStream_t stream, bool eager);
  // Launches `a` on `stream`; `eager`: as call number `seq`, reporting its end in the done word
  // and ordered after this rank's call before (launch_end_). Returns false,
  // launching nothing and leaving the last launch as it was, when `a` runs nothing.
  bool launch_kernel_mode(DType dtype, KernelArgs& a, uint64_t seq, cudaStream_t stream,
                          bool eager);
  // Waits (bounded) for everything this rank has queued: our stream, and the launches on
  // callers' streams (the done word).
  void wait_queued(const WaitContext& w);
  // A mismatch found on the host: our device segment's failure word stops peers' device waits.
  void stop_peers_on_mismatch();
  // Work running now, queued by this rank: the watchdog stops its device waits if a peer dies.
  void watch(std::shared_ptr<CudaWork> work);
  // `call` over registered buffers where they are (registered_call; off otherwise), which
  // run_registered runs (the two-shot for an all-reduce).
  RegisteredCall registered_of(const CollectiveCall& call, Algo algo) const;
  void run_on_registered(const CollectiveCall& call, const RegisteredCall& t, const Fingerprint& f,
                         const WaitContext& w, cudaStream_t stream, bool eager);
  void run_host_mode(const CollectiveCall& call, const CachedPlan& cp, const WaitContext& w);
  // `met`: the ranks have met on the host for this call already (its fingerprints).
  // `widest`: an all-to-all's largest split of every rank's (check_split_matrix).
  void run_host_scratch(const CollectiveCall& call, const WaitContext& w, bool met,
                        uint64_t widest);
  // Host mode: what is queued on our stream after this runs once what every rank queued
  // before it has run (host_steps.h, event_fence; without host_events the host waits for our
  // stream, then meets every peer).
  void fence(const WaitContext& w);
  void wait_device(const std::function<bool()>& reached, const WaitContext& w);
  void wait_event(cudaEvent_t ev, const WaitContext& w);
  // Waits (bounded) until what is queued on our stream now has run.
  void wait_stream(const WaitContext& w);
  void check_device_status(const char* name);
  void check_usable(const char* name) const;
  // Nothing of ours in flight on the device: every eager launch has reported its end and our
  // stream is idle (registry.h, the quiet hook of deferred frees). Any thread.
  bool quiet();
  WaitContext wait_context(const char* name, uint64_t seq) const;
  void watchdog_loop();
  void release();

  int rank_, size_, device_;
  CudaCommOptions opts_;
  SyncMode mode_ = SyncMode::Kernel;
  SegmentLayout layout_;
  uint8_t* segment_ = nullptr;           // ours, cudaMalloc
  std::vector<uint8_t*> segments_;       // every rank's, as mapped here
  DeviceStatus* status_host_ = nullptr;  // host-mapped
  DeviceStatus* status_dev_ = nullptr;
  std::shared_ptr<const DeviceStatus> status_keep_;  // owns status_host_
  uint32_t* error_claim_ = nullptr;                  // device memory, see DeviceStatus
  uint32_t* finished_ = nullptr;                     // device memory, see KernelArgs::finished
  // The last eager kernel-mode launch: its stream, call number, and an event recorded on that
  // stream right after it, which a launch on another stream waits for.
  cudaStream_t last_stream_ = nullptr;
  std::atomic<uint64_t> last_launch_{0};
  cudaEvent_t launch_end_ = nullptr;
  cudaStream_t stream_ = nullptr;
  cudaStream_t side_ = nullptr;  // writes the failure word while stream_ may be stuck
  cudaEvent_t ready_ = nullptr;  // the caller's stream, at the collective's issue
  cudaEvent_t step_done_ = nullptr;
  // host_events: ours (interprocess), and every peer's as opened here (ours: null).
  cudaEvent_t fence_events_[2] = {nullptr, nullptr};
  StreamValueOps value_ops_;  // fence_counters
  std::vector<std::array<cudaEvent_t, 2>> peer_fence_events_;
  ShmTransport shm_;  // host flags: host-mode steps, barrier, liveness of peers
  ChannelCounters counters_;
  PlanCache<CachedPlan> plans_;
  IpcRegistry registry_;
  uint64_t twoshot_runs_ = 0;
  uint64_t scratch_runs_ = 0;
  std::shared_ptr<EventPool> events_;
  uint64_t seq_ = 0;
  uint64_t barrier_epoch_ = 0;
  std::atomic<double> timeout_s_;
  std::atomic<bool> aborted_{false};
  mutable std::mutex reason_mu_;
  std::string poison_reason_;
  std::mutex run_mu_;

  // Kernel mode: while work is queued, a watchdog notices dead peers and stops the device.
  std::mutex watch_mu_;
  std::shared_ptr<CudaWork> last_work_;
  std::atomic<bool> stopping_{false};
  std::thread watchdog_;
  bool closed_ = false;
};

}  // namespace cuda
}  // namespace pycoll
