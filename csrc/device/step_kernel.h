// The device executor: runs a schedule's steps, the same steps the host executor runs.
//
// Written once, compiled twice: by nvcc into the CUDA kernel (kernels.cu), and by the host
// compiler into the emulated device (emu/), where every rank runs it over shared memory with
// the GPU's segment layout and every access is bounds-checked. What a step sends and receives
// and the posted/consumed protocol come from algo/messages.h, as for every other executor.
//
// Every block is a channel of its own: it carries its slice of every message, in its own
// sub-slot of every staging slot, with its own flags, so blocks never wait for one another.
// The leader thread waits for the step's inputs and space, every thread moves and reduces
// elements, then the leader publishes the step's messages.
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "algo/messages.h"
#include "algo/step.h"
#include "device/kernel_args.h"
#include "device/plan.h"
#include "device/primitives.cuh"

// The emulated device checks that a block's slice of a message stays in the sub-slot the
// layout gives that block (a no-op on the GPU).
#if defined(__CUDACC__)
#define PYCOLL_CHECK_SLOT(p, bytes, seg, layout, block, channel, m) ((void)(bytes))
#else
#define PYCOLL_CHECK_SLOT(p, bytes, seg, layout, block, channel, m) \
  ::pycoll::emu::check_slot(p, bytes, seg, layout, block, channel, m)
#endif

