#include "host/single_copy.h"

#include <sys/uio.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>

#include "common/errors.h"
#include "common/reduce.h"

namespace pycoll {

bool SingleCopy::eligible(Collective c, Algo algo, size_t bytes) const {
  if (mode_ == CmaMode::Off || state_ == State::Refused || t_.size() != 2) return false;
  return c == Collective::AllGather && (algo == Algo::Direct || algo == Algo::Auto) &&
         bytes >= min_bytes_;
}

void SingleCopy::write(int q, const uint8_t* local, uint64_t remote, size_t bytes) const {
  size_t done = 0;
  const int err = t_.write_into(q, local, remote, bytes, done);
  if (err == 0) return;
  if (!t_.peer_alive(q))
    throw CollectiveError(str_cat("rank ", q, " (pid ", t_.pid_of(q), ") is no longer running"));
  throw CollectiveError(str_cat("writing into rank ", q, "'s output failed: ", std::strerror(err)));
}

// Trades output addresses; on the first call also whether every rank may write every peer.
bool SingleCopy::agree(HostExecutor& ex, const CallBuffers& buf, std::vector<uint64_t>& outputs) {
  const int n = t_.size(), r = t_.rank();
  const uint64_t mine = reinterpret_cast<uint64_t>(buf.output);
  outputs.assign(n, 0);
  ex.exchange(&mine, sizeof mine, reinterpret_cast<uint8_t*>(outputs.data()));
  if (state_ != State::Unknown) return state_ == State::Usable;
  // Probe: an empty write moves nothing but skips the permission check, so read a byte of
  // every peer's output instead (racing with its writes is harmless: the byte is dropped).
  bool ok = true;
  for (int q = 0; q < n && ok; ++q) {
    if (q == r) continue;
    uint8_t byte;
    iovec mine_v{&byte, 1};
    iovec theirs{reinterpret_cast<void*>(outputs[q]), 1};
    errno = EPERM;
    const ssize_t got = mode_ == CmaMode::Fail ? -1
                                               : process_vm_readv(static_cast<pid_t>(t_.pid_of(q)),
                                                                  &mine_v, 1, &theirs, 1, 0);
    if (got != 1) {
      ok = false;
      if (debug_)
        std::fprintf(stderr,
                     "pycollectives INFO rank %d/%d: access to rank %d's memory refused (%s); "
                     "large all-gathers use the staging slots\n",
                     r, n, q, std::strerror(errno));
    }
  }
  const bool all = ex.all_agree(ok);
  state_ = all ? State::Usable : State::Refused;
  return all;
}

bool SingleCopy::all_gather(HostExecutor& ex, const CallBuffers& buf, size_t count) {
  std::vector<uint64_t> outputs;
  if (!agree(ex, buf, outputs)) return false;
  const int n = t_.size(), r = t_.rank();
  const size_t es = buf.elem, per = kBlockBytes;
  const size_t bytes = count * es;
  const size_t base = static_cast<size_t>(r) * bytes;  // our block in every output
  const bool in_place = buf.input == buf.output + base;
  const bool stream = buf.streams();
  for (size_t off = 0; off < bytes; off += per) {
    const size_t len = std::min(per, bytes - off);
    const uint8_t* src = buf.input + off;
    if (!in_place) {
      if (stream)
        stream_copy(buf.output + base + off, src, len);
      else
        copy_bytes(buf.output + base + off, src, len);
    }
    for (int d = 1; d < n; ++d) {
      const int q = (r + d) % n;
      write(q, src, outputs[q] + base + off, len);
    }
  }
  // Every peer has written its block into our output once its word arrives.
  ex.all_agree(true);
  return true;
}

}  // namespace pycoll
