#include "host/fault_board.h"

#include <cstring>

#include "common/errors.h"

namespace pycoll {

void FaultBoard::revoke() const { t_.revoked(t_.rank()).store(1, std::memory_order_release); }

std::vector<BoardEntry> FaultBoard::exchange(uint64_t value, const std::string& payload,
                                             double timeout_s) {
  if (payload.size() > kBoardPayloadBytes)
    throw InvalidArgument(str_cat("a board entry holds at most ", kBoardPayloadBytes,
                                  " bytes, got ", payload.size()));
  const int me = t_.rank();
  const uint64_t round = t_.ft_round(me).load(std::memory_order_relaxed) + 1;
  FtSlot& mine = t_.ft_slot(me, round);
  mine.round = round;
  mine.value = value;
  mine.bytes = payload.size();
  if (!payload.empty()) std::memcpy(mine.payload, payload.data(), payload.size());
  t_.ft_round(me).store(round, std::memory_order_release);

  WaitContext w = WaitContext::start("agreement", round, timeout_s, nullptr, nullptr);
  std::vector<BoardEntry> entries;
  for (int r = 0; r < t_.size(); ++r) {
    bool took_part = true;
    if (r != me) {
      auto& posted = t_.ft_round(r);
      // Liveness first: once a rank has exited, its round flag is final.
      wait_until(
          [&] { return posted.load(std::memory_order_acquire) >= round || !t_.peer_alive(r); }, w,
          r, WaitFor::Arrival);
      took_part = posted.load(std::memory_order_acquire) >= round;
    }
    if (!took_part) continue;
    const FtSlot& s = t_.ft_slot(r, round);
    if (s.round != round || s.bytes > kBoardPayloadBytes)
      throw CollectiveError(str_cat("agreement round ", round, ": rank ", r,
                                    "'s board slot holds round ", s.round, " (corrupt board)"));
    entries.push_back({r, s.value, std::string(reinterpret_cast<const char*>(s.payload), s.bytes)});
  }
  return entries;
}

}  // namespace pycoll
