#include "device/plan.h"

#include <initializer_list>
#include <limits>

#include "common/errors.h"
#include "common/hash.h"

namespace pycoll {
namespace cuda {
namespace {

int16_t peer_code(int peer, int size) {
  if (peer != kNoPeer && peer != kAllPeers && (peer < 0 || peer >= size))
    throw CollectiveError(str_cat("plan: step names peer ", peer, " of ", size, " ranks"));
  return static_cast<int16_t>(peer);
}

// Counts the messages a step moves, the way the host executor does.
class PlanSink final : public StepSink {
 public:
  PlanSink(Plan& plan, int rank, int size) : plan_(plan), rank_(rank), size_(size) {
    plan.moved.sent.assign(size, 0);
    plan.moved.received.assign(size, 0);
    plan.moved.bcast_received.assign(size, 0);
    plan.moved.bcast_sent = 0;
  }

  void step(const Step& s) override {
    if (s.count > std::numeric_limits<uint32_t>::max())
      throw InvalidArgument("plan: a step moves more than 2^32 elements (staging slot too large)");
    DevStep d{};
    d.kind = static_cast<uint8_t>(s.kind);
    d.flags = (s.recv_wire == Wire::Acc ? kRecvAcc : 0) |
              (s.send_wire == Wire::Acc ? kSendAcc : 0) | (s.recv_bcast ? kRecvBcast : 0);
    d.src_buf = static_cast<uint8_t>(s.src.buf);
    d.dst_buf = static_cast<uint8_t>(s.dst.buf);
    d.from = peer_code(s.from, size_);
    d.from2 = peer_code(s.from2, size_);
    d.to = peer_code(s.to, size_);
    d.to2 = peer_code(s.to2, size_);
    d.count = static_cast<uint32_t>(s.count);
    d.src_off = s.src.offset;
    d.dst_off = s.dst.offset;
    plan_.steps.push_back(d);
    count_messages(s);
  }

 private:
  void count_messages(const Step& s) { plan_.moved.advance(peers_of(s), rank_, size_); }

