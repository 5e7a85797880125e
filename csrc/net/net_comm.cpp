#include "net/net_comm.h"

#include <sched.h>

#include <algorithm>
#include <chrono>
#include <cstring>

#include "algo/call.h"
#include "algo/messages.h"
#include "algo/step_io.h"
#include "common/errors.h"
#include "common/hash.h"
#include "common/reduce.h"
#include "runtime/fingerprint.h"
#include "runtime/wait.h"

namespace pycoll {

namespace {

std::string mpi_error_string(int code) {
  char msg[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(code, msg, &len) != MPI_SUCCESS) return str_cat("MPI error ", code);
  return std::string(msg, static_cast<size_t>(len));
}

void check_mpi(int code, const char* what) {
  if (code != MPI_SUCCESS) throw CollectiveError(str_cat(what, ": ", mpi_error_string(code)));
}

// The tag of `c`'s messages: FNV-1a over what every rank of the collective must agree on (its
// fingerprint, as the host transport compares it) and the group's size, so that messages of
// calls that disagree do not match.
int fingerprint_tag(const NetCall& c, int tag_ub) {
  const Fingerprint f = Fingerprint::of_call(c.seq, c, c.algo);
  Fnv1a h;
  for (uint64_t v : {f.seq, f.packed(), f.count, f.splits, uint64_t{c.group.size()}}) h.mix(v);
  return static_cast<int>(h.h % static_cast<uint64_t>(tag_ub));  // 0 .. tag_ub - 1
}

}  // namespace

// Runs one collective's steps (recorded up front, so receives can be posted ahead).
class NetExecutor {
 public:
  // `rc`: the call resolved for this rank's place in its group (its sizes, extents, in place).
  NetExecutor(NetComm& c, const NetCall& call, const ResolvedCall& rc,
              const std::vector<Step>& steps)
      : c_(c),
        call_(call),
        steps_(steps),
        kernels_(reduce_kernels(call.dtype, call.op)),
        elem_(rc.elem),
        acc_(rc.acc),
        tag_(fingerprint_tag(call, c.tag_ub_)),
        me_(rc.rank),
        arrays_{static_cast<const uint8_t*>(call.in), static_cast<uint8_t*>(call.out), rc.ext.in,
                rc.ext.out, rc.elem},
        in_place_(rc.in_place),
        timeout_s_(c.timeout_s_.load()),
        deadline_(deadline_after(timeout_s_)) {
    for (size_t i = 0; i < c_.pool_.size(); ++i) free_.push_back(static_cast<int>(i));
    // Every incoming message, in the order the steps consume them.
    for (const Step& s : steps_) {
      const size_t bytes = s.count * (s.recv_wire == Wire::Acc ? acc_ : elem_);
      for_each_message(
          peers_of(s), me_, static_cast<int>(call.group.size()),
          [&](int q) { incoming_.push_back({q, bytes}); }, [](int) {});
    }
  }

  // On failure, requests still in flight may write into pool buffers: leave them to MPI.
  ~NetExecutor() {
    if (!ok_) {
      for (Posted& p : posted_)
        if (p.req != MPI_REQUEST_NULL) {
          MPI_Cancel(&p.req);
          MPI_Request_free(&p.req);
        }
      for (InFlight& f : sends_)
        if (f.req != MPI_REQUEST_NULL) MPI_Request_free(&f.req);
      // MPI may still write into them: the memory is given up, never reused.
      for (NetBuffer& b : c_.pool_) (void)b.data.release();
      c_.pool_.clear();
    }
  }

  void run() {
    for (const Step& s : steps_) step(s);
    while (!sends_.empty()) finish_oldest_send();
    ok_ = true;
  }

 private:
  struct Incoming {
    int peer;
    size_t bytes;
  };
  struct Posted {
    MPI_Request req = MPI_REQUEST_NULL;
    int buf;
    int peer;
    size_t bytes;
  };
  struct InFlight {
    MPI_Request req = MPI_REQUEST_NULL;
    int buf;  // -1: sent straight from the caller's input
    int peer;
  };

  const uint8_t* src_ptr(const Step& s) const { return arrays_.src(s); }
  uint8_t* dst_ptr(const Step& s) const { return arrays_.dst(s); }
  uint8_t* data(int buf) { return c_.pool_[static_cast<size_t>(buf)].data.get(); }
  void unref(int buf) {
    if (--c_.pool_[static_cast<size_t>(buf)].refs == 0) free_.push_back(buf);
  }

