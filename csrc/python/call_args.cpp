#include "python/call_args.h"

#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <cstdio>
#include <cstring>
#include <numeric>

#include "common/errors.h"

namespace py = pybind11;

namespace pycoll {
namespace pyargs {

// A validated host array: where it is, how many elements, of what type.
struct ArrayArg {
  uint8_t* ptr = nullptr;
  size_t count = 0;
  DType dtype = DType::Float32;
  size_t bytes() const { return count * dtype_size(dtype); }
};

bool is_tagged_bfloat16(const py::dtype& dt) {
  py::object meta = dt.attr("metadata");
  if (meta.is_none()) return false;
  py::object tag = meta.attr("get")("pycollectives");
  return py::isinstance<py::str>(tag) && tag.cast<std::string>() == "bfloat16";
}

// The DType code of numpy dtype `dt`, or -1 for one we do not move.
int dtype_code(const py::dtype& dt) {
  if (dt.byteorder() == '>') return -1;  // not native on the little-endian hosts we run on
  auto of = [](DType t) { return static_cast<int>(t); };
  const auto size = dt.itemsize();
  switch (dt.kind()) {
    case 'i':
      return size == 1   ? of(DType::Int8)
             : size == 4 ? of(DType::Int32)
             : size == 8 ? of(DType::Int64)
                         : -1;
    case 'u':
      if (size == 1) return of(DType::UInt8);
      // bfloat16 bit patterns in a uint16 tagged as such (pycollectives.arrays.BFLOAT16_BITS).
      if (size == 2 && is_tagged_bfloat16(dt)) return of(DType::BFloat16);
      return -1;
    case 'f':
      return size == 2   ? of(DType::Float16)
             : size == 4 ? of(DType::Float32)
             : size == 8 ? of(DType::Float64)
                         : -1;
    default:
      // bfloat16 comes from extension dtypes (ml_dtypes).
      if (size == 2 && py::str(dt.attr("name")).cast<std::string>() == "bfloat16")
        return of(DType::BFloat16);
      return -1;
  }
}

int dtype_code_of(py::handle dtype) {
  if (!py::isinstance<py::dtype>(dtype)) return -1;
  return dtype_code(py::reinterpret_borrow<py::dtype>(dtype));
}

ArrayArg array_arg(py::handle obj, const char* fn, const char* name, bool writable) {
  if (!py::isinstance<py::array>(obj))
    throw InvalidType(str_cat(fn, ": ", name, " must be a numpy.ndarray, got ",
                              py::str(py::type::of(obj).attr("__name__")).cast<std::string>()));
  auto a = py::reinterpret_borrow<py::array>(obj);
  const int code = dtype_code(a.dtype());
  if (code < 0)
    throw InvalidType(str_cat(fn, ": ", name, " has unsupported dtype ",
                              py::str(a.dtype()).cast<std::string>(),
                              " (supported: int8, uint8, int32, int64, float16, bfloat16, "
                              "float32, float64 in native byte order)"));
  if (!(a.flags() & py::array::c_style))
    throw InvalidArgument(str_cat(fn, ": ", name, " must be C-contiguous"));
  if (writable && !a.writeable()) throw InvalidArgument(str_cat(fn, ": ", name, " is read-only"));
  ArrayArg r;
  r.ptr = static_cast<uint8_t*>(const_cast<void*>(a.data()));
  r.count = static_cast<size_t>(a.size());
  r.dtype = static_cast<DType>(code);
  return r;
}

void check_same_dtype(const char* fn, const ArrayArg& x, const ArrayArg& out) {
  if (x.dtype != out.dtype)
    throw InvalidType(str_cat(fn, ": out has dtype ", dtype_name(out.dtype), ", expected ",
                              dtype_name(x.dtype), " (the dtype of x)"));
}

void check_count(const char* fn, const char* name, size_t got, size_t want, const char* why) {
  if (got != want)
    throw InvalidArgument(
        str_cat(fn, ": ", name, " has ", got, " elements, expected ", want, " (", why, ")"));
}

bool overlap(const uint8_t* a, size_t an, const uint8_t* b, size_t bn) {
  return an != 0 && bn != 0 && a < b + bn && b < a + an;
}

// `x` and `out` must either sit exactly where the collective's in-place form puts them
// (`in_place`) or not overlap at all.
void check_aliasing(const char* fn, const ArrayArg& x, const ArrayArg& out, bool in_place) {
  if (!in_place && overlap(x.ptr, x.bytes(), out.ptr, out.bytes()))
    throw InvalidArgument(str_cat(fn, ": x and out overlap without being the in-place layout"));
}

RedOp op_arg(const char* fn, int op, DType t) {
  if (!valid_redop(op)) throw InvalidArgument(str_cat(fn, ": unknown op ", op));
  const RedOp r = static_cast<RedOp>(op);
  if (r == RedOp::Avg && !is_floating(t))
    throw InvalidArgument(str_cat(fn, ": op avg is not supported for integer dtype ", dtype_name(t),
                                  " (use sum and divide)"));
  return r;
}

int root_arg(const char* fn, int root, int size) {
  if (root < 0 || root >= size)
    throw InvalidArgument(str_cat(fn, ": root ", root, " is out of range for ", size, " ranks"));
  return root;
}

CollectiveCall make_call(Collective coll, const ArrayArg& x, const ArrayArg& out, int algo,
                         size_t count) {
  CollectiveCall call;
  call.collective = coll;
  call.algo = algo_for(coll, algo);
  call.in = x.ptr;
  call.out = out.ptr;
  call.count = count;
  call.dtype = x.dtype;
  return call;
}

// `list` as unsigned counts: one per rank, none negative.
std::vector<uint64_t> count_list(const char* fn, const char* name, const std::vector<int64_t>& list,
                                 int size) {
  if (list.size() != static_cast<size_t>(size))
    throw InvalidArgument(str_cat(fn, ": ", name, " has ", list.size(),
                                  " entries, expected one per rank (", size, ")"));
  std::vector<uint64_t> r;
  for (size_t i = 0; i < list.size(); ++i) {
    if (list[i] < 0)
      throw InvalidArgument(str_cat(fn, ": ", name, "[", i, "] is negative (", list[i], ")"));
    r.push_back(static_cast<uint64_t>(list[i]));
  }
  return r;
}

size_t prefix(const std::vector<uint64_t>& v, int k) {
  return static_cast<size_t>(std::accumulate(v.begin(), v.begin() + k, uint64_t{0}));
}

// All-gather / reduce-scatter with per-rank blocks: rank-major and contiguous; the in-place
// form puts this rank's block where it belongs in the long array.
CollectiveCall uneven_call(Collective c, const ArrayArg& x, const ArrayArg& out,
                           const std::vector<int64_t>& list, int algo, int rank, int size) {
  const char* fn = collective_name(c);
  check_same_dtype(fn, x, out);
  std::vector<uint64_t> counts = count_list(fn, "counts", list, size);
  const size_t total = sum_of(counts), mine = counts[rank];
  const size_t at = prefix(counts, rank) * dtype_size(x.dtype);
  CollectiveCall call;
  if (c == Collective::AllGather) {
    check_count(fn, "x", x.count, mine, "counts[rank]");
    check_count(fn, "out", out.count, total, "sum(counts)");
    check_aliasing(fn, x, out, x.ptr == out.ptr + at);
  } else {
    check_count(fn, "x", x.count, total, "sum(counts)");
    check_count(fn, "out", out.count, mine, "counts[rank]");
    check_aliasing(fn, x, out, out.ptr == x.ptr + at);
  }
  call = make_call(c, x, out, algo, total);
  call.counts = std::move(counts);
  return call;
}

CollectiveCall all_to_all_call(const ArrayArg& x, const ArrayArg& out, const Splits& sp, int algo,
                               int size) {
  const char* fn = "all_to_all";
  check_same_dtype(fn, x, out);
  check_aliasing(fn, x, out, false);  // no in-place form: blocks move between positions
  if (sp.in_splits.has_value() != sp.out_splits.has_value())
    throw InvalidArgument(str_cat(fn, ": give both in_splits and out_splits, or neither"));
  if (!sp.in_splits) {
    const size_t n = static_cast<size_t>(size);
    if (x.count % n != 0)
      throw InvalidArgument(str_cat(fn, ": x has ", x.count, " elements, not a multiple of ", size,
                                    " ranks (give in_splits/out_splits for uneven blocks)"));
    check_count(fn, "out", out.count, x.count, "the size of x");
    return make_call(Collective::AllToAll, x, out, algo, x.count / n);
  }
  std::vector<uint64_t> send = count_list(fn, "in_splits", *sp.in_splits, size);
  std::vector<uint64_t> recv = count_list(fn, "out_splits", *sp.out_splits, size);
  check_count(fn, "x", x.count, sum_of(send), "sum(in_splits)");
  check_count(fn, "out", out.count, sum_of(recv), "sum(out_splits)");
  CollectiveCall call = make_call(Collective::AllToAll, x, out, algo, 0);
  call.send_counts = std::move(send);
  call.recv_counts = std::move(recv);
  return call;
}

// The checks that depend on the collective, on arrays already described (numpy here, GPU
// arrays in pycollectives/cuda_args.py): the errors a caller sees before any byte moves.
// `out` is `x` in the in-place forms of all_reduce and reduce, and for broadcast. An array a
// rank does not use (gather's out, scatter's x off the root) may be absent (null, 0 elements).
// Returns the call to run.
CollectiveCall checked_call(Collective c, const ArrayArg& x, const ArrayArg& out, int root,
                            int op_code, int algo, int rank, int size, const Splits& sp) {
  const char* fn = collective_name(c);
  if (sp.counts && c != Collective::AllGather && c != Collective::ReduceScatter)
    throw InvalidArgument(str_cat(fn, ": counts apply to all_gather and reduce_scatter only"));
  if ((sp.in_splits || sp.out_splits) && c != Collective::AllToAll)
    throw InvalidArgument(str_cat(fn, ": in_splits/out_splits apply to all_to_all only"));
  if (has_root(c)) root_arg(fn, root, size);
  const bool at_root = rank == root;
  CollectiveCall call;
  switch (c) {
    case Collective::AllReduce:
    case Collective::Reduce:
      check_same_dtype(fn, x, out);
      check_count(fn, "out", out.count, x.count, "the size of x");
      check_aliasing(fn, x, out, x.ptr == out.ptr && x.count == out.count);
      call = make_call(c, x, out, algo, x.count);
      break;
    case Collective::ReduceScatter:
      if (sp.counts) {
        call = uneven_call(c, x, out, *sp.counts, algo, rank, size);
        break;
      }
      check_same_dtype(fn, x, out);
      check_count(fn, "x", x.count, out.count * size, "size * out.size");
      check_aliasing(fn, x, out, out.ptr == x.ptr + rank * out.bytes());
      call = make_call(c, x, out, algo, out.count);
      break;
    case Collective::AllGather:
      if (sp.counts) {
        call = uneven_call(c, x, out, *sp.counts, algo, rank, size);
        break;
      }
      check_same_dtype(fn, x, out);
      check_count(fn, "out", out.count, x.count * size, "size * x.size");
      check_aliasing(fn, x, out, x.ptr == out.ptr + rank * x.bytes());
      call = make_call(c, x, out, algo, x.count);
      break;
    case Collective::Broadcast:
      call = make_call(c, x, x, algo, x.count);
      break;
    case Collective::AllToAll:
      call = all_to_all_call(x, out, sp, algo, size);
      break;
    case Collective::Gather:
      // Only the root has an output; the root may gather in place (x already in its block).
      if (at_root) {
        if (out.ptr == nullptr && out.count == 0 && x.count != 0)
          throw InvalidArgument(str_cat(fn, ": out is required on the root"));
        check_same_dtype(fn, x, out);
        check_count(fn, "out", out.count, x.count * size, "size * x.size");
        check_aliasing(fn, x, out, x.ptr == out.ptr + root * x.bytes());
      }
      call = make_call(c, x, out, algo, x.count);
      if (!at_root) call.out = nullptr;
      break;
    case Collective::Scatter:
      // Only the root has an input; the root may scatter in place (out is its own block).
      if (at_root) {
        if (x.ptr == nullptr && x.count == 0 && out.count != 0)
          throw InvalidArgument(str_cat(fn, ": x is required on the root"));
        check_same_dtype(fn, x, out);
        check_count(fn, "x", x.count, out.count * size, "size * out.size");
        check_aliasing(fn, x, out, out.ptr == x.ptr + root * out.bytes());
      }
      call = make_call(c, out, out, algo, out.count);
      call.in = at_root ? x.ptr : nullptr;
      break;
  }
  if (has_root(c)) call.root = root;
  if (carries_partials(c)) call.op = op_arg(fn, op_code, x.dtype);
  return call;
}

// Whether `array` of collective `c` may be None on this rank: an array the rank does not use.
bool may_be_absent(Collective c, const char* array, int rank, int root) {
  if (rank == root) return false;
  return (c == Collective::Gather && std::strcmp(array, "out") == 0) ||
         (c == Collective::Scatter && std::strcmp(array, "x") == 0);
}

CallFields call_fields(py::handle obj) {
  if (!py::isinstance<py::tuple>(obj) || py::len(obj) != kNumCallFields)
    throw InvalidArgument("expected a pycollectives.backends.Call");
  const auto call = py::reinterpret_borrow<py::tuple>(obj);
  auto list = [&](int i) -> CountList {
    if (call[i].is_none()) return std::nullopt;
    return call[i].cast<std::vector<int64_t>>();
  };
  return CallFields{collective_from_name(call[kCallCollective].cast<std::string>()),
                    call[kCallOp].cast<int>(),
                    call[kCallRoot].cast<int>(),
                    call[kCallAlgorithm].cast<int>(),
                    call[kCallAsyncOp].cast<bool>(),
                    Splits{list(kCallCounts), list(kCallInSplits), list(kCallOutSplits)},
                    static_cast<int8_t>(call[kCallReproducible].is_none()
                                            ? -1
                                            : (call[kCallReproducible].cast<bool>() ? 1 : 0))};
}

// A call on numpy arrays: each array checked (type, dtype, layout, writability), then the
// collective's own checks. `out_obj` None: in place (all_reduce, reduce); broadcast has none.
CollectiveCall parse_call(Collective c, py::handle x_obj, py::handle out_obj, int root, int op,
                          int algo, int rank, int size, const Splits& sp) {
  const char* fn = collective_name(c);
  const bool reduces_in_place =
      (c == Collective::AllReduce || c == Collective::Reduce) && out_obj.is_none();
  const bool one_array = c == Collective::Broadcast || reduces_in_place;
  // Arrays a rank does not use are not looked at beyond their type: gather's out and
  // scatter's x off the root are left untouched.
  auto arg = [&](py::handle obj, const char* name, bool writable) {
    if (may_be_absent(c, name, rank, root)) {
      ArrayArg absent;
      if (!obj.is_none()) absent.dtype = array_arg(obj, fn, name, false).dtype;
      return absent;
    }
    return array_arg(obj, fn, name, writable);
  };
  ArrayArg x = arg(x_obj, "x", one_array);
  const ArrayArg out = one_array ? x : arg(out_obj, "out", true);
  if (c == Collective::Scatter && x.ptr == nullptr) x.dtype = out.dtype;
  return checked_call(c, x, out, root, op, algo, rank, size, sp);
}

CollectiveCall parse_call(const py::tuple& call, int rank, int size, bool* async_op) {
  const CallFields f = call_fields(call);
  if (async_op != nullptr) *async_op = f.async_op;
  CollectiveCall c = parse_call(f.collective, call[kCallX], call[kCallOut], f.root, f.op, f.algo,
                                rank, size, f.splits);
  c.reproducible = f.reproducible;
  return c;
}

std::pair<size_t, int> check_args(const py::tuple& call, int rank, int size) {
  const CollectiveCall c = parse_call(call, rank, size);
  return {c.count, static_cast<int>(c.dtype)};
}

CollectiveCall described_call(Collective c, const void* x, size_t x_count, void* out,
                              size_t out_count, int dtype, int root, int op, int algo, int rank,
                              int size) {
  if (!valid_dtype(dtype)) throw InvalidArgument(str_cat("unknown dtype code ", dtype));
  ArrayArg xa, oa;
  xa.ptr = static_cast<uint8_t*>(const_cast<void*>(x));
  xa.count = x_count;
  oa.ptr = static_cast<uint8_t*>(out);
  oa.count = out_count;
  xa.dtype = oa.dtype = static_cast<DType>(dtype);
  return checked_call(c, xa, oa, root, op, algo, rank, size, Splits{});
}

CollectiveCall described_call(Collective c, const Described& x, const Described& out, int root,
                              int op, int algo, int rank, int size, const Splits& sp) {
  auto described = [](const std::tuple<uintptr_t, size_t, int>& t) {
    if (!valid_dtype(std::get<2>(t))) throw InvalidArgument("unknown dtype code");
    ArrayArg a;
    a.ptr = reinterpret_cast<uint8_t*>(std::get<0>(t));
    a.count = std::get<1>(t);
    a.dtype = static_cast<DType>(std::get<2>(t));
    return a;
  };
  ArrayArg xa, oa;  // absent (null, 0 elements) unless given
  if (x)
    xa = described(*x);
  else if (!may_be_absent(c, "x", rank, root))
    throw InvalidArgument(str_cat(collective_name(c), ": x is required"));
  if (out)
    oa = described(*out);
  else if (!may_be_absent(c, "out", rank, root))
    oa = xa;  // the single-array forms
  if (!x) xa.dtype = oa.dtype;
  return checked_call(c, xa, oa, root, op, algo, rank, size, sp);
}

CollectiveCall described_call(const py::tuple& call, const Described& x, const Described& out,
                              int rank, int size, bool* async_op) {
  const CallFields f = call_fields(call);
  if (async_op != nullptr) *async_op = f.async_op;
  CollectiveCall c =
      described_call(f.collective, x, out, f.root, f.op, f.algo, rank, size, f.splits);
  c.reproducible = f.reproducible;
  return c;
}

// p2p ops as ("send"|"recv", array, peer, tag), every one checked before anything moves.
// `arrays` collects the arrays, to keep them alive as long as an asynchronous batch.
std::vector<P2POp> parse_p2p(py::handle ops_obj, int rank, int size, py::list& arrays) {
  const char* fn = "p2p";
  if (!py::isinstance<py::list>(ops_obj) && !py::isinstance<py::tuple>(ops_obj))
    throw InvalidType(str_cat(fn, ": ops must be a list of (kind, array, peer, tag) tuples"));
  std::vector<P2POp> ops;
  std::vector<ArrayArg> args;
  size_t i = 0;
  for (py::handle item : py::reinterpret_borrow<py::sequence>(ops_obj)) {
    // Formatted without streams: this runs for every op of every call (latency matters).
    char where[32], what[48];
    std::snprintf(where, sizeof where, "ops[%zu]", i++);
    std::snprintf(what, sizeof what, "%s array", where);
    if (!py::isinstance<py::tuple>(item) || py::len(item) != 4)
      throw InvalidType(str_cat(fn, ": ", where, " must be a (kind, array, peer, tag) tuple"));
    auto t = py::reinterpret_borrow<py::tuple>(item);
    if (!py::isinstance<py::str>(t[0]))
      throw InvalidType(str_cat(fn, ": ", where, " kind must be \"send\" or \"recv\""));
    const std::string kind = t[0].cast<std::string>();
    if (kind != "send" && kind != "recv")
      throw InvalidArgument(
          str_cat(fn, ": ", where, " kind must be \"send\" or \"recv\", got \"", kind, "\""));
    P2POp op;
    op.kind = kind == "send" ? P2PKind::Send : P2PKind::Recv;
    const ArrayArg a = array_arg(t[1], fn, what, op.kind == P2PKind::Recv);
    for (const char* field : {"peer", "tag"}) {
      py::handle v = t[field[0] == 'p' ? 2 : 3];
      if (!py::isinstance<py::int_>(v) || py::isinstance<py::bool_>(v))
        throw InvalidType(str_cat(fn, ": ", where, " ", field, " must be an int"));
    }
    const long long peer = t[2].cast<long long>();
    if (peer < 0 || peer >= size || peer == rank)
      throw InvalidArgument(str_cat(fn, ": ", where, " peer ", peer, " is not another rank of ",
                                    size, " (this is rank ", rank, ")"));
    int overflow = 0;
    const long long tag = PyLong_AsLongLongAndOverflow(t[3].ptr(), &overflow);
    if (overflow != 0 || tag < 0)  // [0, 2**63): the tags above are the communicator's own
      throw InvalidArgument(str_cat(fn, ": ", where, " tag must be in [0, 2**63), got ",
                                    py::str(t[3]).cast<std::string>()));
    op.buf = a.ptr;
    op.count = a.count;
    op.dtype = a.dtype;
    op.peer = static_cast<int>(peer);
    op.tag = static_cast<uint64_t>(tag);
    // A receive must not land on bytes another op of the batch reads or writes.
    for (size_t j = 0; j < args.size(); ++j)
      if ((op.kind == P2PKind::Recv || ops[j].kind == P2PKind::Recv) &&
          overlap(a.ptr, a.bytes(), args[j].ptr, args[j].bytes()))
        throw InvalidArgument(str_cat(fn, ": ", where, " array overlaps the array of ops[", j,
                                      "] and one of them is received into"));
    ops.push_back(op);
    args.push_back(a);
    arrays.append(t[1]);
  }
  return ops;
}

}  // namespace pyargs
}  // namespace pycoll