  Plan& plan_;
  int rank_, size_;
};

}  // namespace

void check_device_call(const CollectiveCall& call, int size) {
  if (size > kMaxRanks)
    throw InvalidArgument(str_cat("the CUDA transport holds at most ", kMaxRanks, " ranks"));
  if (call.barrier) return;
  // The schedules read `size` entries of each list: a shorter one would be read past its end.
  const size_t n = static_cast<size_t>(size);
  for (const std::vector<uint64_t>* v : {&call.counts, &call.send_counts, &call.recv_counts})
    if (!v->empty() && v->size() != n)
      throw InvalidArgument(str_cat(collective_name(call.collective), ": per-rank lists need ",
                                    size, " entries, got ", v->size()));
  if (call.send_counts.empty() != call.recv_counts.empty())
    throw InvalidArgument("all_to_all: in_splits and out_splits go together");
}

namespace {

// FNV-1a over the lists, each preceded by its length (so that moving an entry from one list
// to the next changes the hash).
uint64_t hash_lists(std::initializer_list<const std::vector<uint64_t>*> lists) {
  Fnv1a h;
  for (const std::vector<uint64_t>* v : lists) {
    h.mix(v->size());
    for (uint64_t x : *v) h.mix(x);
  }
  return h.h;
}

}  // namespace

PlanKey::PlanKey(const CollectiveCall& call, Algo algo)
    : shape{static_cast<int>(call.collective), call.count, static_cast<int>(algo),
            static_cast<int>(call.dtype), call.root},
      counts(call.counts),
      send_counts(call.send_counts),
      recv_counts(call.recv_counts) {
  if (call.uneven()) counts_hash = hash_lists({&counts, &send_counts, &recv_counts});
}

Plan build_plan(Algo a, Collective c, const ScheduleParams& p) {
  if (p.size > kMaxRanks)
    throw InvalidArgument(str_cat("the CUDA transport holds at most ", kMaxRanks, " ranks"));
  Plan plan;
  PlanSink sink(plan, p.rank, p.size);
  make_schedule(a, c, p, sink);
  return plan;
}

Plan plan_call(const ResolvedCall& rc, const SegmentLayout& L, size_t slot_bytes,
               size_t oneshot_max_bytes, size_t ll_max_bytes, bool lookahead) {
  if (lookahead && L.nslots < 2)
    throw InvalidArgument("lookahead needs two staging slots per channel or more");
  Plan plan = build_plan(rc.algo, rc.call->collective,
                         plan_params(rc, slot_bytes, oneshot_max_bytes, lookahead));
  plan.grid = plan_grid(plan.steps, L);
  mark_ll(plan, rc.elem, rc.acc, L, ll_max_bytes);
  return plan;
}

void mark_ll(Plan& plan, size_t elem_bytes, size_t acc_bytes, const SegmentLayout& L,
             size_t ll_max_bytes) {
  for (DevStep& d : plan.steps) {
    const StepKind k = static_cast<StepKind>(d.kind);
    const size_t in_w = (d.flags & kRecvAcc) ? acc_bytes : elem_bytes;
    const size_t out_w = (d.flags & kSendAcc) ? acc_bytes : elem_bytes;
    if (step_receives(k) && ll_message(d.count, in_w, L, ll_max_bytes)) d.flags |= kRecvLL;
    if (step_sends(k) && ll_message(d.count, out_w, L, ll_max_bytes)) d.flags |= kSendLL;
  }
}

void check_capturable(const char* name, bool kernel_mode, bool plan_ready) {
  if (!kernel_mode)
    throw CollectiveError(str_cat(name, ": cannot be captured into a CUDA graph in stepped mode, ",
                                  "where the host drives every step (kernel mode needs a GPU ",
                                  "per rank, or MPS)"));
  if (!plan_ready)
    throw CollectiveError(str_cat(name, ": capture a call shape into a CUDA graph only after ",
                                  "running it once (its plan is built then, outside the capture)"));
}

size_t sub_slot_bytes(size_t slot_bytes, int nblocks) {
  const size_t share = (slot_bytes + nblocks - 1) / nblocks + kSliceAlign * 8;
  return (share + 255) / 256 * 256;
}

SegmentLayout make_layout(int size, int nslots, int nblocks, size_t slot_bytes, size_t ll_max_bytes,
                          int ll_flag_bits) {
  if (ll_flag_bits < 2 || ll_flag_bits > 32 ||
      static_cast<uint64_t>(nslots) > uint64_t{1} << (ll_flag_bits - 1))
    throw InvalidArgument(str_cat("LL flags of ", ll_flag_bits, " bits for ", nslots, " slots"));
  SegmentLayout l;
  l.size = size;
  l.nslots = nslots;
  l.nblocks = nblocks;
  l.sub_slot_bytes = sub_slot_bytes(slot_bytes, nblocks);
  l.flags_bytes = l.headers_end();
  l.flags_bytes = (l.flags_bytes + 255) / 256 * 256;
  l.ll_offset = l.data_end();
  l.ll_flag_bits = ll_flag_bits;
  if (ll_max_bytes > 0) {
    // Twice the largest LL message, at most a sub-slot (ll_message keeps to it); as many blocks
    // as the message of most elements (1-byte ones) reaches. No message exceeds a slot.
    const size_t ll = ll_max_bytes < slot_bytes ? ll_max_bytes : slot_bytes;
    const size_t twice = (2 * ll + 255) / 256 * 256;
    l.ll_sub_slot_bytes = twice < l.sub_slot_bytes ? twice : l.sub_slot_bytes;
    l.ll_blocks = active_channels(ll, l);
  }
  return l;
}

}  // namespace cuda
}  // namespace pycoll
