// The emulated device: the CUDA transport's device code (device/step_kernel.h) compiled for the
// host and run by every rank over POSIX shared memory laid out exactly as the GPU segment
// (device/kernel_args.h's SegmentLayout), with the same plans, counters and fingerprints, under
// the orchestration CudaComm runs (device/orchestration.h): only the device's primitives are
// its own.
//
//   Kernel mode: one "launch" per collective; every block is a thread of its own that waits
//                on its peers' flags in their segments, as on the GPU. The calling thread
//                watches the peers meanwhile and aborts the blocks' waits when one has died.
//   Stepped mode:   one launch per step, blocks run in turn; between launches the host waits on
//                the counters in the host flags segment (device/stepped.h), as CudaComm does.
//                With stepped_events, stepped mode's work goes on a queue (op_queue.h) that runs it
//                as a stream would, ordered across ranks by fences on counters or on emulated
//                interprocess events (EmuEvents), as CudaComm's; the call waits for its queue
//                before it returns.
// Every access the device code makes is bounds-checked (emu/emu_checks.h): a wrong staging
// address fails here as a CollectiveError naming the access, instead of corrupting a GPU.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "algo/call.h"
#include "device/kernel_args.h"
#include "device/orchestration.h"
#include "device/plan.h"
#include "device/stepped.h"
#include "emu/emu_checks.h"
#include "emu/emu_registry.h"
#include "emu/op_queue.h"
#include "host/executor.h"
#include "host/shm_transport.h"
#include "runtime/fingerprint.h"
#include "runtime/shm_segment.h"

