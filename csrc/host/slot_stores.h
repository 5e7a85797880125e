// Which stores write the staging slots of a call: ordinary ones, after which the reading core
// takes every line out of the writing core's cache, or non-temporal ones, through memory.
//
// Which is faster depends on where the two cores sit, and a VM's host may move its vCPUs while
// a job runs. On the 2-vCPU EPYC VM of the README, one core writing 256 KiB blocks and the
// other reading them, ordinary against non-temporal stores (cache-line round trip):
//   sharing a cache      (30-50 ns)   32 against 15 GB/s
//   on one socket        (~105 ns)    15 against 15 GB/s
//   across sockets       (~400 ns)   4.3 against 19 GB/s
// and the 2-rank all-reduce of 16 MiB took 2.0-2.3 ms cached against 2.7-2.9 ms streamed in
// the first two placements, 4.6-6.4 ms against 3.2-3.9 ms in the third, which came and went
// for seconds to minutes at a time. So the choice is measured, per kind of call (collective,
// algorithm and size class), and revisited:
//   - a class runs one call each way first, then keeps the faster;
//   - every `probe_every`-th call (8, doubling after each probe that loses, up to 64) runs the
//     other way, and the class switches when that call is at least 10% faster than the median
//     of the last 3 calls run the kept way;
//   - when that median grows 30% past what it was at the last probe (the placement changed),
//     the next call probes at once.
// Every rank decides for itself, from its own clock; ranks making the same calls probe the
// same calls. A rank's choice concerns only the slots it writes, so ranks that choose
// differently still agree on every byte.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <unordered_map>

namespace pycoll {

enum class SlotStores { Auto, Cached, Streamed };
const char* slot_stores_name(SlotStores s);
// "auto", "cached" or "streamed"; InvalidArgument otherwise.
SlotStores parse_slot_stores(const std::string& name);

class SlotStorePolicy {
 public:
  // Calls moving fewer bytes per rank always use ordinary stores: the reader finds small
  // messages in cache, and the difference is within the noise of their timing.
  static constexpr size_t kMinBytes = 64 * 1024;
  static constexpr uint32_t kFirstProbe = 8, kMaxProbe = 64;

  explicit SlotStorePolicy(SlotStores mode = SlotStores::Auto) : mode_(mode) {}
  SlotStores mode() const { return mode_; }

  // Whether the call about to run streams its slots: `kind` names the collective and
  // algorithm, `bytes` its size per rank.
  bool choose(uint32_t kind, size_t bytes);
  // What the call took, in seconds, after it ran its slots as choose() said.
  void record(uint32_t kind, size_t bytes, bool streamed, double seconds);

 private:
  struct Class {
    bool streamed = false;           // the way kept
    std::array<double, 3> recent{};  // the last calls run that way (0: none yet)
    // (the median of 3, the mean of 2)
    size_t next = 0;      // where the next of them goes
    double other = 0;     // the other way's last time (0: never run)
    double at_probe = 0;  // the kept way's median at the last probe
    uint32_t since_probe = 0, probe_every = kFirstProbe;
    bool probe_now = false;
    double median() const;
  };
  Class* find(uint32_t kind, size_t bytes);

  SlotStores mode_;
  std::unordered_map<uint32_t, Class> classes_;
};

}  // namespace pycoll
