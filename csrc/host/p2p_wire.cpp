// The point-to-point channels on the wire: requests, rendezvous pieces, matching, direct
// writes (the protocol is described in p2p.h; eager messages are in p2p_eager.cpp).
#include "host/p2p_wire.h"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>

#include "algo/messages.h"
#include "common/errors.h"
#include "common/reduce.h"
#include "host/host_comm.h"
#include "host/p2p.h"

namespace pycoll {
using p2p_wire::kData;
using p2p_wire::kMismatch;
using p2p_wire::kWritten;
using p2p_wire::PieceHeader;
using WireRequest = p2p_wire::Request;

// Sends and requests of one tag pair up oldest first, so messages of a tag never overtake. A
// small send whose request has not arrived goes eagerly; it still waits in `sends` for its
// request, which carries the verdict.
void P2PEngine::add_send(Peer& p, const OpPtr& send) {
  auto it = std::find_if(p.requests.begin(), p.requests.end(),
                         [&](const Request& r) { return r.tag == send->tag; });
  if (it == p.requests.end()) {
    p.sends.push_back(send);
    if (send->bytes() <= eager_max_bytes_) {
      send->eager = true;
      p.eager_out.push_back(send);
    }
    return;
  }
  const bool mismatch = it->count != send->count || it->dtype != send->dtype;
  p.transfers.push_back(Transfer{send, *it, mismatch});
  p.requests.erase(it);
}

void P2PEngine::add_request(int q, Peer& p, const Request& req) {
  auto it = std::find_if(p.sends.begin(), p.sends.end(),
                         [&](const OpPtr& s) { return s->tag == req.tag; });
  if (it == p.sends.end()) {
    p.requests.push_back(req);
    return;
  }
  const OpPtr send = *it;
  p.sends.erase(it);
  const bool mismatch = req.count != send->count || req.dtype != send->dtype;
  if (send->eager) {  // its data goes (or went) out on its own; the request is its verdict
    send->matched = true;
    send->mismatch = mismatch;
    send->want_count = req.count;
    send->want_dtype = req.dtype;
    if (send->written) settle_eager(q, send);
    return;
  }
  p.transfers.push_back(Transfer{send, req, mismatch});
}

bool P2PEngine::progress_peer(int q, Peer& p) {
  bool moved = write_eager(q, p);
  moved |= post_requests(q, p);
  moved |= take_pieces(q, p);
  moved |= take_requests(q, p);
  moved |= stream(q, p);
  return moved;
}

bool P2PEngine::post_requests(int q, Peer& p) {
  const int me = t_.rank();
  bool moved = false;
  while (!p.unrequested.empty()) {
    const uint64_t m = p.requests_posted + 1;
    if (t_.p2p_req_consumed(q, me).load(std::memory_order_acquire) <
        channel::consumed_needed(m, kP2PRequestSlots))
      break;
    const OpPtr o = p.unrequested.front();
    auto* r = reinterpret_cast<WireRequest*>(t_.p2p_request(me, q, m));
    r->id = m;
    r->tag = o->tag;
    r->count = o->count;
    r->addr = reinterpret_cast<uint64_t>(o->buf);
    r->dtype = static_cast<uint32_t>(o->dtype);
    t_.p2p_req_posted(me, q).store(m, std::memory_order_release);
    p.requests_posted = m;
    p.unrequested.pop_front();
    moved = true;
    o->recv_id = m;
    p.awaiting.emplace(m, o);
    // Only now may an eager message complete it: the sender learns the verdict from this
    // request, so a mismatch raised here is raised there too.
    const Key key{o->tag, o->ordinal};
    auto u = p.unexpected.find(key);
    if (u == p.unexpected.end()) {
      p.unmatched_recvs.emplace(key, o);
      continue;
    }
    const Unexpected msg = std::move(u->second);
    p.unexpected.erase(u);
    deliver_eager(q, p, o, msg.count, msg.dtype, msg.data.data());
  }
  return moved;
}

bool P2PEngine::take_pieces(int q, Peer& p) {
  const int me = t_.rank();
  bool moved = false;
  while (t_.p2p_posted(q, me).load(std::memory_order_acquire) > p.pieces_taken) {
    const uint64_t m = p.pieces_taken + 1;
    const uint8_t* slot = t_.p2p_slot(q, me, m);
    const PieceHeader h = *reinterpret_cast<const PieceHeader*>(slot);
    if (h.kind == p2p_wire::kEager) {
      take_eager(q, p, slot);
      p.pieces_taken = m;
      t_.p2p_consumed(me, q).store(m, std::memory_order_release);
      moved = true;
      continue;
    }
    auto it = p.awaiting.find(h.id);
    PYCOLL_CHECK(it != p.awaiting.end(), "rank ", q, " sent a piece for unknown receive ", h.id);
    const OpPtr o = it->second;
    if (h.kind == kMismatch)
      raise<CollectiveMismatch>(
          o, str_cat(o->describe(), ": the matching send does not fit: rank ", q, " sends ",
                     h.count, " x ", dtype_name(static_cast<DType>(h.dtype)),
                     ", this rank receives ", o->count, " x ", dtype_name(o->dtype)));
    PYCOLL_CHECK(h.offset == o->done_bytes && h.length <= o->bytes() - o->done_bytes,
                 "piece out of order from rank ", q);
    if (h.kind == kData) copy_bytes(o->buf + h.offset, slot + kP2PHeaderBytes, h.length);
    o->done_bytes += h.length;
    p.pieces_taken = m;
    t_.p2p_consumed(me, q).store(m, std::memory_order_release);
    moved = true;
    if (o->done_bytes == o->bytes()) complete_recv(p, o);
  }
  return moved;
}

bool P2PEngine::take_requests(int q, Peer& p) {
  const int me = t_.rank();
  bool moved = false;
  while (t_.p2p_req_posted(q, me).load(std::memory_order_acquire) > p.requests_taken) {
    const uint64_t m = p.requests_taken + 1;
    const WireRequest r = *reinterpret_cast<const WireRequest*>(t_.p2p_request(q, me, m));
    p.requests_taken = m;
    t_.p2p_req_consumed(me, q).store(m, std::memory_order_release);
    PYCOLL_CHECK(r.id == m && valid_dtype(static_cast<int>(r.dtype)), "corrupt request from rank ",
                 q);
    add_request(q, p, Request{r.id, r.tag, r.count, r.addr, static_cast<DType>(r.dtype)});
    moved = true;
  }
  return moved;
}

// Moves the matched transfers to `q` along, oldest first, as far as the data ring has room.
bool P2PEngine::stream(int q, Peer& p) {
  const int me = t_.rank();
  bool moved = false;
  while (!p.transfers.empty()) {
    Transfer& x = p.transfers.front();
    const OpPtr& o = x.send;
    bool finished = false;
    while (!finished) {
      const uint64_t m = p.pieces_sent + 1;
      if (t_.p2p_consumed(q, me).load(std::memory_order_acquire) <
          channel::consumed_needed(m, t_.nslots()))
        return moved;
      uint8_t* slot = t_.p2p_slot(me, q, m);
      PieceHeader h{};
      h.id = x.req.id;
      h.offset = o->done_bytes;
      if (x.mismatch) {
        h.kind = kMismatch;
        h.count = o->count;
        h.dtype = static_cast<uint32_t>(o->dtype);
      } else if (o->done_bytes == 0 && o->bytes() >= cma_min_bytes_ && p.cma &&
                 cma_mode_ != CmaMode::Off && write_direct(q, p, x)) {
        h.kind = kWritten;
        h.length = o->bytes();
      } else {
        h.kind = kData;
        h.length = std::min(t_.slot_bytes(), o->bytes() - o->done_bytes);
        copy_bytes(slot + kP2PHeaderBytes, o->buf + o->done_bytes, h.length);
      }
      *reinterpret_cast<PieceHeader*>(slot) = h;
      t_.p2p_posted(me, q).store(m, std::memory_order_release);
      p.pieces_sent = m;
      o->done_bytes += h.length;
      moved = true;
      finished = x.mismatch || o->done_bytes == o->bytes();
    }
    const Transfer done = std::move(x);
    p.transfers.pop_front();
    if (done.mismatch)
      raise<CollectiveMismatch>(
          done.send,
          str_cat(done.send->describe(), ": the matching recv does not fit: this rank sends ",
                  done.send->count, " x ", dtype_name(done.send->dtype), ", rank ", q, " receives ",
                  done.req.count, " x ", dtype_name(done.req.dtype)));
    complete(done.send);
  }
  return moved;
}

// Writes the whole message into the receiver's buffer (cross-memory attach). False when the
// kernel refuses (no permission, no syscall, another PID namespace): from then on this peer's
// messages go through the slots.
bool P2PEngine::write_direct(int q, Peer& p, Transfer& x) {
  const OpPtr& o = x.send;
  // A receiver that gave up its receives may have freed their buffers.
  if (t_.p2p_closed(q).load(std::memory_order_acquire) != 0)
    raise<CollectiveError>(
        o, str_cat(o->describe(), ": rank ", q, " abandoned its receives after an error"));
  size_t done = 0;
  const int err =
      cma_mode_ == CmaMode::Fail ? EPERM : t_.write_into(q, o->buf, x.req.addr, o->bytes(), done);
  if (err == 0) return true;
  if (!t_.peer_alive(q))
    raise<CollectiveError>(
        o, str_cat(o->describe(), ": rank ", q, " (pid ", t_.pid_of(q), ") is no longer running"));
  if (done == 0 && (err == EPERM || err == ENOSYS || err == ESRCH)) {
    p.cma = false;
    if (comm_.options().debug)
      std::fprintf(stderr,
                   "pycollectives INFO rank %d/%d: p2p direct writes to rank %d refused (%s); "
                   "using the staging slots\n",
                   t_.rank(), t_.size(), q, std::strerror(err));
    return false;
  }
  raise<CollectiveError>(o, str_cat(o->describe(), ": writing into rank ", q,
                                    "'s buffer failed: ", std::strerror(err)));
}

}  // namespace pycoll