namespace pycoll {
namespace emu {

class BlockThreads;
class EmuComm;

// A rank's two fence events (cuda::event_fence), in its device segment after the layout's end,
// where its peers read them: how many records the host has queued, and up to which the queue
// has run. A wait queued on a peer's event waits for the record the peer's host made last
// before this queue reached the wait: the weakest reading of an interprocess event (within a
// process, cudaStreamWaitEvent binds to the record current when it is called).
struct EmuEvents {
  uint64_t recorded[2];
  uint64_t completed[2];
};

// The SMs of an emulated GPU, shared by every rank on it (EmuOptions::sms): in the device
// segment of the lowest rank on that GPU, after its events. A kernel-mode block runs only once
// it holds an SM, and keeps it until it ends, as on a GPU; launches are dispatched in the
// order they reach the GPU, a launch's blocks in block order, and a launch's first block only
// after every block of the launch before is resident (the GPU's work distributor: a grid's
// blocks before the next grid's). So a protocol that needs more blocks resident at once than
// the SMs hold deadlocks here as on a GPU; here the wait for an SM is bounded and says so.
struct EmuSms {
  uint32_t free;  // SMs no block holds
  uint32_t pad;
  uint64_t tickets;  // launches that have reached the GPU
  uint64_t serving;  // launches whose every block is resident (or given up)
};

// A collective captured for replay, as a CUDA graph captures a kernel-mode launch: the
// launches the orchestration queued while capturing (arguments built once), launched again by
// EmuComm::replay with no host rendezvous and no plan lookup. Replays stay right only because
// kernel mode's blocks read their message counts from their own flags at every launch
// (step_kernel.h, load_own_counts), so the flags advance on the device, and because the plan
// they read is pinned in the cache.
struct EmuGraph {
  struct Launch {
    DType dtype{};
    cuda::KernelArgs args{};
    Regions regions;
  };
  const EmuComm* owner = nullptr;
  std::vector<Launch> launches;  // none: the call runs nothing on this rank
  bool waits_launch = false;     // a replay waits for the end of the eager launch before it
  std::string name;
  uint64_t seq = 0;  // the captured call's number: errors name it
};

struct EmuOptions {
  size_t slot_bytes = 64 * 1024;
  int nslots = 4;
  int nblocks = 4;  // channels: blocks per launch
  int threads = 3;  // emulated threads per block (their strided shares of every slice)
  bool kernel_mode = true;
  double timeout_s = 60.0;
  size_t oneshot_max_bytes = 64 * 1024;
  size_t direct_max_bytes = 256 * 1024;  // automatic choice: direct up to here, ring above
  // Kernel mode: messages up to here in the LL format (cuda::ll_message; 0: none), their flags
  // of ll_flag_bits bits (fewer than 32: tests that see the flags wrap).
  size_t ll_max_bytes = 32 * 1024;
  int ll_flag_bits = 32;
  // Fault drills (tests): in collective #fault_seq, after `fault_step` steps, this rank's
  // process exits (fault_exit) or stops responding for longer than the timeout.
  uint64_t fault_seq = 0;
  int fault_step = 0;
  bool fault_exit = true;
  // Drills of the launch's end (tests): block b reaches its end b * finish_stagger_ms later;
  // with previous_late_ms, every kernel-mode launch is queued as if on another stream than the
  // call before (ordered after that call's end: cuda::DeviceComm::launch_kernel_mode), and that
  // call's end is reported this much later.
  int finish_stagger_ms = 0;
  int previous_late_ms = 0;
  bool stepped_twoshot = true;       // cuda::CudaCommOptions::stepped_twoshot
  size_t register_on_use_bytes = 0;  // cuda::CudaCommOptions::register_on_use_bytes
  bool push = false;                 // cuda::CudaCommOptions::push
  bool copy_engines = false;         // cuda::CudaCommOptions::copy_engines
  bool lookahead = false;            // cuda::CudaCommOptions::lookahead
  bool stepped_events = true;        // cuda::CudaCommOptions::stepped_events
  // stepped_events: the fences on counters (cuda::counter_fence), as CudaComm's where the GPU has
  // 64-bit stream memory operations; false: on emulated interprocess events (event_fence),
  // whose queued waits bind when the queue reaches them, the weakest reading CUDA allows.
  bool fence_counters = true;
  size_t flight_entries = 1024;  // the flight recorder's ring (0: none)
  bool reproducible = false;     // cuda::CudaCommOptions::reproducible
  Algo forced = Algo::Auto;      // cuda::CudaCommOptions::forced
  // Stepped mode's queue (tests): in calls of odd number on even ranks and of even number on odd
  // ranks, every queued op starts this much late, so that a rank whose queue does not wait
  // for a peer's reads what that peer has not written yet.
  int queue_delay_ms = 0;
  // Stepped mode (tests): the host pauses this long between a step's inputs arriving and its
  // launch, so that its peers run ahead of it.
  int step_delay_ms = 0;
  // Stepped mode: every call's fingerprints compared on the host before anything moves
  // (cuda::meets_on_host; PYCOLL_CHECK_MISMATCH=0 turns that off on the GPU).
  bool check_mismatch = true;
  // Data stores visible to peers only at a release or a fence, or at the block's end
  // (emu_checks.h, buffer_store); false: at once, as x86 shows them.
  bool weak_stores = true;
  // Kernel mode: the SMs of each emulated GPU (EmuSms; the ranks on each GPU: attach's
  // `gpus`), one block per SM; 0: as many as the blocks ask.
  int sms = 0;
};

// The plans' steps on the emulated device (device/plan_arena.h): chunks of host memory, the
// copies at once (launches here are synchronous). A retired chunk is overwritten with garbage
// at once and freed only at the end, so that a launch still reading one (a graph's plan
// retired with the cache) fails, where on a GPU it would read freed memory.
struct EmuPlanMemory {
  EmuPlanMemory() = default;
  EmuPlanMemory(EmuPlanMemory&& o) noexcept : retired(std::move(o.retired)) {}
  ~EmuPlanMemory();
  cuda::ArenaChunk alloc(size_t bytes);
  void copy(uint8_t* dev, const uint8_t* host, size_t bytes, int);
  void retire(const cuda::ArenaChunk& c);
  void free(const cuda::ArenaChunk& c);
  std::vector<cuda::ArenaChunk> retired;
};

// The emulated device under the orchestration a GPU runs (device/orchestration.h): its
// streams are numbers (the caller's: 1, or 1 and 2 by turns with previous_late_ms; ours: 0), a
// kernel-mode launch runs at once on block threads, stepped mode's work goes on an OpQueue (with
// stepped_events) that runs it in order as a stream would.
class EmuComm : public cuda::DeviceComm<EmuComm, int, EmuPlanMemory> {
 public:
  EmuComm(int rank, int size, const EmuOptions& opts);
  ~EmuComm();
  EmuComm(const EmuComm&) = delete;
  EmuComm& operator=(const EmuComm&) = delete;

