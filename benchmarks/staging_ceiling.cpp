// How fast can a 2-rank all-reduce of private (not shared) arrays be when every byte that
// crosses between the ranks goes through staging slots? Two threads stand for the two ranks;
// each runs a bare version of a schedule, with no library around it, and the times are set
// against the memory bound as pycoll-bench takes it: a non-temporal copy of the same bytes by
// both threads at once.
//
//   g++ -O2 -mavx2 -pthread benchmarks/staging_ceiling.cpp -o /tmp/staging_ceiling
//   /tmp/staging_ceiling [MiB per rank, default 64] [rounds, default 8]
//
// Schedules (float32 sum, 4 slots of 256 KiB per direction, outputs streamed, as the library
// does for out-of-place outputs of 16 MiB and more):
//   nt-copy   the bound: out = in with non-temporal stores
//   ring      the library's 2-rank ring per piece: our half of the peer's shard into a slot;
//             our shard + the peer's slot into the output and a slot; the peer's slot into
//             the output
//   one-shot  each rank reduces the whole array: its input into a slot, then input + the
//             peer's slot into the output
//   cma       as ring, but the peer's input shard is read with process_vm_readv instead of
//             from a slot (cross-memory attach, as single-copy paths do)
// Every variant's output is checked against in0 + in1.
#include <immintrin.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

namespace {

constexpr size_t kPiece = 64 * 1024;  // floats: a 256 KiB slot
constexpr uint64_t kSlots = 4;

struct alignas(128) Counter {
  std::atomic<uint64_t> v{0};
};

struct Rank {
  float* in = nullptr;
  float* out = nullptr;
  float* slots = nullptr;  // written by this rank, read by the other
  Counter posted, consumed;
};

size_t g_count = 0;  // floats per rank
Rank g_rank[2];

void wait_for(const Counter& c, uint64_t at_least) {
  while (c.v.load(std::memory_order_acquire) < at_least) _mm_pause();
}

void stream(float* d, const float* s, size_t n) {
  for (size_t i = 0; i < n; i += 8) _mm256_stream_ps(d + i, _mm256_loadu_ps(s + i));
}

// d = a + b streamed; d2 (if any) = the same, cached.
void add(float* d, float* d2, const float* a, const float* b, size_t n) {
  for (size_t i = 0; i < n; i += 8) {
    const __m256 v = _mm256_add_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i));
    _mm256_stream_ps(d + i, v);
    if (d2) _mm256_storeu_ps(d2 + i, v);
  }
}

// One rank's side of the slot channels.
class Channel {
 public:
  explicit Channel(int r) : me_(g_rank[r]), peer_(g_rank[1 - r]) {}
  float* send_slot() {
    if (sent_ >= kSlots) wait_for(peer_.consumed, sent_ - kSlots + 1);
    return me_.slots + (sent_ % kSlots) * kPiece;
  }
  void post() { me_.posted.v.store(++sent_, std::memory_order_release); }
  const float* recv_slot() {
    wait_for(peer_.posted, got_ + 1);
    return peer_.slots + (got_ % kSlots) * kPiece;
  }
  void release() { me_.consumed.v.store(++got_, std::memory_order_release); }

 private:
  Rank& me_;
  Rank& peer_;
  uint64_t sent_ = 0, got_ = 0;
};

// In rank order, so that both ranks compute the same bits.
void add_ordered(int r, float* d, float* d2, const float* mine, const float* theirs, size_t n) {
  if (r == 0)
    add(d, d2, mine, theirs, n);
  else
    add(d, d2, theirs, mine, n);
}

void nt_copy(int r) { stream(g_rank[r].out, g_rank[r].in, g_count); }

void ring(int r) {
  Channel ch(r);
  const Rank& me = g_rank[r];
  const size_t half = g_count / 2, mine = r * half, theirs = (1 - r) * half;
  for (size_t o = 0; o < half; o += kPiece) {
    const size_t n = std::min(kPiece, half - o);
    std::memcpy(ch.send_slot(), me.in + theirs + o, n * 4);
    ch.post();
    const float* partial = ch.recv_slot();
    add_ordered(r, me.out + mine + o, ch.send_slot(), me.in + mine + o, partial, n);
    ch.post();
    ch.release();
    stream(me.out + theirs + o, ch.recv_slot(), n);
    ch.release();
  }
}