  // Waits for `req` with back-off, bounded by the deadline; `peer` is a schedule rank.
  void wait(MPI_Request* req, MPI_Status* st, int peer, const char* why) {
    int done = 0;
    for (int i = 0; i < 256; ++i) {
      check_mpi(MPI_Test(req, &done, st), call_name());
      if (done) return;
      PYCOLL_CPU_RELAX();
    }
    const auto start = Clock::now();
    Sleeper sleeper;
    for (;;) {
      check_mpi(MPI_Test(req, &done, st), call_name());
      if (done) return;
      const auto now = Clock::now();
      if (now >= deadline_)
        throw CollectiveTimeout(str_cat(call_name(), " #", call_.seq, " (inter-node, ",
                                        algo_name(call_.algo), ") timed out after ", timeout_s_,
                                        " s: rank ", call_.group[static_cast<size_t>(peer)],
                                        " did not arrive (", why, ")"));
      if (now - start >= std::chrono::milliseconds(1) || !Yield::now(now)) sleeper.sleep();
    }
  }
  const char* call_name() const { return collective_name(call_.collective); }

  // Posts receives ahead while buffers and the window allow.
  void post_more() {
    while (next_in_ < incoming_.size() && posted_.size() < static_cast<size_t>(c_.opts_.window) &&
           free_.size() > 2) {
      const Incoming& m = incoming_[next_in_++];
      Posted p{MPI_REQUEST_NULL, take_free(), m.peer, m.bytes};
      check_mpi(MPI_Irecv(data(p.buf), static_cast<int>(c_.opts_.piece_bytes), MPI_BYTE,
                          call_.group[static_cast<size_t>(m.peer)], MPI_ANY_TAG, c_.comm_, &p.req),
                "MPI_Irecv");
      posted_.push_back(p);
    }
  }
  int take_free() {
    while (free_.empty()) finish_oldest_send();
    const int b = free_.back();
    free_.pop_back();
    c_.pool_[static_cast<size_t>(b)].refs = 1;
    return b;
  }

  // The next incoming message, which must come from `peer`; returns its buffer (ref held).
  int recv(int peer) {
    post_more();
    PYCOLL_CHECK(!posted_.empty(), "no receive posted");
    Posted p = posted_.front();
    posted_.pop_front();
    PYCOLL_CHECK(p.peer == peer, "receive order");
    MPI_Status st;
    wait(&p.req, &st, peer, "waiting for data from it");
    int got = 0;
    MPI_Get_count(&st, MPI_BYTE, &got);
    if (st.MPI_TAG != tag_ || static_cast<size_t>(got) != p.bytes)
      throw CollectiveMismatch(str_cat(
          call_name(), " #", call_.seq, ": rank ", call_.group[static_cast<size_t>(peer)],
          " is running a different collective (its message carries fingerprint ", st.MPI_TAG,
          " and ", got, " bytes; this rank expected ", tag_, " and ", p.bytes,
          " bytes: sequence number, collective, count, dtype, op, root or algorithm differ)"));
    return p.buf;
  }

  // Sends `bytes` at `ptr` (pool buffer `buf`, or -1 for the caller's input) to the step's
  // destinations.
  void send(const Step& s, const uint8_t* ptr, int buf, size_t bytes) {
    auto one = [&](int to) {
      if (buf >= 0) ++c_.pool_[static_cast<size_t>(buf)].refs;
      InFlight f{MPI_REQUEST_NULL, buf, to};
      check_mpi(MPI_Isend(ptr, static_cast<int>(bytes), MPI_BYTE,
                          call_.group[static_cast<size_t>(to)], tag_, c_.comm_, &f.req),
                "MPI_Isend");
      sends_.push_back(f);
      while (sends_.size() > static_cast<size_t>(2 * c_.opts_.window)) finish_oldest_send();
    };
    if (s.to == kAllPeers) {
      for (int q = 0; q < static_cast<int>(call_.group.size()); ++q)
        if (q != me_) one(q);
    } else {
      one(s.to);
      if (s.to2 != kNoPeer) one(s.to2);
    }
  }
  void finish_oldest_send() {
    PYCOLL_CHECK(!sends_.empty(), "out of message buffers");
    InFlight f = sends_.front();
    sends_.pop_front();
    wait(&f.req, MPI_STATUS_IGNORE, f.peer, "waiting for it to receive our data");
    if (f.buf >= 0) unref(f.buf);
  }

  // acc = op over the step's incoming messages and src, in the schedule's order.
  void reduce_into(uint8_t* acc, const Step& s) {
    int b = -1;  // the message being reduced (each is released before the next is taken)
    reduce_step(
        kernels_, acc_, acc, src_ptr(s), s, me_, static_cast<int>(call_.group.size()),
        [&](int q) { return data(b = recv(q)); }, [&](int) { unref(b); });
  }

