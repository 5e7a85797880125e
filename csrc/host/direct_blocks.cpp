#include "host/direct_blocks.h"

#include <algorithm>

#include "host/p2p.h"

namespace pycoll {

DirectBlocks direct_blocks(const CollectiveCall& call, Algo algo, int rank, int size,
                           size_t min_bytes) {
  DirectBlocks blocks;
  const bool has_blocks = call.collective == Collective::AllToAll ||
                          call.collective == Collective::Gather ||
                          call.collective == Collective::Scatter;
  // Even without direct writes the engine beats the schedule here: both ranks copy at once,
  // where the schedule's piece-by-piece messages keep them waiting on each other.
  if (call.barrier || !has_blocks || algo != Algo::Direct) return blocks;
  const size_t esize = dtype_size(call.dtype);
  const size_t min_count = blocks.min_count = std::max<size_t>(1, (min_bytes + esize - 1) / esize);
  std::vector<P2POp>& ops = blocks.ops;
  auto* in = static_cast<uint8_t*>(const_cast<void*>(call.in));  // sends only read it
  auto* out = static_cast<uint8_t*>(call.out);
  auto add = [&](P2PKind kind, uint8_t* base, size_t off, size_t count, int peer) {
    if (count < min_count) return;
    ops.push_back(
        P2POp{kind, base + off * esize, count, call.dtype, peer, P2PEngine::kInternalTag});
  };
  const size_t m = call.count;
  switch (call.collective) {
    case Collective::AllToAll: {
      size_t soff = 0, roff = 0;
      for (int q = 0; q < size; ++q) {
        const size_t slen = call.send_counts.empty() ? m : call.send_counts[q];
        const size_t rlen = call.recv_counts.empty() ? m : call.recv_counts[q];
        if (q != rank) {
          add(P2PKind::Send, in, soff, slen, q);
          add(P2PKind::Recv, out, roff, rlen, q);
        }
        soff += slen;
        roff += rlen;
      }
      break;
    }
    case Collective::Gather:
      if (rank != call.root)
        add(P2PKind::Send, in, 0, m, call.root);
      else
        for (int q = 0; q < size; ++q)
          if (q != rank) add(P2PKind::Recv, out, static_cast<size_t>(q) * m, m, q);
      break;
    case Collective::Scatter:
      if (rank != call.root)
        add(P2PKind::Recv, out, 0, m, call.root);
      else
        for (int q = 0; q < size; ++q)
          if (q != rank) add(P2PKind::Send, in, static_cast<size_t>(q) * m, m, q);
      break;
    default:
      break;
  }
  return blocks;
}

}  // namespace pycoll
