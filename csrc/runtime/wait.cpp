#include "runtime/wait.h"

#include <signal.h>
#include <sys/prctl.h>

#include <algorithm>
#include <cerrno>
#include <string>
#include <vector>

#include "common/errors.h"
#include "host/shm_transport.h"
#include "runtime/fingerprint.h"
#include "runtime/flight_recorder.h"

namespace pycoll {

Sleeper::~Sleeper() {
  if (saved_slack_ >= 0)
    prctl(PR_SET_TIMERSLACK, static_cast<unsigned long>(saved_slack_), 0, 0, 0);
}

void Sleeper::sleep() {
  if (saved_slack_ < 0) {
    saved_slack_ = prctl(PR_GET_TIMERSLACK, 0, 0, 0, 0);
    prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0);
  }
  const long cap =
      Yield::contended(Clock::now()) ? std::min(max_ns_, Yield::kBusySleepNs) : max_ns_;
  if (ns_ > cap) ns_ = cap;
  struct timespec ts{0, ns_};
  nanosleep(&ts, nullptr);
  ns_ = ns_ * 2 < cap ? ns_ * 2 : cap;
}

void check_wait(const WaitContext& ctx, int peer) {
  if (ctx.abort != nullptr && ctx.abort->load(std::memory_order_relaxed))
    throw CollectiveError(str_cat(ctx.collective, " #", ctx.seq, ": communicator was aborted"));
  if (ctx.fingerprints != nullptr) ctx.fingerprints->check_arrived();
  if (ctx.deferred != nullptr)
    for (FingerprintGuard& g : *ctx.deferred) g.check_arrived();
  if (ctx.transport != nullptr) {
    const int revoker = ctx.transport->revoker();
    if (revoker >= 0)
      throw CollectiveError(str_cat(ctx.collective, " #", ctx.seq,
                                    ": the communicator was revoked by rank ", revoker));
  }
  if (ctx.transport != nullptr && peer >= 0) {
    if (!ctx.transport->peer_alive(peer))
      throw CollectiveError(str_cat(ctx.collective, " #", ctx.seq, ": rank ",
                                    ctx.transport->name_of(peer), " (pid ",
                                    ctx.transport->pid_of(peer), ") is no longer running"));
  }
}

void throw_timeout(const WaitContext& ctx, int peer, WaitFor what) {
  const char* why = what == WaitFor::Data      ? "waiting for data from it"
                    : what == WaitFor::Space   ? "waiting for it to drain a staging slot"
                    : what == WaitFor::Arrival ? "waiting for it to start the collective"
                                               : "waiting for it at the barrier";
  auto name = [&](int r) { return ctx.transport != nullptr ? ctx.transport->name_of(r) : r; };
  auto listed = [&](const std::vector<int>& ranks, const std::vector<int>& except = {}) {
    std::string s;
    for (int r : ranks)
      if (std::find(except.begin(), except.end(), r) == except.end())
        s += str_cat(s.empty() ? "" : ", ", name(r));
    return s;
  };
  std::string missing;
  if (ctx.fingerprints != nullptr) {
    // A node-local phase of a call across nodes: a peer still in an earlier phase of the same
    // call has started it (it waits on another node), and is not said to have not.
    const std::vector<int> earlier = ctx.fingerprints->in_earlier_phase();
    missing = listed(ctx.fingerprints->missing(), earlier);
    if (!missing.empty()) missing = "; ranks that never started it: " + missing;
    if (!earlier.empty())
      missing +=
          "; ranks still in an earlier phase of it (waiting on another node): " + listed(earlier);
  }
  // Earlier calls that did not wait for their peers (HostComm::deferred_).
  if (ctx.deferred != nullptr)
    for (const FingerprintGuard& g : *ctx.deferred) {
      const std::string m = listed(g.missing());
      if (!m.empty())
        missing += str_cat("; ranks that never started ", g.name(), " #", g.mine().seq, ": ", m);
    }
  throw CollectiveTimeout(str_cat(ctx.collective, " #", ctx.seq, " timed out after ", ctx.timeout_s,
                                  " s: rank ", name(peer), " did not arrive (", why, ")", missing,
                                  ctx.flight != nullptr ? ctx.flight->pointer() : std::string()));
}

}  // namespace pycoll
