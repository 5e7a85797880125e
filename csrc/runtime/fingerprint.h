// Mismatch detection: every rank publishes what it is about to run, and checks its peers'.
//
// Before any data moves, a rank writes the fingerprint of collective #seq (collective,
// algorithm, count, dtype, op, root, and a hash of per-rank counts) into its segment, in a ring of
// recent entries guarded seqlock-style. A node-local phase of a collective over several nodes
// carries the record of the whole call too (`outer`), so that ranks whose calls differ only
// in what the local phase does not see (an all-reduce of 5 and of 6 elements both reduce-scatter
// 3 per rank) still disagree here. A rank checks a peer's entry the first time data arrives
// from that peer, whenever a wait drags on, and, for peers it never heard from, at the end of the
// collective. So a disagreement raises CollectiveMismatch on every rank instead of a silent wrong
// answer or a hang.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

#include "algo/schedule.h"
#include "common/dtypes.h"

namespace pycoll {

class ShmTransport;
struct WaitContext;
struct CollectiveCall;

using CallRecord = std::array<uint64_t, 4>;

struct Fingerprint {
  uint64_t seq = 0;
  int kind = 0;  // a Collective, or kBarrierKind
  int algo = 0;
  uint64_t count = 0;
  int dtype = 0;
  int op = 0;
  int root = 0;
  // 0: even. Per-rank counts of all-gather / reduce-scatter (the same list on every rank):
  // their hash. All-to-all splits (each rank holds its own row): kSplitsTag, the matrix itself
  // being checked apart (runtime/splits.h).
  uint64_t splits = 0;
  // Whether the call starts by trading shared-buffer descriptors (host/shared_buffers.h); on
  // the device transports, whether it runs over registered buffers (then `splits` says where:
  // device/stepped.h, registered_fingerprint).
  bool shared = false;
  // The record of the call across nodes this is a node-local phase of (its packed form, see
  // record()); all zeros for a call of this communicator's own.
  CallRecord outer{};

  // The fingerprint of collective #seq as every rank must call it (op and root only where
  // they matter).
  static Fingerprint of_call(uint64_t seq, Collective c, Algo algo, uint64_t count, DType dtype,
                             RedOp op, int root, uint64_t splits = 0);
  // The fingerprint of `call` (its count and split fields included).
  static Fingerprint of_call(uint64_t seq, const CollectiveCall& call, Algo algo);
  uint64_t packed() const;
  static Fingerprint unpack(uint64_t seq, uint64_t count, uint64_t packed, uint64_t splits);
  std::string describe() const;
  // The collective's name ("barrier" for a barrier).
  const char* name() const;
  // Names of the fields that differ from `o` ("count, dtype").
  std::string differences(const Fingerprint& o) const;
  bool same_call(const Fingerprint& o) const {
    return packed() == o.packed() && count == o.count && splits == o.splits && outer == o.outer;
  }
  // The whole fingerprint as four words (seq, count, packed, splits), as records of calls
  // across nodes travel; from_record reads them back.
  CallRecord record() const { return {seq, count, packed(), splits}; }
  static Fingerprint from_record(const CallRecord& r) { return unpack(r[0], r[1], r[2], r[3]); }
};

constexpr uint64_t kSplitsTag = ~uint64_t{0};

constexpr int kBarrierKind = kNumCollectives;
constexpr int kFingerprintHistory = 8;

// One entry of a segment's fingerprint ring (written only by the segment's owner).
struct alignas(64) FingerprintSlot {
  std::atomic<uint64_t> seq;  // 0 while being written
  std::atomic<uint64_t> count;
  std::atomic<uint64_t> packed;
  std::atomic<uint64_t> splits;
  std::atomic<uint64_t> outer[4];  // Fingerprint::outer
};

class FingerprintGuard {
 public:
  FingerprintGuard(const ShmTransport& t, const Fingerprint& mine);

  // Writes our fingerprint; call before any data moves.
  void publish();
  // Checks `peer` if not yet done and it has published (throws CollectiveMismatch).
  void check(int peer);
  // Checks every peer that has published.
  void check_arrived();
  // Waits for every unchecked peer to publish, and checks it.
  void finish(const WaitContext& w);
  // Ranks that have not yet started this collective.
  std::vector<int> missing() const;
  // Of those, the ranks whose latest entry is an earlier node-local phase of the same call
  // across nodes (they started the call, and are in another phase of it).
  std::vector<int> in_earlier_phase() const;
  // `peer`'s record of the call across nodes in its entry for this collective (ours too),
  // whatever the rest of that entry says; waits for it, bounded by `w`.
  CallRecord outer_of(int peer, const WaitContext& w) const;
  // Whether every peer has been checked.
  bool done() const { return unchecked_ == 0; }
  const Fingerprint& mine() const { return mine_; }
  // The collective's name, for messages ("barrier" for a barrier).
  const char* name() const;

 private:
  enum class Seen { NotYet, Match, Mismatch, Gone };
  Seen read(int peer, Fingerprint* out) const;
  [[noreturn]] void raise_mismatch(int first_peer, const Fingerprint& theirs) const;

  const ShmTransport* t_;  // a pointer: guards are kept in vectors (HostComm::deferred_)
  Fingerprint mine_;
  std::vector<char> checked_;
  int unchecked_;
};

}  // namespace pycoll
