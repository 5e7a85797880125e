// Element types and reduction operators, erased to small enums at the API edge.
#pragma once

#include <cstddef>
#include <cstdint>

namespace pycoll {

enum class DType : int {
  Int8 = 0,
  UInt8 = 1,
  Int32 = 2,
  Int64 = 3,
  Float16 = 4,
  BFloat16 = 5,
  Float32 = 6,
  Float64 = 7,
};
constexpr int kNumDTypes = 8;

enum class RedOp : int { Sum = 0, Prod = 1, Min = 2, Max = 3, Avg = 4 };
constexpr int kNumRedOps = 5;

size_t dtype_size(DType t);
// Size of the type partial sums travel in: float32 for the 16-bit floats.
size_t acc_size(DType t);
bool is_floating(DType t);
const char* dtype_name(DType t);
const char* redop_name(RedOp op);
bool valid_dtype(int t);
bool valid_redop(int op);

}  // namespace pycoll
