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

// `to` peers: `to` and, if set, `to2`. Incoming: from `from` and, if set, `from2`; a reduction
// over them is op(op(from, src), from2). With from == kAllPeers a reduction covers every rank
// in rank order, this rank's own contribution being `src`: the same order on every rank.
enum class StepKind : uint8_t {
  Send,                // send src to the `to` peers
  Recv,                // dst = incoming
  RecvReduceSend,      // send op(incoming..., src) to the `to` peers
  RecvReduceCopy,      // dst = op(incoming..., src), finalised (avg divides)
  RecvReduceCopySend,  // dst = op(incoming..., src), finalised; send dst to the `to` peers
  RecvCopySend,        // dst = incoming; send it on to the `to` peers
  Copy,                // dst = src (local)
};

constexpr int kNoPeer = -1;
constexpr int kAllPeers = -2;

// What travels on the wire: partial reductions in the accumulation type, or finished elements.
enum class Wire : uint8_t { Elem = 0, Acc = 1 };

struct Step {
  StepKind kind;
  Wire recv_wire = Wire::Elem;  // format of the incoming message (if any)
  Wire send_wire = Wire::Elem;  // format of the outgoing message (if any)
  int from = kNoPeer;           // peer we receive from, or kAllPeers
  int from2 = kNoPeer;          // second peer we receive from (tree nodes with two children)
  int to = kNoPeer;             // peer we send to, or kAllPeers (our broadcast channel)
  int to2 = kNoPeer;            // second peer we send to
  bool recv_bcast = false;      // incoming messages come from the senders' broadcast channels
  BufRef src;                   // local operand
  BufRef dst;                   // local result
  size_t count = 0;             // elements
};

const char* step_kind_name(StepKind k);

// What every schedule is a function of.
struct ScheduleParams {
  int rank = 0;
  int size = 1;
  size_t count = 0;      // elements: of the whole vector (all-reduce, broadcast, reduce), of one
                         // rank's shard (all-gather, reduce-scatter) or block (all-to-all,
                         // gather, scatter)
  int root = 0;          // broadcast / reduce / gather / scatter
  size_t piece = 1;      // max elements per message
  size_t acc_bytes = 4;  // bytes per element in the accumulation type
  // Direct all-reduce: one-shot up to this many bytes (accumulation type), two-shot above.
  size_t oneshot_max_bytes = 64 * 1024;
  // Ring and two-shot shards hold a multiple of this many elements (the last one fewer).
  size_t shard_align = 1;
  // Uneven blocks, `size` entries each (nullptr: every block holds `count`). Blocks are
  // rank-major and contiguous: a block's offset is the sum of the lengths before it.
  // All-gather / reduce-scatter: the block of each rank (the same list on every rank).
  const uint64_t* counts = nullptr;
  // All-to-all: elements this rank sends to / receives from each rank (its row and column).
  const uint64_t* send_counts = nullptr;
  const uint64_t* recv_counts = nullptr;
  // All-to-all, gather, scatter: blocks between different ranks of at least this many
  // elements are left out (the caller moves them point-to-point; host/direct_blocks.h). 0: none.
  size_t direct_min_count = 0;
  // Ring and two-shot all-reduce: each piece's first messages go out before the previous
  // piece's last receives (needs 2 slots per channel; the order of messages on every channel
  // is the same).
  bool lookahead = false;
};

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
