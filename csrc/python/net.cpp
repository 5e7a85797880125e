// pybind11 module pycollectives._net: the inter-node transport over the job's MPI.
//
// Kept apart from _C so that importing pycollectives never loads an MPI library of its own
// choosing: this module is imported only once mpi4py has loaded MPI, for communicators that
// span several nodes. Arguments were validated by the caller (pycollectives/hierarchy.py).
// It needs MPI's header and library only, not mpi4py's: a communicator arrives as its
// Fortran handle (mpi4py's Comm.py2f), so an isolated build (pip's default) can make it.
#include <mpi.h>
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "common/coverage.h"
#include "common/errors.h"
#include "common/reduce.h"
#include "net/net_check.h"
#include "net/net_comm.h"
#include "net/net_p2p.h"
#include "python/call_args.h"
#include "python/core_errors.h"

namespace py = pybind11;
using namespace pycoll;

namespace {

MPI_Comm mpi_comm_of(py::handle obj) {
  return MPI_Comm_f2c(static_cast<MPI_Fint>(obj.attr("py2f")().cast<long long>()));
}

// The MPI family this module was compiled against: its handles and calls fit only that one.
const char* built_with_mpi() {
#if defined(OPEN_MPI)
  return "Open MPI";
#elif defined(MPICH)
  return "MPICH";
#else
  return "unknown";
#endif
}

uint8_t* array_data(const py::array& a) {
  return static_cast<uint8_t*>(const_cast<void*>(a.data()));
}

// The communicator object keeps the mpi4py communicator alive as long as we use its handle.
struct PyNetComm {
  py::object keep;
  std::unique_ptr<NetComm> comm;
};

struct PyNetCheck {
  py::object keep;
  std::unique_ptr<NetCheck> check;
};

struct PyNetP2P {
  py::object keep;
  std::shared_ptr<NetP2P> engine;
  std::vector<char> away;  // per rank: on another node (set_nodes)
};

// A batch of point-to-point operations in flight; it keeps its engine (closed or not) alive.
struct PyNetP2PWork {
  std::shared_ptr<NetP2P> engine;
  std::shared_ptr<P2PBatch> batch;
};

// (send, address, count, dtype code, peer, tag), as pycollectives._C.check_p2p describes them.
using DescribedOp = std::tuple<bool, uintptr_t, size_t, int, int, uint64_t>;

std::vector<P2POp> net_ops(const std::vector<DescribedOp>& described) {
  std::vector<P2POp> ops;
  for (const auto& [send, addr, count, dtype, peer, tag] : described) {
    if (!valid_dtype(dtype)) throw InvalidArgument(str_cat("p2p: bad dtype code ", dtype));
    P2POp o;
    o.kind = send ? P2PKind::Send : P2PKind::Recv;
    o.buf = reinterpret_cast<uint8_t*>(addr);
    o.count = count;
    o.dtype = static_cast<DType>(dtype);
    o.peer = peer;
    o.tag = tag;
    ops.push_back(o);
  }
  return ops;
}

}  // namespace