void one_shot(int r) {
  Channel ch(r);
  const Rank& me = g_rank[r];
  for (size_t o = 0; o < g_count; o += kPiece) {
    const size_t n = std::min(kPiece, g_count - o);
    std::memcpy(ch.send_slot(), me.in + o, n * 4);
    ch.post();
    add_ordered(r, me.out + o, nullptr, me.in + o, ch.recv_slot(), n);
    ch.release();
  }
}

void cma(int r) {
  Channel ch(r);
  const Rank& me = g_rank[r];
  const Rank& peer = g_rank[1 - r];
  std::vector<float> buf(kPiece);
  const size_t half = g_count / 2, mine = r * half, theirs = (1 - r) * half;
  for (size_t o = 0; o < half; o += kPiece) {
    const size_t n = std::min(kPiece, half - o);
    iovec local{buf.data(), n * 4}, remote{peer.in + mine + o, n * 4};
    if (process_vm_readv(getpid(), &local, 1, &remote, 1, 0) != static_cast<ssize_t>(n * 4)) {
      std::perror("process_vm_readv");
      std::exit(1);
    }
    add_ordered(r, me.out + mine + o, ch.send_slot(), me.in + mine + o, buf.data(), n);
    ch.post();
    stream(me.out + theirs + o, ch.recv_slot(), n);
    ch.release();
  }
}

}  // namespace

int main(int argc, char** argv) {
  const double mib = argc > 1 ? std::atof(argv[1]) : 64;
  const int rounds = argc > 2 ? std::atoi(argv[2]) : 8;
  g_count = static_cast<size_t>(mib * (1 << 20) / 4) / (2 * kPiece) * (2 * kPiece);
  if (g_count == 0 || rounds < 1) {
    std::fprintf(stderr, "usage: %s [MiB >= 0.5] [rounds >= 1]\n", argv[0]);
    return 2;
  }
  for (int r = 0; r < 2; ++r) {
    Rank& k = g_rank[r];
    k.in = static_cast<float*>(std::aligned_alloc(4096, g_count * 4));
    k.out = static_cast<float*>(std::aligned_alloc(4096, g_count * 4));
    k.slots = static_cast<float*>(std::aligned_alloc(4096, kSlots * kPiece * 4));
    for (size_t i = 0; i < g_count; ++i) k.in[i] = static_cast<float>(i % 251 + 3 * r);
    std::memset(k.out, 0, g_count * 4);
    std::memset(k.slots, 0, kSlots * kPiece * 4);
  }
  struct Variant {
    const char* name;
    void (*run)(int);
    bool reduces;
  };
  const Variant variants[] = {
      {"nt-copy", nt_copy, false}, {"ring", ring, true}, {"one-shot", one_shot, true},
      {"cma", cma, true}};
  std::vector<std::vector<double>> times(std::size(variants));
  for (int k = 0; k < rounds; ++k) {
    for (size_t v = 0; v < std::size(variants); ++v) {
      for (Rank& rk : g_rank) rk.posted.v = rk.consumed.v = 0;
      const auto t0 = std::chrono::steady_clock::now();
      std::thread other([&] {
        variants[v].run(1);
        _mm_sfence();
      });
      variants[v].run(0);
      _mm_sfence();
      other.join();
      times[v].push_back(
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
      if (!variants[v].reduces) continue;
      for (size_t i = 0; i < g_count; ++i) {
        const float want = g_rank[0].in[i] + g_rank[1].in[i];
        if (g_rank[0].out[i] != want || g_rank[1].out[i] != want) {
          std::fprintf(stderr, "%s: wrong result at %zu\n", variants[v].name, i);
          return 1;
        }
      }
    }
  }
  std::printf("# 2 threads, %.1f MiB float32 each, best and median of %d rounds\n",
              g_count * 4.0 / (1 << 20), rounds);
  std::printf("# %-10s %10s %10s %9s\n", "schedule", "best ms", "median ms", "of bound");
  double bound = 0;
  for (size_t v = 0; v < std::size(variants); ++v) {
    std::vector<double>& t = times[v];
    std::sort(t.begin(), t.end());
    if (v == 0) bound = t[0];
    std::printf("  %-10s %10.3f %10.3f %8.0f%%\n", variants[v].name, t[0] * 1e3,
                t[t.size() / 2] * 1e3, 100 * bound / t[0]);
  }
  return 0;
}