  void step(const Step& s) {
    const size_t n = s.count;
    const bool one_input = s.from != kAllPeers && s.from2 == kNoPeer;
    switch (s.kind) {
      case StepKind::Send: {
        const uint8_t* src = src_ptr(s);
        // The input is never written while we run, unless the call is in place.
        if (s.send_wire == Wire::Elem && s.src.buf == Buf::Input && !in_place_) {
          send(s, src, -1, n * elem_);
          break;
        }
        const int b = take_free();
        if (s.send_wire == Wire::Acc)
          kernels_.load(data(b), src, n);
        else
          std::memcpy(data(b), src, n * elem_);
        send(s, data(b), b, n * (s.send_wire == Wire::Acc ? acc_ : elem_));
        unref(b);
        break;
      }
      case StepKind::Recv: {
        const int b = recv(s.from);
        std::memcpy(dst_ptr(s), data(b), n * elem_);
        unref(b);
        break;
      }
      case StepKind::RecvCopySend: {
        const int b = recv(s.from);
        send(s, data(b), b, n * elem_);
        std::memcpy(dst_ptr(s), data(b), n * elem_);
        unref(b);
        break;
      }
      case StepKind::RecvReduceSend: {
        const int b = take_free();
        reduce_into(data(b), s);
        send(s, data(b), b, n * acc_);
        unref(b);
        break;
      }
      case StepKind::RecvReduceCopy:
      case StepKind::RecvReduceCopySend: {
        const bool forward = s.kind == StepKind::RecvReduceCopySend;
        PYCOLL_CHECK(!forward || s.send_wire == Wire::Elem, "finished results travel as elements");
        const int out = forward ? take_free() : -1;
        uint8_t* dst2 = forward ? data(out) : nullptr;
        if (one_input) {
          const int b = recv(s.from);
          kernels_.reduce_final(dst_ptr(s), dst2, data(b), src_ptr(s), n, call_.divisor);
          unref(b);
        } else {
          const int acc = take_free();
          reduce_into(data(acc), s);
          kernels_.finalize(dst_ptr(s), dst2, data(acc), n, call_.divisor);
          unref(acc);
        }
        if (forward) {
          send(s, data(out), out, n * elem_);
          unref(out);
        }
        break;
      }
      case StepKind::Copy:
        copy_bytes(dst_ptr(s), src_ptr(s), n * elem_);
        break;
    }
  }

  NetComm& c_;
  const NetCall& call_;
  const std::vector<Step>& steps_;
  const ReduceKernels& kernels_;
  size_t elem_, acc_;
  int tag_;
  int me_;
  StepArrays arrays_;
  bool in_place_;  // input and output overlap: a later step may overwrite what a send reads
  double timeout_s_;
  Clock::time_point deadline_;
  std::vector<Incoming> incoming_;
  size_t next_in_ = 0;
  std::deque<Posted> posted_;
  std::deque<InFlight> sends_;
  std::vector<int> free_;
  bool ok_ = false;
};

NetComm::NetComm(MPI_Comm comm, const NetOptions& opts)
    : comm_(comm), opts_(opts), timeout_s_(opts.timeout_s) {
  PYCOLL_CHECK(opts.window >= 2, "window");
  PYCOLL_CHECK(opts.piece_bytes >= 64 && opts.piece_bytes <= (size_t{1} << 30), "piece_bytes");
  check_mpi(MPI_Comm_rank(comm, &rank_), "MPI_Comm_rank");
  check_mpi(MPI_Comm_size(comm, &size_), "MPI_Comm_size");
  int* ub = nullptr;
  int flag = 0;
  if (MPI_Comm_get_attr(MPI_COMM_WORLD, MPI_TAG_UB, &ub, &flag) == MPI_SUCCESS && flag && ub)
    tag_ub_ = *ub;
}

NetComm::~NetComm() = default;

void NetComm::run(const NetCall& call) {
  const char* name = collective_name(call.collective);
  if (poisoned_)
    throw CollectiveError(
        str_cat(name, ": communicator is unusable after an earlier error: ", poison_reason_));
  const int n = static_cast<int>(call.group.size());
  const int me =
      static_cast<int>(std::find(call.group.begin(), call.group.end(), rank_) - call.group.begin());
  PYCOLL_CHECK(n >= 1 && me < n, "this rank is not in the group");
  PYCOLL_CHECK(call.root >= 0 && call.root < n, "root");
  for (int r : call.group) PYCOLL_CHECK(r >= 0 && r < size_, "group rank ", r);
  if (pool_.empty()) {
    pool_.resize(static_cast<size_t>(2 * opts_.window + 4));
    for (NetBuffer& b : pool_) b.data.reset(new uint8_t[opts_.piece_bytes]);
  }
  // The algorithm is the caller's (the inter-node algorithm of a hierarchical collective, or
  // the one a flat call over every rank names): nothing is chosen here.
  const ResolvedCall rc = resolve_call(call, me, n, false, [](Collective, size_t) -> AlgoChoice {
    throw InvalidArgument("between nodes a collective runs the algorithm it is given");
  });
  // Messages of one piece fill one buffer of the pool (piece_bytes).
  const ScheduleParams p = rc.schedule(opts_.piece_bytes, ScheduleParams{}.oneshot_max_bytes);
  StepRecorder rec;
  make_schedule(rc.algo, call.collective, p, rec);
  try {
    NetExecutor(*this, call, rc, rec.steps).run();
  } catch (const CollectiveError& e) {
    poisoned_ = true;
    poison_reason_ = e.what();
    throw;
  }
}

}  // namespace pycoll
