#include "runtime/splits.h"

#include <algorithm>
#include <cstring>

#include "common/errors.h"
#include "host/shm_transport.h"
#include "runtime/fingerprint.h"
#include "runtime/wait.h"

namespace pycoll {

void exchange_rows(const ShmTransport& t, FingerprintGuard& guard, const WaitContext& w,
                   const void* mine, size_t bytes, const char* what,
                   const std::function<void(const uint8_t* rows)>& read) {
  const int n = t.size(), me = t.rank();
  const uint64_t seq = w.seq;
  PYCOLL_CHECK(bytes <= ShmTransport::row_bytes(n), "a call's row");

  // Our previous row must have been read by everyone before we overwrite it.
  const uint64_t previous = t.splits_seq(me).load(std::memory_order_relaxed);
  for (int p = 0; p < n; ++p) {
    if (p == me || previous == 0) continue;
    wait_until([&] { return t.splits_read(p).load(std::memory_order_acquire) >= previous; }, w, p,
               WaitFor::Arrival);
  }
  std::memcpy(t.row(me), mine, bytes);
  t.splits_seq(me).store(seq, std::memory_order_release);

  // Every peer's row, once it has published it for this very call.
  std::vector<uint8_t> rows(static_cast<size_t>(n) * bytes);
  for (int p = 0; p < n; ++p) {
    if (p != me) {
      uint64_t theirs = 0;
      wait_until([&] { return (theirs = t.splits_seq(p).load(std::memory_order_acquire)) >= seq; },
                 w, p, WaitFor::Arrival);
      // A peer that published its row published its fingerprint first: a different call
      // raises the fingerprint's mismatch, naming the fields.
      guard.check(p);
      if (theirs != seq)
        throw CollectiveMismatch(str_cat(w.collective, " #", seq, ": rank ", p,
                                         " has moved past this call without running ", what));
    }
    std::memcpy(&rows[static_cast<size_t>(p) * bytes], t.row(p), bytes);
  }
  read(rows.data());
  t.splits_read(me).store(seq, std::memory_order_release);
}

uint64_t check_split_matrix(const ShmTransport& t, FingerprintGuard& guard, const WaitContext& w,
                            const std::vector<uint64_t>& send_counts,
                            const std::vector<uint64_t>& recv_counts) {
  const int n = t.size();
  const uint64_t seq = w.seq;
  const size_t row_bytes = static_cast<size_t>(n) * sizeof(uint64_t);
  PYCOLL_CHECK(
      send_counts.size() == static_cast<size_t>(n) && recv_counts.size() == static_cast<size_t>(n),
      "split lists");
  std::vector<uint64_t> mine(2 * static_cast<size_t>(n));
  std::memcpy(mine.data(), send_counts.data(), row_bytes);
  std::memcpy(mine.data() + n, recv_counts.data(), row_bytes);
  std::vector<uint64_t> matrix(static_cast<size_t>(n) * 2 * n);
  exchange_rows(t, guard, w, mine.data(), 2 * row_bytes, "an all_to_all with splits",
                [&](const uint8_t* rows) { std::memcpy(matrix.data(), rows, n * 2 * row_bytes); });

  auto sends = [&](int q, int p) { return matrix[static_cast<size_t>(q) * 2 * n + p]; };
  auto expects = [&](int p, int q) { return matrix[static_cast<size_t>(p) * 2 * n + n + q]; };
  uint64_t widest = 0;
  for (int q = 0; q < n; ++q)
    for (int p = 0; p < n; ++p)
      if (sends(q, p) == expects(p, q))
        widest = std::max(widest, sends(q, p));
      else
        throw CollectiveMismatch(str_cat(
            "all_to_all #", seq, ": ranks disagree on the splits: rank ", q, " sends ", sends(q, p),
            " elements to rank ", p, ", but rank ", p, " expects ", expects(p, q), " from rank ", q,
            " (in_splits of each rank must match out_splits of its peers)"));
  return widest;
}

}  // namespace pycoll
