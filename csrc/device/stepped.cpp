#include "device/stepped.h"

#include "common/errors.h"
#include "device/plan.h"

namespace pycoll {
namespace cuda {

void stepped_wait_step(const ShmTransport& shm, const ChannelCounters& c, const DevStep& d,
                       const WaitContext& w) {
  const int me = shm.rank(), size = shm.size();
  const bool bcast = (d.flags & kRecvBcast) != 0;
  auto wait_for = [&](const std::atomic<uint64_t>& counter, uint64_t need, int peer, WaitFor why) {
    wait_until([&] { return counter.load(std::memory_order_acquire) >= need; }, w, peer, why,
               kSteppedMaxSleepNs);
  };
  for_each_message(
      peers_of(d), me, size,
      [&](int q) {
        const uint64_t need = channel::posted_needed(c.next_in(q, bcast));
        wait_for(bcast ? shm.bcast_posted(q) : shm.posted(q, me), need, q, WaitFor::Data);
      },
      [&](int t) {
        const uint64_t need = channel::consumed_needed(c.next_out(t), shm.nslots());
        if (need == 0) return;
        for (int q = 0; q < size; ++q) {
          if (q == me || (t != kAllPeers && q != t)) continue;
          wait_for(t == kAllPeers ? shm.bcast_consumed(q, me) : shm.consumed(t, me), need, q,
                   WaitFor::Space);
        }
      });
}

void stepped_publish_step(const ShmTransport& shm, ChannelCounters& c, const DevStep& d) {
  const int me = shm.rank();
  const bool bcast = (d.flags & kRecvBcast) != 0;
  for_each_message(
      peers_of(d), me, shm.size(),
      [&](int q) {
        auto& consumed = bcast ? shm.bcast_consumed(me, q) : shm.consumed(me, q);
        consumed.store(c.take_in(q, bcast), std::memory_order_release);
      },
      [&](int t) {
        auto& posted = t == kAllPeers ? shm.bcast_posted(me) : shm.posted(me, t);
        posted.store(c.put_out(t), std::memory_order_release);
      });
}

}  // namespace cuda
}  // namespace pycoll

namespace pycoll {
namespace cuda {

KernelArgs make_kernel_args(const LaunchSetup& setup, const CollectiveCall& call,
                            const DevStep* steps, size_t nsteps, int grid,
                            const ChannelCounters& c) {
  KernelArgs a{};
  a.steps = steps;
  a.first_step = 0;
  a.end_step = static_cast<uint32_t>(nsteps);
  a.use_flags = setup.use_flags;
  a.rank = setup.rank;
  a.op = static_cast<int>(call.op);
  a.divisor = setup.size;
  a.input = static_cast<const uint8_t*>(call.in);
  a.output = static_cast<uint8_t*>(call.out);
  for (int r = 0; r < setup.size; ++r) {
    a.segments[r] = setup.segments[r];
    a.counters.sent[r] = c.sent[r];
    a.counters.received[r] = c.received[r];
    a.counters.bcast_received[r] = c.bcast_received[r];
  }
  a.counters.bcast_sent = c.bcast_sent;
  a.layout = setup.layout;
  a.grid = grid;
  a.status = setup.status;
  a.error_claim = setup.error_claim;
  a.timeout_ns = static_cast<uint64_t>(setup.timeout_s * 1e9);
  // Far more polls than fit in the timeout: the clock, not the count, normally ends a wait.
  a.max_spins = static_cast<uint64_t>(setup.timeout_s * 1e9);
  return a;
}

void check_on_device(KernelArgs& a, const Fingerprint& f) {
  a.matches_calls = a.layout.size > 1;
  a.seq = f.seq;
  a.fingerprint[0] = f.packed();
  a.fingerprint[1] = f.count;
  a.fingerprint[2] = f.splits;
}

void host_meet(const ShmTransport& shm, uint64_t epoch, const WaitContext& w) {
  shm.barrier(shm.rank()).store(epoch, std::memory_order_release);
  for (int r = 0; r < shm.size(); ++r) {
    if (r == shm.rank()) continue;
    auto& flag = shm.barrier(r);
    wait_until([&] { return flag.load(std::memory_order_acquire) >= epoch; }, w, r,
               WaitFor::Barrier);
  }
}

size_t scratch_elems(const SegmentLayout& L, size_t esize) {
  return (L.data_end() - L.flags_bytes) / esize / kSliceAlign * kSliceAlign;
}

std::vector<uint8_t*> scratch_of(const SegmentLayout& L, uint8_t* const* segments) {
  std::vector<uint8_t*> s(L.size);
  for (int q = 0; q < L.size; ++q) s[q] = segments[q] + L.flags_bytes;
  return s;
}

namespace {

void set_reg(KernelArgs& a, Collective kind, int root, size_t count,
             const std::vector<uint8_t*>& in, const std::vector<uint8_t*>& out) {
  const int n = a.layout.size;
  if (static_cast<int>(in.size()) != n || static_cast<int>(out.size()) != n)
    throw InvalidArgument("registered buffers: one input and one output per rank expected");
  a.reg.on = true;
  a.reg.kind = static_cast<int>(kind);
  a.reg.root = root;
  a.reg.count = count;
  for (int q = 0; q < n; ++q) {
    a.reg.in[q] = in[q];
    a.reg.out[q] = out[q];
  }
  a.steps = nullptr;
  a.first_step = 0;
  a.end_step = 1;
  a.grid = registered_grid(kind, count, a.layout);
}

}  // namespace

void set_twoshot(KernelArgs& a, size_t count, const std::vector<uint8_t*>& in,
                 const std::vector<uint8_t*>& out) {
  set_reg(a, Collective::AllReduce, 0, count, in, out);
}

void set_registered(KernelArgs& a, const CollectiveCall& call, const std::vector<uint8_t*>& in,
                    const std::vector<uint8_t*>& out) {
  set_reg(a, call.collective, call.root, call.count, in, out);
}

std::string device_mismatch_message(const char* name, const DeviceStatus& st, int rank) {
  const Fingerprint mine = Fingerprint::unpack(st.seq, st.mine[1], st.mine[0], st.mine[2]);
  if (fail_finder(st.fail) != rank) {  // found by another rank: who stopped first
    const int finder = fail_finder(st.fail), other = fail_other(st.fail);
    const std::string found = other == finder
                                  ? str_cat("rank ", finder, " found a mismatch")
                                  : str_cat("rank ", finder, "'s call differs from rank ", other,
                                            "'s (found by rank ", finder, ")");
    return str_cat(name, " #", st.seq, ": ranks disagree on the collective: ", found, "; rank ",
                   rank, " runs ", mine.describe(), " and stopped waiting for rank ", st.peer);
  }
  const Fingerprint theirs = Fingerprint::unpack(st.seq, st.theirs[1], st.theirs[0], st.theirs[2]);
  return str_cat(name, " #", st.seq, ": ranks disagree on the collective (",
                 theirs.differences(mine), "): rank ", rank, " runs ", mine.describe(), "; rank ",
                 st.peer, " runs ", theirs.describe(), " (found on the device)");
}

std::string device_wait_target(const DeviceStatus& st, int rank) {
  if (st.peer == rank && st.step == -2)
    return str_cat("this rank's comparison of the call with its peers (block ", st.block, ")");
  return str_cat("rank ", st.peer, " (step ", st.step, ", block ", st.block, ")");
}

}  // namespace cuda
}  // namespace pycoll
