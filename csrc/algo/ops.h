// The vocabulary every schedule is written in, and every executor runs.
//
// A schedule says, for one rank, which element ranges to send to and receive from which peer,
// and what to do with what arrives. It never touches memory. Between a pair of ranks, messages
// arrive in the order they were sent (a FIFO per directed pair), so a schedule is a plain
// sequence of Steps per rank.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace pycoll {

enum class Buf : uint8_t { None = 0, Input = 1, Output = 2 };

struct BufRef {
  Buf buf = Buf::None;
  size_t offset = 0;  // in elements
};

enum class StepKind : uint8_t {
  Send,                // send src to `to`
  Recv,                // dst = incoming
  RecvReduceSend,      // send op(incoming, src) to `to`
  RecvReduceCopy,      // dst = op(incoming, src), finalised (avg divides)
  RecvReduceCopySend,  // dst = op(incoming, src), finalised; send dst to `to`
  RecvCopySend,        // dst = incoming; send it on to `to`
  Copy,                // dst = src (local)
};

// What travels on the wire: partial reductions in the accumulation type, or finished elements.
enum class Wire : uint8_t { Elem = 0, Acc = 1 };

struct Step {
  StepKind kind;
  Wire recv_wire = Wire::Elem;  // format of the incoming message (if any)
  Wire send_wire = Wire::Elem;  // format of the outgoing message (if any)
  int from = -1;                // peer we receive from
  int to = -1;                  // peer we send to
  BufRef src;                   // local operand
  BufRef dst;                   // local result
  size_t count = 0;             // elements
};

const char* step_kind_name(StepKind k);

// Receives a schedule's steps one at a time (the executor runs them; tests record them).
class StepSink {
 public:
  virtual ~StepSink() = default;
  virtual void step(const Step& s) = 0;
};

class StepRecorder : public StepSink {
 public:
  void step(const Step& s) override { steps.push_back(s); }
  std::vector<Step> steps;
};

}  // namespace pycoll
