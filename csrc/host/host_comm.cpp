#include "host/host_comm.h"

#include <algorithm>
#include <chrono>
#include <cstdio>

#include "common/errors.h"
#include "host/direct_blocks.h"
#include "runtime/fingerprint.h"
#include "runtime/splits.h"

namespace pycoll {

// ---- Work ------------------------------------------------------------------------------------

bool Work::wait(double timeout_s) {
  std::unique_lock<std::mutex> g(mu_);
  if (timeout_s < 0) {
    cv_.wait(g, [&] { return done_; });
  } else if (!cv_.wait_for(g, std::chrono::duration<double>(timeout_s), [&] { return done_; })) {
    return false;
  }
  if (error_) std::rethrow_exception(error_);
  return true;
}

bool Work::is_completed() const {
  std::lock_guard<std::mutex> g(mu_);
  return done_;
}

int64_t Work::now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

std::pair<int64_t, int64_t> Work::times() const {
  std::lock_guard<std::mutex> g(mu_);
  return {started_ns_.load(), completed_ns_};
}

void Work::complete(std::exception_ptr error) {
  {
    std::lock_guard<std::mutex> g(mu_);
    done_ = true;
    error_ = error;
    completed_ns_ = now_ns();
  }
  cv_.notify_all();
}

// ---- HostComm --------------------------------------------------------------------------------

HostComm::HostComm(int rank, int size, const HostCommOptions& opts)
    : opts_(opts),
      flight_(opts.flight_entries),
      transport_(rank, size, opts.slot_bytes, opts.nslots, /*p2p=*/true),
      counters_(size),
      scratch_(opts.slot_bytes),
      single_copy_(transport_, opts.p2p_cma, opts.single_copy_min_bytes, opts.debug),
      shared_(transport_, opts.p2p_cma, opts.shared_min_bytes, opts.debug),
      slot_stores_(opts.slot_stores),
      timeout_s_(opts.timeout_s),
      board_(transport_),
      p2p_(std::make_unique<P2PEngine>(*this, transport_, opts.p2p_eager_max_bytes,
                                       opts.p2p_cma_min_bytes, opts.p2p_cma)) {}

HostComm::~HostComm() {
  p2p_.reset();  // fails what is still in flight, while the communicator can still be poisoned
  {
    std::lock_guard<std::mutex> g(queue_mu_);
    stopping_ = true;
    if (pending_ != 0) abort("communicator closed with collectives in flight");
  }
  queue_cv_.notify_all();
  if (progress_.joinable()) progress_.join();
}

void HostComm::abort(const std::string& reason) {
  poison(reason);
  flight_.dump(reason, /*failure=*/true);
}

void HostComm::poison(const std::string& reason) const {
  {
    std::lock_guard<std::mutex> g(reason_mu_);
    if (poison_reason_.empty()) poison_reason_ = reason;
  }
  aborted_.store(true);
}

bool HostComm::poisoned() const {
  if (aborted_.load()) return true;
  const int r = transport_.revoker();
  if (r < 0) return false;
  poison(str_cat("the communicator was revoked by rank ", r));
  return true;
}

void HostComm::revoke() {
  board_.revoke();
  poison("the communicator was revoked by this rank");
}

std::string HostComm::poison_reason() const {
  std::lock_guard<std::mutex> g(reason_mu_);
  return poison_reason_;
}

void HostComm::check_usable(const char* name) const {
  if (poisoned())
    throw CollectiveError(
        str_cat(name, ": communicator is unusable after an earlier error: ", poison_reason()));
}

Algo HostComm::choose(Collective c, size_t bytes) const {
  const Algo a = choose_fastest(c, bytes).algo;
  return opts_.reproducible ? rank_ordered(c, a) : a;
}

AlgoChoice HostComm::choose_fastest(Collective c, size_t bytes) const {
  if (forced_ != Algo::Auto && algo_supports(forced_, c)) return {forced_, Reason::Forced};
  if (single_copy_.eligible(c, Algo::Auto, bytes)) return {Algo::Direct, Reason::SingleCopy};
  return table_choice(tuning_, c, size(), bytes);
}

AlgoChoice table_choice(const std::vector<TuningRule>& rules, Collective c, int size,
                        size_t bytes) {
  for (const TuningRule& r : rules)
    if (r.collective == c && size >= r.min_ranks && size <= r.max_ranks && bytes <= r.max_bytes &&
        algo_supports(r.algo, c))
      return {r.algo, Reason::Table};
  return {algo_supports(Algo::Ring, c) ? Algo::Ring : Algo::Direct, Reason::Default};
}

WaitContext HostComm::wait_context(const char* name, uint64_t seq) const {
  WaitContext w = WaitContext::start(name, seq, timeout_s_.load(), &transport_, &aborted_);
  w.flight = &flight_;
  return w;
}

void HostComm::execute(const CollectiveCall& call, uint64_t seq) {
  const char* own_name = call.barrier ? "barrier" : collective_name(call.collective);
  check_usable(own_name);
  // A phase of a call across nodes is named in errors as that call, which the user made.
  const std::string phase_of = call.outer == CallRecord{}
                                   ? std::string()
                                   : str_cat(Fingerprint::from_record(call.outer).name(), " #",
                                             call.outer[0], ", in its node-local ", own_name);
  const char* name = phase_of.empty() ? own_name : phase_of.c_str();
  settle_deferred(call.barrier ? 0 : kMaxDeferred - 1);
  Fingerprint mine;
  mine.seq = seq;
  mine.outer = call.outer;
  if (call.barrier) {
    mine.kind = kBarrierKind;
    FingerprintGuard guard(transport_, mine);
    WaitContext w = wait_context(name, seq);
    w.fingerprints = &guard;
    try {
      guard.publish();
      barrier_steps(w);
      guard.finish(w);
    } catch (const CollectiveError& e) {
      failed(e);
      throw;
    }
    return;
  }
  const int n = size();
  const ResolvedCall rc =
      resolve_call(call, rank(), n, opts_.reproducible,
                   [this](Collective c, size_t bytes) { return choose_fastest(c, bytes); });
  const Algo algo = rc.algo;
  flight_.set_algo(flight_id_, static_cast<uint32_t>(algo));
  const bool timed = slot_stores_.measures(rc.choice_bytes);  // small calls read no clock
  const auto started = timed ? Clock::now() : Clock::time_point{};

  CallBuffers buf;
  buf.input = static_cast<const uint8_t*>(call.in);
  buf.input_count = rc.ext.in;
  buf.output = static_cast<uint8_t*>(call.out);
  buf.output_count = rc.ext.out;
  buf.dtype = call.dtype;
  buf.elem = rc.elem;
  buf.acc = rc.acc;
  buf.in_place = rc.in_place;
  buf.op = call.op;
  buf.divisor = n;
  buf.stream_bytes = opts_.stream_bytes;
  // Which stores fill the slots, measured per kind of call: collective, algorithm, and in
  // place or not (in-place outputs stay in cache; calls of the two kinds cost differently).
  const uint32_t kind =
      (static_cast<uint32_t>(call.collective) * kNumAlgos + static_cast<uint32_t>(algo)) * 2 +
      (rc.in_place ? 1 : 0);
  const bool stream_slots = slot_stores_.choose(kind, rc.choice_bytes);
  buf.stream_slots = stream_slots;
  if (opts_.debug)
    std::fprintf(
        stderr,
        "pycollectives INFO rank %d/%d: %s #%llu count=%zu %s %s root=%d algo=%s (%s%s)%s\n",
        rank(), n, name, static_cast<unsigned long long>(seq), call.count, dtype_name(call.dtype),
        redop_name(call.op), call.root, algo_name(algo), reason_name(rc.why),
        rc.rank_ordered ? ", rank order" : "", stream_slots ? " slots=streamed" : "");

  // The peer's reduction of a piece overlaps our copy of the next (2-rank ring, 16-64 MiB:
  // 5-15% faster); channels have at least 2 slots.
  ScheduleParams p = rc.schedule(opts_.slot_bytes, opts_.oneshot_max_bytes, 1, true);
  const DirectBlocks direct =
      direct_blocks(call, algo, rank(), n, std::min(kBlockP2PBytes, opts_.p2p_cma_min_bytes));
  p.direct_min_count = direct.min_count;

  mine = Fingerprint::of_call(seq, call, algo);
  mine.outer = call.outer;
  // Descriptors first (host/shared_buffers.h): automatic choice only, so that an algorithm
  // asked for is the one that runs.
  mine.shared = shared_enabled_.load() && forced_ == Algo::Auto && shared_.eligible(call);
  FingerprintGuard guard(transport_, mine);
  WaitContext w = wait_context(name, seq);
  if (opts_.check_mismatch) w.fingerprints = &guard;
  w.deferred = &deferred_;
  try {
    if (w.fingerprints) guard.publish();
    // Split lists are checked whatever check_mismatch says: a disagreement there would make
    // peers wait for messages that never come, or overrun an output.
    if (!call.send_counts.empty())
      check_split_matrix(transport_, guard, w, call.send_counts, call.recv_counts);
    HostExecutor exec(transport_, counters_, scratch_.data(), w, buf);
    const bool mapped = mine.shared && shared_.run(exec, call, buf);
    const bool single = !mapped && call.counts.empty() &&
                        single_copy_.eligible(call.collective, algo, rc.choice_bytes) &&
                        single_copy_.all_gather(exec, buf, call.count);
    if (opts_.debug && mapped)
      std::fprintf(stderr,
                   "pycollectives INFO rank %d/%d: %s #%llu: one pass over mapped buffers\n",
                   rank(), n, name, static_cast<unsigned long long>(seq));
    const bool staged = !single && !mapped;  // through the slots
    if (staged) make_schedule(algo, call.collective, p, exec);
    exec.finish();
    if (staged && timed)
      slot_stores_.record(kind, rc.choice_bytes, stream_slots,
                          std::chrono::duration<double>(Clock::now() - started).count());
    if (w.fingerprints) {
      // A rank that received nothing (a broadcast's root, a chain's first sender) used no
      // peer's data, so it need not wait here for its peers to arrive: what is still
      // unchecked is checked later (deferred_), and always before data from that peer is
      // used. So its loop of small calls runs ahead instead of in step with the receivers.
      // Not a phase of a call across nodes: what it found of its peers is its node's status
      // there (backends/call_check.py), so it has checked every one of them.
      guard.check_arrived();
      if (!guard.done() && !exec.received_any() && direct.ops.empty() && call.outer == CallRecord{})
        deferred_.push_back(std::move(guard));
      else
        guard.finish(w);
    }
    // Every peer runs this collective (checked just above): the blocks left out of the
    // schedule cannot wait for a rank that is elsewhere.
    if (!direct.ops.empty()) {
      if (opts_.debug)
        std::fprintf(stderr, "pycollectives INFO rank %d/%d: %s #%llu: %zu blocks point-to-point\n",
                     rank(), n, name, static_cast<unsigned long long>(seq), direct.ops.size());
      p2p_->run(direct.ops);
    }
  } catch (const CollectiveError& e) {
    failed(e);  // peers' counters no longer match ours
    throw;
  }
}

void HostComm::failed(const CollectiveError& e) {
  abort(e.what());
  // A peer that never came may be in its own code, where no timeout writes its ring for it.
  if (dynamic_cast<const CollectiveTimeout*>(&e) != nullptr)
    transport_.ask_peers_for_flight_records();
}

void HostComm::set_flight_dump(const std::string& path, int rank, int size,
                               const std::string& comm) {
  flight_.set_dump(path, rank, size, comm);
  if (!path.empty() && flight_.on()) transport_.set_flight_signal();
}

void HostComm::run(const CollectiveCall& call) {
  {
    std::unique_lock<std::mutex> g(queue_mu_);
    if (pending_ != 0) {  // keep issue order: queue behind the asynchronous work
      g.unlock();
      submit(call)->wait(-1);
      return;
    }
  }
  std::lock_guard<std::mutex> g(exec_mu_);
  const uint64_t seq = ++seq_;
  flight_id_ = flight_.begin(flight_call_of(call, seq, call.algo), FlightState::Started);
  try {
    execute(call, seq);
  } catch (...) {
    flight_.mark(flight_id_, FlightState::Failed);
    throw;
  }
  flight_.mark(flight_id_, FlightState::Ended);
}

std::shared_ptr<Work> HostComm::submit(const CollectiveCall& call) {
  check_usable(call.barrier ? "barrier" : collective_name(call.collective));
  auto work = std::make_shared<Work>();
  {
    std::lock_guard<std::mutex> g(queue_mu_);
    if (stopping_) throw CollectiveError("communicator is closing");
    work->seq_ = ++seq_;
    work->flight_id_ =
        flight_.begin(flight_call_of(call, work->seq_, call.algo), FlightState::Queued);
    queue_.emplace_back(call, work);
    ++pending_;
    if (!progress_.joinable()) progress_ = std::thread([this] { progress_loop(); });
  }
  queue_cv_.notify_one();
  return work;
}

void HostComm::progress_loop() {
  for (;;) {
    std::pair<CollectiveCall, std::shared_ptr<Work>> item;
    {
      std::unique_lock<std::mutex> g(queue_mu_);
      queue_cv_.wait(g, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping, nothing left
      item = std::move(queue_.front());
      queue_.pop_front();
    }
    std::exception_ptr error;
    try {
      std::lock_guard<std::mutex> g(exec_mu_);
      item.second->started_ns_ = Work::now_ns();
      flight_id_ = item.second->flight_id_;
      flight_.mark(flight_id_, FlightState::Started);
      execute(item.first, item.second->seq());
    } catch (...) {
      error = std::current_exception();
    }
    flight_.mark(item.second->flight_id_, error ? FlightState::Failed : FlightState::Ended);
    {
      std::lock_guard<std::mutex> g(queue_mu_);
      --pending_;
    }
    item.second->complete(error);
  }
}

std::vector<CallRecord> HostComm::outer_records(uint64_t seq) const {
  Fingerprint at;
  at.seq = seq;
  const FingerprintGuard entries(transport_, at);
  // No abort flag: the communicator is poisoned by then.
  const WaitContext w =
      WaitContext::start("the check across nodes", seq, timeout_s_.load(), &transport_, nullptr);
  std::vector<CallRecord> out;
  for (int p = 0; p < size(); ++p) out.push_back(entries.outer_of(p, w));
  return out;
}

void HostComm::settle_deferred(size_t keep) {
  try {
    for (FingerprintGuard& g : deferred_) g.check_arrived();
    while (!deferred_.empty() && (deferred_.front().done() || deferred_.size() > keep)) {
      FingerprintGuard& g = deferred_.front();
      WaitContext w = wait_context(g.name(), g.mine().seq);
      w.fingerprints = &g;
      g.finish(w);
      deferred_.erase(deferred_.begin());
    }
  } catch (const CollectiveError& e) {
    deferred_.clear();
    abort(e.what());
    throw;
  }
}

void HostComm::barrier_steps(const WaitContext& w) {
  const uint64_t epoch = ++barrier_epoch_;
  transport_.barrier(rank()).store(epoch, std::memory_order_release);
  for (int r = 0; r < size(); ++r) {
    if (r == rank()) continue;
    auto& flag = transport_.barrier(r);
    wait_until([&] { return flag.load(std::memory_order_acquire) >= epoch; }, w, r,
               WaitFor::Barrier);
  }
}

}  // namespace pycoll
