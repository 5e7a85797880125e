// The device executor: runs a schedule's steps, the same steps the host executor runs.
//
// One kernel per element type; the reduction op is a runtime switch (uniform across a block,
// so it costs a predictable branch, not an instantiation per op). Every block is a channel of
// its own: it carries its slice of every message, with its own flags, so blocks never wait
// for one another. Thread 0 waits for the step's inputs and space, every thread moves and
// reduces elements, then thread 0 publishes the step's messages.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "algo/ops.h"
#include "common/dtypes.h"
#include "cuda/device_primitives.cuh"
#include "cuda/launch.h"
#include "cuda/plan.h"

namespace pycoll {
namespace cuda {
namespace {

// How an element type is accumulated (float32 for the 16-bit floats, as on the host).
template <class T>
struct Acc {
  using type = T;
  static PYCOLL_DEVICE T load(T v) { return v; }
  static PYCOLL_DEVICE T store(T v) { return v; }
};
template <>
struct Acc<__half> {
  using type = float;
  static PYCOLL_DEVICE float load(__half v) { return __half2float(v); }
  static PYCOLL_DEVICE __half store(float v) { return __float2half_rn(v); }
};
template <>
struct Acc<__nv_bfloat16> {
  using type = float;
  static PYCOLL_DEVICE float load(__nv_bfloat16 v) { return __bfloat162float(v); }
  static PYCOLL_DEVICE __nv_bfloat16 store(float v) { return __float2bfloat16_rn(v); }
};

// Integers wrap like numpy's: arithmetic in the unsigned type of at least int's width.
template <class A>
PYCOLL_DEVICE A apply_op(int op, A a, A b) {
  if constexpr (std::is_integral_v<A>) {
    using U = std::conditional_t<(sizeof(A) < sizeof(unsigned)), unsigned, std::make_unsigned_t<A>>;
    switch (op) {
      case static_cast<int>(RedOp::Prod):
        return static_cast<A>(static_cast<U>(a) * static_cast<U>(b));
      case static_cast<int>(RedOp::Min):
        return a < b ? a : b;
      case static_cast<int>(RedOp::Max):
        return a > b ? a : b;
      default:
        return static_cast<A>(static_cast<U>(a) + static_cast<U>(b));
    }
  } else {
    // min and max propagate NaN like numpy.minimum / numpy.maximum.
    switch (op) {
      case static_cast<int>(RedOp::Prod):
        return a * b;
      case static_cast<int>(RedOp::Min):
        return (a < b || a != a) ? a : b;
      case static_cast<int>(RedOp::Max):
        return (a > b || a != a) ? a : b;
      default:
        return a + b;
    }
  }
}

// Pointers of one step for this block, already advanced to its slice.
struct StepPtrs {
  const uint8_t* in[kMaxRanks];  // incoming message by sender rank (reductions over all ranks)
  const uint8_t* in0;            // from `from`
  const uint8_t* in1;            // from `from2`
  uint8_t* out0;                 // to `to` (or our broadcast channel)
  uint8_t* out1;                 // to `to2`
  const uint8_t* src;
  uint8_t* dst;
  size_t n;
  bool vec;
  bool failed;
};

struct BlockState {
  LaunchCounters c;
  StepPtrs p;
  uint64_t start_ns;
};

// The first failure of a launch is recorded. Arbitration happens in device memory (atomics on
// mapped host memory are not available over every bus); the host reads `code` last.
PYCOLL_DEVICE void report(const KernelArgs& a, uint32_t code, int peer, int step) {
  DeviceStatus* st = a.status;
  if (atomicCAS(a.error_claim, 0u, 1u) == 0u) {
    volatile DeviceStatus* v = st;
    v->peer = peer;
    v->step = step;
    v->block = static_cast<int>(blockIdx.x);
    __threadfence_system();  // the error path only: the details before the code
    st_relaxed_sys(const_cast<uint32_t*>(&st->code), code);
  }
  st_relaxed_sys(&st->abort, 1u);  // the other blocks stop too
}

// Waits until *flag >= target; false (with the status written) when it gives up.
PYCOLL_DEVICE bool wait_flag(const KernelArgs& a, BlockState& s, const uint8_t* seg, size_t off,
                             uint64_t target, int peer, int step) {
  const uint64_t* flag = reinterpret_cast<const uint64_t*>(seg + off);
  uint64_t spins = 0;
  while (ld_acquire_sys(flag) < target) {
    if ((++spins & 1023) != 0) continue;
    if (ld_relaxed_sys(&a.status->abort) != 0) {
      report(a, kAborted, peer, step);
      return false;
    }
    if (spins >= a.max_spins || global_timer_ns() - s.start_ns > a.timeout_ns) {
      report(a, kTimeout, peer, step);
      return false;
    }
  }
  return true;
}

PYCOLL_DEVICE void post_flag(const KernelArgs& a, size_t off, uint64_t value) {
  st_release_sys(reinterpret_cast<uint64_t*>(a.segments[a.rank] + off), value);
}

PYCOLL_DEVICE bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

// Thread 0: finds this block's pointers for step `i` and waits until its inputs have arrived
// and its outgoing slots are free.
template <class T>
PYCOLL_DEVICE void prepare(const KernelArgs& a, BlockState& s, const DevStep& d, int i) {
  using A = typename Acc<T>::type;
  const SegmentLayout& L = a.layout;
  const int me = a.rank, b = static_cast<int>(blockIdx.x);
  const Slice sl = block_slice(d.count, L.nblocks, b);
  StepPtrs& p = s.p;
  p.n = sl.hi - sl.lo;
  p.failed = false;
  const size_t in_w = (d.flags & kRecvAcc) ? sizeof(A) : sizeof(T);
  const size_t out_w = (d.flags & kSendAcc) ? sizeof(A) : sizeof(T);
  const uint8_t* base_in = d.src_buf == static_cast<uint8_t>(Buf::Input) ? a.input : a.output;
  p.src = base_in + (d.src_off + sl.lo) * sizeof(T);
  p.dst = a.output + (d.dst_off + sl.lo) * sizeof(T);
  p.in0 = p.in1 = nullptr;
  p.out0 = p.out1 = nullptr;
  const StepKind kind = static_cast<StepKind>(d.kind);
  const bool bcast = (d.flags & kRecvBcast) != 0;
  bool ok = true;
  auto incoming = [&](int q) -> const uint8_t* {
    const uint64_t m = (bcast ? s.c.bcast_received[q] : s.c.received[q]) + 1;
    const int channel = bcast ? L.size : me;
    const size_t flag = bcast ? L.flag_offset(b, L.bcast_posted()) : L.flag_offset(b, L.posted(me));
    if (a.use_flags && ok) ok = wait_flag(a, s, a.segments[q], flag, m, q, i);
    return a.segments[q] + L.slot_offset(b, channel, m) + sl.lo * in_w;
  };
  auto outgoing = [&](int t) -> uint8_t* {
    const uint64_t k = static_cast<uint64_t>(L.nslots);
    if (t == kAllPeers) {
      const uint64_t m = s.c.bcast_sent + 1;
      for (int q = 0; q < L.size && a.use_flags && m > k && ok; ++q)
        if (q != me)
          ok = wait_flag(a, s, a.segments[q], L.flag_offset(b, L.bcast_consumed(me)), m - k, q, i);
      return a.segments[me] + L.slot_offset(b, L.size, m) + sl.lo * out_w;
    }
    const uint64_t m = s.c.sent[t] + 1;
    if (a.use_flags && m > k && ok)
      ok = wait_flag(a, s, a.segments[t], L.flag_offset(b, L.consumed(me)), m - k, t, i);
    return a.segments[me] + L.slot_offset(b, t, m) + sl.lo * out_w;
  };
  if (kind != StepKind::Send && kind != StepKind::Copy) {
    if (d.from == kAllPeers) {
      for (int q = 0; q < L.size; ++q) p.in[q] = q == me ? nullptr : incoming(q);
    } else {
      p.in0 = incoming(d.from);
      if (d.from2 != kNoPeer) p.in1 = incoming(d.from2);
    }
  }
  if (kind == StepKind::Send || kind == StepKind::RecvReduceSend ||
      kind == StepKind::RecvReduceCopySend || kind == StepKind::RecvCopySend) {
    p.out0 = outgoing(d.to);
    if (d.to2 != kNoPeer) p.out1 = outgoing(d.to2);
  }
  bool vec = aligned16(p.src) && aligned16(p.dst) && aligned16(p.in0) && aligned16(p.in1) &&
             aligned16(p.out0) && aligned16(p.out1);
  if (d.from == kAllPeers)
    for (int q = 0; q < L.size; ++q) vec = vec && aligned16(p.in[q]);
  p.vec = vec;
  p.failed = !ok;
}

// Thread 0, once every thread is done with the step: publishes sends, frees received slots.
PYCOLL_DEVICE void publish(const KernelArgs& a, BlockState& s, const DevStep& d) {
  const SegmentLayout& L = a.layout;
  const int me = a.rank, b = static_cast<int>(blockIdx.x);
  const StepKind kind = static_cast<StepKind>(d.kind);
  const bool bcast = (d.flags & kRecvBcast) != 0;
  auto received = [&](int q) {
    if (bcast) {
      const uint64_t m = ++s.c.bcast_received[q];
      if (a.use_flags) post_flag(a, L.flag_offset(b, L.bcast_consumed(q)), m);
    } else {
      const uint64_t m = ++s.c.received[q];
      if (a.use_flags) post_flag(a, L.flag_offset(b, L.consumed(q)), m);
    }
  };
  auto sent = [&](int t) {
    if (t == kAllPeers) {
      const uint64_t m = ++s.c.bcast_sent;
      if (a.use_flags) post_flag(a, L.flag_offset(b, L.bcast_posted()), m);
    } else {
      const uint64_t m = ++s.c.sent[t];
      if (a.use_flags) post_flag(a, L.flag_offset(b, L.posted(t)), m);
    }
  };
  if (kind != StepKind::Send && kind != StepKind::Copy) {
    if (d.from == kAllPeers) {
      for (int q = 0; q < L.size; ++q)
        if (q != me) received(q);
    } else {
      received(d.from);
      if (d.from2 != kNoPeer) received(d.from2);
    }
  }
  if (s.p.out0 != nullptr) sent(d.to);
  if (s.p.out1 != nullptr) sent(d.to2);
}

// Elements [i, i + E) of the block's slice of one step.
template <class T, int E>
PYCOLL_DEVICE void move(const KernelArgs& a, const StepPtrs& p, const DevStep& d, size_t i,
                        bool vec) {
  using A = typename Acc<T>::type;
  const StepKind kind = static_cast<StepKind>(d.kind);
  switch (kind) {
    case StepKind::Copy:
    case StepKind::Send: {
      T v[E];
      load(v, p.src, i, vec);
      if (kind == StepKind::Copy) {
        store(p.dst, i, v, vec);
      } else if (d.flags & kSendAcc) {
        A w[E];
#pragma unroll
        for (int k = 0; k < E; ++k) w[k] = Acc<T>::load(v[k]);
        store(p.out0, i, w, vec);
        store(p.out1, i, w, vec);
      } else {
        store(p.out0, i, v, vec);
        store(p.out1, i, v, vec);
      }
      return;
    }
    case StepKind::Recv:
    case StepKind::RecvCopySend: {
      T v[E];
      load(v, p.in0, i, vec);
      store(p.out0, i, v, vec);
      store(p.out1, i, v, vec);
      store(p.dst, i, v, vec);
      return;
    }
    default:
      break;
  }
  // A reduction: op(op(from, src), from2), or every rank in rank order.
  A acc[E], x[E];
  T v[E];
  load(v, p.src, i, vec);
  if (d.from == kAllPeers) {
    for (int q = 0; q < a.layout.size; ++q) {
      if (q == a.rank) {
#pragma unroll
        for (int k = 0; k < E; ++k) x[k] = Acc<T>::load(v[k]);
      } else {
        load(x, p.in[q], i, vec);
      }
#pragma unroll
      for (int k = 0; k < E; ++k) acc[k] = q == 0 ? x[k] : apply_op(a.op, acc[k], x[k]);
    }
  } else {
    load(acc, p.in0, i, vec);
#pragma unroll
    for (int k = 0; k < E; ++k) acc[k] = apply_op(a.op, acc[k], Acc<T>::load(v[k]));
    if (p.in1 != nullptr) {
      load(x, p.in1, i, vec);
#pragma unroll
      for (int k = 0; k < E; ++k) acc[k] = apply_op(a.op, acc[k], x[k]);
    }
  }
  if (kind == StepKind::RecvReduceSend) {
    store(p.out0, i, acc, vec);
    store(p.out1, i, acc, vec);
    return;
  }
  const bool avg = a.op == static_cast<int>(RedOp::Avg);
#pragma unroll
  for (int k = 0; k < E; ++k)
    v[k] = Acc<T>::store(avg ? acc[k] / static_cast<A>(a.divisor) : acc[k]);
  store(p.dst, i, v, vec);
  store(p.out0, i, v, vec);
  store(p.out1, i, v, vec);
}

// One block per SM is all a launch needs (a handful of channels): promising no more lets
// ptxas use ~106 registers instead of 64, without which every type spilled 100-150 bytes.
template <class T>
__global__ void __launch_bounds__(kThreadsPerBlock, 1) steps_kernel(const KernelArgs a) {
  constexpr int E = 16 / sizeof(T) > 0 ? 16 / sizeof(T) : 1;
  __shared__ BlockState s;
  const int tid = static_cast<int>(threadIdx.x), nt = static_cast<int>(blockDim.x);
  if (tid == 0) {
    s.c = a.counters;
    s.start_ns = global_timer_ns();
  }
  for (uint32_t i = a.first_step; i < a.end_step; ++i) {
    const DevStep d = a.steps[i];
    if (tid == 0) prepare<T>(a, s, d, static_cast<int>(i));
    __syncthreads();
    if (s.p.failed) return;
    const StepKind kind = static_cast<StepKind>(d.kind);
    const bool skip = kind == StepKind::Copy && s.p.src == s.p.dst;  // in place: nothing moves
    const size_t n = skip ? 0 : s.p.n;
    const size_t groups = s.p.vec ? n / E : 0;
    for (size_t g = tid; g < groups; g += nt) move<T, E>(a, s.p, d, g * E, true);
    for (size_t j = groups * E + tid; j < n; j += nt) move<T, 1>(a, s.p, d, j, false);
    __syncthreads();
    if (tid == 0) publish(a, s, d);
    // The next step's prepare overwrites s.p only after this barrier.
    __syncthreads();
  }
}

template <class T>
cudaError_t launch(const KernelArgs& args, cudaStream_t stream) {
  steps_kernel<T><<<args.layout.nblocks, kThreadsPerBlock, 0, stream>>>(args);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_steps(DType dtype, const KernelArgs& args, cudaStream_t stream) {
  if (args.first_step >= args.end_step) return cudaSuccess;
  switch (dtype) {
    case DType::Int8:
      return launch<int8_t>(args, stream);
    case DType::UInt8:
      return launch<uint8_t>(args, stream);
    case DType::Int32:
      return launch<int32_t>(args, stream);
    case DType::Int64:
      return launch<long long>(args, stream);
    case DType::Float16:
      return launch<__half>(args, stream);
    case DType::BFloat16:
      return launch<__nv_bfloat16>(args, stream);
    case DType::Float32:
      return launch<float>(args, stream);
    case DType::Float64:
      return launch<double>(args, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace cuda
}  // namespace pycoll
