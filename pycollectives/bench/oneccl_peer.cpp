// oneCCL as a pycoll-bench peer: a few C entry points over oneCCL's own C++ API (oneapi/ccl.hpp),
// compiled by pycollectives.bench.oneccl against the installed oneccl-cpu-devel package and
// called through ctypes on the same buffers and in the same timing loop as every other peer.
// Nothing of pycollectives is linked in.
//
// Rendezvous: rank 0 creates oneCCL's main key-value store and hands its address out (the
// caller broadcasts it with MPI); every rank then creates the communicator. Each call returns 0,
// or -1 with the exception's text left for occl_error().

#include <cstring>
#include <memory>
#include <string>

#include "oneapi/ccl.hpp"

namespace {

std::shared_ptr<ccl::kvs> g_kvs;
std::unique_ptr<ccl::communicator> g_comm;
std::string g_error;

template <class F>
int guarded(F&& f) {
  try {
    f();
    return 0;
  } catch (const std::exception& e) {
    g_error = e.what();
  } catch (...) {
    g_error = "unknown exception";
  }
  return -1;
}

}  // namespace

extern "C" {

const char* occl_error() { return g_error.c_str(); }

int occl_version(int* major, int* minor, int* update) {
  return guarded([&] {
    auto v = ccl::get_library_version();
    *major = v.major;
    *minor = v.minor;
    *update = v.update;
  });
}

// Rank 0: creates the main store and writes its address (at most *len bytes; *len is set).
int occl_main_kvs(char* addr, size_t* len) {
  return guarded([&] {
    ccl::init();
    g_kvs = ccl::create_main_kvs();
    auto a = g_kvs->get_address();
    if (a.size() > *len) throw std::runtime_error("kvs address buffer too small");
    std::memcpy(addr, a.data(), a.size());
    *len = a.size();
  });
}

// Other ranks: attach to rank 0's store from its address.
int occl_kvs(const char* addr, size_t len) {
  return guarded([&] {
    ccl::init();
    ccl::kvs::address_type a;
    if (len > a.size()) throw std::runtime_error("kvs address too long");
    std::memcpy(a.data(), addr, len);
    g_kvs = ccl::create_kvs(a);
  });
}

int occl_comm(int size, int rank) {
  return guarded([&] {
    g_comm = std::make_unique<ccl::communicator>(ccl::create_communicator(size, rank, g_kvs));
  });
}

int occl_allreduce(const void* x, void* y, size_t count, int dtype, int op) {
  return guarded([&] {
    ccl::allreduce(x, y, count, ccl::datatype(dtype), ccl::reduction(op), *g_comm).wait();
  });
}

int occl_allgather(const void* x, void* y, size_t send_count, int dtype) {
  return guarded([&] { ccl::allgather(x, y, send_count, ccl::datatype(dtype), *g_comm).wait(); });
}

int occl_reduce_scatter(const void* x, void* y, size_t recv_count, int dtype, int op) {
  return guarded([&] {
    ccl::reduce_scatter(x, y, recv_count, ccl::datatype(dtype), ccl::reduction(op), *g_comm).wait();
  });
}

int occl_broadcast(void* x, size_t count, int dtype, int root) {
  return guarded([&] { ccl::broadcast(x, count, ccl::datatype(dtype), root, *g_comm).wait(); });
}

int occl_reduce(const void* x, void* y, size_t count, int dtype, int op, int root) {
  return guarded([&] {
    ccl::reduce(x, y, count, ccl::datatype(dtype), ccl::reduction(op), root, *g_comm).wait();
  });
}

void occl_close() {
  g_comm.reset();
  g_kvs.reset();
}

}  // extern "C"
