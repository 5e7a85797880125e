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
// elements, then the leader publishes the step's messages. A message in the LL format
// (plan.h, ll_message) is not waited for by the leader: every thread polls the words it reads.
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
#define PYCOLL_CHECK_LL_SLOT(p, bytes, seg, layout, block, channel, m) ((void)(bytes))
#else
#define PYCOLL_CHECK_SLOT(p, bytes, seg, layout, block, channel, m) \
  ::pycoll::emu::check_slot(p, bytes, seg, layout, block, channel, m)
#define PYCOLL_CHECK_LL_SLOT(p, bytes, seg, layout, block, channel, m) \
  ::pycoll::emu::check_ll_slot(p, bytes, seg, layout, block, channel, m)
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
  bool failed;  // set by the leader's waits, or by any thread whose LL poll gave up
  // LL: the flag of the message each input pointer reads (by sender rank: in[q] reads q's, in0
  // from's, in1 from2's) and of out0's and out1's.
  uint32_t in_flag[kMaxRanks];
  uint32_t out_flag[2];
  // Kernel mode: out0's and out1's LL sub-slots when they are swept (ll_sweeps), else null;
  // every word from `sweep_from` (the words of the step's own LL message) to the end.
  uint8_t* sweep[2];
  size_t sweep_from;
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

// Polls until ready(at, seen) is true (until then it names a word it waits on and what it saw
// there, for the pause) on rank `peer`'s segment `seg`; false (with the status written) when it
// gives up: at the timeout, when this rank is aborted, or when the peer it waits for has
// stopped on a mismatch.
template <class Ready>
PYCOLL_DEVICE bool poll_until(const KernelArgs& a, const BlockState& s, int block,
                              const uint8_t* seg, int peer, int step, Ready&& ready,
                              uint64_t grace_ns = 0) {
  uint64_t spins = 0;
  const uint64_t* at = nullptr;
  for (uint64_t seen = 0; !ready(at, seen);) {
    poll_pause(at, seen, ++spins);
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
    if (spins >= a.max_spins || global_timer_ns() - s.start_ns > a.timeout_ns + grace_ns) {
      report(a, block, kTimeout, peer, step);
      return false;
    }
  }
  return true;
}

// Waits until *flag >= target, as poll_until.
PYCOLL_DEVICE bool wait_flag(const KernelArgs& a, const BlockState& s, int block,
                             const uint8_t* seg, size_t off, uint64_t target, int peer, int step,
                             uint64_t grace_ns = 0) {
  const uint64_t* flag = reinterpret_cast<const uint64_t*>(seg + off);
  return poll_until(
      a, s, block, seg, peer, step,
      [&](const uint64_t*& at, uint64_t& seen) {
        at = flag;
        seen = ld_acquire_sys(flag);
        return seen >= target;
      },
      grace_ns);
}

