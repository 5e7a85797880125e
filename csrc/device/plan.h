// Host-side planning for the CUDA transport: a schedule's steps in the kernel's format.
//
// Pure code (no CUDA calls), so it is built and tested without a GPU.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <tuple>
#include <utility>
#include <vector>

#include "algo/call.h"
#include "algo/messages.h"
#include "algo/schedule.h"
#include "common/dtypes.h"
#include "device/kernel_args.h"

namespace pycoll {
namespace cuda {

// One collective's steps for one rank, and the messages they move on each channel: the host
// advances its counters by these once the steps are queued.
struct Plan {
  std::vector<DevStep> steps;
  MessageCounts<std::vector<uint64_t>> moved;  // by peer
  int grid = 1;                                // blocks a launch runs (plan_grid)
};

// Throws InvalidArgument, before anything moves, for a call the device cannot run: more ranks
// than the kernel arguments hold, or per-rank lists that do not have one entry per rank.
void check_device_call(const CollectiveCall& call, int size);

// Builds rank p.rank's plan. Throws InvalidArgument when a step does not fit the kernel format.
Plan build_plan(Algo a, Collective c, const ScheduleParams& p);

// The schedule parameters of a resolved call on the device: pieces of one staging slot (in
// the wire type of the collective's messages), ring and two-shot shards of whole 16-byte
// words; with `lookahead`, the ring all-reduce's next piece's first message before this
// piece's last (ScheduleParams::lookahead: two messages in flight per channel, as on the
// host). The per-rank counts point into the call, which must outlive the parameters.
inline ScheduleParams plan_params(const ResolvedCall& rc, size_t slot_bytes,
                                  size_t oneshot_max_bytes, bool lookahead = false) {
  return rc.schedule(slot_bytes, oneshot_max_bytes, kSliceAlign, lookahead);
}

// The rank's plan of a resolved call on a device segment laid out as `L` (slots of
// `slot_bytes`): build_plan of plan_params, with the grid its launches run (plan_grid) and its
// messages of at most `ll_max_bytes` in the LL format where they fit (mark_ll; 0: none).
Plan plan_call(const ResolvedCall& rc, const SegmentLayout& L, size_t slot_bytes,
               size_t oneshot_max_bytes, size_t ll_max_bytes = 0, bool lookahead = false);

// Refuses, with a CollectiveError and before anything is exchanged, a call that a CUDA graph
// capture could not replay right: in stepped mode (the host drives every step, between launches),
// or one whose plan is not built yet (it would be built and uploaded inside the capture).
void check_capturable(const char* name, bool kernel_mode, bool plan_ready);

// The automatic choice on the device: direct up to `direct_max_bytes` (of the input), ring
// above; direct always for the collectives that have no ring (all-to-all, gather, scatter).
inline AlgoChoice device_choose(Collective c, size_t bytes, size_t direct_max_bytes) {
  if (!algo_supports(Algo::Ring, c)) return {Algo::Direct, Reason::Default};
  if (bytes <= direct_max_bytes && algo_supports(Algo::Direct, c))
    return {Algo::Direct, Reason::Size};
  return {Algo::Ring, Reason::Size};
}

// What a plan is a function of: the call's shape (the steps depend on the element sizes, not
// on the op) and its per-rank counts. The counts' hash orders keys cheaply; the lists
// themselves decide equality, so two calls whose lists merely hash alike never share a plan.
struct PlanKey {
  std::tuple<int, size_t, int, int, int> shape;  // collective, count, algo, dtype, root
  uint64_t counts_hash = 0;
  std::vector<uint64_t> counts, send_counts, recv_counts;

  PlanKey(const CollectiveCall& call, Algo algo);
  bool operator<(const PlanKey& o) const {
    return std::tie(shape, counts_hash, counts, send_counts, recv_counts) <
           std::tie(o.shape, o.counts_hash, o.counts, o.send_counts, o.recv_counts);
  }
};

// Plans by PlanKey. When full, every entry is dropped at once, after `drop_all` has released
// them (launches may still read them). Calls whose splits change every time (a mixture of
// experts' all-to-all) each build a plan, and refill the cache in 256 calls. A plan that a
// captured launch reads (a CUDA graph replays it any number of times, later) is pinned: it
// leaves the cache's count and is never dropped, and its address stays the same (map nodes).
template <class Entry>
class PlanCache {
 public:
  static constexpr size_t kCapacity = 256;
  using Key = PlanKey;

