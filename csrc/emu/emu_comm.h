// The emulated device: the CUDA transport's device code (device/step_kernel.h) compiled for the
// host and run by every rank over POSIX shared memory laid out exactly as the GPU segment
// (device/kernel_args.h's SegmentLayout), with the same plans, counters and fingerprints.
//
//   Kernel mode: one "launch" per collective; every block is a thread of its own that waits
//                on its peers' flags in their segments, as on the GPU. The calling thread
//                watches the peers meanwhile and aborts the blocks' waits when one has died.
//   Host mode:   one launch per step, blocks run in turn; between launches the host waits on
//                the counters in the host flags segment (device/host_steps.h), as CudaComm does.
//                Registered calls and calls through scratch go on a queue (op_queue.h) that
//                runs them as a stream would, ordered across ranks by fences on emulated
//                interprocess events (EmuEvents), as CudaComm's with host_events; the call
//                waits for its queue before it returns.
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
#include "device/host_steps.h"
#include "device/kernel_args.h"
#include "device/plan.h"
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

// A collective captured for replay, as a CUDA graph captures a kernel-mode launch: the launch's
// arguments, built once at capture, launched again by EmuComm::replay with no host rendezvous
// and no plan lookup. Replays stay right only because kernel mode's blocks read their message
// counts from their own flags at every launch (step_kernel.h, load_own_counts), so the flags
// advance on the device, and because the plan they read is pinned in the cache.
struct EmuGraph {
  const EmuComm* owner = nullptr;
  bool empty = false;  // the call moves nothing on this rank: a replay only compares it
  DType dtype{};
  cuda::KernelArgs args{};
  Regions regions;
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
  // call before (ordered after that call's end: CudaComm::launch_kernel_mode), and that call's
  // end is reported this much later.
  int finish_stagger_ms = 0;
  int previous_late_ms = 0;
  bool host_twoshot = true;  // cuda::CudaCommOptions::host_twoshot
  bool lookahead = false;    // cuda::CudaCommOptions::lookahead
  bool host_events = true;   // cuda::CudaCommOptions::host_events
  // host_events: the fences on counters (cuda::counter_fence), as CudaComm's where the GPU has
  // 64-bit stream memory operations; false: on emulated interprocess events (event_fence),
  // whose queued waits bind when the queue reaches them, the weakest reading CUDA allows.
  bool fence_counters = true;
  // Host mode's queue (tests): in calls of odd number on even ranks and of even number on odd
  // ranks, every queued op starts this much late, so that a rank whose queue does not wait
  // for a peer's reads what that peer has not written yet.
  int queue_delay_ms = 0;
  // Host mode (tests): the host pauses this long between a step's inputs arriving and its
  // launch, so that its peers run ahead of it.
  int step_delay_ms = 0;
  // Host mode: every call's fingerprints compared on the host before anything moves
  // (cuda::meets_on_host; PYCOLL_CHECK_MISMATCH=0 turns that off on the GPU).
  bool host_checks = true;
  // Data stores visible to peers only at a release or a fence, or at the block's end
  // (emu_checks.h, buffer_store); false: at once, as x86 shows them.
  bool weak_stores = true;
  // Kernel mode: the SMs of each emulated GPU (EmuSms; the ranks on each GPU: attach's
  // `gpus`), one block per SM; 0: as many as the blocks ask.
  int sms = 0;
};