// Into rank q's segment (push: a remote write), ordered after the block's stores before it.
PYCOLL_DEVICE void post_flag_to(const KernelArgs& a, int q, size_t off, uint64_t value) {
  st_release_sys(reinterpret_cast<uint64_t*>(a.segments[q] + off), value);
}
// ... into our own.
PYCOLL_DEVICE void post_flag(const KernelArgs& a, size_t off, uint64_t value) {
  post_flag_to(a, a.rank, off, value);
}
// A count that nobody waits on (the posted flag of an LL message: its words carry their own
// flags): kept only as the block's count for later launches (load_own_counts). No fence.
PYCOLL_DEVICE void post_count(const KernelArgs& a, size_t off, uint64_t value) {
  st_relaxed_sys(reinterpret_cast<uint64_t*>(a.segments[a.rank] + off), value);
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

// Whether the block has failed (s.p.failed), as every thread of it sees it: read between two
// barriers, so that no thread writes the flag again (a failing wait in the next phase) before
// every thread has read it. Read with one barrier only, a fast thread's failure in the next
// phase could reach a slow thread still reading it: the two would take different branches and
// wait at different __syncthreads, which hangs or corrupts the block on a GPU.
template <class Threads>
PYCOLL_DEVICE bool block_failed(BlockState& s, const Threads& th) {
  th.sync();
  const bool failed = *static_cast<volatile bool*>(&s.p.failed);
  th.sync();
  return failed;
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
// On a mismatch, a timeout or an abort the status and our failure word are written, and it
// returns false (on every thread of the block alike: block_failed).
template <class Threads>
PYCOLL_DEVICE bool match_calls(const KernelArgs& a, BlockState& s, const Threads& th) {
  const SegmentLayout& L = a.layout;
  const int me = a.rank;
  uint8_t* own = a.segments[me];
  auto peers = [&](auto&& f) {
    th.each([&](int tid, int nt) {
      for (int q = tid; q < L.size; q += nt)
        if (q != me && !s.p.failed && !f(q)) s.p.failed = true;
    });
    return !block_failed(s, th);
  };
  const bool sent = peers([&](int q) {
    CallHeader* h = reinterpret_cast<CallHeader*>(own + L.header_offset(q));
    const uint64_t written = ld_relaxed_sys(&h->n);
    if (!wait_flag(a, s, 0, a.segments[q], L.ack_offset(me), written, q, -1)) return false;
    for (int k = 0; k < 3; ++k) st_relaxed_sys(&h->words[k], a.fingerprint[k]);
    st_release_sys(&h->n, written + 1);
    return true;
  });
  if (!sent) return false;
  return peers([&](int q) {
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
  const bool ll_in = (d.flags & kRecvLL) != 0, ll_out = (d.flags & kSendLL) != 0;
  const uint8_t* base_in = d.src_buf == static_cast<uint8_t>(Buf::Input) ? a.input : a.output;
  p.src = base_in + (d.src_off + sl.lo) * sizeof(T);
  p.dst = a.output + (d.dst_off + sl.lo) * sizeof(T);
  p.in0 = p.in1 = nullptr;
  p.out0 = p.out1 = nullptr;
  p.sweep[0] = p.sweep[1] = nullptr;
  p.sweep_from = ll_out ? ll_words(p.n, out_w) : 0;
  const bool bcast = (d.flags & kRecvBcast) != 0;
  bool ok = true;
  // A block's slice of message m sits at the start of the block's own sub-slot of m's slot (of
  // its LL sub-slot, in the LL format: its words are polled by the threads, not waited for here).
  // Pushed (L.push, not a broadcast): in our own segment, on the sender's channel; else in the
  // sender's, on ours.
  auto incoming = [&](int q) -> const uint8_t* {
    const uint64_t m = s.c.next_in(q, bcast);
    const bool pushed = L.push && !bcast;
    const uint8_t* seg = pushed ? a.segments[me] : a.segments[q];
    const int ch = bcast ? L.size : pushed ? q : me;
    if (ll_in) {
      p.in_flag[q] = ll_flag(m, L);
      const uint8_t* in = seg + L.ll_slot_offset(b, ch, m);
      PYCOLL_CHECK_LL_SLOT(in, 8 * ll_words(p.n, in_w), seg, L, b, ch, m);
      return in;
    }
    const size_t flag = L.flag_offset(b, bcast    ? L.bcast_posted()
                                         : pushed ? L.pushed(q)
                                                  : L.posted(me));
    if (a.use_flags && ok) ok = wait_flag(a, s, b, seg, flag, channel::posted_needed(m), q, i);
    const uint8_t* in = seg + L.slot_offset(b, ch, m);
    PYCOLL_CHECK_SLOT(in, p.n * in_w, seg, L, b, ch, m);
    return in;
  };
  // Pushed: into the receiver's segment, on our channel there, its slot freed by a flag in ours.
  auto outgoing = [&](int t, int k) -> uint8_t* {
    const uint64_t m = s.c.next_out(t);
    const uint64_t need = channel::consumed_needed(m, L.nslots);
    const bool pushed = L.push && t != kAllPeers;
    if (t == kAllPeers) {
      for (int q = 0; q < L.size && a.use_flags && need > 0 && ok; ++q)
        if (q != me)
          ok =
              wait_flag(a, s, b, a.segments[q], L.flag_offset(b, L.bcast_consumed(me)), need, q, i);
    } else if (a.use_flags && need > 0 && ok) {
      const size_t freed = L.flag_offset(b, pushed ? L.freed(t) : L.consumed(me));
      ok = wait_flag(a, s, b, pushed ? a.segments[me] : a.segments[t], freed, need, t, i);
    }
    uint8_t* const seg = pushed ? a.segments[t] : a.segments[me];
    const int ch = t == kAllPeers ? L.size : pushed ? me : t;
    if (a.use_flags && b < L.ll_blocks && ll_sweeps(m, L))
      p.sweep[k] = seg + L.ll_slot_offset(b, ch, m);
    p.out_flag[k] = ll_flag(m, L);  // of an LL message, or of the sweep's blank words
    if (ll_out) {
      uint8_t* out = seg + L.ll_slot_offset(b, ch, m);
      PYCOLL_CHECK_LL_SLOT(out, 8 * ll_words(p.n, out_w), seg, L, b, ch, m);
      return out;
    }
    uint8_t* out = seg + L.slot_offset(b, ch, m);
    PYCOLL_CHECK_SLOT(out, p.n * out_w, seg, L, b, ch, m);
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
      [&](int t) {
        const int k = nout++;
        (k == 0 ? p.out0 : p.out1) = outgoing(t, k);
      });
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
        if (!a.use_flags) return;
        if (L.push && !bcast) {  // the sender polls its own memory; our count stays ours
          post_flag_to(a, q, L.flag_offset(b, L.freed(me)), m);
          post_count(a, L.flag_offset(b, L.consumed(q)), m);
        } else {
          post_flag(a, L.flag_offset(b, bcast ? L.bcast_consumed(q) : L.consumed(q)), m);
        }
      },
      [&](int t) {
        const uint64_t m = s.c.put_out(t);
        const size_t off = L.flag_offset(b, t == kAllPeers ? L.bcast_posted() : L.posted(t));
        if (!a.use_flags) return;
        if (d.flags & kSendLL) {
          post_count(a, off, m);  // the words carry their flags, wherever they went
        } else if (L.push && t != kAllPeers) {
          post_flag_to(a, t, L.flag_offset(b, L.pushed(me)), m);
          post_count(a, off, m);
        } else {
          post_flag(a, off, m);
        }
      });
}

// How move() reaches memory. PlainIo: buffers and slots as they are, in whole 16-byte words
// where `vec`. Its receives never fail: the leader has waited for the messages.
struct PlainIo {
  bool vec;
  template <class X, int E>
  PYCOLL_DEVICE void local_load(X (&v)[E], const void* p, size_t i) const {
    load(v, p, i, vec);
  }
  template <class X, int E>
  PYCOLL_DEVICE void local_store(void* p, size_t i, const X (&v)[E]) const {
    store(p, i, v, vec);
  }
  template <class X, int E>
  PYCOLL_DEVICE bool recv(X (&v)[E], const uint8_t* msg, size_t i, int) const {
    load(v, msg, i, vec);
    return true;
  }
  template <class X, int E>
  PYCOLL_DEVICE void send(uint8_t* msg, int, size_t i, const X (&v)[E]) const {
    store(msg, i, v, vec);
  }
};

// Elements a thread moves at once in a step with LL messages: 8 bytes of the element type, so
// that a group is whole LL words in every wire type (8 or 16 bytes: 2 or 4 words).
template <class T>
constexpr int kLLElems = sizeof(T) >= 8 ? 1 : 8 / static_cast<int>(sizeof(T));

// LLIo: a group of `k` <= E elements (fewer only at the slice's end), read and written one
// element at a time, its LL messages word by word: a receive polls each word until its flag is
// the message's (poll_until's bounds), a send stores payload and flag in one store.
struct LLIo {
  const KernelArgs& a;
  const BlockState& s;
  int block, step;
  size_t k;
  bool ll_in, ll_out;

  template <class X, int E>
  PYCOLL_DEVICE void local_load(X (&v)[E], const void* p, size_t i) const {
    using B = typename BitsOf<sizeof(X)>::type;
    PYCOLL_UNROLL
    for (int j = 0; j < E; ++j)
      v[j] =
          static_cast<size_t>(j) < k
              ? bit_cast<X>(load_bits(reinterpret_cast<const B*>(static_cast<const X*>(p) + i + j)))
              : bit_cast<X>(B{0});
  }
  template <class X, int E>
  PYCOLL_DEVICE void local_store(void* p, size_t i, const X (&v)[E]) const {
    if (p == nullptr) return;
    PYCOLL_UNROLL
    for (int j = 0; j < E; ++j)
      if (static_cast<size_t>(j) < k) store_elem(static_cast<X*>(p) + i + j, v[j]);
  }
  template <class X, int E>
  PYCOLL_DEVICE bool recv(X (&v)[E], const uint8_t* msg, size_t i, int peer) const {
    if (!ll_in) {
      local_load(v, msg, i);
      return true;
    }
    constexpr int W = E * static_cast<int>(sizeof(X)) / 4;
    const uint64_t* words = reinterpret_cast<const uint64_t*>(msg) + i * sizeof(X) / 4;
    const int nw = static_cast<int>(ll_words(k, sizeof(X)));
    const uint32_t flag = s.p.in_flag[peer];
    uint32_t pay[W] = {};
    unsigned got = 0;
    const bool ok = poll_until(a, s, block, a.segments[peer], peer, step,
                               [&](const uint64_t*& at, uint64_t& seen) {
                                 PYCOLL_UNROLL
                                 for (int j = 0; j < W; ++j) {
                                   if (j >= nw || (got >> j & 1u) != 0) continue;
                                   const uint64_t w = ld_relaxed_sys(words + j);
                                   if (static_cast<uint32_t>(w) == flag) {
                                     pay[j] = static_cast<uint32_t>(w >> 32);
                                     got |= 1u << j;
                                   } else {
                                     at = words + j;
                                     seen = w;
                                   }
                                 }
                                 return got == (1u << nw) - 1;
                               });
    memcpy(static_cast<void*>(v), pay, sizeof(pay));
    return ok;
  }
  template <class X, int E>
  PYCOLL_DEVICE void send(uint8_t* msg, int which, size_t i, const X (&v)[E]) const {
    if (msg == nullptr) return;
    if (!ll_out) return local_store(msg, i, v);
    constexpr int W = E * static_cast<int>(sizeof(X)) / 4;
    uint32_t pay[W];
    memcpy(pay, static_cast<const void*>(v), sizeof(pay));
    uint64_t* words = reinterpret_cast<uint64_t*>(msg) + i * sizeof(X) / 4;
    const size_t used = k * sizeof(X);  // payload bytes; the rest of the last word is zero
    const uint32_t flag = s.p.out_flag[which];
    PYCOLL_UNROLL
    for (int j = 0; j < W; ++j) {
      const size_t at = 4 * static_cast<size_t>(j);
      if (at >= used) continue;
      const uint32_t x = used - at >= 4 ? pay[j] : pay[j] & ((1u << (8 * (used - at))) - 1);
      st_ll(words + j, static_cast<uint64_t>(x) << 32 | flag);
    }
  }
};

// Elements [i, i + E) of the block's slice of one step, through `io`; false when a receive
// gave up (its status written).
template <class T, int E, class Io>
PYCOLL_DEVICE bool move(const KernelArgs& a, const StepPtrs& p, const DevStep& d, size_t i,
                        const Io& io) {
  using A = typename Acc<T>::type;
  const StepKind kind = static_cast<StepKind>(d.kind);
  switch (kind) {
    case StepKind::Copy:
    case StepKind::Send: {
      T v[E];
      io.local_load(v, p.src, i);
      if (kind == StepKind::Copy) {
        io.local_store(p.dst, i, v);
      } else if (d.flags & kSendAcc) {
        A w[E];
        PYCOLL_UNROLL
        for (int k = 0; k < E; ++k) w[k] = Acc<T>::load(v[k]);
        io.send(p.out0, 0, i, w);
        io.send(p.out1, 1, i, w);
      } else {
        io.send(p.out0, 0, i, v);
        io.send(p.out1, 1, i, v);
      }
      return true;
    }
    case StepKind::Recv:
    case StepKind::RecvCopySend: {
      T v[E];
      if (!io.recv(v, p.in0, i, d.from)) return false;
      io.send(p.out0, 0, i, v);
      io.send(p.out1, 1, i, v);
      io.local_store(p.dst, i, v);
      return true;
    }
    default:
      break;
  }
  // A reduction: op(op(from, src), from2), or every rank in rank order.
  A acc[E] = {}, x[E];
  T v[E];
  io.local_load(v, p.src, i);
  if (d.from == kAllPeers) {
    for (int q = 0; q < a.layout.size; ++q) {
      if (q == a.rank) {
        PYCOLL_UNROLL
        for (int k = 0; k < E; ++k) x[k] = Acc<T>::load(v[k]);
      } else if (!io.recv(x, p.in[q], i, q)) {
        return false;
      }
      PYCOLL_UNROLL
      for (int k = 0; k < E; ++k) acc[k] = q == 0 ? x[k] : apply_op(a.op, acc[k], x[k]);
    }
  } else {
    if (!io.recv(acc, p.in0, i, d.from)) return false;
    PYCOLL_UNROLL
    for (int k = 0; k < E; ++k) acc[k] = apply_op(a.op, acc[k], Acc<T>::load(v[k]));
    if (p.in1 != nullptr) {
      if (!io.recv(x, p.in1, i, d.from2)) return false;
      PYCOLL_UNROLL
      for (int k = 0; k < E; ++k) acc[k] = apply_op(a.op, acc[k], x[k]);
    }
  }
  if (kind == StepKind::RecvReduceSend) {
    io.send(p.out0, 0, i, acc);
    io.send(p.out1, 1, i, acc);
    return true;
  }
  const bool avg = a.op == static_cast<int>(RedOp::Avg);
  PYCOLL_UNROLL
  for (int k = 0; k < E; ++k)
    v[k] = Acc<T>::store(avg ? acc[k] / static_cast<A>(a.divisor) : acc[k]);
  io.local_store(p.dst, i, v);
  io.send(p.out0, 0, i, v);
  io.send(p.out1, 1, i, v);
  return true;
}

// Elements [lo, lo + len) shared among the block's threads: `f(E, i, vec)` for each group of E
// elements from i (16-byte words where `vec`), then single elements.
template <class T, class F>
PYCOLL_DEVICE void for_groups(size_t lo, size_t len, bool vec, int tid, int nt, F&& f) {
  constexpr int E = kElemsPerThread<T>;
  const size_t groups = vec ? len / E : 0;
  for (size_t g = tid; g < groups; g += nt) f(std::integral_constant<int, E>{}, lo + g * E, true);
  for (size_t j = groups * E + tid; j < len; j += nt)
    f(std::integral_constant<int, 1>{}, lo + j, false);
}

// Thread `tid` of `nt`: its share of the block's slice of step `step`, whole groups first, then
// the tail; in a step with LL messages, groups of kLLElems (the last one shorter), and then
// its share of the swept LL sub-slots' words. A failed LL receive sets s.p.failed: the
// thread stops, and so do the others (at their next group, or at their poll's next check of
// the abort word, which the failure's report set).
template <class T>
PYCOLL_DEVICE void move_step(const KernelArgs& a, BlockState& s, const DevStep& d, int block,
                             int step, int tid, int nt) {
  const StepPtrs& p = s.p;
  const bool skip = static_cast<StepKind>(d.kind) == StepKind::Copy && p.src == p.dst;
  const size_t n = skip ? 0 : p.n;  // in place: nothing moves
  if ((d.flags & (kRecvLL | kSendLL)) == 0) {
    for_groups<T>(0, n, p.vec, tid, nt, [&](auto e, size_t i, bool vec) {
      move<T, decltype(e)::value>(a, p, d, i, PlainIo{vec});
    });
  } else {
    constexpr int E = kLLElems<T>;
    const bool ll_in = (d.flags & kRecvLL) != 0, ll_out = (d.flags & kSendLL) != 0;
    for (size_t i = static_cast<size_t>(tid) * E; i < n; i += static_cast<size_t>(nt) * E) {
      if (*static_cast<volatile bool*>(&s.p.failed)) return;
      const LLIo io{a, s, block, step, n - i < E ? n - i : E, ll_in, ll_out};
      if (!move<T, E>(a, p, d, i, io)) {
        *static_cast<volatile bool*>(&s.p.failed) = true;
        return;
      }
    }
  }
  const size_t words = a.layout.ll_sub_slot_bytes / 8;
  for (int k = 0; k < 2; ++k) {
    if (p.sweep[k] == nullptr) continue;
    uint64_t* w = reinterpret_cast<uint64_t*>(p.sweep[k]);
    const uint64_t blank = p.out_flag[k];  // the message's flag, no payload
    for (size_t j = p.sweep_from + tid; j < words; j += nt) st_relaxed_sys(w + j, blank);
  }
}

// Kernel mode, an eager launch (done_seq != 0), once every thread of the block is done: the
// block is counted, and the last block of the launch to be counted writes the call's number
// into status->done (host-mapped), after every block's writes: the host learns that the call
// has ended with no event.
// Every block ends here, failed or not, so the count always reaches the grid.
template <class Threads>
PYCOLL_DEVICE void finish_launch(const KernelArgs& a, const Threads& th) {
  th.sync();
  if (!th.leader()) return;
  th.ending();
  if (a.done_seq == 0) return;
  fence_device();
  if (count_one(a.finished) + 1 != static_cast<uint32_t>(a.grid)) return;
  *static_cast<volatile uint32_t*>(a.finished) = 0;  // for the next launch, which follows this one
  fence_system();
  st_release_sys(&a.status->done, a.done_seq);
}

// The start of block `b` of a launch, before it moves anything: its own counts, and the call's
// comparison with every peer's (block 0; the other blocks wait at the gate). False when a wait gave
// up. `Threads` is how the block's threads are spelled: CUDA threads on the GPU, a loop over
// emulated threads on the host. It provides leader(), sync(), each(f) (f(tid, nt) for every thread
// of the block this caller runs), and ending() (the leader, as its block ends: a probe for the
// emulated device's checks).
template <class Threads>
PYCOLL_DEVICE bool start_block(const KernelArgs& a, BlockState& s, int b, const Threads& th) {
  if (th.leader()) {
    s.start_ns = global_timer_ns();
    s.p.failed = false;
    s.c = a.counters;
    if (a.use_flags) load_own_counts(a, s.c, b);
  }
  th.sync();
  if (b == 0 && a.matches_calls) {
    if (!match_calls(a, s, th)) return false;  // every thread returns the same
    if (a.gate && th.leader()) post_flag(a, a.layout.gate_offset(), a.done_seq);
  } else if (a.gate) {
    // Block 0's waits give up at the timeout, naming the rank they waited for, and then stop
    // this one (abort): this wait allows as long again, so that block 0's report is the one.
    if (th.leader())
      s.p.failed = !wait_flag(a, s, b, a.segments[a.rank], a.layout.gate_offset(), a.done_seq,
                              a.rank, -2, a.timeout_ns);
    if (block_failed(s, th)) return false;
  }
  return true;
}

// Block `b`'s steps [first_step, end_step), once start_block has let it through.
template <class T, class Threads>
PYCOLL_DEVICE void run_steps(const KernelArgs& a, BlockState& s, int b, const Threads& th) {
  for (uint32_t i = a.first_step; i < a.end_step; ++i) {
    const DevStep d = a.steps[i];
    if (th.leader()) prepare<T>(a, s, d, static_cast<int>(i), b);
    // Between two barriers: a thread's failed LL receive in move_step writes the flag.
    if (block_failed(s, th)) return;
    th.each([&](int tid, int nt) { move_step<T>(a, s, d, b, static_cast<int>(i), tid, nt); });
    th.sync();
    if (s.p.failed) return;  // an LL receive gave up
    if (th.leader()) publish(a, s, d, b);
    // The next step's prepare overwrites s.p only after this barrier.
    th.sync();
  }
}

}  // namespace cuda
}  // namespace pycoll