  const EmuOptions& options() const { return opts_; }
  size_t segment_bytes() const { return layout_.total_bytes(); }
  // The segment's data area (its staging slots): stepped mode's scratch (cuda::scratch_of).
  size_t segment_data_bytes() const { return layout_.data_end() - layout_.flags_bytes; }

  // What the rendezvous exchanges: the device segment's and the host flags' names.
  const std::string& segment_name() const { return segment_.name(); }
  const std::string& flags_name() const { return shm_.name(); }
  // `gpus`: the emulated GPU of each rank (empty: a GPU of its own each), whose SMs the ranks
  // on it share (EmuOptions::sms).
  void attach(const std::vector<std::string>& segments, const std::vector<std::string>& flags,
              const std::vector<int>& gpus = {});
  void unlink();

  // Runs `call` (arguments already checked) to its end, as a blocking call on the caller's
  // stream.
  void run(const CollectiveCall& call);
  void barrier();
  // Kernel mode only, and only for a call shape run once before (its plan is built then): the
  // fingerprints are compared now, every rank captures, nothing moves until replay.
  std::shared_ptr<EmuGraph> capture(const CollectiveCall& call);
  void replay(const EmuGraph& graph);
  // Blocks run by every launch so far, added up: a launch runs only the blocks its messages
  // use (cuda::plan_grid), as on the GPU.
  uint64_t blocks_run() const { return blocks_run_; }
  // Steps run with a message in the LL format (kRecvLL or kSendLL), added up.
  uint64_t ll_steps_run() const { return ll_steps_run_; }
  // The number of the last call whose launch has ended, as the device wrote it (status done).
  uint64_t completed() const { return __atomic_load_n(&status_.done, __ATOMIC_ACQUIRE); }

  // Registered buffers (emu_registry.h): memory of the emulated device, and the registration of
  // a range of it (collective; the rendezvous trades the handles between handle and add).
  Registry& registry() { return registry_; }
  // Data the device code has moved since the last reset (emu_checks.h, Traffic).
  const Traffic& traffic() const { return traffic_; }
  void reset_traffic() {
    traffic_.reset();
    copied_ = 0;
  }
  // Bytes queued as device-to-device copies (copy engines: no device code) since the reset.
  uint64_t copied() const { return copied_; }

 private:
  friend class cuda::DeviceComm<EmuComm, int, EmuPlanMemory>;

  // The device's primitives (device/orchestration.h).
  int own_stream() const { return 0; }
  void queue_behind(int) {}  // our queue starts after the caller's call has: it is synchronous
  void launch(const CollectiveCall& call, const cuda::KernelArgs& a, int stream,
              const WaitContext& w);
  void copy(void* dst, const void* src, size_t bytes);
  void write_counter(uint64_t epoch, const WaitContext& w);
  void wait_counter(int q, uint64_t epoch, const WaitContext& w);
  void record_fence_event(int k);
  void wait_fence_event(int q, int k, const WaitContext& w);
  // previous_late_ms: the host waits (bounded) for the end of the launch before, reported late.
  void stream_waits_launch(int stream, const WaitContext& w);
  void launch_ended(int stream, uint64_t seq);
  void replay_waits_launch(int, const WaitContext&) { capturing_->waits_launch = true; }
  void replay_ended(int) {}          // a replay has ended when replay() returns
  void stream_waits_replays(int) {}  // ... so no launch after it can start before its end
  void wait_stream(const WaitContext&) { drain_queue(); }
  void wait_queued(const WaitContext&) { drain_queue(); }
  void wait_launch(uint64_t, const WaitContext&) {}  // the launch has run
  const cuda::DeviceStatus* host_status() const { return &status_; }
  cuda::LaunchSetup launch_setup(bool use_flags) const;
  uint32_t* finished_word() { return &finished_; }
  cuda::RegisteredCall registered_of(const CollectiveCall& call, Algo algo) const;
  // Registration on first use (device/first_use.h): an allocation's key is its number in the
  // registry, its handle the segment's name; a peer's is mapped once (peer_maps_).
  cuda::BufferRecord buffer_of(const void* p, size_t bytes, const cuda::SentAllocations& sent);
  uint8_t* map_peer(int q, const cuda::BufferRecord& r);
  void shared_everywhere(uint64_t key) { registry_.unlink_key(key); }
  const cuda::PeerMappings<ShmSegment>& peer_mappings() const { return peer_maps_; }
  void stop_device() { __atomic_store_n(&status_.abort, 1u, __ATOMIC_RELEASE); }
  void stop_peers();
  bool closed() const { return false; }
  void trace(const ResolvedCall&, uint64_t) const {}
  void drill(const WaitContext& w, cuda::FaultPoint at, int step);
  void drill_launch(cuda::KernelArgs& a, const WaitContext& w);

