// pybind11 module pycollectives._net: the inter-node transport over the job's MPI.
//
// Kept apart from _C so that importing pycollectives never loads an MPI library of its own
// choosing: this module is imported only once mpi4py has loaded MPI, for communicators that
// span several nodes. Arguments were validated by the caller (pycollectives/hierarchy.py).
#include <mpi4py/mpi4py.h>
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>
#include <string>

#include "common/errors.h"
#include "core_errors.h"
#include "net/net_comm.h"

namespace py = pybind11;
using namespace pycoll;

namespace {

MPI_Comm mpi_comm_of(py::handle obj) {
  MPI_Comm* c = PyMPIComm_Get(obj.ptr());
  if (c == nullptr) throw py::error_already_set();
  return *c;
}

Collective collective_by_name(const std::string& name) {
  for (int k = 0; k < kNumCollectives; ++k)
    if (name == collective_name(static_cast<Collective>(k))) return static_cast<Collective>(k);
  throw InvalidArgument(str_cat("unknown collective ", name));
}

Algo algo_by_name(const std::string& name) {
  for (int k = 1; k < kNumAlgos; ++k)
    if (name == algo_name(static_cast<Algo>(k))) return static_cast<Algo>(k);
  throw InvalidArgument(str_cat("unknown algorithm ", name));
}

uint8_t* array_data(const py::array& a) {
  return static_cast<uint8_t*>(const_cast<void*>(a.data()));
}

// The communicator object keeps the mpi4py communicator alive as long as we use its handle.
struct PyNetComm {
  py::object keep;
  std::unique_ptr<NetComm> comm;
};

}  // namespace

PYBIND11_MODULE(_net, m) {
  m.doc() = "pycollectives inter-node transport over MPI (private)";
  if (import_mpi4py() < 0) throw py::error_already_set();
  translate_errors_as_core();

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
             int root, int divisor, uint64_t seq) {
            if (!valid_dtype(dtype) || !valid_redop(op))
              throw InvalidArgument("run: bad dtype or op code");
            NetCall call;
            call.collective = collective_by_name(collective);
            call.algo = algo_by_name(algorithm);
            if (!algo_supports(call.algo, call.collective))
              throw InvalidArgument(str_cat(algorithm, " has no ", collective));
            call.dtype = static_cast<DType>(dtype);
            call.op = static_cast<RedOp>(op);
            const size_t esize = dtype_size(call.dtype);
            const size_t n = group.size();
            const size_t in_count =
                call.collective == Collective::ReduceScatter ? count * n : count;
            const size_t out_count = call.collective == Collective::AllGather ? count * n : count;
            if (static_cast<size_t>(x.itemsize()) != esize ||
                static_cast<size_t>(out.itemsize()) != esize ||
                static_cast<size_t>(x.size()) < in_count ||
                static_cast<size_t>(out.size()) < out_count)
              throw InvalidArgument(str_cat(collective, ": buffers do not fit the call"));
            call.group = std::move(group);
            call.in = array_data(x);
            call.out = array_data(out);
            call.count = count;
            call.root = root;
            call.divisor = divisor;
            call.seq = seq;
            py::gil_scoped_release nogil;
            c.comm->run(call);
          },
          py::arg("collective"), py::arg("algorithm"), py::arg("group"), py::arg("x"),
          py::arg("out"), py::arg("count"), py::arg("dtype"), py::arg("op"), py::arg("root"),
          py::arg("divisor"), py::arg("seq"));
}
