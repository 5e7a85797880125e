// Eager messages: small sends that go out before their request arrives (protocol in p2p.h).
#include <cstring>

#include "algo/messages.h"
#include "common/errors.h"
#include "common/reduce.h"
#include "host/host_comm.h"
#include "host/p2p.h"
#include "host/p2p_wire.h"

namespace pycoll {
using p2p_wire::PieceHeader;

// Writes eager sends into the data ring, oldest first, while it has room.
bool P2PEngine::write_eager(int q, Peer& p) {
  const int me = t_.rank();
  bool moved = false;
  while (!p.eager_out.empty()) {
    const uint64_t m = p.pieces_sent + 1;
    if (t_.p2p_consumed(q, me).load(std::memory_order_acquire) <
        channel::consumed_needed(m, t_.nslots()))
      break;
    const OpPtr o = p.eager_out.front();
    uint8_t* slot = t_.p2p_slot(me, q, m);
    PieceHeader h{};
    h.kind = p2p_wire::kEager;
    h.tag = o->tag;
    h.ordinal = o->ordinal;
    h.count = o->count;
    h.dtype = static_cast<uint32_t>(o->dtype);
    h.length = o->bytes();
    copy_bytes(slot + kP2PHeaderBytes, o->buf, h.length);
    *reinterpret_cast<PieceHeader*>(slot) = h;
    t_.p2p_posted(me, q).store(m, std::memory_order_release);
    p.pieces_sent = m;
    p.eager_out.pop_front();
    o->written = true;
    moved = true;
    if (o->matched) settle_eager(q, o);
  }
  return moved;
}

// An eager message in the ring: into its recv if that has posted its request, else into the
// unexpected queue (the slot must be freed now, or messages behind it could never arrive).
void P2PEngine::take_eager(int q, Peer& p, const uint8_t* slot) {
  const PieceHeader h = *reinterpret_cast<const PieceHeader*>(slot);
  PYCOLL_CHECK(valid_dtype(static_cast<int>(h.dtype)) && h.length <= t_.slot_bytes() &&
                   h.length == h.count * dtype_size(static_cast<DType>(h.dtype)),
               "corrupt eager message from rank ", q);
  const DType dtype = static_cast<DType>(h.dtype);
  const uint8_t* data = slot + kP2PHeaderBytes;
  auto it = p.unmatched_recvs.find(Key{h.tag, h.ordinal});
  if (it != p.unmatched_recvs.end()) {
    deliver_eager(q, p, it->second, h.count, dtype, data);
    return;
  }
  Unexpected& u = p.unexpected[Key{h.tag, h.ordinal}];
  u.count = h.count;
  u.dtype = dtype;
  u.data.assign(data, data + h.length);
}

void P2PEngine::deliver_eager(int q, Peer& p, const OpPtr& o, uint64_t count, DType dtype,
                              const uint8_t* data) {
  if (count != o->count || dtype != o->dtype)
    raise<CollectiveMismatch>(
        o, str_cat(o->describe(), ": the matching send does not fit: rank ", q, " sends ", count,
                   " x ", dtype_name(dtype), ", this rank receives ", o->count, " x ",
                   dtype_name(o->dtype)));
  copy_bytes(o->buf, data, o->bytes());
  o->done_bytes = o->bytes();
  complete_recv(p, o);
}

void P2PEngine::settle_eager(int q, const OpPtr& o) {
  if (o->mismatch)
    raise<CollectiveMismatch>(
        o, str_cat(o->describe(), ": the matching recv does not fit: this rank sends ", o->count,
                   " x ", dtype_name(o->dtype), ", rank ", q, " receives ", o->want_count, " x ",
                   dtype_name(o->want_dtype)));
  complete(o);
}

// A recv is complete: nothing may match it any more.
void P2PEngine::complete_recv(Peer& p, const OpPtr& o) {
  p.unmatched_recvs.erase(Key{o->tag, o->ordinal});
  p.awaiting.erase(o->recv_id);
  complete(o);
}

}  // namespace pycoll
