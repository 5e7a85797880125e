#include "host/p2p.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <unordered_set>

#include "common/errors.h"
#include "host/host_comm.h"

namespace pycoll {
namespace {

constexpr long kMaxSleepNs = 200000;  // the progress thread's longest pause between passes

}  // namespace

P2PEngine::P2PEngine(HostComm& comm, const ShmTransport& t, size_t eager_max_bytes,
                     size_t cma_min_bytes, CmaMode cma)
    : P2PProgress(std::chrono::microseconds(0), kMaxSleepNs),
      comm_(comm),
      t_(t),
      eager_max_bytes_(std::min(eager_max_bytes, t.slot_bytes())),
      cma_min_bytes_(cma_min_bytes),
      cma_mode_(cma),
      peers_(t.size()) {}

P2PEngine::~P2PEngine() {
  {
    std::lock_guard<std::mutex> g(mu_);
    stopping_ = true;
    if (pending_ != 0)
      fail_all(nullptr, std::make_exception_ptr(CollectiveError(
                            "communicator closed with point-to-point operations in flight")));
  }
  join();
}

void P2PEngine::run(const std::vector<P2POp>& ops) {
  std::unique_lock<std::mutex> g(mu_);
  const std::shared_ptr<Batch> b = enqueue(ops, false);
  progress_until(g, *b, Clock::time_point::max());  // the batch's deadline bounds it
  end_call(g, *b);                                  // the progress thread takes over what is left
  if (b->error) std::rethrow_exception(b->error);
}

std::shared_ptr<Work> P2PEngine::start(const std::vector<P2POp>& ops) {
  std::unique_lock<std::mutex> g(mu_);
  const std::shared_ptr<Batch> b = enqueue(ops, true);
  progress();  // requests and first pieces go out now, not when the thread wakes
  std::shared_ptr<Work> work = b->work;
  end_call(g, *b);
  return work;
}

std::shared_ptr<P2PEngine::Batch> P2PEngine::enqueue(const std::vector<P2POp>& ops, bool async) {
  if (comm_.poisoned())
    throw CollectiveError(
        str_cat("p2p: communicator is unusable after an earlier error: ", comm_.poison_reason()));
  auto b = std::make_shared<Batch>();
  b->remaining = ops.size();
  b->timeout_s = comm_.timeout();
  b->deadline = deadline_after(b->timeout_s);
  if (async) b->work = std::make_shared<Work>();
  for (const P2POp& in : ops) {
    auto o = std::make_shared<Op>();
    static_cast<P2POp&>(*o) = in;
    o->batch = b;
    if (o->tag < kInternalTag) {  // a collective's own blocks are in its entry
      FlightCall f;
      f.kind = o->kind == P2PKind::Send ? kFlightSend : kFlightRecv;
      f.dtype = static_cast<uint32_t>(o->dtype);
      f.count = o->count;
      f.root = t_.name_of(o->peer);
      f.tag = o->tag;
      o->flight_id = comm_.flight().begin(f, FlightState::Started);
    }
    if (comm_.options().debug && o->tag < kInternalTag)  // collectives log themselves
      std::fprintf(stderr, "pycollectives INFO rank %d/%d: p2p %s%s\n", t_.rank(), t_.size(),
                   o->describe().c_str(), async ? " async" : "");
    Peer& p = peers_[o->peer];
    if (o->kind == P2PKind::Recv) {
      o->ordinal = ++p.recv_ordinals[o->tag];
      p.unrequested.push_back(o);
    } else {
      o->ordinal = ++p.send_ordinals[o->tag];
      add_send(p, o);
    }
  }
  pending_ += ops.size();
  if (ops.empty()) finish(*b);
  return b;
}

bool P2PEngine::move() {
  if (comm_.poisoned())
    throw CollectiveError(str_cat("p2p: communicator was aborted: ", comm_.poison_reason()));
  bool moved = false;
  for (int q = 0; q < t_.size(); ++q)
    if (q != t_.rank()) moved |= progress_peer(q, peers_[q]);
  return moved;
}

void P2PEngine::fail_pending(std::exception_ptr e) {
  fail_all(culprit_, e);
  culprit_.reset();
}

void P2PEngine::complete(const OpPtr& op) {
  comm_.flight().mark(op->flight_id, FlightState::Ended);
  --pending_;
  if (--op->batch->remaining == 0) finish(*op->batch);
}

void P2PEngine::finish(Batch& b) {
  b.done.store(true, std::memory_order_release);
  if (b.work) b.work->complete(b.error);
}

// Every 10 ms: a dead peer fails its ops at once; an op past its batch's deadline times out.
// (A revoked communicator fails every op sooner: move() checks comm_.poisoned() first.)
void P2PEngine::check_stalled(Clock::time_point now) {
  for (int q = 0; q < t_.size(); ++q) {
    Peer& p = peers_[q];
    auto check = [&](const OpPtr& o, const char* why) {
      if (!t_.peer_alive(q))
        raise<CollectiveError>(o, str_cat(o->describe(), ": rank ", q, " (pid ", t_.pid_of(q),
                                          ") is no longer running"));
      if (now >= o->batch->deadline)
        raise<CollectiveTimeout>(o, str_cat(o->describe(), " timed out after ", o->batch->timeout_s,
                                            " s: rank ", q, " ", why, comm_.flight().pointer()));
    };
    for (const OpPtr& o : p.unrequested) check(o, "did not take this rank's requests");
    for (const auto& [id, o] : p.awaiting)
      check(o, o->done_bytes == 0 ? "sent no matching message" : "stopped sending mid-message");
    for (const OpPtr& o : p.sends) check(o, "posted no matching recv");
    for (const Transfer& x : p.transfers) check(x.send, "did not drain the staging slots");
    for (const OpPtr& o : p.eager_out) check(o, "did not drain the staging slots");
  }
}

// Poisons the communicator and fails every pending op: `culprit`'s batch with `e`, the others
// with an error that names it.
void P2PEngine::fail_all(const OpPtr& culprit, std::exception_ptr e) {
  const std::string reason = what_of(e);
  comm_.abort(reason);
  // Our posted receives are abandoned: no sender may write into their buffers any more.
  t_.p2p_closed(t_.rank()).store(1, std::memory_order_release);
  const auto others =
      std::make_exception_ptr(CollectiveError(str_cat("p2p: communicator was aborted: ", reason)));
  std::unordered_set<Batch*> batches;
  std::vector<std::shared_ptr<Batch>> keep;
  auto add = [&](const OpPtr& o) {
    comm_.flight().mark(o->flight_id, FlightState::Failed);
    if (batches.insert(o->batch.get()).second) keep.push_back(o->batch);
  };
  if (culprit) {
    culprit->batch->error = e;
    add(culprit);
  }
  for (Peer& p : peers_) {
    for (const OpPtr& o : p.unrequested) add(o);
    for (const auto& kv : p.awaiting) add(kv.second);
    for (const OpPtr& o : p.sends) add(o);
    for (const Transfer& x : p.transfers) add(x.send);
    for (const OpPtr& o : p.eager_out) add(o);
    p.unrequested.clear();
    p.unmatched_recvs.clear();
    p.unexpected.clear();
    p.eager_out.clear();
    p.awaiting.clear();
    p.sends.clear();
    p.requests.clear();
    p.transfers.clear();
  }
  pending_ = 0;
  for (const auto& b : keep) {
    if (!b->error) b->error = culprit ? others : e;
    finish(*b);
  }
}

}  // namespace pycoll
