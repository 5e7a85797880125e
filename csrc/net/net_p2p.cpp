#include "net/net_p2p.h"

#include <algorithm>
#include <climits>
#include <cstring>
#include <unordered_set>

#include "common/errors.h"

namespace pycoll {
namespace {

// The progress thread stands aside until the program has made no call for this long, and then
// sleeps between passes, from 2 us doubling up to kIdleSleepNs.
constexpr auto kQuiet = std::chrono::microseconds(200);
constexpr long kIdleSleepNs = 200000;
// How long a failure waits for cancelled receives to let go of the caller's arrays.
constexpr auto kCancelGrace = std::chrono::seconds(1);

std::string mpi_error(int code, const char* what) {
  char msg[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(code, msg, &len) != MPI_SUCCESS) return str_cat(what, ": MPI error ", code);
  return str_cat(what, ": ", std::string(msg, static_cast<size_t>(len)));
}

void check_mpi(int code, const char* what) {
  if (code != MPI_SUCCESS) throw CollectiveError(str_cat("p2p: ", mpi_error(code, what)));
}

std::string shape(int64_t count, int64_t dtype) {
  return str_cat(count, " x ",
                 valid_dtype(static_cast<int>(dtype)) ? dtype_name(static_cast<DType>(dtype))
                                                      : "an unknown dtype");
}

bool mpi_live() {
  int finalized = 1;
  MPI_Finalized(&finalized);
  return finalized == 0;
}

}  // namespace

NetP2P::NetP2P(MPI_Comm comm, double timeout_s, size_t block_bytes, size_t inline_bytes)
    : P2PProgress(kQuiet, kIdleSleepNs),
      block_bytes_(std::max<size_t>(1, std::min<size_t>(block_bytes, INT_MAX))),
      inline_bytes_(std::min<size_t>(inline_bytes, size_t{1} << 20)),
      timeout_s_(timeout_s) {
  check_mpi(MPI_Comm_rank(comm, &rank_), "MPI_Comm_rank");
  check_mpi(MPI_Comm_size(comm, &size_), "MPI_Comm_size");
  for (MPI_Comm* c : {&headers_, &data_, &verdicts_, &poison_}) {
    check_mpi(MPI_Comm_dup(comm, c), "MPI_Comm_dup");
    check_mpi(MPI_Comm_set_errhandler(*c, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
  }
  check_mpi(MPI_Irecv(poison_in_, 6, MPI_INT64_T, MPI_ANY_SOURCE, 0, poison_, &poison_req_),
            "MPI_Irecv");
  int* ub = nullptr;
  int found = 0;
  check_mpi(MPI_Comm_get_attr(comm, MPI_TAG_UB, &ub, &found), "MPI_Comm_get_attr");
  if (found && ub != nullptr) tag_ub_ = *ub;
}

NetP2P::~NetP2P() { close(); }

void NetP2P::close() {
  {
    std::lock_guard<std::mutex> g(mu_);
    if (closed_) return;
    closed_ = stopping_ = true;
    if (pending_ != 0)
      fail_all(nullptr, std::make_exception_ptr(CollectiveError(
                            "communicator closed with point-to-point operations in flight")));
  }
  join();
  std::lock_guard<std::mutex> g(mu_);
  if (!mpi_live()) return;  // MPI is gone, and everything with it
  // Verdicts still travelling: their receivers have the data; MPI may finish them alone.
  for (const OpPtr& o : answering_)
    if (o->req[2] != MPI_REQUEST_NULL) MPI_Request_free(&o->req[2]);
  answering_.clear();
  if (poison_req_ != MPI_REQUEST_NULL) {
    MPI_Cancel(&poison_req_);
    MPI_Wait(&poison_req_, MPI_STATUS_IGNORE);
  }
  for (MPI_Comm* c : {&headers_, &data_, &verdicts_, &poison_})
    if (*c != MPI_COMM_NULL) MPI_Comm_free(c);
}

std::pair<MPI_Datatype, int> NetP2P::bytes_type(size_t bytes) const {
  if (bytes <= block_bytes_) return {MPI_BYTE, static_cast<int>(bytes)};
  const size_t blocks = bytes / block_bytes_, tail = bytes % block_bytes_;
  PYCOLL_CHECK(blocks <= INT_MAX, "message of ", bytes, " bytes");
  MPI_Datatype block, whole;
  check_mpi(MPI_Type_contiguous(static_cast<int>(block_bytes_), MPI_BYTE, &block),
            "MPI_Type_contiguous");
  int lengths[2] = {static_cast<int>(blocks), static_cast<int>(tail)};
  MPI_Aint at[2] = {0, static_cast<MPI_Aint>(blocks * block_bytes_)};
  MPI_Datatype types[2] = {block, MPI_BYTE};
  const int code = MPI_Type_create_struct(tail ? 2 : 1, lengths, at, types, &whole);
  MPI_Type_free(&block);
  check_mpi(code, "MPI_Type_create_struct");
  check_mpi(MPI_Type_commit(&whole), "MPI_Type_commit");
  return {whole, 1};
}

std::shared_ptr<P2PBatch> NetP2P::start(const std::vector<P2POp>& ops, bool waited) {
  for (const P2POp& o : ops) {
    if (o.peer < 0 || o.peer >= size_ || o.peer == rank_)
      throw InvalidArgument(str_cat("p2p: peer ", o.peer, " is not another rank of ", size_));
    if (o.tag > static_cast<uint64_t>(tag_ub_))
      throw InvalidArgument(str_cat("p2p: tag ", o.tag, " to rank ", o.peer,
                                    " on another node exceeds MPI's largest tag ", tag_ub_));
  }
  std::unique_lock<std::mutex> g(mu_);
  if (!poisoned_.empty())
    throw CollectiveError(
        str_cat("p2p: communicator is unusable after an earlier error: ", poisoned_));
  if (closed_) throw CollectiveError("p2p: the communicator is closed");
  auto b = std::make_shared<P2PBatch>();
  b->remaining = ops.size();
  b->timeout_s = timeout_s_.load();
  b->deadline = deadline_after(b->timeout_s);
  try {
    for (const P2POp& in : ops) {
      auto o = std::make_shared<Op>();
      o->io = in;
      o->batch = b;
      o->mine[0] = static_cast<int64_t>(in.count);
      o->mine[1] = static_cast<int64_t>(in.dtype);
      ++pending_;
      if (in.kind == P2PKind::Send) {
        sends_.push_back(o);
        post_send(o);
      } else {
        heads_[{in.peer, in.tag}].push_back(o);
        o->box.resize(kHeaderBytes + inline_bytes_);  // room for any inline message
        check_mpi(MPI_Irecv(o->box.data(), static_cast<int>(o->box.size()), MPI_BYTE, in.peer,
                            static_cast<int>(in.tag), headers_, &o->req[0]),
                  "MPI_Irecv");
      }
    }
  } catch (const CollectiveError&) {
    fail_all(nullptr, std::current_exception());
    throw;
  }
  if (ops.empty()) finish(*b, nullptr);
  // One pass now: an inline send is usually out at once, and then nothing is left to wake
  // the progress thread for.
  if (!waited && !b->done.load()) progress();
  end_call(g, *b, /*wake=*/!waited);
  return b;
}

void NetP2P::post_send(const OpPtr& o) {
  const int tag = static_cast<int>(o->io.tag), peer = o->io.peer;
  const size_t bytes = o->bytes();
  o->inlined = bytes <= inline_bytes_;
  const int64_t head[3] = {o->mine[0], o->mine[1], o->inlined ? 1 : 0};
  o->box.resize(kHeaderBytes + (o->inlined ? bytes : 0));
  std::memcpy(o->box.data(), head, kHeaderBytes);
  if (o->inlined && bytes != 0) std::memcpy(o->box.data() + kHeaderBytes, o->io.buf, bytes);
  check_mpi(MPI_Isend(o->box.data(), static_cast<int>(o->box.size()), MPI_BYTE, peer, tag, headers_,
                      &o->req[0]),
            "MPI_Isend");
  if (o->inlined) return;  // done once MPI has it
  auto [type, count] = bytes_type(bytes);
  const int code = MPI_Isend(o->io.buf, count, type, peer, tag, data_, &o->req[1]);
  if (type != MPI_BYTE) MPI_Type_free(&type);
  check_mpi(code, "MPI_Isend");
  check_mpi(MPI_Irecv(o->theirs, 3, MPI_INT64_T, peer, tag, verdicts_, &o->req[2]), "MPI_Irecv");
}

// The header is in: the data goes into the caller's array if it fits, else into scratch.
void NetP2P::post_data_recv(const OpPtr& o) {
  o->fits = o->theirs[0] == o->mine[0] && o->theirs[1] == o->mine[1];
  uint8_t* into = o->io.buf;
  size_t bytes = o->bytes();
  if (!o->fits) {
    const int64_t dt = o->theirs[1];
    const size_t elem = valid_dtype(static_cast<int>(dt)) ? dtype_size(static_cast<DType>(dt)) : 1;
    bytes = static_cast<size_t>(std::max<int64_t>(o->theirs[0], 0)) * elem;
    o->scratch.resize(bytes);
    into = o->scratch.data();
  }
  auto [type, count] = bytes_type(bytes);
  const int code =
      MPI_Irecv(into, count, type, o->io.peer, static_cast<int>(o->io.tag), data_, &o->req[1]);
  if (type != MPI_BYTE) MPI_Type_free(&type);
  check_mpi(code, "MPI_Irecv");
}

bool NetP2P::move() {
  const bool moved = test_all();
  if (moved && poison_req_ == MPI_REQUEST_NULL) poisoned_by_peer();
  if (moved) {
    advance_sends();
    advance_headers();
    advance_receives();
    advance_verdicts();
  }
  return moved;
}

void NetP2P::fail_pending(std::exception_ptr e) {
  fail_all(culprit_, e);
  culprit_.reset();
}

// One MPI_Testsome over every request in flight (one turn of MPI's progress engine, not one
// per request); a completed request becomes MPI_REQUEST_NULL in its op. True if any completed.
bool NetP2P::test_all() {
  reqs_.clear();
  slots_.clear();
  auto add = [&](const OpPtr& o, int k) {
    if (o->req[k] == MPI_REQUEST_NULL) return;
    reqs_.push_back(o->req[k]);
    slots_.push_back(&o->req[k]);
  };
  for (const OpPtr& o : sends_)
    for (int k = 0; k < 3; ++k) add(o, k);
  for (const auto& kv : heads_)
    for (const OpPtr& o : kv.second) add(o, 0);
  for (const OpPtr& o : receiving_) add(o, 1);
  for (const OpPtr& o : answering_) add(o, 2);
  if (reqs_.empty()) return false;
  if (poison_req_ != MPI_REQUEST_NULL) {
    reqs_.push_back(poison_req_);
    slots_.push_back(&poison_req_);
  }
  done_.resize(reqs_.size());
  int count = 0;
  check_mpi(MPI_Testsome(static_cast<int>(reqs_.size()), reqs_.data(), &count, done_.data(),
                         MPI_STATUSES_IGNORE),
            "MPI_Testsome");
  if (count == MPI_UNDEFINED) return false;
  for (int i = 0; i < count; ++i)
    *slots_[static_cast<size_t>(done_[static_cast<size_t>(i)])] = MPI_REQUEST_NULL;
  return count > 0;
}

// A send completes with its verdict (its header and data are out by then too).
void NetP2P::advance_sends() {
  for (size_t i = 0; i < sends_.size();) {
    const OpPtr o = sends_[i];
    if (o->req[0] != MPI_REQUEST_NULL || o->req[1] != MPI_REQUEST_NULL ||
        o->req[2] != MPI_REQUEST_NULL) {
      ++i;
      continue;
    }
    sends_.erase(sends_.begin() + static_cast<std::ptrdiff_t>(i));
    if (!o->inlined && o->theirs[0] == 0)
      raise<CollectiveMismatch>(
          o, str_cat(o->describe(), ": the matching recv does not fit: this rank sends ",
                     o->io.count, " x ", dtype_name(o->io.dtype), ", rank ", o->io.peer,
                     " receives ", shape(o->theirs[1], o->theirs[2])));
    complete(o);
  }
}

// Data receives are posted in the order of their headers, per peer and tag.
void NetP2P::advance_headers() {
  for (auto it = heads_.begin(); it != heads_.end();) {
    std::deque<OpPtr>& queue = it->second;
    while (!queue.empty() && queue.front()->req[0] == MPI_REQUEST_NULL) {
      const OpPtr o = queue.front();
      queue.pop_front();
      take_header(o);
    }
    it = queue.empty() ? heads_.erase(it) : std::next(it);
  }
}

void NetP2P::take_header(const OpPtr& o) {
  std::memcpy(o->theirs, o->box.data(), kHeaderBytes);
  if (o->theirs[2] == 0) {  // the data follows
    o->box = {};
    receiving_.push_back(o);
    post_data_recv(o);
    return;
  }
  o->fits = o->theirs[0] == o->mine[0] && o->theirs[1] == o->mine[1];
  if (o->fits) {
    if (o->bytes() != 0) std::memcpy(o->io.buf, o->box.data() + kHeaderBytes, o->bytes());
    o->box = {};
    complete(o);
    return;
  }
  const int64_t poison[6] = {
      rank_, static_cast<int64_t>(o->io.tag), o->theirs[0], o->theirs[1], o->mine[0], o->mine[1]};
  std::memcpy(o->verdict, poison, sizeof poison);
  answering_.push_back(o);  // the poison goes out whatever happens to this rank next
  check_mpi(MPI_Isend(o->verdict, 6, MPI_INT64_T, o->io.peer, 0, poison_, &o->req[2]), "MPI_Isend");
  raise<CollectiveMismatch>(
      o, str_cat(o->describe(), ": the matching send does not fit: rank ", o->io.peer, " sends ",
                 shape(o->theirs[0], o->theirs[1]), ", this rank receives ", o->io.count, " x ",
                 dtype_name(o->io.dtype)));
}

void NetP2P::poisoned_by_peer() {
  const int64_t* p = poison_in_;
  const std::string sent = shape(p[2], p[3]);
  throw CollectiveMismatch(str_cat("send to rank ", p[0], " (tag ", p[1], ", ", sent,
                                   "): the matching recv does not fit: this rank sends ", sent,
                                   ", rank ", p[0], " receives ", shape(p[4], p[5])));
}

// A receive completes with its data, and answers with its verdict.
void NetP2P::advance_receives() {
  for (size_t i = 0; i < receiving_.size();) {
    const OpPtr o = receiving_[i];
    if (o->req[1] != MPI_REQUEST_NULL) {
      ++i;
      continue;
    }
    receiving_.erase(receiving_.begin() + static_cast<std::ptrdiff_t>(i));
    o->verdict[0] = o->fits ? 1 : 0;
    o->verdict[1] = o->mine[0];
    o->verdict[2] = o->mine[1];
    answering_.push_back(o);  // the verdict goes back whatever happens to this rank next
    check_mpi(MPI_Isend(o->verdict, 3, MPI_INT64_T, o->io.peer, static_cast<int>(o->io.tag),
                        verdicts_, &o->req[2]),
              "MPI_Isend");
    if (!o->fits)
      raise<CollectiveMismatch>(
          o, str_cat(o->describe(), ": the matching send does not fit: rank ", o->io.peer,
                     " sends ", shape(o->theirs[0], o->theirs[1]), ", this rank receives ",
                     o->io.count, " x ", dtype_name(o->io.dtype)));
    complete(o);
  }
}

void NetP2P::advance_verdicts() {
  answering_.erase(std::remove_if(answering_.begin(), answering_.end(),
                                  [](const OpPtr& o) { return o->req[2] == MPI_REQUEST_NULL; }),
                   answering_.end());
}

// An operation past its batch's deadline times out, naming what it still waits for.
void NetP2P::check_stalled(Clock::time_point now) {
  auto check = [&](const OpPtr& o, const char* why) {
    if (now >= o->batch->deadline)
      raise<CollectiveTimeout>(o, str_cat(o->describe(), " timed out after ", o->batch->timeout_s,
                                          " s: rank ", o->io.peer, " ", why));
  };
  for (const OpPtr& o : sends_) check(o, "posted no matching recv");
  for (const auto& kv : heads_)
    for (const OpPtr& o : kv.second) check(o, "sent no matching message");
  for (const OpPtr& o : receiving_) check(o, "stopped sending mid-message");
}

void NetP2P::complete(const OpPtr& o) {
  --pending_;
  if (--o->batch->remaining == 0) finish(*o->batch, nullptr);
}

void NetP2P::finish(P2PBatch& b, std::exception_ptr error) {
  b.error = error;
  b.done.store(true, std::memory_order_release);
}

// Poisons the engine and fails every pending operation: `culprit`'s batch with `e`, the others
// with an error that names it. Cancelled receives are given a moment to let go of the caller's
// arrays; sends are left to MPI.
void NetP2P::fail_all(const OpPtr& culprit, std::exception_ptr e) {
  const std::string reason = what_of(e);
  if (poisoned_.empty()) poisoned_ = reason;
  failed_.store(true, std::memory_order_release);
  bool mismatch = false;  // a peer's poison: what is pending here fails as a mismatch too
  try {
    std::rethrow_exception(e);
  } catch (const CollectiveMismatch&) {
    mismatch = !culprit;
  } catch (...) {
  }
  const std::string aborted = str_cat("p2p: communicator was aborted: ", reason);
  const auto others = mismatch ? std::make_exception_ptr(CollectiveMismatch(aborted))
                               : std::make_exception_ptr(CollectiveError(aborted));
  std::unordered_set<P2PBatch*> seen;
  std::vector<std::shared_ptr<P2PBatch>> batches;
  auto add = [&](const OpPtr& o) {
    if (seen.insert(o->batch.get()).second) batches.push_back(o->batch);
  };
  if (culprit) add(culprit);
  std::vector<MPI_Request> cancelled;
  const bool live = mpi_live();
  auto cancel = [&](MPI_Request& r) {
    if (r == MPI_REQUEST_NULL || !live) return;
    MPI_Cancel(&r);
    cancelled.push_back(r);
    r = MPI_REQUEST_NULL;
  };
  for (const OpPtr& o : sends_) {
    add(o);
    for (int k = 0; k < 2; ++k)
      if (o->req[k] != MPI_REQUEST_NULL && live) MPI_Request_free(&o->req[k]);
    cancel(o->req[2]);
  }
  for (auto& kv : heads_)
    for (const OpPtr& o : kv.second) {
      add(o);
      cancel(o->req[0]);
    }
  for (const OpPtr& o : receiving_) {
    add(o);
    cancel(o->req[1]);
  }
  sends_.clear();
  heads_.clear();
  receiving_.clear();
  pending_ = 0;
  const auto until = Clock::now() + kCancelGrace;
  Sleeper sleeper;
  for (int done = 0; !cancelled.empty();) {
    if (MPI_Testall(static_cast<int>(cancelled.size()), cancelled.data(), &done,
                    MPI_STATUSES_IGNORE) != MPI_SUCCESS ||
        done || Clock::now() >= until)
      break;
    sleeper.sleep();
  }
  for (MPI_Request& r : cancelled)
    if (r != MPI_REQUEST_NULL) MPI_Request_free(&r);
  for (const auto& b : batches)
    if (!b->done.load())
      finish(*b, b.get() == (culprit ? culprit->batch.get() : nullptr) ? e : others);
}

void NetP2P::abort(const std::string& reason) {
  std::lock_guard<std::mutex> g(mu_);
  if (!poisoned_.empty()) return;
  fail_all(nullptr, std::make_exception_ptr(CollectiveError(reason)));
}

std::string NetP2P::poison_reason() const {
  if (!failed_.load(std::memory_order_acquire)) return {};  // without the lock: asked per call
  std::lock_guard<std::mutex> g(mu_);
  return poisoned_;
}

bool NetP2P::wait(P2PBatch& b, double timeout_s) {
  if (!b.done.load(std::memory_order_acquire)) {
    const auto until = timeout_s >= 0 ? deadline_after(timeout_s) : Clock::time_point::max();
    std::unique_lock<std::mutex> g(mu_);
    const bool done = progress_until(g, b, until);
    end_call(g, b);  // the progress thread takes over what is left
    if (!done) return false;
  }
  if (b.error) std::rethrow_exception(b.error);
  return true;
}

}  // namespace pycoll