namespace pycoll {
namespace cuda {

// How an element type is accumulated (float32 for the 16-bit floats, as on the host).
template <class T>
struct Acc {
  using type = T;
  static PYCOLL_DEVICE T load(T v) { return v; }
  static PYCOLL_DEVICE T store(T v) { return v; }
};
template <>
struct Acc<DevHalf> {
  using type = float;
  static PYCOLL_DEVICE float load(DevHalf v) { return widen(v); }
  static PYCOLL_DEVICE DevHalf store(float v) { return narrow<DevHalf>(v); }
};
template <>
struct Acc<DevBFloat16> {
  using type = float;
  static PYCOLL_DEVICE float load(DevBFloat16 v) { return widen(v); }
  static PYCOLL_DEVICE DevBFloat16 store(float v) { return narrow<DevBFloat16>(v); }
};

// Elements one thread moves per iteration: whole 16-byte words, several of them, all loaded
// before any is stored so that more than one load is in flight.
template <class T>
constexpr int kElemsPerThread = (sizeof(T) >= 4 ? 4 : 2) * 16 / static_cast<int>(sizeof(T));

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

// The first failure of a launch is recorded, with what `details(v)` adds to it; the host
// reads `code` last.
template <class Details>
PYCOLL_DEVICE void report(const KernelArgs& a, int block, uint32_t code, int peer, int step,
                          Details&& details) {
  DeviceStatus* st = a.status;
  if (claim(a.error_claim)) {
    volatile DeviceStatus* v = st;
    v->peer = peer;
    v->step = step;
    v->block = block;
    details(v);
    fence_system();
    st_relaxed_sys(const_cast<uint32_t*>(&st->code), code);
  }
  st_relaxed_sys(&st->abort, 1u);  // the other blocks stop too
}
PYCOLL_DEVICE void report(const KernelArgs& a, int block, uint32_t code, int peer, int step) {
  report(a, block, code, peer, step, [](volatile DeviceStatus*) {});
}

// A mismatch: the status says which call and with whom, our failure word (read by the peers'
// waits) says that we stopped and why. `theirs`: the peer's header words (null: the mismatch
// was found by another rank, whose failure word is `fail`).
PYCOLL_DEVICE void report_mismatch(const KernelArgs& a, int block, int peer, const uint64_t* theirs,
                                   uint64_t fail) {
  uint64_t* own = reinterpret_cast<uint64_t*>(a.segments[a.rank] + a.layout.fail_offset());
  if (ld_acquire_sys(own) == 0) st_release_sys(own, fail);
  report(a, block, kMismatch, peer, -1, [&](volatile DeviceStatus* v) {
    v->seq = a.seq;
    for (int k = 0; k < 3; ++k) {
      v->mine[k] = a.fingerprint[k];
      v->theirs[k] = theirs != nullptr ? theirs[k] : 0;
    }
    v->fail = fail;
  });
}

// Waits until *flag >= target; false (with the status written) when it gives up: at the
// timeout, when this rank is aborted, or when the peer it waits for has stopped on a mismatch.
PYCOLL_DEVICE bool wait_flag(const KernelArgs& a, const BlockState& s, int block,
                             const uint8_t* seg, size_t off, uint64_t target, int peer, int step) {
  const uint64_t* flag = reinterpret_cast<const uint64_t*>(seg + off);
  uint64_t spins = 0;
  for (uint64_t seen; (seen = ld_acquire_sys(flag)) < target;) {
    poll_pause(flag, seen, ++spins);
    if ((spins & 1023) != 0) continue;
    if (ld_relaxed_sys(&a.status->abort) != 0) {
      report(a, block, kAborted, peer, step);
      return false;
    }
    const uint64_t fail =
        ld_acquire_sys(reinterpret_cast<const uint64_t*>(seg + a.layout.fail_offset()));
    if (fail != 0) {
      report_mismatch(a, block, peer, nullptr, fail);
      return false;
    }
    if (spins >= a.max_spins || global_timer_ns() - s.start_ns > a.timeout_ns) {
      report(a, block, kTimeout, peer, step);
      return false;
    }
  }
  return true;
}

PYCOLL_DEVICE void post_flag(const KernelArgs& a, size_t off, uint64_t value) {
  st_release_sys(reinterpret_cast<uint64_t*>(a.segments[a.rank] + off), value);
}

// Kernel mode: a block carries only the messages its slices are part of, so each block keeps
// its own counts, and they are exactly the flags it writes in its own segment (posted to each
// peer, consumed from each peer, posted and consumed on broadcast channels).
// They were written by this rank's earlier launches, which a launch follows: relaxed loads,
// all in flight at once, instead of one acquire after another.
PYCOLL_DEVICE void load_own_counts(const KernelArgs& a, LaunchCounters& c, int b) {
  const SegmentLayout& L = a.layout;
  auto own = [&](int index) {
    return ld_relaxed_sys(
        reinterpret_cast<const uint64_t*>(a.segments[a.rank] + L.flag_offset(b, index)));
  };
  for (int q = 0; q < L.size; ++q) {
    c.sent[q] = own(L.posted(q));
    c.received[q] = own(L.consumed(q));
    c.bcast_received[q] = own(L.bcast_consumed(q));
  }
  c.bcast_sent = own(L.bcast_posted());
}

// Kernel mode, block 0, before its first step: the call's header goes to every peer, and each
// peer's header for us is compared with ours (thread t looks after peers t, t + nt, ...), so
// every pair of ranks compares its calls, as the host's fingerprint rendezvous did, with no
// host wait. The k-th header of a pair meets the k-th on the other side: a writer overwrites
// its header only once the reader has acknowledged the last one, so a reader sees exactly the
// header it waits for. Every header goes out before any is waited for (a block's threads may
// run one after another: the emulated device's do). Own words (written by this rank's earlier
// launches) and the header's words are read and written relaxed, all in flight at once; the
// header's count (release, read with acquire) and its acknowledgement (likewise) order them.
// On a mismatch, a timeout or an abort the status and our failure word are written and
// `s.p.failed` is set.
template <class Threads>
PYCOLL_DEVICE void check_call(const KernelArgs& a, BlockState& s, const Threads& th) {
  const SegmentLayout& L = a.layout;
  const int me = a.rank;
  uint8_t* own = a.segments[me];
  auto peers = [&](auto&& f) {
    th.each([&](int tid, int nt) {
      for (int q = tid; q < L.size; q += nt)
        if (q != me && !s.p.failed && !f(q)) s.p.failed = true;
    });
    th.sync();
  };
  peers([&](int q) {
    CallHeader* h = reinterpret_cast<CallHeader*>(own + L.header_offset(q));
    const uint64_t written = ld_relaxed_sys(&h->n);
    if (!wait_flag(a, s, 0, a.segments[q], L.ack_offset(me), written, q, -1)) return false;
    for (int k = 0; k < 3; ++k) st_relaxed_sys(&h->words[k], a.fingerprint[k]);
    st_release_sys(&h->n, written + 1);
    return true;
  });
  if (s.p.failed) return;
  peers([&](int q) {
    uint64_t* ack = reinterpret_cast<uint64_t*>(own + L.ack_offset(q));
    const uint64_t want = ld_relaxed_sys(ack) + 1;
    const size_t at = L.header_offset(me);
    if (!wait_flag(a, s, 0, a.segments[q], at + offsetof(CallHeader, n), want, q, -1)) return false;
    const CallHeader* h = reinterpret_cast<const CallHeader*>(a.segments[q] + at);
    uint64_t theirs[3];
    bool same = true;
    for (int k = 0; k < 3; ++k) {
      theirs[k] = ld_relaxed_sys(&h->words[k]);
      same = same && theirs[k] == a.fingerprint[k];
    }
    if (!same) {
      report_mismatch(a, 0, q, theirs, fail_word(me, q));
      return false;
    }
    st_release_sys(ack, want);
    return true;
  });
}

PYCOLL_DEVICE bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

// Leader: finds this block's pointers for step `i` and waits until its inputs have arrived
// and its outgoing slots are free.
template <class T>
PYCOLL_DEVICE void prepare(const KernelArgs& a, BlockState& s, const DevStep& d, int i, int b) {
  using A = typename Acc<T>::type;
  const SegmentLayout& L = a.layout;
  const int me = a.rank;
  const Slice sl = channel_slice(d.count, L, b);
  StepPtrs& p = s.p;
  p.n = sl.hi - sl.lo;
  p.failed = false;
  if (p.n == 0) return;  // not one of this message's channels: nothing to wait for or move
  const size_t in_w = (d.flags & kRecvAcc) ? sizeof(A) : sizeof(T);
  const size_t out_w = (d.flags & kSendAcc) ? sizeof(A) : sizeof(T);
  const uint8_t* base_in = d.src_buf == static_cast<uint8_t>(Buf::Input) ? a.input : a.output;
  p.src = base_in + (d.src_off + sl.lo) * sizeof(T);
  p.dst = a.output + (d.dst_off + sl.lo) * sizeof(T);
  p.in0 = p.in1 = nullptr;
  p.out0 = p.out1 = nullptr;
  const bool bcast = (d.flags & kRecvBcast) != 0;
  bool ok = true;
  // A block's slice of message m sits at the start of the block's own sub-slot of m's slot.
  auto incoming = [&](int q) -> const uint8_t* {
    const uint64_t m = s.c.next_in(q, bcast);
    const size_t flag = L.flag_offset(b, bcast ? L.bcast_posted() : L.posted(me));
    if (a.use_flags && ok)
      ok = wait_flag(a, s, b, a.segments[q], flag, channel::posted_needed(m), q, i);
    const int ch = bcast ? L.size : me;
    const uint8_t* in = a.segments[q] + L.slot_offset(b, ch, m);
    PYCOLL_CHECK_SLOT(in, p.n * in_w, a.segments[q], L, b, ch, m);
    return in;
  };
  auto outgoing = [&](int t) -> uint8_t* {
    const uint64_t m = s.c.next_out(t);
    const uint64_t need = channel::consumed_needed(m, L.nslots);
    if (t == kAllPeers) {
      for (int q = 0; q < L.size && a.use_flags && need > 0 && ok; ++q)
        if (q != me)
          ok =
              wait_flag(a, s, b, a.segments[q], L.flag_offset(b, L.bcast_consumed(me)), need, q, i);
    } else if (a.use_flags && need > 0 && ok) {
      ok = wait_flag(a, s, b, a.segments[t], L.flag_offset(b, L.consumed(me)), need, t, i);
    }
    const int ch = t == kAllPeers ? L.size : t;
    uint8_t* out = a.segments[me] + L.slot_offset(b, ch, m);
    PYCOLL_CHECK_SLOT(out, p.n * out_w, a.segments[me], L, b, ch, m);
    return out;
  };
  int nout = 0;
  for_each_message(
      peers_of(d), me, L.size,
      [&](int q) {
        const uint8_t* in = incoming(q);
        if (d.from == kAllPeers)
          p.in[q] = in;
        else if (q == d.from)
          p.in0 = in;
        else
          p.in1 = in;
      },
      [&](int t) { (nout++ == 0 ? p.out0 : p.out1) = outgoing(t); });
  bool vec = aligned16(p.src) && aligned16(p.dst) && aligned16(p.in0) && aligned16(p.in1) &&
             aligned16(p.out0) && aligned16(p.out1);
  if (d.from == kAllPeers)
    for (int q = 0; q < L.size; ++q) vec = vec && (q == me || aligned16(p.in[q]));
  p.vec = vec;
  p.failed = !ok;
}

// Leader, once every thread is done with the step: frees received slots, publishes sends.
PYCOLL_DEVICE void publish(const KernelArgs& a, BlockState& s, const DevStep& d, int b) {
  if (s.p.n == 0) return;  // the block took no part in this step's messages
  const SegmentLayout& L = a.layout;
  const int me = a.rank;
  const bool bcast = (d.flags & kRecvBcast) != 0;
  for_each_message(
      peers_of(d), me, L.size,
      [&](int q) {
        const uint64_t m = s.c.take_in(q, bcast);
        if (a.use_flags)
          post_flag(a, L.flag_offset(b, bcast ? L.bcast_consumed(q) : L.consumed(q)), m);
      },
      [&](int t) {
        const uint64_t m = s.c.put_out(t);
        if (a.use_flags)
          post_flag(a, L.flag_offset(b, t == kAllPeers ? L.bcast_posted() : L.posted(t)), m);
      });
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
        PYCOLL_UNROLL
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
  A acc[E] = {}, x[E];
  T v[E];
  load(v, p.src, i, vec);
  if (d.from == kAllPeers) {
    for (int q = 0; q < a.layout.size; ++q) {
      if (q == a.rank) {
        PYCOLL_UNROLL
        for (int k = 0; k < E; ++k) x[k] = Acc<T>::load(v[k]);
      } else {
        load(x, p.in[q], i, vec);
      }
      PYCOLL_UNROLL
      for (int k = 0; k < E; ++k) acc[k] = q == 0 ? x[k] : apply_op(a.op, acc[k], x[k]);
    }
  } else {
    load(acc, p.in0, i, vec);
    PYCOLL_UNROLL
    for (int k = 0; k < E; ++k) acc[k] = apply_op(a.op, acc[k], Acc<T>::load(v[k]));
    if (p.in1 != nullptr) {
      load(x, p.in1, i, vec);
      PYCOLL_UNROLL
      for (int k = 0; k < E; ++k) acc[k] = apply_op(a.op, acc[k], x[k]);
    }
  }
  if (kind == StepKind::RecvReduceSend) {
    store(p.out0, i, acc, vec);
    store(p.out1, i, acc, vec);
    return;
  }
  const bool avg = a.op == static_cast<int>(RedOp::Avg);
  PYCOLL_UNROLL
  for (int k = 0; k < E; ++k)
    v[k] = Acc<T>::store(avg ? acc[k] / static_cast<A>(a.divisor) : acc[k]);
  store(p.dst, i, v, vec);
  store(p.out0, i, v, vec);
  store(p.out1, i, v, vec);
}

// Thread `tid` of `nt`: its share of the block's slice, whole groups first, then the tail.
template <class T>
PYCOLL_DEVICE void move_step(const KernelArgs& a, const StepPtrs& p, const DevStep& d, int tid,
                             int nt) {
  constexpr int E = kElemsPerThread<T>;
  const bool skip = static_cast<StepKind>(d.kind) == StepKind::Copy && p.src == p.dst;
  const size_t n = skip ? 0 : p.n;  // in place: nothing moves
  const size_t groups = p.vec ? n / E : 0;
  for (size_t g = tid; g < groups; g += nt) move<T, E>(a, p, d, g * E, true);
  for (size_t j = groups * E + tid; j < n; j += nt) move<T, 1>(a, p, d, j, false);
}

// Runs steps [first_step, end_step) as block `b`. `Threads` is how the block's threads are
// spelled: CUDA threads on the GPU, a loop over emulated threads on the host. It provides
// leader(), sync() and each(f) (f(tid, nt) for every thread of the block this caller runs).
template <class T, class Threads>
PYCOLL_DEVICE void run_block(const KernelArgs& a, BlockState& s, int b, const Threads& th) {
  if (th.leader()) {
    s.c = a.counters;
    if (a.use_flags) load_own_counts(a, s.c, b);
    s.start_ns = global_timer_ns();
    s.p.failed = false;
  }
  if (b == 0 && a.check_calls) {
    th.sync();
    check_call(a, s, th);
    if (s.p.failed) return;
  }
  for (uint32_t i = a.first_step; i < a.end_step; ++i) {
    const DevStep d = a.steps[i];
    if (th.leader()) prepare<T>(a, s, d, static_cast<int>(i), b);
    th.sync();
    if (s.p.failed) return;
    th.each([&](int tid, int nt) { move_step<T>(a, s.p, d, tid, nt); });
    th.sync();
    if (th.leader()) publish(a, s, d, b);
    // The next step's prepare overwrites s.p only after this barrier.
    th.sync();
  }
}

}  // namespace cuda
}  // namespace pycoll
