// Where do the two cores of the 2-rank runs sit relative to each other, right now? Two threads,
// pinned to CPUs 0 and 1, time a cache-line round trip and the hand-over of 256 KiB blocks
// (one writes, the other reads, two blocks in flight), written with ordinary stores (the reader
// takes each line out of the writer's cache) and with non-temporal ones (through memory).
// Prints a line every ~0.3 s; on a VM the host moves the vCPUs, and the figures jump with it.
// This is why the host transport measures which stores to use for its slots
// (csrc/host/slot_stores.h).
//
//   g++ -O2 -mavx2 -pthread benchmarks/core_placement.cpp -o /tmp/core_placement
//   /tmp/core_placement [seconds, default 60]
#include <immintrin.h>
#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>

namespace {

using Clock = std::chrono::steady_clock;
constexpr size_t kBlock = 256 * 1024;
constexpr uint64_t kBlocks = 64, kTrips = 20000;

struct alignas(128) Line {
  std::atomic<uint64_t> v{0};
};
Line ping, pong, posted, consumed;
std::atomic<int> task{0}, go{0}, done{0};  // task: 1 round trips, 2 hand-over, -1 quit
float* blocks[2];
float sink;

void pin(int cpu) {
  cpu_set_t s;
  CPU_ZERO(&s);
  CPU_SET(cpu, &s);
  pthread_setaffinity_np(pthread_self(), sizeof s, &s);
}

double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// The reading side, on CPU 1.
void reader() {
  pin(1);
  for (int seen = 0;;) {
    while (go.load() == seen) _mm_pause();
    seen = go.load();
    if (task.load() < 0) return;
    if (task.load() == 1) {
      for (uint64_t i = 1; i <= kTrips; ++i) {
        while (ping.v.load(std::memory_order_acquire) != i) _mm_pause();
        pong.v.store(i, std::memory_order_release);
      }
    } else {
      __m256 acc = _mm256_setzero_ps();
      for (uint64_t i = 1; i <= kBlocks; ++i) {
        while (posted.v.load(std::memory_order_acquire) < i) _mm_pause();
        const float* b = blocks[i & 1];
        for (size_t k = 0; k < kBlock / 4; k += 8) acc = _mm256_add_ps(acc, _mm256_load_ps(b + k));
        consumed.v.store(i, std::memory_order_release);
      }
      float t[8];
      _mm256_storeu_ps(t, acc);
      sink += t[0];
    }
    done.fetch_add(1);
  }
}

void start(int what) {
  task = what;
  go.fetch_add(1);
}

// Seconds `body` takes while the reader runs `what`, the two lines the task signals on reset
// first; returns once the reader is done too.
template <class Body>
double timed(int what, Line& a, Line& b, Body&& body) {
  a.v = 0;
  b.v = 0;
  const int before = done.load();
  start(what);
  const auto t = Clock::now();
  body();
  const double s = seconds_since(t);
  while (done.load() == before) _mm_pause();
  return s;
}

double round_trip_ns() {
  const double s = timed(1, ping, pong, [] {
    for (uint64_t i = 1; i <= kTrips; ++i) {
      ping.v.store(i, std::memory_order_release);
      while (pong.v.load(std::memory_order_acquire) != i) _mm_pause();
    }
  });
  return s * 1e9 / kTrips;
}

double hand_over_gbs(bool streamed) {
  const double s = timed(2, posted, consumed, [streamed] {
    for (uint64_t i = 1; i <= kBlocks; ++i) {
      if (i > 2)
        while (consumed.v.load(std::memory_order_acquire) < i - 2) _mm_pause();
      float* b = blocks[i & 1];
      const __m256 v = _mm256_set1_ps(static_cast<float>(i));
      if (streamed) {
        for (size_t k = 0; k < kBlock / 4; k += 8) _mm256_stream_ps(b + k, v);
        _mm_sfence();
      } else {
        for (size_t k = 0; k < kBlock / 4; k += 8) _mm256_store_ps(b + k, v);
      }
      posted.v.store(i, std::memory_order_release);
    }
    while (consumed.v.load(std::memory_order_acquire) < kBlocks) _mm_pause();
  });
  return kBlocks * kBlock / s / 1e9;
}

}  // namespace

int main(int argc, char** argv) {
  const double duration = argc > 1 ? std::atof(argv[1]) : 60;
  for (float*& b : blocks) {
    b = static_cast<float*>(std::aligned_alloc(64, kBlock));
    std::memset(b, 0, kBlock);
  }
  pin(0);
  std::thread t(reader);
  std::printf("# time s, round trip ns, hand-over GB/s ordinary, non-temporal (best of 5)\n");
  const auto t0 = Clock::now();
  while (seconds_since(t0) < duration) {
    double trip = 1e9, cached = 0, streamed = 0;
    for (int rep = 0; rep < 5; ++rep) {
      trip = std::min(trip, round_trip_ns());
      cached = std::max(cached, hand_over_gbs(false));
      streamed = std::max(streamed, hand_over_gbs(true));
    }
    std::printf("%6.1f %7.1f %6.2f %6.2f\n", seconds_since(t0), trip, cached, streamed);
    std::fflush(stdout);
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
  }
  start(-1);
  t.join();
}
