// Line coverage (make coverage, PYCOLL_COVERAGE=ON): gcov writes a process's counts from an
// exit handler, which a process that ends with _exit() or is ended by MPI_Abort never runs: the
// survivors of a fault drill, the very code paths that handle the fault. Such a process calls
// the module's _coverage_dump() first. Each extension module carries its own gcov runtime, so
// each binds its own.
#pragma once

#ifdef PYCOLL_COVERAGE
extern "C" void __gcov_dump(void);
#define PYCOLL_BIND_COVERAGE_DUMP(m) (m).def("_coverage_dump", [] { __gcov_dump(); })
#else
#define PYCOLL_BIND_COVERAGE_DUMP(m) static_cast<void>(m)
#endif