PYBIND11_MODULE(_net, m) {
  m.doc() = "pycollectives inter-node transport over MPI (private)";
  translate_errors_as_core();
  m.attr("built_with_mpi") = built_with_mpi();
  PYCOLL_BIND_COVERAGE_DUMP(m);

  py::class_<PyNetComm>(m, "NetComm")
      .def(py::init([](py::object comm, size_t piece_bytes, int window, double timeout) {
             NetOptions o;
             o.piece_bytes = piece_bytes;
             o.window = window;
             o.timeout_s = timeout;
             auto c = std::make_unique<NetComm>(mpi_comm_of(comm), o);
             return PyNetComm{comm, std::move(c)};
           }),
           py::arg("comm"), py::arg("piece_bytes"), py::arg("window"), py::arg("timeout"))
      .def_property(
          "timeout", [](const PyNetComm& c) { return c.comm->timeout(); },
          [](PyNetComm& c, double s) { c.comm->set_timeout(s); })
      .def_property_readonly("poisoned", [](const PyNetComm& c) { return c.comm->poisoned(); })
      .def(
          "run",
          [](PyNetComm& c, const std::string& collective, const std::string& algorithm,
             std::vector<int> group, py::array x, py::array out, size_t count, int dtype, int op,
             int root, int divisor, uint64_t seq, std::vector<uint64_t> counts,
             std::vector<uint64_t> send_counts, std::vector<uint64_t> recv_counts) {
            if (!valid_dtype(dtype) || !valid_redop(op))
              throw InvalidArgument("run: bad dtype or op code");
            NetCall call;
            call.collective = collective_from_name(collective);
            call.algo = algo_from_name(algorithm);
            if (!algo_supports(call.algo, call.collective))
              throw InvalidArgument(str_cat(algorithm, " has no ", collective));
            call.dtype = static_cast<DType>(dtype);
            call.op = static_cast<RedOp>(op);
            call.count = count;
            call.root = root;
            call.counts = std::move(counts);
            call.send_counts = std::move(send_counts);
            call.recv_counts = std::move(recv_counts);
            const int me = static_cast<int>(std::find(group.begin(), group.end(), c.comm->rank()) -
                                            group.begin());
            const int n = static_cast<int>(group.size());
            if (me >= n || (!call.counts.empty() && call.counts.size() != group.size()) ||
                call.send_counts.size() != call.recv_counts.size() ||
                (!call.send_counts.empty() && call.send_counts.size() != group.size()))
              throw InvalidArgument(str_cat(collective, ": counts do not fit the group"));
            const CallExtents e = call_extents(call, me, n);
            const size_t esize = dtype_size(call.dtype);
            if ((e.in && static_cast<size_t>(x.itemsize()) != esize) ||
                (e.out && static_cast<size_t>(out.itemsize()) != esize) ||
                static_cast<size_t>(x.size()) < e.in || static_cast<size_t>(out.size()) < e.out)
              throw InvalidArgument(str_cat(collective, ": buffers do not fit the call"));
            call.group = std::move(group);
            call.in = array_data(x);
            call.out = array_data(out);
            call.divisor = divisor;
            call.seq = seq;
            py::gil_scoped_release nogil;
            c.comm->run(call);
          },
          py::arg("collective"), py::arg("algorithm"), py::arg("group"), py::arg("x"),
          py::arg("out"), py::arg("count"), py::arg("dtype"), py::arg("op"), py::arg("root"),
          py::arg("divisor"), py::arg("seq"), py::arg("counts") = std::vector<uint64_t>{},
          py::arg("send_counts") = std::vector<uint64_t>{},
          py::arg("recv_counts") = std::vector<uint64_t>{});

  py::class_<PyNetCheck>(m, "NetCheck")
      .def(py::init([](py::object comm, double timeout) {
             return PyNetCheck{comm, std::make_unique<NetCheck>(mpi_comm_of(comm), timeout)};
           }),
           py::arg("comm"), py::arg("timeout"))
      .def_property(
          "timeout", [](const PyNetCheck& c) { return c.check->timeout(); },
          [](PyNetCheck& c, double s) { c.check->set_timeout(s); })
      .def("close", [](PyNetCheck& c) { c.check->close(); })
      .def(
          "exchange",
          [](PyNetCheck& c, const std::vector<int>& group, const std::string& what,
             const py::bytes& status) {
            const std::string mine = status;
            std::vector<std::string> got;
            {
              py::gil_scoped_release nogil;
              got = c.check->exchange(group, what, mine, nullptr, 0, nullptr, nullptr);
            }
            py::list out;
            for (const std::string& s : got) out.append(py::bytes(s));
            return out;
          },
          py::arg("group"), py::arg("what"), py::arg("status"),
          "Every member's status (bytes), in `group` order: see net/net_check.h.")
      .def(
          "exchange_into",
          [](PyNetCheck& c, const std::vector<int>& group, const std::string& what,
             const py::bytes& status, py::array x, py::array out) {
            const size_t bytes = static_cast<size_t>(x.nbytes());
            if (static_cast<size_t>(out.nbytes()) != bytes * group.size())
              throw InvalidArgument("exchange_into: out must hold every member's x");
            const std::string mine = status;
            std::vector<std::string> got;
            bool sizes_ok = false;
            {
              py::gil_scoped_release nogil;
              got =
                  c.check->exchange(group, what, mine, x.data(), bytes, array_data(out), &sizes_ok);
            }
            py::list statuses;
            for (const std::string& s : got) statuses.append(py::bytes(s));
            return py::make_tuple(statuses, sizes_ok);
          },
          py::arg("group"), py::arg("what"), py::arg("status"), py::arg("x"), py::arg("out"),
          "exchange, with `x` riding along to every member; member k's lands in `out`'s k-th "
          "block where it has x's size. Returns (statuses, whether every one had).")
      .def(
          "exchange_reduce",
          [](PyNetCheck& c, const std::vector<int>& group, const std::string& what,
             const py::bytes& status, py::array x, py::array out, int dtype, int op, int divisor) {
            if (!valid_dtype(dtype) || !valid_redop(op))
              throw InvalidArgument("exchange_reduce: bad dtype or op code");
            const auto t = static_cast<DType>(dtype);
            const size_t count = static_cast<size_t>(x.size());
            const size_t bytes = count * dtype_size(t);
            if (static_cast<size_t>(x.nbytes()) != bytes || out.nbytes() != x.nbytes())
              throw InvalidArgument("exchange_reduce: buffers do not fit the call");
            const std::string mine = status;
            std::vector<std::string> got;
            bool reduced = false;
            {
              py::gil_scoped_release nogil;
              const size_t n = group.size();
              std::vector<uint8_t> from(n * bytes);
              bool sizes_ok = false;
              got = c.check->exchange(group, what, mine, x.data(), bytes, from.data(), &sizes_ok);
              reduced = sizes_ok && std::all_of(got.begin(), got.end(),
                                                [&](const std::string& s) { return s == mine; });
              if (reduced) {
                // In node order, the same on every member: results bitwise identical.
                fold_rows(t, static_cast<RedOp>(op), from.data(), n, count, array_data(out),
                          divisor);
              }
            }
            py::list statuses;
            for (const std::string& s : got) statuses.append(py::bytes(s));
            return py::make_tuple(statuses, reduced);
          },
          py::arg("group"), py::arg("what"), py::arg("status"), py::arg("x"), py::arg("out"),
          py::arg("dtype"), py::arg("op"), py::arg("divisor"),
          "exchange, with `x` riding along to every member; when every status equals ours, "
          "`out` = op over every member's x in group order (avg: divided by divisor). Returns "
          "(statuses, whether it reduced).");

  py::class_<PyNetP2PWork>(m, "NetP2PWork")
      .def(
          "wait",
          [](PyNetP2PWork& w, std::optional<double> timeout) {
            bool done;
            {
              py::gil_scoped_release nogil;
              done = w.engine->wait(*w.batch, timeout ? *timeout : -1.0);
            }
            if (!done)
              throw CollectiveTimeout(str_cat(
                  "Work.wait: point-to-point operations not complete after ", *timeout, " s"));
            return true;
          },
          py::arg("timeout") = py::none())
      .def("is_completed", [](const PyNetP2PWork& w) { return w.batch->done.load(); })
      .def_property_readonly("seq", [](const PyNetP2PWork&) { return 0; });

  py::class_<PyNetP2P> net_p2p(m, "NetP2P");
  // start() takes the ops as _C.check_p2p describes them (the gloo engine takes the arrays).
  net_p2p.attr("takes_arrays") = false;
  net_p2p
      .def(py::init([](py::object comm, double timeout, size_t block_bytes, size_t inline_bytes) {
             return PyNetP2P{comm, std::make_shared<NetP2P>(mpi_comm_of(comm), timeout, block_bytes,
                                                            inline_bytes)};
           }),
           py::arg("comm"), py::arg("timeout"), py::arg("block_bytes") = size_t{1} << 30,
           py::arg("inline_bytes") = NetP2P::kDefaultInlineBytes)
      .def_property(
          "timeout", [](const PyNetP2P& p) { return p.engine->timeout(); },
          [](PyNetP2P& p, double s) { p.engine->set_timeout(s); })
      .def_property_readonly("tag_ub", [](const PyNetP2P& p) { return p.engine->tag_ub(); })
      .def_property_readonly("error",
                             [](const PyNetP2P& p) -> std::optional<std::string> {
                               std::string why = p.engine->poison_reason();
                               if (why.empty()) return std::nullopt;
                               return why;
                             })
      .def(
          "start",
          [](PyNetP2P& p, const std::vector<DescribedOp>& described) {
            const std::vector<P2POp> ops = net_ops(described);
            py::gil_scoped_release nogil;
            return PyNetP2PWork{p.engine, p.engine->start(ops)};
          },
          py::arg("ops"))
      .def(
          "set_nodes",
          [](PyNetP2P& p, const std::vector<int>& node_of, int node) {
            p.away.assign(node_of.size(), 0);
            for (size_t r = 0; r < node_of.size(); ++r) p.away[r] = node_of[r] != node;
          },
          py::arg("node_of"), py::arg("node"), "which ranks run_away may take: other nodes'")
      .def(
          "run_away",
          [](PyNetP2P& p, py::handle ops_obj, int rank, int size) {
            py::list arrays;  // what the checks made of the arrays, alive until done
            const std::vector<P2POp> ops = pyargs::parse_p2p(ops_obj, rank, size, arrays);
            for (const P2POp& o : ops)
              if (static_cast<size_t>(o.peer) >= p.away.size() || !p.away[o.peer]) return false;
            py::gil_scoped_release nogil;
            const auto batch = p.engine->start(ops, /*waited=*/true);
            p.engine->wait(*batch, -1.0);
            return true;
          },
          py::arg("ops"), py::arg("rank"), py::arg("size"),
          "run() on P2POps, each checked as the host path checks it, where every peer is on "
          "another node (set_nodes); else False, nothing posted")
      .def(
          "abort",
          [](PyNetP2P& p, const std::string& reason) {
            py::gil_scoped_release nogil;
            p.engine->abort(reason);
          },
          py::arg("reason"))
      .def("close", [](PyNetP2P& p) {
        py::gil_scoped_release nogil;
        p.engine->close();
      });
}
