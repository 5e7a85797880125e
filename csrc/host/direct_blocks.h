// Large blocks of all-to-all, gather and scatter over the point-to-point engine.
//
// The collective schedules move a block between two ranks piece by piece through the
// collective's staging slots, one message per piece. From `min_bytes` up the schedule leaves
// blocks between different ranks out (ScheduleParams::direct_min_count), and the host
// communicator moves them through the point-to-point engine on its internal tag: through its
// slots, both ranks copying at once, or, for messages from the engine's direct-write size up,
// written straight into the receiver's buffer with process_vm_writev. This runs only once
// every peer's fingerprint has been checked, so all ranks are in the same collective and
// agree on every block's length; the internal tag keeps these messages apart from users' own,
// and one tag suffices because collectives run in the same order on every rank and messages
// of a tag never overtake.
#pragma once

#include <cstddef>
#include <vector>

#include "algo/call.h"
#include "runtime/p2p_core.h"

namespace pycoll {

// Blocks from this size up go through the point-to-point engine (or from the engine's
// direct-write size, if smaller).
constexpr size_t kBlockP2PBytes = 64 * 1024;

// The element count from which `call`'s blocks go through the point-to-point engine (0: none
// do: another collective or algorithm).
size_t direct_min_count(const CollectiveCall& call, Algo algo, size_t min_bytes);

// The sends and recvs of `rank` for the blocks the schedule left out.
std::vector<P2POp> direct_block_ops(const CollectiveCall& call, int rank, int size,
                                    size_t min_count);

}  // namespace pycoll
