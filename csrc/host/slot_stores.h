// Which stores write the staging slots of a call: ordinary ones, after which the reading core
// takes every line out of the writing core's cache, or non-temporal ones, through memory.
//
// Which is faster depends on where the two cores sit, and a VM's host may move its vCPUs while
// a job runs. On the 2-vCPU EPYC VM of docs/performance.md, one core writing 256 KiB blocks and
// the other reading them, ordinary against non-temporal stores (cache-line round trip):
//   sharing a cache      (30-50 ns)   32 against 15 GB/s
//   on one socket        (~105 ns)    15 against 15 GB/s
//   across sockets       (~400 ns)   4.3 against 19 GB/s
// and the 2-rank all-reduce of 16 MiB took 2.0-2.3 ms cached against 2.7-2.9 ms streamed in
// the first two placements, 4.6-6.4 ms against 3.2-3.9 ms in the third, which came and went
// for seconds to minutes at a time. So the choice is measured, per kind of call (collective,
// algorithm, in place or not, and size class), and revisited. Each way is judged by the fastest of
// its last 3 calls: a call is only ever slowed down by what runs beside it (a busy thread taking
// the core for a time slice), so the fastest is what the way itself costs.
//   - a class runs 3 calls the ordinary way, then 3 the other, and keeps the faster;
//   - after every `probe_every` calls run the kept way (8, doubling after each probe that
//     loses, up to 64), 3 calls run the other way, and the class switches when they beat the
//     kept way by 10%;
//   - when the kept way's time grows 30% past what it was at the last probe (the placement
//     changed), the probe comes at once.
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
  static constexpr uint32_t kFirstProbe = 8, kMaxProbe = 64, kProbeCalls = 3;

  explicit SlotStorePolicy(SlotStores mode = SlotStores::Auto) : mode_(mode) {}
  SlotStores mode() const { return mode_; }

  // Whether calls of `bytes` per rank are measured (record() wants their times).
  bool measures(size_t bytes) const { return mode_ == SlotStores::Auto && bytes >= kMinBytes; }
  // Whether the call about to run streams its slots: `kind` names the collective, algorithm
  // and whether it runs in place, `bytes` its size per rank.
  bool choose(uint32_t kind, size_t bytes);
  // What the call took, in seconds, after it ran its slots as choose() said.
  void record(uint32_t kind, size_t bytes, bool streamed, double seconds);

 private:
  // The last calls run one way, fastest first out.
  struct Times {
    std::array<double, kProbeCalls> t{};
    uint32_t count = 0;  // calls recorded (the last kProbeCalls kept)
    void add(double seconds) { t[count++ % t.size()] = seconds; }
    bool full() const { return count >= t.size(); }
    double fastest() const;
  };
  struct Class {
    bool streamed = false;  // the way kept
    Times kept, probe;      // the kept way's last calls; the probe under way
    bool probing = false;   // the next calls run the other way
    bool probed = false;    // a probe has run
    double at_probe = 0;    // the kept way's time at the last probe
    uint32_t since_probe = 0, probe_every = kFirstProbe;
    bool next_streamed() const { return streamed != probing; }  // the way the next call runs
  };
  Class* find(uint32_t kind, size_t bytes);

  SlotStores mode_;
  std::unordered_map<uint32_t, Class> classes_;
};

}  // namespace pycoll
