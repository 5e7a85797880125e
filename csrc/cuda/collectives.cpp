// CudaComm's calls: the device's primitives under the orchestration (device/orchestration.h)
// on CUDA streams, events and the driver's stream memory operations, and the entry points.
#include <algorithm>
#include <cstdio>

#include "common/errors.h"
#include "cuda/cuda_check.h"
#include "cuda/cuda_comm.h"
#include "cuda/launch.h"
#include "device/stepped.h"
#include "runtime/fingerprint.h"

namespace pycoll {
namespace cuda {

std::shared_ptr<CudaWork> CudaComm::run(const CollectiveCall& call, cudaStream_t stream,
                                        bool async_op) {
  free_deferred();  // frees put off while a collective was in flight (registry.h)
  std::lock_guard<std::mutex> g(run_mu_);
  DeviceGuard dg(device_);
  // A stream being captured into a CUDA graph: the launch is captured, to run at every launch
  // of the graph (its plan pinned), unless a replay could not be right (check_capturable).
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  PYCOLL_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
  const bool capturing = capture == cudaStreamCaptureStatusActive;
  return issue(call, stream, capturing, async_op, [&](const Issued& is) {
    // A blocking kernel-mode call: complete once the done word says so (or, not launched,
    // once the launch before it has); otherwise an event on our stream, which the caller's
    // stream waits for unless the call is async (a capture must end joined: always there).
    if (is.direct) {
      auto work = std::make_shared<CudaWork>(status_keep_, events_, device_, is.seq, stream);
      if (!is.launched) work->not_launched(last_launch_);
      watch(work);
      return work;
    }
    auto work = std::make_shared<CudaWork>(events_, device_, is.seq, capturing);
    PYCOLL_CUDA_CHECK(cudaEventRecord(work->event(), stream_));
    if (!async_op || capturing) PYCOLL_CUDA_CHECK(cudaStreamWaitEvent(stream, work->event(), 0));
    if (!capturing) watch(work);
    return work;
  });
}

void CudaComm::barrier() {
  free_deferred();
  std::lock_guard<std::mutex> g(run_mu_);
  DeviceGuard dg(device_);
  barrier_call();
}

void CudaComm::trace(const ResolvedCall& rc, uint64_t seq) const {
  if (!opts_.debug) return;
  const CollectiveCall& call = *rc.call;
  std::fprintf(stderr,
               "pycollectives INFO rank %d/%d cuda:%d %s #%llu count=%zu %s %s root=%d algo=%s "
               "(%s%s) sync=%s\n",
               rank_, size_, device_, collective_name(call.collective),
               static_cast<unsigned long long>(seq), call.count, dtype_name(call.dtype),
               redop_name(call.op), call.root, algo_name(rc.algo), reason_name(rc.why),
               rc.rank_ordered ? ", rank order" : "", kernel_ ? "kernel" : "stepped");
}

LaunchSetup CudaComm::launch_setup(bool use_flags) const {
  LaunchSetup setup;
  setup.rank = rank_;
  setup.size = size_;
  setup.layout = layout_;
  setup.segments = segments_.data();
  setup.status = status_dev_;
  setup.error_claim = error_claim_;
  setup.timeout_s = timeout_s_.load();
  setup.use_flags = use_flags;
  return setup;
}

void CudaComm::queue_behind(cudaStream_t caller) {
  PYCOLL_CUDA_CHECK(cudaEventRecord(ready_, caller));
  PYCOLL_CUDA_CHECK(cudaStreamWaitEvent(stream_, ready_, 0));
}

void CudaComm::launch(const CollectiveCall& call, const KernelArgs& a, cudaStream_t stream,
                      const WaitContext&) {
  PYCOLL_CUDA_CHECK(launch_steps(call.dtype, a, stream));
}

void CudaComm::copy(void* dst, const void* src, size_t bytes) {
  PYCOLL_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream_));
}

// The stream waits on an event recorded right after the launch before: no block of this launch
// takes an SM while that one runs (residency, backends/cuda/residency.py).
void CudaComm::stream_waits_launch(cudaStream_t stream, const WaitContext&) {
  PYCOLL_CUDA_CHECK(cudaStreamWaitEvent(stream, launch_end_, 0));
}

void CudaComm::launch_ended(cudaStream_t stream, uint64_t) {
  PYCOLL_CUDA_CHECK(cudaEventRecord(launch_end_, stream));
}

// A graph's launch waits on an external event wait node for launch_end_, and records replay_end_
// on an external record node: both bind when the graph is launched, not when it was captured,
// so each replay is ordered after this rank's eager launch issued before it, and the eager
// launches issued after it wait for it.
void CudaComm::replay_waits_launch(cudaStream_t stream, const WaitContext&) {
  PYCOLL_CUDA_CHECK(cudaStreamWaitEvent(stream, launch_end_, cudaEventWaitExternal));
}

void CudaComm::replay_ended(cudaStream_t stream) {
  PYCOLL_CUDA_CHECK(cudaEventRecordWithFlags(replay_end_, stream, cudaEventRecordExternal));
}

void CudaComm::stream_waits_replays(cudaStream_t stream) {
  PYCOLL_CUDA_CHECK(cudaStreamWaitEvent(stream, replay_end_, 0));
}

RegisteredCall CudaComm::registered_of(const CollectiveCall& call, Algo algo) const {
  return registered_call(call, algo, rank_, size_,
                         [&](const void* p, size_t bytes) { return registry_.find(p, bytes); });
}

// The fence counters (counter_fence): the default flags of the write make it a memory barrier
// that orders the stream's earlier writes before it.
void CudaComm::write_counter(uint64_t epoch, const WaitContext& w) {
  const auto at = reinterpret_cast<CUdeviceptr>(segments_[rank_] + layout_.fence_offset());
  if (value_ops_.write(stream_, at, epoch, CU_STREAM_WRITE_VALUE_DEFAULT) != CUDA_SUCCESS)
    throw CollectiveError(
        str_cat(w.collective, " #", w.seq, ": cuStreamWriteValue64 failed on the fence counter"));
}

void CudaComm::wait_counter(int q, uint64_t epoch, const WaitContext& w) {
  const auto at = reinterpret_cast<CUdeviceptr>(segments_[q] + layout_.fence_offset());
  if (value_ops_.wait(stream_, at, epoch, CU_STREAM_WAIT_VALUE_GEQ) != CUDA_SUCCESS)
    throw CollectiveError(str_cat(w.collective, " #", w.seq, ": cuStreamWaitValue64 on rank ", q,
                                  "'s fence counter failed"));
}

void CudaComm::record_fence_event(int k) {
  PYCOLL_CUDA_CHECK(cudaEventRecord(fence_events_[k], stream_));
}

void CudaComm::wait_fence_event(int q, int k, const WaitContext&) {
  PYCOLL_CUDA_CHECK(cudaStreamWaitEvent(stream_, peer_fence_events_[q][k], 0));
}

}  // namespace cuda
}  // namespace pycoll
