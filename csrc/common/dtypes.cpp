#include "common/dtypes.h"

namespace pycoll {

size_t dtype_size(DType t) {
  switch (t) {
    case DType::Int8:
    case DType::UInt8:
      return 1;
    case DType::Float16:
    case DType::BFloat16:
      return 2;
    case DType::Int32:
    case DType::Float32:
      return 4;
    case DType::Int64:
    case DType::Float64:
      return 8;
  }
  return 0;
}

size_t acc_size(DType t) {
  return (t == DType::Float16 || t == DType::BFloat16) ? 4 : dtype_size(t);
}

bool is_floating(DType t) {
  return t == DType::Float16 || t == DType::BFloat16 || t == DType::Float32 || t == DType::Float64;
}

const char* dtype_name(DType t) {
  static const char* names[] = {"int8",    "uint8",    "int32",   "int64",
                                "float16", "bfloat16", "float32", "float64"};
  int i = static_cast<int>(t);
  return (i >= 0 && i < kNumDTypes) ? names[i] : "?";
}

const char* redop_name(RedOp op) {
  static const char* names[] = {"sum", "prod", "min", "max", "avg"};
  int i = static_cast<int>(op);
  return (i >= 0 && i < kNumRedOps) ? names[i] : "?";
}

bool valid_dtype(int t) { return t >= 0 && t < kNumDTypes; }
bool valid_redop(int op) { return op >= 0 && op < kNumRedOps; }

}  // namespace pycoll