  template <class Make, class DropAll>
  Entry& get(const CollectiveCall& call, Algo algo, Make&& make, DropAll&& drop_all) {
    Key key(call, algo);
    if (Entry* e = find(key)) return *e;
    if (entries_.size() >= kCapacity) {
      drop_all(entries_);
      entries_.clear();
    }
    return entries_.emplace(std::move(key), make()).first->second;
  }
  // The cached plan of `call`, or null: nothing is built.
  Entry* find(const CollectiveCall& call, Algo algo) { return find(Key(call, algo)); }
  // Keeps `call`'s plan (which must be cached) for the cache's lifetime; returns it.
  Entry& pin(const CollectiveCall& call, Algo algo) {
    Key key(call, algo);
    auto it = entries_.find(key);
    if (it == entries_.end()) return pinned_.at(key);
    return pinned_.insert(entries_.extract(it)).position->second;
  }
  size_t size() const { return entries_.size(); }
  size_t pinned() const { return pinned_.size(); }
  std::map<Key, Entry>& entries() { return entries_; }
  std::map<Key, Entry>& pinned_entries() { return pinned_; }

 private:
  Entry* find(const Key& key) {
    auto it = entries_.find(key);
    if (it != entries_.end()) return &it->second;
    auto p = pinned_.find(key);
    return p != pinned_.end() ? &p->second : nullptr;
  }
  std::map<Key, Entry> entries_;
  std::map<Key, Entry> pinned_;
};

// Elements [lo, hi) of an n-element message that block `block` of `nblocks` carries. Both ends
// of a message compute the same split; the schedules touch memory in whole pieces with fixed
// boundaries, so a block alone ever touches the elements it is given.
struct Slice {
  size_t lo, hi;
};
PYCOLL_HD_INLINE Slice block_slice(size_t n, int nblocks, int block) {
  size_t per = (n + nblocks - 1) / nblocks;
  per = (per + kSliceAlign - 1) / kSliceAlign * kSliceAlign;
  const size_t lo = per * block < n ? per * block : n;
  const size_t hi = lo + per < n ? lo + per : n;
  return Slice{lo, hi};
}

// Blocks that carry a message of n elements: as few as hold it in their sub-slots (counted
// in the widest wire type, with the alignment slack), at most every block. A function of n and
// the layout alone, so both ends of a message agree; blocks past these carry nothing and skip
// the message altogether (kernel mode: no flag waits either).
PYCOLL_HD_INLINE int active_channels(size_t n, const SegmentLayout& L) {
  const size_t cap = (L.sub_slot_bytes - kSliceAlign * 8) / 8;
  const size_t c = (n + cap - 1) / cap;
  return c < 1 ? 1 : c > static_cast<size_t>(L.nblocks) ? L.nblocks : static_cast<int>(c);
}
PYCOLL_HD_INLINE Slice channel_slice(size_t n, const SegmentLayout& L, int block) {
  const int active = active_channels(n, L);
  return block < active ? block_slice(n, active, block) : Slice{n, n};
}

// Blocks a launch of `steps` runs: the most channels any of its messages uses. The blocks past
// it carry none of the messages (channel_slice gives them nothing, on both ends of each message,
// so they neither wait nor count), and are not launched: one block for the smallest calls.
inline int plan_grid(const std::vector<DevStep>& steps, const SegmentLayout& L) {
  int grid = 1;
  for (const DevStep& d : steps) {
    const int c = active_channels(d.count, L);
    grid = c > grid ? c : grid;
  }
  return grid;
}

// The two-shot all-reduce over registered buffers (device/twoshot_kernel.h): rank r owns shard
// r of the message, n contiguous shards of ceil(count / n) elements rounded up to kSliceAlign
// (so every shard starts 16-byte aligned); the last ones may be short or empty.
PYCOLL_HD_INLINE Slice twoshot_shard(size_t count, int size, int rank) {
  return block_slice(count, size, rank);  // the same cut: shards are a launch's blocks of ranks
}
// Blocks a two-shot launch runs: as many as the largest shard (rank 0's) takes channels of the
// layout, the same on every rank (a function of count, size and layout alone); block b of every
// rank meets block b of every other at the barriers, and carries block_slice(shard, grid, b).
PYCOLL_HD_INLINE int twoshot_grid(size_t count, const SegmentLayout& L) {
  const Slice s0 = twoshot_shard(count, L.size, 0);
  return active_channels(s0.hi - s0.lo, L);
}
// The elements a rank covers in a collective over registered buffers (run_registered) of
// `count` elements: its shard in an all-reduce or a reduce, else all of them (reduce-scatter:
// of its block; all-gather: of every rank's block; broadcast: of the buffer).
PYCOLL_HD_INLINE bool registered_sharded(Collective c) {
  return c == Collective::AllReduce || c == Collective::Reduce;
}
PYCOLL_HD_INLINE Slice registered_range(Collective c, size_t count, int size, int rank) {
  return registered_sharded(c) ? twoshot_shard(count, size, rank) : Slice{0, count};
}
// Its blocks, the same on every rank (see twoshot_grid).
PYCOLL_HD_INLINE int registered_grid(Collective c, size_t count, const SegmentLayout& L) {
  return registered_sharded(c) ? twoshot_grid(count, L) : active_channels(count, L);
}

// The low-latency (LL) format. A message in it is written as 8-byte words, each 4 bytes of the
// block's slice (in its wire type, the last word zero-padded) and a 4-byte flag, ll_flag(m) of
// message m, stored together by one 64-bit store; the receiver polls the words themselves until
// every flag is m's, instead of waiting for the posted flag and then reading. It lives in the
// LL area, apart from the slots, so that a word the receiver reads holds either a flag of this
// message or of an earlier LL message of the same slot (or zero, never written): the plain
// format's bytes, being anything, could pass for a flag. The flag is the low ll_flag_bits of m,
// the payload the high half of the word (the emulated device sleeps on the low 32 bits).
PYCOLL_HD_INLINE uint32_t ll_flag(uint64_t m, const SegmentLayout& L) {
  return static_cast<uint32_t>(L.ll_flag_bits >= 32 ? m
                                                    : m & ((uint64_t{1} << L.ll_flag_bits) - 1));
}
// Words of an LL slice of n elements of `width` bytes.
PYCOLL_HD_INLINE size_t ll_words(size_t n, size_t width) { return (n * width + 3) / 4; }
// Flags are compared modulo 2^ll_flag_bits, so a word left from 2^ll_flag_bits messages ago on
// the slot would pass for the current one. The sender of message m rewrites every word of its
// LL sub-slot that m does not cover (with m's flag, no payload) when m is the first message of
// its slot in a window of 2^(ll_flag_bits - 1) messages: then no word a receiver reads is older
// than that window plus nslots messages, less than 2^ll_flag_bits. (Kernel mode only, where a
// block counts exactly the messages it carries, so it sees every m of its channel.)
PYCOLL_HD_INLINE bool ll_sweeps(uint64_t m, const SegmentLayout& L) {
  const uint64_t half = uint64_t{1} << (L.ll_flag_bits - 1);
  return (m - 1) % half < static_cast<uint64_t>(L.nslots);
}
// Whether a message of n elements, `width` bytes each on the wire, travels in the LL format: it
// is at most `ll_max_bytes` (0: never) and each block's LL slice (block 0's is the largest; the
// blocks split it as channel_slice does) fits an LL sub-slot. A function of the message and the
// layout alone: its sender and its receiver, each planning its own side, agree.
PYCOLL_HD_INLINE bool ll_message(size_t n, size_t width, const SegmentLayout& L,
                                 size_t ll_max_bytes) {
  if (n == 0 || n * width > ll_max_bytes || L.ll_sub_slot_bytes == 0) return false;
  if (active_channels(n, L) > L.ll_blocks) return false;
  const Slice s = channel_slice(n, L, 0);
  return 8 * ll_words(s.hi - s.lo, width) <= L.ll_sub_slot_bytes;
}

// Marks the plan's messages that travel in the LL format (kRecvLL, kSendLL), by ll_message of
// each message in its wire type (the accumulation type's `acc_bytes` or the element's).
void mark_ll(Plan& plan, size_t elem_bytes, size_t acc_bytes, const SegmentLayout& L,
             size_t ll_max_bytes);

// Bytes one block's share of a `slot_bytes` slot needs (the largest slice of the largest
// message, in the widest wire type, rounded to 256 bytes).
size_t sub_slot_bytes(size_t slot_bytes, int nblocks);

// The layout of a rank's device segment, with an LL area for messages of up to `ll_max_bytes`
// (0: none) whose flags have `ll_flag_bits` bits (32; fewer in tests, to see them wrap).
SegmentLayout make_layout(int size, int nslots, int nblocks, size_t slot_bytes,
                          size_t ll_max_bytes = 0, int ll_flag_bits = 32);

}  // namespace cuda
}  // namespace pycoll
