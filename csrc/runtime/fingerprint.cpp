#include "runtime/fingerprint.h"

#include "algo/call.h"
#include "common/errors.h"
#include "common/hash.h"
#include "host/shm_transport.h"
#include "runtime/wait.h"

namespace pycoll {

namespace {

// FNV-1a over a list of per-rank counts; never 0 (0 means even).
uint64_t hash_counts(const std::vector<uint64_t>& counts) {
  Fnv1a f;
  for (uint64_t v : counts) f.mix(v);
  return f.h == 0 || f.h == kSplitsTag ? 1 : f.h;
}

}  // namespace

Fingerprint Fingerprint::of_call(uint64_t seq, const CollectiveCall& call, Algo algo) {
  uint64_t splits = 0;
  if (!call.counts.empty()) splits = hash_counts(call.counts);
  if (!call.send_counts.empty()) splits = kSplitsTag;
  return of_call(seq, call.collective, algo, call.count, call.dtype, call.op, call.root, splits);
}

Fingerprint Fingerprint::of_call(uint64_t seq, Collective c, Algo algo, uint64_t count, DType dtype,
                                 RedOp op, int root, uint64_t splits) {
  Fingerprint f;
  f.seq = seq;
  f.kind = static_cast<int>(c);
  f.algo = static_cast<int>(algo);
  f.count = count;
  f.dtype = static_cast<int>(dtype);
  f.op = carries_partials(c) ? static_cast<int>(op) : 0;
  f.root = has_root(c) ? root : 0;
  f.splits = splits;
  return f;
}

uint64_t Fingerprint::packed() const {
  return static_cast<uint64_t>(kind & 0xff) | static_cast<uint64_t>(algo & 0x7f) << 8 |
         static_cast<uint64_t>(shared) << 15 | static_cast<uint64_t>(dtype & 0xff) << 16 |
         static_cast<uint64_t>(op & 0xff) << 24 |
         static_cast<uint64_t>(static_cast<uint32_t>(root)) << 32;
}

Fingerprint Fingerprint::unpack(uint64_t seq, uint64_t count, uint64_t packed, uint64_t splits) {
  Fingerprint f;
  f.splits = splits;
  f.seq = seq;
  f.count = count;
  f.kind = static_cast<int>(packed & 0xff);
  f.algo = static_cast<int>(packed >> 8 & 0x7f);
  f.shared = (packed >> 15 & 1) != 0;
  f.dtype = static_cast<int>(packed >> 16 & 0xff);
  f.op = static_cast<int>(packed >> 24 & 0xff);
  f.root = static_cast<int32_t>(static_cast<uint32_t>(packed >> 32));
  return f;
}

std::string Fingerprint::describe() const {
  if (kind == kBarrierKind) return "barrier";
  if (kind < 0 || kind >= kNumCollectives) return str_cat("unknown collective ", kind);
  const auto c = static_cast<Collective>(kind);
  std::string s =
      str_cat(collective_name(c), " count=", count,
              " dtype=", valid_dtype(dtype) ? dtype_name(static_cast<DType>(dtype)) : "?");
  if (carries_partials(c))
    s += str_cat(" op=", valid_redop(op) ? redop_name(static_cast<RedOp>(op)) : "?");
  if (has_root(c)) s += str_cat(" root=", root);
  if (splits == kSplitsTag)
    s += " splits=per-rank";
  else if (splits != 0)
    s += str_cat(shared ? " placement=#" : " counts=#", std::hex, splits & 0xffffffff, std::dec);
  s += str_cat(" algorithm=",
               algo >= 0 && algo < kNumAlgos ? algo_name(static_cast<Algo>(algo)) : "?");
  if (shared) s += " shared-buffers";
  return s;
}

std::string Fingerprint::differences(const Fingerprint& o) const {
  std::string d;
  auto add = [&](bool differs, const char* name) {
    if (differs) d += str_cat(d.empty() ? "" : ", ", name);
  };
  add(kind != o.kind, "collective");
  add(count != o.count, "count");
  add(dtype != o.dtype, "dtype");
  add(op != o.op, "op");
  add(root != o.root, "root");
  add(splits != o.splits, kind == static_cast<int>(Collective::AllToAll) ? "splits"
                          : shared || o.shared                           ? "buffer placement"
                                                                         : "counts");
  add(algo != o.algo, "algorithm");
  add(shared != o.shared, "shared buffers (Communicator.empty, register)");
  add(outer != o.outer, "the call across nodes");
  return d;
}

FingerprintGuard::FingerprintGuard(const ShmTransport& t, const Fingerprint& mine)
    : t_(&t), mine_(mine), checked_(t.size(), 0), unchecked_(t.size() - 1) {
  checked_[t.rank()] = 1;
}

void FingerprintGuard::publish() {
  FingerprintSlot& e = t_->fingerprint(t_->rank(), mine_.seq);
  e.seq.store(0, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_release);
  e.count.store(mine_.count, std::memory_order_relaxed);
  e.packed.store(mine_.packed(), std::memory_order_relaxed);
  e.splits.store(mine_.splits, std::memory_order_relaxed);
  for (int i = 0; i < 4; ++i) e.outer[i].store(mine_.outer[i], std::memory_order_relaxed);
  e.seq.store(mine_.seq, std::memory_order_release);
}

namespace {

// The entry `e` as of collective #want: its sequence number (0 while being written, or torn),
// and, when that is `want`, the fingerprint in `out`.
uint64_t read_slot(const FingerprintSlot& e, uint64_t want, Fingerprint* out) {
  const uint64_t s1 = e.seq.load(std::memory_order_acquire);
  if (s1 != want) return s1;
  const uint64_t count = e.count.load(std::memory_order_relaxed);
  const uint64_t packed = e.packed.load(std::memory_order_relaxed);
  const uint64_t splits = e.splits.load(std::memory_order_relaxed);
  CallRecord outer;
  for (int i = 0; i < 4; ++i) outer[i] = e.outer[i].load(std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_acquire);
  if (e.seq.load(std::memory_order_relaxed) != s1) return 0;  // torn: look again
  *out = Fingerprint::unpack(s1, count, packed, splits);
  out->outer = outer;
  return s1;
}

}  // namespace

FingerprintGuard::Seen FingerprintGuard::read(int peer, Fingerprint* out) const {
  const uint64_t s = read_slot(t_->fingerprint(peer, mine_.seq), mine_.seq, out);
  if (s == 0 || s < mine_.seq) return Seen::NotYet;
  if (s > mine_.seq) return Seen::Gone;  // already reused for a later collective
  return out->same_call(mine_) ? Seen::Match : Seen::Mismatch;
}

void FingerprintGuard::check(int peer) {
  if (checked_[peer]) return;
  Fingerprint theirs;
  const Seen s = read(peer, &theirs);
  if (s == Seen::Mismatch) raise_mismatch(peer, theirs);
  if (s != Seen::NotYet) {
    checked_[peer] = 1;
    --unchecked_;
  }
}

void FingerprintGuard::check_arrived() {
  for (int p = 0; p < t_->size() && unchecked_ > 0; ++p) check(p);
}

void FingerprintGuard::finish(const WaitContext& w) {
  for (int p = 0; p < t_->size() && unchecked_ > 0; ++p) {
    if (checked_[p]) continue;
    Fingerprint theirs;
    wait_until([&] { return read(p, &theirs) != Seen::NotYet; }, w, p, WaitFor::Arrival);
    check(p);
  }
}

std::vector<int> FingerprintGuard::missing() const {
  std::vector<int> m;
  for (int p = 0; p < t_->size(); ++p) {
    Fingerprint f;
    if (p != t_->rank() && !checked_[p] && read(p, &f) == Seen::NotYet) m.push_back(p);
  }
  return m;
}

std::vector<int> FingerprintGuard::in_earlier_phase() const {
  std::vector<int> m;
  if (mine_.outer == CallRecord{} || mine_.seq < 2) return m;
  for (int p : missing()) {
    Fingerprint f;
    if (read_slot(t_->fingerprint(p, mine_.seq - 1), mine_.seq - 1, &f) == mine_.seq - 1 &&
        f.outer == mine_.outer)
      m.push_back(p);
  }
  return m;
}

CallRecord FingerprintGuard::outer_of(int peer, const WaitContext& w) const {
  Fingerprint f;
  uint64_t s = 0;
  wait_until(
      [&] {
        s = read_slot(t_->fingerprint(peer, mine_.seq), mine_.seq, &f);
        return s >= mine_.seq;
      },
      w, peer, WaitFor::Arrival);
  if (s != mine_.seq)
    throw CollectiveError(str_cat(name(), " #", mine_.seq, ": rank ", t_->name_of(peer),
                                  " has gone on to later collectives"));
  return f.outer;
}

const char* Fingerprint::name() const {
  if (kind == kBarrierKind) return "barrier";
  if (kind < 0 || kind >= kNumCollectives) return "an unknown collective";
  return collective_name(static_cast<Collective>(kind));
}

const char* FingerprintGuard::name() const { return mine_.name(); }

void FingerprintGuard::raise_mismatch(int first_peer, const Fingerprint& theirs) const {
  const char* name = this->name();
  std::string msg =
      str_cat(name, " #", mine_.seq, ": ranks disagree on the collective (",
              theirs.differences(mine_), "): rank ", t_->name_of(t_->rank()), " runs ",
              mine_.describe(), "; rank ", t_->name_of(first_peer), " runs ", theirs.describe());
  // Name every other rank that has published something different too.
  for (int p = 0; p < t_->size(); ++p) {
    if (p == t_->rank() || p == first_peer) continue;
    Fingerprint f;
    if (read(p, &f) == Seen::Mismatch)
      msg += str_cat("; rank ", t_->name_of(p), " runs ", f.describe());
  }
  throw CollectiveMismatch(msg);
}

}  // namespace pycoll
