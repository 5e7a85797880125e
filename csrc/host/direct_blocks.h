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

// The blocks of a call that go through the point-to-point engine.
struct DirectBlocks {
  size_t min_count = 0;    // from this element count up (0: none: another collective or algorithm)
  std::vector<P2POp> ops;  // the sends and recvs of this rank for them
};

// `call`'s direct blocks on `rank` of `size` under `algo`, from `min_bytes` up: the schedule
// leaves them out (ScheduleParams::direct_min_count = min_count) and the engine runs `ops`.
DirectBlocks direct_blocks(const CollectiveCall& call, Algo algo, int rank, int size,
                           size_t min_bytes);

}  // namespace pycoll
