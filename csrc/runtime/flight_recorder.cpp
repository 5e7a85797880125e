#include "runtime/flight_recorder.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <thread>

#include "algo/schedule.h"
#include "common/dtypes.h"

#if defined(__x86_64__) || defined(__i386__)
#include <x86intrin.h>
#define PYCOLL_HAVE_TSC 1
#endif

namespace pycoll {

namespace {

// Every recorder that is on, for SIGUSR1.
std::mutex g_live_mu;
std::vector<const FlightRecorder*>& live() {
  static auto* v = new std::vector<const FlightRecorder*>();  // outlives static destructors
  return *v;
}

// The signal's pipe: the handler writes a byte, the dumper thread reads it.
int g_pipe[2] = {-1, -1};
pid_t g_installed_by = 0;
struct sigaction g_previous{};

void on_sigusr1(int sig, siginfo_t* info, void* ctx) {
  const int saved = errno;
  if (g_pipe[1] >= 0) {
    const char b = 1;
    ssize_t rc = write(g_pipe[1], &b, 1);  // non-blocking: a full pipe already has a request
    (void)rc;
  }
  errno = saved;
  if (g_previous.sa_flags & SA_SIGINFO) {
    if (g_previous.sa_sigaction != nullptr) g_previous.sa_sigaction(sig, info, ctx);
  } else if (g_previous.sa_handler != SIG_DFL && g_previous.sa_handler != SIG_IGN &&
             g_previous.sa_handler != nullptr) {
    g_previous.sa_handler(sig);
  }
}

const char* state_name(uint32_t s) {
  switch (static_cast<FlightState>(s)) {
    case FlightState::Queued:
      return "queued";
    case FlightState::Started:
      return "started";
    case FlightState::Ended:
      return "ended";
    case FlightState::Failed:
      return "failed";
    default:
      return "empty";
  }
}

const char* kind_name(uint32_t k) {
  if (k == kFlightBarrier) return "barrier";
  if (k == kFlightSend) return "send";
  if (k == kFlightRecv) return "recv";
  if (k < static_cast<uint32_t>(kNumCollectives))
    return collective_name(static_cast<Collective>(k));
  return "unknown";
}

// `s` as a JSON string.
std::string quoted(const std::string& s) {
  std::string q = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') {
      q += '\\';
      q += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", static_cast<unsigned>(c));
      q += buf;
    } else {
      q += c;
    }
  }
  return q + "\"";
}

void make_parents(const std::string& path) {
  for (size_t i = 1; i < path.size(); ++i)
    if (path[i] == '/') mkdir(path.substr(0, i).c_str(), 0777);  // EEXIST is fine
}

}  // namespace

FlightRecorder::FlightRecorder(size_t entries) {
  tick0_ = ticks();
  ns0_ = now_ns();
  if (entries == 0) return;
  size_t n = 1;
  while (n < entries) n <<= 1;
  mask_ = n - 1;
  ring_.reset(new Entry[n]);
  std::lock_guard<std::mutex> g(g_live_mu);
  live().push_back(this);
}

FlightRecorder::~FlightRecorder() {
  if (!on()) return;
  std::lock_guard<std::mutex> g(g_live_mu);
  auto& v = live();
  v.erase(std::remove(v.begin(), v.end(), this), v.end());
}

int64_t FlightRecorder::now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

uint64_t FlightRecorder::ticks() {
#ifdef PYCOLL_HAVE_TSC
  return __rdtsc();  // ~10 ns; the clock costs 20-80 ns on a VM
#else
  return static_cast<uint64_t>(now_ns());
#endif
}

long double FlightRecorder::ns_per_tick() const {
#ifdef PYCOLL_HAVE_TSC
  // The rate since creation: a ring read soon after holds times as near the creation's, so a
  // coarse rate then costs little. (No wait here: a failing communicator reads it.)
  const uint64_t t1 = ticks();
  const int64_t n1 = now_ns();
  if (t1 <= tick0_ || n1 <= ns0_) return 0.0L;
  return static_cast<long double>(n1 - ns0_) / static_cast<long double>(t1 - tick0_);
#else
  return 1.0L;
#endif
}

int64_t FlightRecorder::ticks_to_ns(uint64_t t, long double rate) const {
  if (t == 0) return 0;
#ifdef PYCOLL_HAVE_TSC
  return ns0_ + static_cast<int64_t>(
                    (static_cast<long double>(t) - static_cast<long double>(tick0_)) * rate);
#else
  (void)rate;
  return static_cast<int64_t>(t);
#endif
}

