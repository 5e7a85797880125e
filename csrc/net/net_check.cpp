#include "net/net_check.h"

#include <algorithm>
#include <climits>
#include <cstring>

#include "common/errors.h"
#include "runtime/wait.h"

namespace pycoll {
namespace {

constexpr int kCheckTag = 1;  // the duplicate carries nothing else

std::string mpi_error(int code) {
  char msg[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(code, msg, &len) != MPI_SUCCESS) return str_cat("MPI error ", code);
  return std::string(msg, static_cast<size_t>(len));
}

bool mpi_live() {
  int finalized = 1;
  MPI_Finalized(&finalized);
  return finalized == 0;
}

}  // namespace

NetCheck::NetCheck(MPI_Comm comm, double timeout_s) : timeout_s_(timeout_s) {
  int code = MPI_Comm_dup(comm, &comm_);
  if (code == MPI_SUCCESS) code = MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
  if (code == MPI_SUCCESS) code = MPI_Comm_rank(comm_, &rank_);
  if (code == MPI_SUCCESS) code = MPI_Comm_size(comm_, &size_);
  if (code != MPI_SUCCESS)
    throw CollectiveError(str_cat("the check across nodes: ", mpi_error(code)));
}

NetCheck::~NetCheck() { close(); }

void NetCheck::close() {
  if (comm_ == MPI_COMM_NULL) return;
  // After a failure, messages may wait unreceived on either end. Freed, the duplicate's
  // context could be handed to a later communicator, whose receives would take them: it is
  // kept instead (one per failed communicator).
  if (poison_.empty() && mpi_live()) MPI_Comm_free(&comm_);
  comm_ = MPI_COMM_NULL;
  if (poison_.empty()) poison_ = "closed";
}

void NetCheck::fail(const std::string& why) {
  if (poison_.empty()) poison_ = why;
  // Sends still in flight are left to MPI, and their buffer with them: never freed or reused.
  bool in_flight = false;
  for (MPI_Request& r : sends_)
    if (r != MPI_REQUEST_NULL) {
      MPI_Request_free(&r);
      in_flight = true;
    }
  sends_.clear();
  if (in_flight) (void)new std::vector<uint8_t>(std::move(out_));
}

std::vector<std::string> NetCheck::exchange(const std::vector<int>& group, const std::string& what,
                                            const std::string& status, const void* payload,
                                            size_t payload_bytes, void* recv, bool* sizes_ok) {
  if (!poison_.empty())
    throw CollectiveError(str_cat(what,
                                  ": the check across nodes is unusable after an earlier "
                                  "error: ",
                                  poison_));
  const int n = static_cast<int>(group.size());
  const int me = static_cast<int>(std::find(group.begin(), group.end(), rank_) - group.begin());
  PYCOLL_CHECK(me < n, "this rank is not in the column");
  const size_t len = sizeof(uint32_t) + status.size() + payload_bytes;
  PYCOLL_CHECK(len <= INT_MAX && status.size() <= UINT32_MAX, "check message of ", len, " bytes");
  // The message: the status's length, the status, the payload.
  out_.resize(len);
  const auto slen = static_cast<uint32_t>(status.size());
  std::memcpy(out_.data(), &slen, sizeof slen);
  std::memcpy(out_.data() + sizeof slen, status.data(), status.size());
  if (payload_bytes) std::memcpy(out_.data() + sizeof slen + status.size(), payload, payload_bytes);

  auto error = [&](int code, const char* call) {
    const std::string why =
        str_cat(what, ": the check across nodes: ", call, ": ", mpi_error(code));
    fail(why);
    throw CollectiveError(why);
  };
  sends_.assign(static_cast<size_t>(n), MPI_REQUEST_NULL);
  for (int k = 0; k < n; ++k) {
    if (k == me) continue;
    const int code = MPI_Isend(out_.data(), static_cast<int>(len), MPI_BYTE, group[k], kCheckTag,
                               comm_, &sends_[static_cast<size_t>(k)]);
    if (code != MPI_SUCCESS) error(code, "MPI_Isend");
  }
  in_.resize(static_cast<size_t>(n));
  std::vector<char> got(static_cast<size_t>(n), 0);
  got[static_cast<size_t>(me)] = 1;
  int left = n - 1;
  const double timeout_s = timeout_s_.load();
  const auto deadline = deadline_after(timeout_s);
  const auto start = Clock::now();
  Sleeper sleeper;
  for (int spins = 0;; ++spins) {
    bool moved = false;
    for (int k = 0; k < n && left > 0; ++k) {
      if (got[static_cast<size_t>(k)]) continue;
      int flag = 0;
      MPI_Message msg;
      MPI_Status st;
      int code = MPI_Improbe(group[k], kCheckTag, comm_, &flag, &msg, &st);
      if (code != MPI_SUCCESS) error(code, "MPI_Improbe");
      if (!flag) continue;
      int count = 0;
      MPI_Get_count(&st, MPI_BYTE, &count);
      std::vector<uint8_t>& buf = in_[static_cast<size_t>(k)];
      buf.resize(static_cast<size_t>(count));
      code = MPI_Mrecv(buf.data(), count, MPI_BYTE, &msg, MPI_STATUS_IGNORE);
      if (code != MPI_SUCCESS) error(code, "MPI_Mrecv");
      got[static_cast<size_t>(k)] = 1;
      --left;
      moved = true;
    }
    int sent = 0;
    const int code = MPI_Testall(n, sends_.data(), &sent, MPI_STATUSES_IGNORE);
    if (code != MPI_SUCCESS) error(code, "MPI_Testall");
    if (left == 0 && sent) break;
    if (moved) sleeper.reset();
    if (spins < 256) {
      PYCOLL_CPU_RELAX();
      continue;
    }
    const auto now = Clock::now();
    if (now >= deadline) {
      std::string missing;
      for (int k = 0; k < n; ++k)
        if (!got[static_cast<size_t>(k)]) missing += str_cat(missing.empty() ? "" : ", ", group[k]);
      const std::string why =
          missing.empty()
              ? str_cat(what, ": the check across nodes timed out after ", timeout_s,
                        " s: its messages were not taken")
              : str_cat(what, ": the check across nodes timed out after ", timeout_s, " s: rank ",
                        missing,
                        " did not reach it (it has not started the call, or waits for a rank "
                        "of its own node)");
      fail(why);
      throw CollectiveTimeout(why);
    }
    if (now - start >= std::chrono::milliseconds(1) || !Yield::now(now)) sleeper.sleep();
  }
  sends_.clear();

  std::vector<std::string> statuses(static_cast<size_t>(n));
  bool ok = true;
  for (int k = 0; k < n; ++k) {
    if (k == me) {
      statuses[static_cast<size_t>(k)] = status;
      if (payload_bytes && recv != nullptr)
        std::memcpy(static_cast<uint8_t*>(recv) + static_cast<size_t>(k) * payload_bytes, payload,
                    payload_bytes);
      continue;
    }
    const std::vector<uint8_t>& m = in_[static_cast<size_t>(k)];
    uint32_t sl = 0;
    if (m.size() < sizeof sl) {
      ok = false;
      continue;
    }
    std::memcpy(&sl, m.data(), sizeof sl);
    if (m.size() < sizeof sl + sl) {
      ok = false;
      continue;
    }
    statuses[static_cast<size_t>(k)].assign(reinterpret_cast<const char*>(m.data()) + sizeof sl,
                                            sl);
    const size_t rest = m.size() - sizeof sl - sl;
    if (rest != payload_bytes) {
      ok = false;
      continue;
    }
    if (payload_bytes && recv != nullptr)
      std::memcpy(static_cast<uint8_t*>(recv) + static_cast<size_t>(k) * payload_bytes,
                  m.data() + sizeof sl + sl, payload_bytes);
  }
  if (sizes_ok != nullptr) *sizes_ok = ok;
  return statuses;
}

}  // namespace pycoll
