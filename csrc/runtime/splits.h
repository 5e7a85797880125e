// Rows of a call: what each rank alone knows of a call, published for every peer to read before
// any data moves, and the split matrix of an all-to-all with per-rank splits, checked through
// them.
//
// Each rank knows only its row (what it sends to each rank) and its column (what it receives
// from each rank); a fingerprint cannot compare those, since they legitimately differ between
// ranks. So every rank publishes both in its segment's row, tagged with the call's sequence
// number, reads every peer's, and checks the whole matrix: send_counts of q towards p
// == recv_counts of p from q, for all p, q. Every rank checks the same matrix in the same
// order, so every rank raises the same CollectiveMismatch, naming the first disagreeing pair.
// A call on device arrays registered on first use (device/first_use.h) trades where its buffers
// lie the same way.
//
// A rank rewrites its row only once every peer has read the previous contents (each rank
// acknowledges with splits_read, after it has used the rows), so a slow peer never finds it
// overwritten by a later call. Even all-to-alls never come here: their fingerprint (count)
// already says everything.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <vector>

namespace pycoll {

class ShmTransport;
class FingerprintGuard;
struct WaitContext;

// Publishes `bytes` of `mine` (at most ShmTransport::row_bytes) as this rank's row for call
// #w.seq, waits (bounded) for every peer's row of that call, and calls `read` with every rank's
// row, rank after rank `bytes` apart (ours included), before acknowledging them. A peer whose
// fingerprint differs raises its CollectiveMismatch; one that moved past the call without
// publishing a row raises one that says it ran no `what`.
void exchange_rows(const ShmTransport& t, FingerprintGuard& guard, const WaitContext& w,
                   const void* mine, size_t bytes, const char* what,
                   const std::function<void(const uint8_t* rows)>& read);

// Returns the matrix's largest entry (the same on every rank).
uint64_t check_split_matrix(const ShmTransport& t, FingerprintGuard& guard, const WaitContext& w,
                            const std::vector<uint64_t>& send_counts,
                            const std::vector<uint64_t>& recv_counts);

}  // namespace pycoll
