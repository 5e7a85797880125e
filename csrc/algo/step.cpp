#include "algo/step.h"

namespace pycoll {

const char* step_kind_name(StepKind k) {
  switch (k) {
    case StepKind::Send:
      return "send";
    case StepKind::Recv:
      return "recv";
    case StepKind::RecvReduceSend:
      return "recv_reduce_send";
    case StepKind::RecvReduceCopy:
      return "recv_reduce_copy";
    case StepKind::RecvReduceCopySend:
      return "recv_reduce_copy_send";
    case StepKind::RecvCopySend:
      return "recv_copy_send";
    case StepKind::Copy:
      return "copy";
  }
  return "?";
}

}  // namespace pycoll