uint64_t FlightRecorder::begin(const FlightCall& call, FlightState state) {
  if (!on()) return 0;
  const uint64_t id = next_.fetch_add(1, std::memory_order_relaxed);
  Entry& e = ring_[id & mask_];
  constexpr auto r = std::memory_order_relaxed;
  e.id.store(0, r);
  std::atomic_thread_fence(std::memory_order_release);
  e.kind.store(call.kind, r);
  e.dtype.store(call.dtype, r);
  e.op.store(call.op, r);
  e.algo.store(call.algo, r);
  e.root.store(call.root, r);
  e.count.store(call.count, r);
  e.tag.store(call.tag, r);
  e.seq.store(call.seq, r);
  e.outer_seq.store(call.outer_seq, r);
  const uint64_t now = ticks();
  e.queued.store(now, r);
  e.started.store(state == FlightState::Started ? now : 0, r);
  e.ended.store(0, r);
  e.state.store(static_cast<uint32_t>(state), r);
  e.id.store(id, std::memory_order_release);
  return id;
}

void FlightRecorder::set_algo(uint64_t id, uint32_t algo) {
  if (id == 0) return;
  Entry& e = ring_[id & mask_];
  if (e.id.load(std::memory_order_relaxed) == id) e.algo.store(algo, std::memory_order_relaxed);
}

void FlightRecorder::mark(uint64_t id, FlightState state) {
  if (id == 0) return;
  Entry& e = ring_[id & mask_];
  if (e.id.load(std::memory_order_relaxed) != id) return;  // overwritten: the ring went round
  const uint64_t now = ticks();
  if (state == FlightState::Started)
    e.started.store(now, std::memory_order_relaxed);
  else
    e.ended.store(now, std::memory_order_relaxed);
  e.state.store(static_cast<uint32_t>(state), std::memory_order_release);
}

std::vector<FlightRecord> FlightRecorder::snapshot() const {
  std::vector<FlightRecord> out;
  if (!on()) return out;
  const uint64_t last = next_.load(std::memory_order_acquire);
  const uint64_t n = mask_ + 1;
  const uint64_t first = last > n ? last - n : 1;
  struct Raw {
    FlightRecord rec;
    uint64_t q, s, e;
  };
  std::vector<Raw> raw;
  for (uint64_t id = first; id < last; ++id) {
    const Entry& e = ring_[id & mask_];
    if (e.id.load(std::memory_order_acquire) != id) continue;
    Raw r;
    r.rec.id = id;
    r.rec.state = static_cast<FlightState>(e.state.load(std::memory_order_acquire));
    r.rec.call.kind = e.kind.load();
    r.rec.call.dtype = e.dtype.load();
    r.rec.call.op = e.op.load();
    r.rec.call.algo = e.algo.load();
    r.rec.call.root = e.root.load();
    r.rec.call.count = e.count.load();
    r.rec.call.tag = e.tag.load();
    r.rec.call.seq = e.seq.load();
    r.rec.call.outer_seq = e.outer_seq.load();
    r.q = e.queued.load();
    r.s = e.started.load();
    r.e = e.ended.load();
    std::atomic_thread_fence(std::memory_order_acquire);
    if (e.id.load(std::memory_order_relaxed) != id) continue;  // rewritten while read
    raw.push_back(r);
  }
  const long double rate = raw.empty() ? 1.0L : ns_per_tick();
  for (Raw& r : raw) {
    r.rec.queued_ns = ticks_to_ns(r.q, rate);
    r.rec.started_ns = ticks_to_ns(r.s, rate);
    r.rec.ended_ns = ticks_to_ns(r.e, rate);
    out.push_back(r.rec);
  }
  return out;
}

void FlightRecorder::set_dump(const std::string& path, int rank, int size,
                              const std::string& comm_id) {
  {
    std::lock_guard<std::mutex> g(dump_mu_);
    path_ = path;
    rank_ = rank;
    size_ = size;
    comm_id_ = comm_id;
  }
  if (!path.empty() && on()) install_signal_handler();
}

std::string FlightRecorder::pointer() const {
  if (path_.empty() || !on()) return std::string();
  const size_t slash = path_.rfind('/');
  const std::string dir = slash == std::string::npos ? std::string(".") : path_.substr(0, slash);
  return "; flight record: " + path_ + " (all ranks: python -m pycollectives.trace analyze " + dir +
         ")";
}

bool FlightRecorder::dump(const std::string& reason, bool failure) const {
  std::lock_guard<std::mutex> g(dump_mu_);
  if (failure) {
    if (failed_) return false;  // the first failure's record stays
    failed_ = true;
  }
  return write_locked(reason);
}

