// Large blocks of all-to-all, gather and scatter in one copy.
//
// Through the staging slots a block is copied twice (into a slot, out of it). From
// `min_bytes` up the schedule leaves blocks between different ranks out
// (ScheduleParams::direct_min_count), and the host communicator moves them through the
// point-to-point engine on its internal tag, where the sender writes straight into the
// receiver's buffer with process_vm_writev (or, where the kernel refuses, through the p2p
// slots). This runs only once every peer's fingerprint has been checked, so all ranks are in
// the same collective and agree on every block's length; the internal tag keeps these
// messages apart from users' own, and one tag suffices because collectives run in the same
// order on every rank and messages of a tag never overtake.
#pragma once

#include <cstddef>
#include <vector>

#include "algo/call.h"
#include "host/p2p.h"

namespace pycoll {

// The element count from which `call`'s blocks go directly (0: none do: another collective,
// algorithm, or direct writes turned off).
size_t direct_min_count(const CollectiveCall& call, Algo algo, size_t min_bytes, CmaMode cma);

// The sends and recvs of `rank` for the blocks the schedule left out.
std::vector<P2POp> direct_block_ops(const CollectiveCall& call, int rank, int size,
                                    size_t min_count);

}  // namespace pycoll