class EmuComm {
 public:
  EmuComm(int rank, int size, const EmuOptions& opts);
  ~EmuComm();
  EmuComm(const EmuComm&) = delete;
  EmuComm& operator=(const EmuComm&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  uint64_t seq() const { return seq_; }
  const EmuOptions& options() const { return opts_; }
  size_t plans_cached() const { return plans_.size(); }
  uint64_t plans_built() const { return plans_built_; }
  size_t segment_bytes() const { return layout_.total_bytes(); }
  // The segment's data area (its staging slots): host mode's scratch (cuda::scratch_of).
  size_t segment_data_bytes() const { return layout_.data_end() - layout_.flags_bytes; }

  // What the rendezvous exchanges: the device segment's and the host flags' names.
  const std::string& segment_name() const { return segment_.name(); }
  const std::string& flags_name() const { return shm_.name(); }
  // `gpus`: the emulated GPU of each rank (empty: a GPU of its own each), whose SMs the ranks
  // on it share (EmuOptions::sms).
  void attach(const std::vector<std::string>& segments, const std::vector<std::string>& flags,
              const std::vector<int>& gpus = {});
  void unlink();

  Algo choose(Collective c, size_t bytes) const;
  // Runs `call` (arguments already checked).
  void run(const CollectiveCall& call);
  // Kernel mode only, and only for a call shape run once before (its plan is built then): the
  // fingerprints are compared now, every rank captures, nothing moves until replay.
  std::shared_ptr<EmuGraph> capture(const CollectiveCall& call);
  void replay(const EmuGraph& graph);
  size_t plans_pinned() const { return plans_.pinned(); }
  // Blocks run by every launch so far, added up: a launch runs only the blocks its messages
  // use (cuda::plan_grid), as on the GPU.
  uint64_t blocks_run() const { return blocks_run_; }
  // Steps run with a message in the LL format (kRecvLL or kSendLL), added up.
  uint64_t ll_steps_run() const { return ll_steps_run_; }
  // The number of the last call whose launch has ended, as the device wrote it (status done).
  uint64_t completed() const { return __atomic_load_n(&status_.done, __ATOMIC_ACQUIRE); }
  // The LL limit the plans use: the option in kernel mode, none in host mode.
  size_t ll_max_bytes() const { return opts_.kernel_mode ? opts_.ll_max_bytes : 0; }
  void abort(const std::string& reason);
  bool poisoned() const { return aborted_.load(); }

  // Registered buffers (emu_registry.h): memory of the emulated device, and the registration of
  // a range of it (collective; the rendezvous trades the handles between handle and add).
  // A call whose buffers are registered as cuda::registered_call needs them, with the
  // algorithm automatic or direct, runs over them (device/twoshot_kernel.h; in host mode
  // between two fences, as CudaComm does).
  Registry& registry() { return registry_; }
  // Data the device code has moved since the last reset (emu_checks.h, Traffic).
  const Traffic& traffic() const { return traffic_; }
  void reset_traffic() { traffic_.reset(); }
  uint64_t twoshot_runs() const { return twoshot_runs_; }
  // Host mode's calls through scratch (cuda::run_scratch), and their chunks.
  uint64_t scratch_runs() const { return scratch_runs_; }
  uint64_t scratch_chunks() const { return scratch_chunks_; }

 private:
  static const cuda::Plan kNoSteps;
  const cuda::Plan& plan_for(const CollectiveCall& call, Algo algo);
  void run_kernel_mode(const CollectiveCall& call, const cuda::Plan& plan, const WaitContext& w,
                       const Fingerprint& f);
  void launch_eager(DType dtype, cuda::KernelArgs& a, const Regions& regions, const WaitContext& w,
                    bool drill);
  void launch(DType dtype, const cuda::KernelArgs& a, const Regions& regions, const WaitContext& w,
              bool drill);
  void launch_one(DType dtype, const cuda::KernelArgs& a, const Regions& regions,
                  const WaitContext& w, bool drill);
  Algo algo_of(const CollectiveCall& call) const;
  void check_usable(const std::string& name) const;
  // Returns an all-to-all's largest split of every rank's where it met them (0 otherwise).
  uint64_t rendezvous(const CollectiveCall& call, FingerprintGuard& guard, WaitContext& w,
                      bool meet);
  void stop_peers_on_mismatch();
  void run_host_mode(const CollectiveCall& call, const cuda::Plan& plan, const WaitContext& w);
  Regions launch_regions(const CollectiveCall& call) const;
  // `call` over registered buffers where they are (cuda::registered_call; off otherwise), for
  // run_registered (the two-shot for an all-reduce); the fingerprint says so and where
  // (cuda::registered_fingerprint).
  cuda::RegisteredCall registered_of(const CollectiveCall& call, Algo algo) const;
  void run_host_scratch(const CollectiveCall& call, const WaitContext& w, bool met,
                        uint64_t widest);
  void run_on_registered(const CollectiveCall& call, const cuda::RegisteredCall& t,
                         const WaitContext& w, const Fingerprint& f);
  cuda::LaunchSetup launch_setup(bool use_flags);
  // The launch of the two-shot of `len` elements over every rank's `in` and `out`.
  cuda::KernelArgs twoshot_args(const CollectiveCall& call, size_t len,
                                const std::vector<uint8_t*>& in, const std::vector<uint8_t*>& out,
                                bool use_flags);
  // Host mode's launch: its blocks one after another on this thread, within `regions`.
  void run_in_turn(DType dtype, const cuda::KernelArgs& a, const Regions& regions);
  void check_status(const char* name, uint64_t seq);
  // Host mode's queue: `op` on it (with host_events; else run now), and the fence between ops
  // (cuda::event_fence on the emulated events; else a meeting), and the wait for the queue.
  void enqueue(std::function<void()> op);
  void fence(const WaitContext& w);
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
  // previous_late_ms: waits (bounded) for the end of the launch before (late_seq_).
  void wait_previous(const WaitContext& w);
  WaitContext wait_context(const char* name, uint64_t seq) const;

  int rank_, size_;
  EmuOptions opts_;
  cuda::SegmentLayout layout_;
  ShmSegment segment_;              // our device segment
  std::vector<ShmSegment> peers_;   // peers' device segments, by rank
  std::vector<uint8_t*> segments_;  // every rank's, as mapped here
  ShmTransport shm_;                // host flags: host-mode steps, fingerprints, liveness
  ChannelCounters counters_;
  cuda::PlanCache<cuda::Plan> plans_;
  uint64_t plans_built_ = 0;
  uint64_t blocks_run_ = 0;
  uint64_t ll_steps_run_ = 0;
  uint64_t twoshot_runs_ = 0;
  uint64_t scratch_runs_ = 0;
  uint64_t scratch_chunks_ = 0;
  uint64_t barrier_epoch_ = 0;  // host mode's meetings (cuda::host_meet)
  Registry registry_;
  Traffic traffic_;
  cuda::DeviceStatus status_{};
  uint32_t error_claim_ = 0;
  uint32_t finished_ = 0;  // cuda::KernelArgs::finished
  uint64_t seq_ = 0;
  // previous_late_ms: the call whose end is reported late, and the thread that reports it.
  uint64_t late_seq_ = 0;
  std::thread late_writer_;
  std::atomic<bool> late_stop_{false};
  std::atomic<bool> aborted_{false};
  std::string poison_reason_;
  std::mutex run_mu_;
  EmuSms* sms_ = nullptr;                 // our GPU's SMs (sms > 0), in a segment on it
  std::unique_ptr<BlockThreads> blocks_;  // kernel mode's block threads, from the first launch
  std::unique_ptr<OpQueue> queue_;        // host mode with host_events; last: it stops first
};

}  // namespace emu
}  // namespace pycoll
