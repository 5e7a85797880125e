// Error types. Each maps 1:1 onto a Python exception class in the bindings.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace pycoll {

// A collective could not complete (dead peer, corrupted shared state, OS failure).
struct CollectiveError : std::runtime_error {
  using std::runtime_error::runtime_error;
};
// A bounded wait ran out.
struct CollectiveTimeout : CollectiveError {
  using CollectiveError::CollectiveError;
};
// Ranks disagree on the collective they are running.
struct CollectiveMismatch : CollectiveError {
  using CollectiveError::CollectiveError;
};
// Bad arguments, found before any byte moved (Python: ValueError).
struct InvalidArgument : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};
// Wrong kind of object or element type (Python: TypeError).
struct InvalidType : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

template <class... Args>
std::string str_cat(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}

}  // namespace pycoll

// Internal invariant check that carries file:line.
#define PYCOLL_CHECK(cond, ...)                                                   \
  do {                                                                            \
    if (!(cond))                                                                  \
      throw ::pycoll::CollectiveError(::pycoll::str_cat(                          \
          __FILE__, ":", __LINE__, ": check failed: " #cond " ", ##__VA_ARGS__)); \
  } while (0)
