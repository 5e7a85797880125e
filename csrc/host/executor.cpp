#include "host/executor.h"

#include <algorithm>
#include <cstring>

#include "common/errors.h"

namespace pycoll {

HostExecutor::HostExecutor(const ShmTransport& t, std::vector<uint64_t>& sent,
                           std::vector<uint64_t>& received, const WaitContext& wait,
                           const CallBuffers& call)
    : t_(t),
      sent_(sent),
      received_(received),
      wait_(wait),
      call_(call),
      kernels_(&reduce_kernels(call.dtype, call.op)),
      elem_size_(dtype_size(call.dtype)),
      acc_size_(acc_size(call.dtype)),
      streaming_(call.output_count * dtype_size(call.dtype) >= call.stream_bytes) {}

void HostExecutor::finish() {
  if (streaming_) stream_fence();
}

void HostExecutor::write_out(uint8_t* dst, const uint8_t* src, size_t n) {
  if (streaming_)
    stream_copy(dst, src, n * elem_size_);
  else
    std::memcpy(dst, src, n * elem_size_);
}

void HostExecutor::reduce_out(uint8_t* dst, uint8_t* dst2, const uint8_t* a, const uint8_t* b,
                              size_t n) {
  if (!streaming_) {
    kernels_->reduce_final(dst, dst2, a, b, n, call_.divisor);
    return;
  }
  // Reduce a cache-resident block at a time, then stream it out.
  alignas(64) uint8_t block[8192];
  const size_t per = sizeof(block) / elem_size_;
  for (size_t i = 0; i < n; i += per) {
    const size_t m = std::min(per, n - i);
    kernels_->reduce_final(block, dst2 ? dst2 + i * elem_size_ : nullptr, a + i * acc_size_,
                           b + i * elem_size_, m, call_.divisor);
    stream_copy(dst + i * elem_size_, block, m * elem_size_);
  }
}

const uint8_t* HostExecutor::src_ptr(const Step& s) const {
  if (s.src.buf == Buf::Input) {
    PYCOLL_CHECK(s.src.offset + s.count <= call_.input_count, "input range");
    return call_.input + s.src.offset * elem_size_;
  }
  PYCOLL_CHECK(s.src.buf == Buf::Output && s.src.offset + s.count <= call_.output_count,
               "source range");
  return call_.output + s.src.offset * elem_size_;
}

uint8_t* HostExecutor::dst_ptr(const Step& s) const {
  PYCOLL_CHECK(s.dst.buf == Buf::Output && s.dst.offset + s.count <= call_.output_count,
               "output range");
  return call_.output + s.dst.offset * elem_size_;
}

// Waits for the next message from `s.from` and returns its slot.
const uint8_t* HostExecutor::begin_recv(const Step& s) {
  const int from = s.from, me = t_.rank();
  const uint64_t m = received_[from] + 1;
  PYCOLL_CHECK(s.count * (s.recv_wire == Wire::Acc ? acc_size_ : elem_size_) <= t_.slot_bytes(),
               "message larger than a staging slot");
  auto& posted = t_.posted(from, me);
  wait_until([&] { return posted.load(std::memory_order_acquire) >= m; }, wait_, from,
             WaitFor::Data);
  return t_.slot(from, me, m);
}

void HostExecutor::end_recv(int from) {
  const uint64_t m = ++received_[from];
  t_.consumed(t_.rank(), from).store(m, std::memory_order_release);
}

// Waits until our next slot towards `s.to` is free and returns it.
uint8_t* HostExecutor::begin_send(const Step& s) {
  const int to = s.to, me = t_.rank();
  const uint64_t m = sent_[to] + 1;
  PYCOLL_CHECK(s.count * (s.send_wire == Wire::Acc ? acc_size_ : elem_size_) <= t_.slot_bytes(),
               "message larger than a staging slot");
  const uint64_t k = static_cast<uint64_t>(t_.nslots());
  if (m > k) {
    auto& consumed = t_.consumed(to, me);
    wait_until([&] { return consumed.load(std::memory_order_acquire) >= m - k; }, wait_, to,
               WaitFor::Space);
  }
  return t_.slot(me, to, m);
}

void HostExecutor::end_send(int to) {
  const uint64_t m = ++sent_[to];
  t_.posted(t_.rank(), to).store(m, std::memory_order_release);
}

void HostExecutor::step(const Step& s) {
  const size_t n = s.count;
  switch (s.kind) {
    case StepKind::Send: {
      uint8_t* slot = begin_send(s);
      if (s.send_wire == Wire::Acc)
        kernels_->load(slot, src_ptr(s), n);
      else
        std::memcpy(slot, src_ptr(s), n * elem_size_);
      end_send(s.to);
      break;
    }
    case StepKind::Recv: {
      const uint8_t* in = begin_recv(s);
      write_out(dst_ptr(s), in, n);
      end_recv(s.from);
      break;
    }
    case StepKind::RecvReduceSend: {
      const uint8_t* in = begin_recv(s);
      uint8_t* slot = begin_send(s);
      kernels_->reduce(slot, in, src_ptr(s), n);
      end_send(s.to);
      end_recv(s.from);
      break;
    }
    case StepKind::RecvReduceCopy: {
      const uint8_t* in = begin_recv(s);
      reduce_out(dst_ptr(s), nullptr, in, src_ptr(s), n);
      end_recv(s.from);
      break;
    }
    case StepKind::RecvReduceCopySend: {
      const uint8_t* in = begin_recv(s);
      uint8_t* slot = begin_send(s);
      reduce_out(dst_ptr(s), slot, in, src_ptr(s), n);
      end_send(s.to);
      end_recv(s.from);
      break;
    }
    case StepKind::RecvCopySend: {
      const uint8_t* in = begin_recv(s);
      uint8_t* slot = begin_send(s);
      std::memcpy(slot, in, n * elem_size_);
      end_send(s.to);
      write_out(dst_ptr(s), in, n);
      end_recv(s.from);
      break;
    }
    case StepKind::Copy: {
      uint8_t* dst = dst_ptr(s);
      const uint8_t* src = src_ptr(s);
      if (dst == src) break;
      if (streaming_ && (dst + n * elem_size_ <= src || src + n * elem_size_ <= dst))
        stream_copy(dst, src, n * elem_size_);
      else
        copy_bytes(dst, src, n * elem_size_);
      break;
    }
  }
}

}  // namespace pycoll