bool FlightRecorder::write_locked(const std::string& reason) const {
  if (path_.empty() || !on()) return false;
  const std::vector<FlightRecord> recs = snapshot();
  char host[256] = {0};
  gethostname(host, sizeof host - 1);
  const double wall =
      std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  std::string s = "{\n";
  s += "\"version\": 1,\n\"rank\": " + std::to_string(rank_) +
       ",\n\"size\": " + std::to_string(size_) + ",\n\"comm\": " + quoted(comm_id_) +
       ",\n\"pid\": " + std::to_string(getpid()) + ",\n\"host\": " + quoted(host) +
       ",\n\"reason\": " + quoted(reason) + ",\n\"dumped_ns\": " + std::to_string(now_ns()) + ",\n";
  char wbuf[64];
  std::snprintf(wbuf, sizeof wbuf, "%.6f", wall);
  s += std::string("\"dumped_wall\": ") + wbuf + ",\n\"capacity\": " + std::to_string(capacity()) +
       ",\n\"calls\": [";
  bool first = true;
  for (const FlightRecord& r : recs) {
    const FlightCall& c = r.call;
    const bool p2p = c.kind == kFlightSend || c.kind == kFlightRecv;
    const bool data = c.kind != kFlightBarrier;
    s += first ? "\n" : ",\n";
    first = false;
    s += "{\"id\": " + std::to_string(r.id) + ", \"seq\": " + std::to_string(c.seq) +
         ", \"call\": " + quoted(kind_name(c.kind));
    if (data) {
      s += ", \"count\": " + std::to_string(c.count) + ", \"dtype\": " +
           quoted(valid_dtype(static_cast<int>(c.dtype)) ? dtype_name(static_cast<DType>(c.dtype))
                                                         : "?");
    }
    if (!p2p && data && c.kind < static_cast<uint32_t>(kNumCollectives)) {
      const auto coll = static_cast<Collective>(c.kind);
      if (coll == Collective::AllReduce || coll == Collective::ReduceScatter ||
          coll == Collective::Reduce)
        s += ", \"op\": " + quoted(redop_name(static_cast<RedOp>(c.op)));
      if (has_root(coll)) s += ", \"root\": " + std::to_string(c.root);
      s += ", \"algo\": " + quoted(algo_name(static_cast<Algo>(c.algo)));
    }
    if (p2p) s += ", \"peer\": " + std::to_string(c.root) + ", \"tag\": " + std::to_string(c.tag);
    if (c.outer_seq != 0) s += ", \"outer_seq\": " + std::to_string(c.outer_seq);
    s += ", \"state\": " + quoted(state_name(static_cast<uint32_t>(r.state))) +
         ", \"queued_ns\": " + std::to_string(r.queued_ns) +
         ", \"started_ns\": " + std::to_string(r.started_ns) +
         ", \"ended_ns\": " + std::to_string(r.ended_ns) + "}";
  }
  s += "\n]\n}\n";
  make_parents(path_);
  const std::string tmp = path_ + ".tmp" + std::to_string(getpid());
  FILE* f = std::fopen(tmp.c_str(), "w");
  if (f == nullptr) return false;
  const bool ok = std::fwrite(s.data(), 1, s.size(), f) == s.size();
  if (std::fclose(f) != 0 || !ok || std::rename(tmp.c_str(), path_.c_str()) != 0) {
    std::remove(tmp.c_str());
    return false;
  }
  return true;
}

void FlightRecorder::dump_all(const std::string& reason) {
  std::lock_guard<std::mutex> g(g_live_mu);
  for (const FlightRecorder* r : live()) {
    std::lock_guard<std::mutex> d(r->dump_mu_);
    if (!r->failed_) r->write_locked(reason);
  }
}

void FlightRecorder::install_signal_handler() {
  static std::mutex mu;
  std::lock_guard<std::mutex> g(mu);
  if (g_installed_by == getpid()) return;
  // A fork's child inherits the handler and the pipe but not the thread: start it anew.
  if (g_pipe[0] >= 0) {
    close(g_pipe[0]);
    close(g_pipe[1]);
    g_pipe[0] = g_pipe[1] = -1;
  }
  int fds[2];
  if (pipe2(fds, O_CLOEXEC | O_NONBLOCK) != 0) return;
  const int flags = fcntl(fds[0], F_GETFL);
  fcntl(fds[0], F_SETFL, flags & ~O_NONBLOCK);  // the reader blocks; the writer never does
  struct sigaction current{};
  sigaction(SIGUSR1, nullptr, &current);
  const bool ours = (current.sa_flags & SA_SIGINFO) && current.sa_sigaction == on_sigusr1;
  if (!ours) {
    g_previous = current;
    struct sigaction sa{};
    sa.sa_sigaction = on_sigusr1;
    sa.sa_flags = SA_SIGINFO | SA_RESTART;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGUSR1, &sa, nullptr);
  }
  g_pipe[0] = fds[0];
  g_pipe[1] = fds[1];
  g_installed_by = getpid();
  const int rfd = fds[0];
  std::thread([rfd] {
    char buf[64];
    for (;;) {
      const ssize_t n = read(rfd, buf, sizeof buf);
      if (n > 0) {
        dump_all("SIGUSR1");
      } else if (n == 0 || (n < 0 && errno != EINTR)) {
        return;
      }
    }
  }).detach();
}

}  // namespace pycoll
