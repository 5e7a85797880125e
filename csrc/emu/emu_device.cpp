// The step kernel compiled for the host: one instantiation per element type, as on the GPU,
// and the checks and back-off it runs with here.
#include "emu/emu_device.h"

#include <linux/futex.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstdint>
#include <cstring>
#include <thread>
#include <utility>
#include <vector>

#include "common/errors.h"
#include "device/twoshot_kernel.h"

namespace pycoll {
namespace emu {

namespace {

thread_local const Regions* tls_regions = nullptr;

// This thread's buffered stores (buffer_store): 16-byte lines, the bytes written and which,
// in an open-addressing table kept from one flush to the next (a store is on every data
// path: no allocation per line).
struct Line {
  uint8_t bytes[16];
  uint16_t mask = 0;
};
class StoreTable {
 public:
  bool empty() const { return used_.empty(); }
  Line& at(uintptr_t line) {
    if ((used_.size() + 1) * 2 > keys_.size()) grow();
    size_t i = slot(line);
    while (keys_[i] != 0 && keys_[i] != line) i = (i + 1) & (keys_.size() - 1);
    if (keys_[i] == 0) {
      keys_[i] = line;
      used_.push_back(static_cast<uint32_t>(i));
    }
    return lines_[i];
  }
  const Line* find(uintptr_t line) const {
    if (keys_.empty()) return nullptr;
    for (size_t i = slot(line); keys_[i] != 0; i = (i + 1) & (keys_.size() - 1))
      if (keys_[i] == line) return &lines_[i];
    return nullptr;
  }
  template <class F>
  void each(F&& f) const {
    for (const uint32_t i : used_) f(keys_[i], lines_[i]);
  }
  void clear() {
    for (const uint32_t i : used_) {
      keys_[i] = 0;
      lines_[i].mask = 0;
    }
    used_.clear();
  }

 private:
  size_t slot(uintptr_t line) const {
    return static_cast<size_t>((line >> 4) * 0x9E3779B97F4A7C15ull >> 20) & (keys_.size() - 1);
  }
  void grow() {
    std::vector<std::pair<uintptr_t, Line>> kept;
    kept.reserve(used_.size());
    each([&](uintptr_t k, const Line& l) { kept.emplace_back(k, l); });
    const size_t n = keys_.empty() ? 1024 : keys_.size() * 2;
    keys_.assign(n, 0);
    lines_.assign(n, Line{});
    used_.clear();
    for (const auto& [k, l] : kept) at(k) = l;
  }
  std::vector<uintptr_t> keys_;  // 0: free
  std::vector<Line> lines_;
  std::vector<uint32_t> used_;
};
thread_local StoreTable tls_stores;
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
  struct Ending {  // the block's stores are visible once it has ended (failed: dropped)
    bool ok = false;
    ~Ending() { ok ? flush_stores() : drop_stores(); }
  } ending;
  cuda::run_launch<T>(a, s, block, EmuThreads{threads, block});
  ending.ok = true;
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

bool buffer_store(void* p, const void* v, size_t bytes) {
  const Regions* rs = current_regions();
  if (rs == nullptr || !rs->weak_stores) return false;
  const uintptr_t at = reinterpret_cast<uintptr_t>(p);
  const uint8_t* src = static_cast<const uint8_t*>(v);
  for (size_t i = 0; i < bytes;) {
    const uintptr_t line = (at + i) & ~uintptr_t{15};
    const size_t off = at + i - line;
    const size_t n = std::min<size_t>(bytes - i, 16 - off);
    Line& l = tls_stores.at(line);
    std::memcpy(l.bytes + off, src + i, n);
    l.mask = static_cast<uint16_t>(l.mask | (((1u << n) - 1) << off));
    i += n;
  }
  return true;
}

void forward_load(const void* p, void* v, size_t bytes) {
  if (tls_stores.empty()) return;
  const uintptr_t at = reinterpret_cast<uintptr_t>(p);
  uint8_t* dst = static_cast<uint8_t*>(v);
  for (size_t i = 0; i < bytes;) {
    const uintptr_t line = (at + i) & ~uintptr_t{15};
    const size_t off = at + i - line;
    const size_t n = std::min<size_t>(bytes - i, 16 - off);
    if (const Line* l = tls_stores.find(line))
      for (size_t k = 0; k < n; ++k)
        if (l->mask >> (off + k) & 1) dst[i + k] = l->bytes[off + k];
    i += n;
  }
}

void flush_stores() {
  if (tls_stores.empty()) return;
  tls_stores.each([](uintptr_t line, const Line& l) {
    uint8_t* q = reinterpret_cast<uint8_t*>(line);
    if (l.mask == 0xffff) {
      std::memcpy(q, l.bytes, 16);
      return;
    }
    for (int k = 0; k < 16; ++k)
      if (l.mask >> k & 1) q[k] = l.bytes[k];
  });
  tls_stores.clear();
}

void drop_stores() { tls_stores.clear(); }

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
