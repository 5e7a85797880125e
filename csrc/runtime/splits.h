// The split matrix of an all-to-all with per-rank splits, checked before any data moves.
//
// Each rank knows only its row (what it sends to each rank) and its column (what it receives
// from each rank); a fingerprint cannot compare those, since they legitimately differ between
// ranks. So every rank publishes both in its segment's split area, tagged with the call's
// sequence number, reads every peer's, and checks the whole matrix: send_counts of q towards p
// == recv_counts of p from q, for all p, q. Every rank checks the same matrix in the same
// order, so every rank raises the same CollectiveMismatch, naming the first disagreeing pair.
//
// A rank rewrites its area only once every peer has read the previous contents (each rank
// acknowledges with splits_read), so a slow peer never finds it overwritten by a later call.
// Even all-to-alls never come here: their fingerprint (count) already says everything.
#pragma once

#include <cstdint>
#include <vector>

namespace pycoll {

class ShmTransport;
class FingerprintGuard;
struct WaitContext;

// Returns the matrix's largest entry (the same on every rank).
uint64_t check_split_matrix(const ShmTransport& t, FingerprintGuard& guard, const WaitContext& w,
                            const std::vector<uint64_t>& send_counts,
                            const std::vector<uint64_t>& recv_counts);

}  // namespace pycoll
