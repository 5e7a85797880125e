#include "host/executor.h"

#include <algorithm>
#include <cstring>

#include "common/errors.h"
#include "common/reduce.h"
#include "runtime/fingerprint.h"

namespace pycoll {

HostExecutor::HostExecutor(const ShmTransport& t, ChannelCounters& counters, uint8_t* scratch,
                           const WaitContext& wait, const CallBuffers& call)
    : t_(t),
      c_(counters),
      scratch_(scratch),
      wait_(wait),
      call_(call),
      kernels_(&reduce_kernels(call.dtype, call.op)),
      arrays_{call.input, call.output, call.input_count, call.output_count, call.elem},
      elem_size_(call.elem),
      acc_size_(call.acc),
      streaming_(call.streams()),
      slot_stream_(call.stream_slots) {}

void HostExecutor::finish() {
  if (streaming_) stream_fence();
}

void HostExecutor::exchange(const void* mine, size_t bytes, uint8_t* theirs) {
  const int n = t_.size(), me = t_.rank();
  for (int d = 1; d < n; ++d) {
    const int q = (me + d) % n;
    copy_bytes(wait_send(q, bytes), mine, bytes);
    post_send(q);
  }
  for (int d = 1; d < n; ++d) {
    const int q = (me - d + n) % n;
    copy_bytes(theirs + static_cast<size_t>(q) * bytes, wait_recv(q, false, bytes), bytes);
    release_recv(q, false);
  }
}

bool HostExecutor::all_agree(bool mine) {
  const uint64_t word = mine ? 1 : 0;
  std::vector<uint64_t> words(t_.size(), word);
  exchange(&word, sizeof word, reinterpret_cast<uint8_t*>(words.data()));
  return std::all_of(words.begin(), words.end(), [](uint64_t v) { return v != 0; });
}

const uint8_t* HostExecutor::src_ptr(const Step& s) const { return arrays_.src(s); }
uint8_t* HostExecutor::dst_ptr(const Step& s) const { return arrays_.dst(s); }

// Waits for the next message from `from` (its channel to us, or its broadcast channel).
const uint8_t* HostExecutor::wait_recv(int from, bool bcast, size_t bytes) {
  PYCOLL_CHECK(from >= 0 && from < t_.size() && from != t_.rank(), "bad source peer ", from);
  PYCOLL_CHECK(bytes <= t_.slot_bytes(), "message larger than a staging slot");
  const int me = t_.rank();
  const uint64_t m = c_.next_in(from, bcast);
  auto& posted = bcast ? t_.bcast_posted(from) : t_.posted(from, me);
  wait_until([&] { return posted.load(std::memory_order_acquire) >= channel::posted_needed(m); },
             wait_, from, WaitFor::Data);
  received_any_ = true;
  // The sender published its fingerprint before this message (and those of its earlier
  // calls): check them before using the data.
  if (wait_.fingerprints != nullptr) wait_.fingerprints->check(from);
  if (wait_.deferred != nullptr)
    for (FingerprintGuard& g : *wait_.deferred) g.check(from);
  return bcast ? t_.bcast_slot(from, m) : t_.slot(from, me, m);
}

void HostExecutor::release_recv(int from, bool bcast) {
  const int me = t_.rank();
  auto& consumed = bcast ? t_.bcast_consumed(me, from) : t_.consumed(me, from);
  consumed.store(c_.take_in(from, bcast), std::memory_order_release);
}

// Waits until our next slot towards `to` (or our broadcast channel) is free and returns it.
uint8_t* HostExecutor::wait_send(int to, size_t bytes) {
  PYCOLL_CHECK(bytes <= t_.slot_bytes(), "message larger than a staging slot");
  const int me = t_.rank();
  PYCOLL_CHECK(to == kAllPeers || (to >= 0 && to < t_.size() && to != me), "bad destination peer ",
               to);
  const uint64_t m = c_.next_out(to);
  const uint64_t need = channel::consumed_needed(m, t_.nslots());
  if (need > 0) {
    for (int p = 0; p < t_.size(); ++p) {
      if (p == me || (to != kAllPeers && p != to)) continue;
      auto& consumed = to == kAllPeers ? t_.bcast_consumed(p, me) : t_.consumed(p, me);
      wait_until([&] { return consumed.load(std::memory_order_acquire) >= need; }, wait_, p,
                 WaitFor::Space);
    }
  }
  return to == kAllPeers ? t_.bcast_slot(me, m) : t_.slot(me, to, m);
}

void HostExecutor::post_send(int to) {
  const int me = t_.rank();
  auto& posted = to == kAllPeers ? t_.bcast_posted(me) : t_.posted(me, to);
  if (slot_stream_) stream_fence();  // the slot's non-temporal stores before the flag
  posted.store(c_.put_out(to), std::memory_order_release);
}

void HostExecutor::write_slot(uint8_t* slot, const uint8_t* src, size_t bytes) {
  if (slot_stream_)
    stream_copy(slot, src, bytes);
  else
    copy_bytes(slot, src, bytes);
}

void HostExecutor::send_to_all(const Step& s, uint8_t* first, size_t bytes) {
  if (s.to2 != kNoPeer) write_slot(wait_send(s.to2, bytes), first, bytes);
  post_send(s.to);
  if (s.to2 != kNoPeer) post_send(s.to2);
}

void HostExecutor::reduce_into(uint8_t* acc, const Step& s) {
  const size_t in_bytes = wire_bytes(s.recv_wire, s.count);
  reduce_step(
      *kernels_, acc_size_, acc, src_ptr(s), s, t_.rank(), t_.size(),
      [&](int q) { return wait_recv(q, s.recv_bcast, in_bytes); },
      [&](int q) { release_recv(q, s.recv_bcast); });
}

void HostExecutor::write_out(uint8_t* dst, const uint8_t* src, size_t n) {
  if (streaming_)
    stream_copy(dst, src, n * elem_size_);
  else
    copy_bytes(dst, src, n * elem_size_);
}

// Writes n output elements at dst, and the same at dst2 (a slot) when not null, through
// produce(out, out2, first, count), out and out2 standing for element `first` (out2 null when
// there is no dst2): straight into both where nothing is streamed, else a cache-resident block
// at a time that is then copied out, streamed where it should be.
constexpr size_t kBlockBytes = 8192;
// The accumulator tile of reduce_all_out: in L1 beside a tile of each input. Steps of at most
// this much reduce into the scratch buffer, which stays in L1 too (a small call's cost).
constexpr size_t kTileBytes = 8192;

template <class Produce>
void HostExecutor::produce_out(uint8_t* dst, uint8_t* dst2, size_t n, Produce&& produce) {
  const bool stream2 = dst2 != nullptr && slot_stream_;
  if (!streaming_ && !stream2) {
    produce(dst, dst2, 0, n);
    return;
  }
  alignas(64) uint8_t block[kBlockBytes];
  const size_t per = kBlockBytes / elem_size_;
  for (size_t i = 0; i < n; i += per) {
    const size_t m = std::min(per, n - i), at = i * elem_size_, bytes = m * elem_size_;
    produce(block, dst2 != nullptr && !stream2 ? dst2 + at : nullptr, i, m);
    write_out(dst + at, block, m);
    if (stream2) stream_copy(dst2 + at, block, bytes);
  }
}

void HostExecutor::finalize_out(uint8_t* dst, uint8_t* dst2, const uint8_t* acc, size_t n) {
  produce_out(dst, dst2, n, [&](uint8_t* out, uint8_t* out2, size_t i, size_t m) {
    kernels_->finalize(out, out2, acc + i * acc_size_, m, call_.divisor);
  });
}

void HostExecutor::reduce_all_out(uint8_t* dst, const Step& s, bool send) {
  const int size = t_.size(), me = t_.rank();
  const size_t n = s.count, in_bytes = wire_bytes(s.recv_wire, n);
  const uint8_t* few[16];
  std::vector<const uint8_t*> many;
  const uint8_t** ins = few;
  if (size > 16) {
    many.resize(static_cast<size_t>(size));
    ins = many.data();
  }
  // Every message first, then our slot, as reduce_into then wait_send would.
  for (int q = 0; q < size; ++q)
    ins[q] = q == me ? src_ptr(s) : wait_recv(q, s.recv_bcast, in_bytes);
  const size_t out_bytes = n * elem_size_;
  uint8_t* slot = send ? wait_send(s.to, out_bytes) : nullptr;
  const size_t tile = kTileBytes / acc_size_;
  produce_out(dst, slot, n, [&](uint8_t* out, uint8_t* out2, size_t first, size_t count) {
    alignas(64) uint8_t acc[kTileBytes];
    for (size_t t = 0; t < count; t += tile) {
      const size_t i = first + t, m = std::min(tile, count - t);
      for (int q = 0; q < size; ++q)  // as reduce_step folds, a tile at a time
        fold_rank(*kernels_, acc_size_, acc, q, q == me,
                  ins[q] + i * (q == me ? elem_size_ : acc_size_), m);
      kernels_->finalize(out + t * elem_size_, out2 ? out2 + t * elem_size_ : nullptr, acc, m,
                         call_.divisor);
    }
  });
  for (int q = 0; q < size; ++q)
    if (q != me) release_recv(q, s.recv_bcast);
  if (send) send_to_all(s, slot, out_bytes);
}

void HostExecutor::reduce_out(uint8_t* dst, uint8_t* dst2, const uint8_t* in, const uint8_t* b,
                              size_t n) {
  const bool stream2 = dst2 != nullptr && slot_stream_;
  if (!streaming_ && !stream2) {
    kernels_->reduce_final(dst, dst2, in, b, n, call_.divisor);
    return;
  }
  // The streamed outputs: the elements before their first 16-byte boundary the ordinary way,
  // the rest computed a tile at a time in registers and streamed, with no block in between
  // (that cost the 2-rank ring's out-of-place all-reduce about 20% from 16 MiB). When both
  // are streamed, they must be misaligned alike.
  const auto misalignment = [](const uint8_t* p) { return reinterpret_cast<uintptr_t>(p) & 15; };
  const size_t misaligned = misalignment(streaming_ ? dst : dst2);
  if (misaligned % elem_size_ == 0 &&
      (!streaming_ || !stream2 || misalignment(dst2) == misaligned)) {
    const size_t head = std::min(n, ((16 - misaligned) & 15) / elem_size_);
    kernels_->reduce_final(dst, dst2, in, b, head, call_.divisor);
    const auto tiles = !stream2     ? kernels_->reduce_final_stream_dst
                       : streaming_ ? kernels_->reduce_final_stream
                                    : kernels_->reduce_final_stream_dst2;
    tiles(dst + head * elem_size_, dst2 ? dst2 + head * elem_size_ : nullptr, in + head * acc_size_,
          b + head * elem_size_, n - head, call_.divisor);
    return;
  }
  produce_out(dst, dst2, n, [&](uint8_t* out, uint8_t* out2, size_t i, size_t m) {
    kernels_->reduce_final(out, out2, in + i * acc_size_, b + i * elem_size_, m, call_.divisor);
  });
}

void HostExecutor::step(const Step& s) {
  const size_t n = s.count;
  const bool one_input = s.from != kAllPeers && s.from2 == kNoPeer;
  switch (s.kind) {
    case StepKind::Send: {
      const size_t bytes = wire_bytes(s.send_wire, n);
      uint8_t* slot = wait_send(s.to, bytes);
      if (s.send_wire == Wire::Elem) {
        write_slot(slot, src_ptr(s), bytes);
      } else if (slot_stream_) {
        kernels_->load(scratch_, src_ptr(s), n);
        stream_copy(slot, scratch_, bytes);
      } else {
        kernels_->load(slot, src_ptr(s), n);
      }
      send_to_all(s, slot, bytes);
      break;
    }
    case StepKind::Recv: {
      const uint8_t* in = wait_recv(s.from, s.recv_bcast, wire_bytes(Wire::Elem, n));
      write_out(dst_ptr(s), in, n);
      release_recv(s.from, s.recv_bcast);
      break;
    }
    case StepKind::RecvCopySend: {
      const size_t bytes = wire_bytes(Wire::Elem, n);
      const uint8_t* in = wait_recv(s.from, s.recv_bcast, bytes);
      uint8_t* slot = wait_send(s.to, bytes);
      write_slot(slot, in, bytes);
      send_to_all(s, slot, bytes);
      write_out(dst_ptr(s), in, n);
      release_recv(s.from, s.recv_bcast);
      break;
    }
    case StepKind::RecvReduceSend: {
      const size_t bytes = wire_bytes(Wire::Acc, n);
      uint8_t* slot = wait_send(s.to, bytes);
      if (slot_stream_) {
        reduce_into(scratch_, s);
        stream_copy(slot, scratch_, bytes);
      } else {
        reduce_into(slot, s);  // the slot itself accumulates
      }
      send_to_all(s, slot, bytes);
      break;
    }
    case StepKind::RecvReduceCopy: {
      if (one_input) {
        const uint8_t* in = wait_recv(s.from, s.recv_bcast, wire_bytes(Wire::Acc, n));
        reduce_out(dst_ptr(s), nullptr, in, src_ptr(s), n);
        release_recv(s.from, s.recv_bcast);
      } else if (s.from == kAllPeers && n * acc_size_ > kTileBytes) {
        reduce_all_out(dst_ptr(s), s, false);
      } else {
        reduce_into(scratch_, s);
        finalize_out(dst_ptr(s), nullptr, scratch_, n);
      }
      break;
    }
    case StepKind::RecvReduceCopySend: {
      const size_t bytes = wire_bytes(s.send_wire, n);
      PYCOLL_CHECK(s.send_wire == Wire::Elem, "finished results travel as elements");
      if (one_input) {
        const uint8_t* in = wait_recv(s.from, s.recv_bcast, wire_bytes(Wire::Acc, n));
        uint8_t* slot = wait_send(s.to, bytes);
        reduce_out(dst_ptr(s), slot, in, src_ptr(s), n);
        send_to_all(s, slot, bytes);
        release_recv(s.from, s.recv_bcast);
      } else if (s.from == kAllPeers && n * acc_size_ > kTileBytes) {
        reduce_all_out(dst_ptr(s), s, true);
      } else {
        reduce_into(scratch_, s);
        uint8_t* slot = wait_send(s.to, bytes);
        finalize_out(dst_ptr(s), slot, scratch_, n);
        send_to_all(s, slot, bytes);
      }
      break;
    }
    case StepKind::Copy: {
      uint8_t* dst = dst_ptr(s);
      const uint8_t* src = src_ptr(s);
      const size_t bytes = n * elem_size_;
      if (dst == src) break;
      if (streaming_ && (dst + bytes <= src || src + bytes <= dst))
        stream_copy(dst, src, bytes);
      else
        copy_bytes(dst, src, bytes);
      break;
    }
  }
}

}  // namespace pycoll
