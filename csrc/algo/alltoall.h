// Personalised exchanges: every rank has a different block for every other rank.
#pragma once

#include "algo/step.h"

namespace pycoll {

// All-to-all: block j of Input goes to rank j, and Output holds the block from each rank,
// rank-major (blocks of p.count, or p.send_counts / p.recv_counts). Pairwise and pipelined: at
// step k of each piece, rank r sends to r+k and receives from r-k, so no two ranks send to one
// peer at once and every channel advances one piece per round.
void direct_alltoall(const ScheduleParams& p, StepSink& sink);

// Gather: the root's Output holds every rank's Input (p.count each), rank-major. The root
// takes piece o from every peer before piece o+1 from any, so all senders stream at once.
void direct_gather(const ScheduleParams& p, StepSink& sink);
// Scatter: block j of the root's Input (p.count each) lands in rank j's Output, the pieces
// interleaved across peers as in gather.
void direct_scatter(const ScheduleParams& p, StepSink& sink);

}  // namespace pycoll
