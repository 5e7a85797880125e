#include "host/executor.h"

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
      acc_size_(acc_size(call.dtype)) {}

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
      std::memcpy(dst_ptr(s), in, n * elem_size_);
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
      kernels_->reduce_final(dst_ptr(s), nullptr, in, src_ptr(s), n, call_.divisor);
      end_recv(s.from);
      break;
    }
    case StepKind::RecvReduceCopySend: {
      const uint8_t* in = begin_recv(s);
      uint8_t* slot = begin_send(s);
      kernels_->reduce_final(dst_ptr(s), slot, in, src_ptr(s), n, call_.divisor);
      end_send(s.to);
      end_recv(s.from);
      break;
    }
    case StepKind::RecvCopySend: {
      const uint8_t* in = begin_recv(s);
      uint8_t* slot = begin_send(s);
      std::memcpy(slot, in, n * elem_size_);
      end_send(s.to);
      std::memcpy(dst_ptr(s), in, n * elem_size_);
      end_recv(s.from);
      break;
    }
    case StepKind::Copy:
      copy_bytes(dst_ptr(s), src_ptr(s), n * elem_size_);
      break;
  }
}

}  // namespace pycoll
