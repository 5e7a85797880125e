// The step kernel compiled for the host: one instantiation per element type, as on the GPU,
// and the checks and back-off it runs with here.
#include "emu/emu_device.h"

#include <linux/futex.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <chrono>
#include <climits>
#include <cstdint>
#include <thread>

#include "common/errors.h"
#include "device/twoshot_kernel.h"

namespace pycoll {
namespace emu {

namespace {

thread_local const Regions* tls_regions = nullptr;
thread_local LaunchProbe* tls_probe = nullptr;
thread_local TrafficCounts tls_traffic;

// The block's threads, run one after another between the block's barriers: the leader's
// phases and every thread's strided share of each slice, exactly as on the GPU.
struct EmuThreads {
  int nt;
  int block;
  bool leader() const { return true; }
  void sync() const {}
  template <class F>
  void each(F&& f) const {
    for (int t = 0; t < nt; ++t) f(t, nt);
  }
  void ending() const {
    LaunchProbe* p = tls_probe;
    if (p == nullptr) return;
    if (p->after != 0 && __atomic_load_n(p->done, __ATOMIC_ACQUIRE) < p->after)
      p->ahead.store(true);
    if (p->stagger_ms > 0)
      std::this_thread::sleep_for(std::chrono::milliseconds(p->stagger_ms * block));
    p->ended.fetch_add(1);
  }
};

template <class T>
void run(const cuda::KernelArgs& a, int block, int threads) {
  cuda::BlockState s;
  tls_traffic = TrafficCounts{};
  cuda::run_launch<T>(a, s, block, EmuThreads{threads, block});
  flush_traffic();
}

std::string describe(const void* p, size_t bytes) {
  const Regions* rs = current_regions();
  std::string near;
  if (rs != nullptr) {
    const uint8_t* q = static_cast<const uint8_t*>(p);
    for (const Region& r : rs->list) {
      if (q + bytes > r.lo && q < r.lo + r.bytes + 4096 && q + 4096 >= r.lo)
        near += str_cat(" [", r.what, r.rank >= 0 ? str_cat(" of rank ", r.rank) : "", ": offset ",
                        static_cast<long long>(q - r.lo), " of ", r.bytes, " bytes]");
    }
  }
  return near.empty() ? std::string(" [outside every buffer of the launch]") : near;
}

}  // namespace

const Regions* current_regions() { return tls_regions; }
void set_current_regions(const Regions* r) { tls_regions = r; }
LaunchProbe* current_probe() { return tls_probe; }
ProbeScope::ProbeScope(LaunchProbe* p) { tls_probe = p; }
ProbeScope::~ProbeScope() { tls_probe = nullptr; }

TrafficCounts& thread_traffic() { return tls_traffic; }

void flush_traffic() {
  const Regions* rs = current_regions();
  if (rs != nullptr && rs->traffic != nullptr) {
    rs->traffic->read_own += tls_traffic.read_own;
    rs->traffic->read_peer += tls_traffic.read_peer;
    rs->traffic->write_own += tls_traffic.write_own;
    rs->traffic->write_peer += tls_traffic.write_peer;
  }
  tls_traffic = TrafficCounts{};
}

void fail_access(const void* p, size_t bytes, bool write) {
  throw CollectiveError(str_cat("emulated device: ", write ? "store" : "load", " of ", bytes,
                                " bytes out of bounds", describe(p, bytes)));
}

void fail(const char* what) { throw CollectiveError(str_cat("emulated device: ", what)); }

void check_slot(const void* p, size_t bytes, const void* seg, const cuda::SegmentLayout& layout,
                int block, int channel, uint64_t m) {
  const uint8_t* q = static_cast<const uint8_t*>(p);
  const uint8_t* s = static_cast<const uint8_t*>(seg) + layout.slot_offset(block, channel, m);
  if (q < s || q + bytes > s + layout.sub_slot_bytes)
    throw CollectiveError(str_cat("emulated device: block ", block, "'s slice of message ", m,
                                  " on channel ", channel, " (", bytes, " bytes at offset ",
                                  static_cast<long long>(q - s), ") leaves its ",
                                  layout.sub_slot_bytes, "-byte sub-slot"));
}

void check_ll_slot(const void* p, size_t bytes, const void* seg, const cuda::SegmentLayout& layout,
                   int block, int channel, uint64_t m) {
  const uint8_t* q = static_cast<const uint8_t*>(p);
  if (block >= layout.ll_blocks)
    throw CollectiveError(str_cat("emulated device: block ", block, " has no LL sub-slots (",
                                  layout.ll_blocks, " blocks have)"));
  const uint8_t* s = static_cast<const uint8_t*>(seg) + layout.ll_slot_offset(block, channel, m);
  if (q != s || bytes > layout.ll_sub_slot_bytes)
    throw CollectiveError(str_cat("emulated device: block ", block, "'s LL slice of message ", m,
                                  " on channel ", channel, " (", bytes, " bytes at offset ",
                                  static_cast<long long>(q - s), ") leaves its ",
                                  layout.ll_sub_slot_bytes, "-byte LL sub-slot"));
}

uint64_t now_ns() {
  return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                   std::chrono::steady_clock::now().time_since_epoch())
                                   .count());
}

// A flag is 64 bits; the futex is its low 32 (little-endian), which change with every post.
void wait_change(const uint64_t* flag, uint64_t seen, uint64_t spins) {
  if (spins < 64) return;
  struct timespec ts{0, 200000};
  // The flag lies in memory shared between processes: not a FUTEX_PRIVATE_FLAG futex. A post
  // between the caller's load and this call changed the word: the call returns at once.
  syscall(SYS_futex, reinterpret_cast<const uint32_t*>(flag), FUTEX_WAIT,
          static_cast<uint32_t>(seen), &ts, nullptr, 0);
}

void wake(const uint64_t* flag) {
  syscall(SYS_futex, reinterpret_cast<const uint32_t*>(flag), FUTEX_WAKE, INT_MAX, nullptr, nullptr,
          0);
}

void run_block(DType dtype, const cuda::KernelArgs& a, int block, int threads) {
  switch (dtype) {
    case DType::Int8:
      return run<int8_t>(a, block, threads);
    case DType::UInt8:
      return run<uint8_t>(a, block, threads);
    case DType::Int32:
      return run<int32_t>(a, block, threads);
    case DType::Int64:
      return run<long long>(a, block, threads);
    case DType::Float16:
      return run<cuda::DevHalf>(a, block, threads);
    case DType::BFloat16:
      return run<cuda::DevBFloat16>(a, block, threads);
    case DType::Float32:
      return run<float>(a, block, threads);
    case DType::Float64:
      return run<double>(a, block, threads);
  }
  throw InvalidArgument("emulated device: unknown dtype");
}

}  // namespace emu
}  // namespace pycoll
