// CudaComm's calls: the plan of a call, its launch arguments, the launch in kernel mode or one
// launch per step in host mode (the host waiting between them), and the barrier.
#include <algorithm>
#include <cstdio>

#include "common/errors.h"
#include "cuda/cuda_check.h"
#include "cuda/cuda_comm.h"
#include "cuda/launch.h"
#include "device/host_steps.h"
#include "runtime/fingerprint.h"
#include "runtime/splits.h"

namespace pycoll {
namespace cuda {

Algo CudaComm::choose(Collective c, size_t bytes) const {
  return device_choose(c, bytes, opts_.direct_max_bytes);
}

// The steps are uploaded on the stream of the launch that first reads them, so it reads them
// only once they are in place (a synchronous copy on the legacy stream is not ordered with a
// non-blocking stream's kernels, and may return before its DMA ends). Later launches follow
// that one: on its stream, or on another stream that waits for its end (launch_kernel_mode).
const CudaComm::CachedPlan& CudaComm::plan_for(const CollectiveCall& call, Algo algo,
                                               cudaStream_t stream) {
  return plans_.get(
      call, algo,
      [&] {
        CachedPlan cp;
        cp.plan =
            plan_call(algo, call, rank_, size_, layout_, opts_.slot_bytes, opts_.oneshot_max_bytes,
                      mode_ == SyncMode::Kernel ? opts_.ll_max_bytes : 0, opts_.lookahead);
        const size_t bytes = cp.plan.steps.size() * sizeof(DevStep);
        if (bytes != 0) {
          PYCOLL_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&cp.device_steps), bytes));
          PYCOLL_CUDA_CHECK(cudaMemcpyAsync(cp.device_steps, cp.plan.steps.data(), bytes,
                                            cudaMemcpyHostToDevice, stream));
        }
        return cp;
      },
      [&](auto& entries) {
        // Queued launches may still read the old plans.
        wait_queued(wait_context("plan cache", seq_));
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

std::shared_ptr<CudaWork> CudaComm::run(const CollectiveCall& call, cudaStream_t stream,
                                        bool async_op) {
  free_deferred();  // frees put off while a collective was in flight (registry.h)
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
  // The two-shot reads no plan: a graph captures its launch arguments, pointers and all.
  const RegisteredCall registered = registered_of(call, algo);
  if (capturing)
    check_capturable(
        name, mode_ == SyncMode::Kernel,
        moves_nothing(call, rank_, size_) || registered.on || plans_.find(call, algo) != nullptr);
  const uint64_t seq = ++seq_;
  if (opts_.debug)
    std::fprintf(stderr,
                 "pycollectives INFO rank %d/%d cuda:%d %s #%llu count=%zu %s %s root=%d algo=%s%s "
                 "sync=%s\n",
                 rank_, size_, device_, name, static_cast<unsigned long long>(seq), call.count,
                 dtype_name(call.dtype), redop_name(call.op), call.root, algo_name(algo),
                 call.algo == Algo::Auto ? " (auto)" : "",
                 mode_ == SyncMode::Kernel ? "kernel" : "host");
  Fingerprint mine = Fingerprint::of_call(seq, call, algo);
  if (registered.on) mine = registered_fingerprint(mine, registered);
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
    uint64_t widest = 0;  // the largest split of every rank's (host mode's scratch counts by it)
    if (!call.send_counts.empty())
      widest = check_split_matrix(shm_, guard, w, call.send_counts, call.recv_counts);
    if (meet) guard.finish(w);  // every peer runs this very call
    // Kernel mode, a blocking call outside a capture: one launch on the caller's stream, and
    // no event (the device reports its end in the done word). Otherwise the launch goes on our
    // stream, behind the caller's: an async call's stream must not wait for it, and in a
    // capture these two calls fork our stream into it, and the two at the end join it back (a
    // capture must end joined, so an async call is joined too).
    const bool direct = kernel && !async_op && !capturing;
    cudaStream_t on = direct ? stream : stream_;
    auto work = direct ? std::make_shared<CudaWork>(status_keep_, events_, device_, seq, stream)
                       : std::make_shared<CudaWork>(events_, device_, seq, capturing);
    if (!direct) {
      PYCOLL_CUDA_CHECK(cudaEventRecord(ready_, stream));
      PYCOLL_CUDA_CHECK(cudaStreamWaitEvent(stream_, ready_, 0));
    }
    // In kernel mode a call that moves nothing launches too: it compares the call (unless
    // there is no peer to compare it with: runs_anything).
    bool launched = true;
    if (moves_nothing(call, rank_, size_)) {
      if (kernel) launched = run_kernel_mode(call, nullptr, mine, on, !capturing);
    } else if (registered.on) {
      run_on_registered(call, registered, mine, w, on, !capturing);
    } else if (host_scratch_eligible(call, algo, kernel, opts_.host_twoshot, widest != 0)) {
      run_host_scratch(call, w, meet, widest);
    } else if (capturing) {
      // The graph reads the plan: never freed.
      run_kernel_mode(call, &plans_.pin(call, algo), mine, on, false);
    } else if (kernel) {
      launched = run_kernel_mode(call, &plan_for(call, algo, on), mine, on, true);
    } else {
      run_host_mode(call, plan_for(call, algo, stream_), w);
    }
    if (direct && !launched) work->not_launched(last_launch_);
    if (!direct) {
      PYCOLL_CUDA_CHECK(cudaEventRecord(work->event(), stream_));
      if (!async_op || capturing) PYCOLL_CUDA_CHECK(cudaStreamWaitEvent(stream, work->event(), 0));
    }
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

bool CudaComm::run_kernel_mode(const CollectiveCall& call, const CachedPlan* cp,
                               const Fingerprint& f, cudaStream_t stream, bool eager) {
  // Each block counts its messages on its own flags (step_kernel.h): no host counts to keep.
  static const CachedPlan no_steps{};
  KernelArgs a = kernel_args(call, cp != nullptr ? *cp : no_steps);
  check_on_device(a, f);
  return launch_kernel_mode(call.dtype, a, f.seq, stream, eager);
}

bool CudaComm::launch_kernel_mode(DType dtype, KernelArgs& a, uint64_t seq, cudaStream_t stream,
                                  bool eager) {
  // Not launched, it never reports an end: neither close(), nor this call's Work, nor a later
  // launch on another stream may wait for one.
  if (!runs_anything(a)) return false;
  if (eager) {
    a.finished = finished_;
    a.done_seq = seq;
    // This rank's launch before, on another stream, ends before this one starts: the stream
    // waits for it (launch_end_, recorded right after it), so this launch's blocks take no SM
    // while it runs, and read the counts it left. (A block spinning on the device for that end
    // would hold an SM that the launch it waits for may need: residency, cuda/residency.h.)
    if (last_launch_ != 0 && stream != last_stream_)
      PYCOLL_CUDA_CHECK(cudaStreamWaitEvent(stream, launch_end_, 0));
  }
  PYCOLL_CUDA_CHECK(launch_steps(dtype, a, stream));
  if (eager) {
    // Recorded after every eager launch, not when the next call turns out to use another
    // stream: by then this stream may have been destroyed.
    PYCOLL_CUDA_CHECK(cudaEventRecord(launch_end_, stream));
    last_stream_ = stream;
    last_launch_ = seq;
  }
  return true;
}

KernelArgs CudaComm::twoshot_args(const CollectiveCall& call, size_t len,
                                  const std::vector<uint8_t*>& in,
                                  const std::vector<uint8_t*>& out) const {
  static const CachedPlan no_steps{};
  KernelArgs a = kernel_args(call, no_steps);
  set_twoshot(a, len, in, out);
  return a;
}

RegisteredCall CudaComm::registered_of(const CollectiveCall& call, Algo algo) const {
  return registered_call(call, algo, rank_, size_,
                         [&](const void* p, size_t bytes) { return registry_.find(p, bytes); });
}

// The collective over every rank's registered buffers (run_registered; the two-shot for an
// all-reduce). Kernel mode: one launch on `stream` that compares the call with every peer's
// first (its other blocks gated on that: launches_of), its entry synchronisation. Host mode
// (the call compared on the host already): a fence (every rank's input is ready: our stream
// follows the caller's), the launch on our stream (no device wait in it), a fence (no rank
// touches its buffers again before every launch has ended).
void CudaComm::run_on_registered(const CollectiveCall& call, const RegisteredCall& t,
                                 const Fingerprint& f, const WaitContext& w, cudaStream_t stream,
                                 bool eager) {
  static const CachedPlan no_steps{};
  KernelArgs a = kernel_args(call, no_steps);
  set_registered(a, call, t.in, t.out);
  ++twoshot_runs_;
  if (mode_ == SyncMode::Kernel) {
    check_on_device(a, f);
    launch_kernel_mode(call.dtype, a, f.seq, stream, eager);
    return;
  }
  fence(w);
  PYCOLL_CUDA_CHECK(launch_steps(call.dtype, a, stream_));
  fence(w);
}

void CudaComm::fence(const WaitContext& w) {
  if (!opts_.host_events) {
    wait_stream(w);
    host_meet(shm_, ++barrier_epoch_, w);
    return;
  }
  if (opts_.fence_counters) {
    const size_t at = layout_.fence_offset();
    auto address = [&](int r) { return reinterpret_cast<CUdeviceptr>(segments_[r] + at); };
    counter_fence(
        shm_, ++barrier_epoch_, w,
        [&](uint64_t epoch) {
          // The default flags: a memory barrier orders the stream's earlier writes before it.
          if (value_ops_.write(stream_, address(rank_), epoch, CU_STREAM_WRITE_VALUE_DEFAULT) !=
              CUDA_SUCCESS)
            throw CollectiveError(str_cat(w.collective, " #", w.seq,
                                          ": cuStreamWriteValue64 failed on the fence counter"));
        },
        [&](int q, uint64_t epoch) {
          if (value_ops_.wait(stream_, address(q), epoch, CU_STREAM_WAIT_VALUE_GEQ) != CUDA_SUCCESS)
            throw CollectiveError(str_cat(w.collective, " #", w.seq,
                                          ": cuStreamWaitValue64 on rank ", q,
                                          "'s fence counter failed"));
        });
    return;
  }
  event_fence(
      shm_, ++barrier_epoch_, w,
      [&](int k) { PYCOLL_CUDA_CHECK(cudaEventRecord(fence_events_[k], stream_)); },
      [&](int q, int k) {
        PYCOLL_CUDA_CHECK(cudaStreamWaitEvent(stream_, peer_fence_events_[q][k], 0));
      });
}

// Host mode through scratch (device/host_steps.h, run_scratch): the copies and the two-shot
// on our stream, behind the caller's, and the fences between them.
void CudaComm::run_host_scratch(const CollectiveCall& call, const WaitContext& w, bool met,
                                uint64_t widest) {
  struct Ops {
    CudaComm& c;
    const CollectiveCall& call;
    const WaitContext& w;
    void copy(void* dst, const void* src, size_t bytes) {
      PYCOLL_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, c.stream_));
    }
    void twoshot(size_t len, const std::vector<uint8_t*>& scratch) {
      PYCOLL_CUDA_CHECK(
          launch_steps(call.dtype, c.twoshot_args(call, len, scratch, scratch), c.stream_));
    }
    void fence() { c.fence(w); }
    void meet() { host_meet(c.shm_, ++c.barrier_epoch_, w); }
    void chunk_done() {}
  } ops{*this, call, w};
  ++scratch_runs_;
  run_scratch(call, layout_, segments_.data(), rank_, met, ops, widest);
}

// One launch per step; between launches the host waits for the peers. A launch never waits
// for another process, so ranks time-slicing one GPU make progress whatever the scheduler does.
void CudaComm::run_host_mode(const CollectiveCall& call, const CachedPlan& cp,
                             const WaitContext& w) {
  const std::vector<DevStep>& steps = cp.plan.steps;
  for (uint32_t i = 0; i < steps.size(); ++i) {
    host_wait_step(shm_, counters_, steps[i], w);
    KernelArgs a = kernel_args(call, cp);
    a.first_step = i;
    a.end_step = i + 1;
    a.grid = active_channels(steps[i].count, layout_);  // this step's message alone
    PYCOLL_CUDA_CHECK(launch_steps(call.dtype, a, stream_));
    wait_stream(w);
    host_publish_step(shm_, counters_, steps[i]);
  }
}

// Kernel mode: a launch that only compares calls with every peer (check_call) is the barrier:
// it runs once this rank's queued work has, and ends once every peer's has reached it. Host
// mode meets on the host flags.
void CudaComm::barrier() {
  free_deferred();
  std::lock_guard<std::mutex> g(run_mu_);
  check_usable("barrier");
  DeviceGuard dg(device_);
  const uint64_t seq = ++seq_;
  Fingerprint mine;
  mine.seq = seq;
  mine.kind = kBarrierKind;
  FingerprintGuard guard(shm_, mine);
  WaitContext w = wait_context("barrier", seq);
  try {
    w.fingerprints = &guard;
    guard.publish();
    if (mode_ == SyncMode::Kernel) {
      CollectiveCall none;
      none.barrier = true;
      if (!run_kernel_mode(none, nullptr, mine, stream_, true)) {
        wait_queued(w);  // one rank: nobody to meet, only this rank's queued work to wait for
        check_device_status("barrier");
        return;
      }
      // The watchdog looks after this launch as after a collective's: its device waits cannot
      // see a peer that died, and the host waits on it alone.
      auto work = std::make_shared<CudaWork>(events_, device_, seq);
      PYCOLL_CUDA_CHECK(cudaEventRecord(work->event(), stream_));
      watch(work);
      wait_event(work->event(), w);
      check_device_status("barrier");
      return;
    }
    wait_stream(w);
    check_device_status("barrier");
    host_meet(shm_, ++barrier_epoch_, w);
    if (opts_.check_mismatch) guard.finish(w);
  } catch (const CollectiveMismatch& e) {
    stop_peers_on_mismatch();
    abort(e.what());
    throw;
  } catch (const CollectiveError& e) {
    abort(e.what());
    throw;
  }
}

}  // namespace cuda
}  // namespace pycoll