  // The caller's stream of the next call: 1, or with previous_late_ms another stream than the
  // last launch's (1 or 2).
  int caller_stream() const;
  // The buffers launch `a` of `call` may touch: the call's, every segment, and where `a` runs
  // over every rank's buffers (registered, or scratch), exactly its bytes of each peer's.
  Regions regions_of(const CollectiveCall& call, const cuda::KernelArgs& a) const;
  void run_launch(DType dtype, const cuda::KernelArgs& a, const Regions& regions,
                  const WaitContext& w, bool drill);
  void launch_one(DType dtype, const cuda::KernelArgs& a, const Regions& regions,
                  const WaitContext& w, bool drill);
  // Stepped mode's launch: its blocks one after another on this thread, within `regions`.
  void run_in_turn(DType dtype, const cuda::KernelArgs& a, const Regions& regions);
  void check_launch(const char* name, uint64_t seq);
  // Stepped mode's queue: `op` on it (with stepped_events; else run now), and the wait for it.
  void enqueue(std::function<void()> op);
  void drain_queue();
  EmuEvents* events_of(int rank) const;
  // Kernel mode with sms: block `b` of a launch of `grid` blocks takes an SM of our GPU
  // (bounded; in block order, after the launch before on the GPU: EmuSms), and gives it back.
  // False: the launch was stopped meanwhile, and the block runs without one (to its end).
  struct Dispatch;
  bool take_sm(Dispatch& d, int b, int grid, const WaitContext& w);
  void give_sm();
  class QueueScope;
  [[noreturn]] void drill_fault() const;
  void report_late(uint64_t seq);

  EmuOptions opts_;
  ShmSegment segment_;             // our device segment
  std::vector<ShmSegment> peers_;  // peers' device segments, by rank
  uint64_t blocks_run_ = 0;
  uint64_t ll_steps_run_ = 0;
  Registry registry_;
  cuda::PeerMappings<ShmSegment> peer_maps_;
  Traffic traffic_;
  uint64_t copied_ = 0;
  cuda::DeviceStatus status_{};
  uint32_t error_claim_ = 0;
  uint32_t finished_ = 0;          // cuda::KernelArgs::finished
  bool drill_now_ = false;         // drill_launch: the launch ends the process
  EmuGraph* capturing_ = nullptr;  // capture: launches are recorded here, not run
  // previous_late_ms: the call whose end is reported late, and the thread that reports it.
  uint64_t late_seq_ = 0;
  std::thread late_writer_;
  std::atomic<bool> late_stop_{false};
  EmuSms* sms_ = nullptr;                 // our GPU's SMs (sms > 0), in a segment on it
  std::unique_ptr<BlockThreads> blocks_;  // kernel mode's block threads, from the first launch
  std::unique_ptr<OpQueue> queue_;        // stepped mode with stepped_events; last: it stops first
};

}  // namespace emu
}  // namespace pycoll
