// Argument checks of the _C module: numpy arrays (or arrays described by pointer, count and
// dtype) turned into a checked CollectiveCall, with the TypeError / ValueError a caller sees
// before any byte moves.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "algo/call.h"
#include "runtime/p2p_core.h"

namespace pycoll {
namespace pyargs {

// Per-rank element counts as Python gives them: None (even) or a list of integers.
using CountList = std::optional<std::vector<int64_t>>;

// The split lists of one call: all-gather / reduce-scatter `counts`, all-to-all in/out splits.
struct Splits {
  CountList counts, in_splits, out_splits;
};

// The call descriptor every backend takes: Python's pycollectives.backends.Call, a tuple with
// these fields in this order (Python builds Call from CALL_FIELDS, exported by _C). Its
// collective is a name; op, root and algorithm are codes (0: automatic); stream is the GPU
// stream object, resolved in Python.
enum CallField : int {
  kCallCollective,
  kCallX,
  kCallOut,
  kCallOp,
  kCallRoot,
  kCallAlgorithm,
  kCallAsyncOp,
  kCallStream,
  kCallCounts,
  kCallInSplits,
  kCallOutSplits,
  kCallReproducible,
  kNumCallFields
};
inline constexpr const char* kCallFieldNames[kNumCallFields] = {
    "collective", "x",      "out",    "op",        "root",       "algorithm",
    "async_op",   "stream", "counts", "in_splits", "out_splits", "reproducible"};

// A Call's fields other than its arrays, read and typed.
struct CallFields {
  Collective collective;
  int op, root, algo;
  bool async_op;
  Splits splits;
  int8_t reproducible;  // CollectiveCall::reproducible: -1 (None: the communicator's), 0, 1
};
// Throws InvalidArgument when `call` is not a Call (not a tuple of kNumCallFields fields).
CallFields call_fields(pybind11::handle call);

// A call on numpy arrays: each array checked (type, dtype, layout, writability), then the
// collective's own checks. `out_obj` None: in place (all_reduce, reduce); broadcast has none;
// gather's out and scatter's x may be None off the root.
CollectiveCall parse_call(Collective c, pybind11::handle x_obj, pybind11::handle out_obj, int root,
                          int op, int algo, int rank, int size, const Splits& sp = {});

// A backends.Call on numpy arrays, checked as parse_call checks its fields; `async_op`, when
// given, receives the call's flag.
CollectiveCall parse_call(const pybind11::tuple& call, int rank, int size,
                          bool* async_op = nullptr);

// The same checks of a backends.Call on numpy arrays, for a communicator whose collectives are
// composed in Python (several nodes); returns (count, dtype code) of the call.
std::pair<size_t, int> check_args(const pybind11::tuple& call, int rank, int size);

// The DType code of `dtype` (a numpy dtype object, as numpy and cupy arrays carry), or -1 for
// anything else and for a dtype we do not move.
int dtype_code_of(pybind11::handle dtype);

// An array described elsewhere (a GPU array, described in Python): (pointer, element count,
// dtype code), or None for an array the call does not take.
using Described = std::optional<std::tuple<uintptr_t, size_t, int>>;

// The collective's checks on described arrays: `out` None in the single-array forms and for
// gather off the root, `x` None for scatter off the root. Returns the call to run.
CollectiveCall described_call(Collective c, const Described& x, const Described& out, int root,
                              int op, int algo, int rank, int size, const Splits& sp = {});

// A backends.Call on described arrays (`x`, `out`: its arrays as Python described them), with
// described_call's checks; `async_op`, when given, receives the call's flag.
CollectiveCall described_call(const pybind11::tuple& call, const Described& x, const Described& out,
                              int rank, int size, bool* async_op = nullptr);

// A call on arrays given by pointer and element count (an absent array: null, 0 elements),
// both of dtype code `dtype`, with parse_call's checks.
CollectiveCall described_call(Collective c, const void* x, size_t x_count, void* out,
                              size_t out_count, int dtype, int root, int op, int algo, int rank,
                              int size);

// p2p ops as ("send"|"recv", array, peer, tag), every one checked before anything moves.
// `arrays` collects the arrays, to keep them alive as long as an asynchronous batch.
std::vector<P2POp> parse_p2p(pybind11::handle ops_obj, int rank, int size, pybind11::list& arrays);

}  // namespace pyargs
}  // namespace pycoll
