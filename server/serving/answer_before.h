#pragma once

#include <algorithm>
#include <chrono>

namespace layercast::server {

// When a call that waits on the shard (a stream for memory budget, a
// WaitVersion for a version) answers by itself: a tenth of the time left
// before the client's deadline, at most 500 ms, ahead of it, so that the
// shard's own answer (RESOURCE_EXHAUSTED, the version now) reaches the
// client instead of its DEADLINE_EXCEEDED. The one margin of the server;
// steady_clock's max for a call without a deadline. On the clock whose time
// is `now` (the shard's timers' clock).
inline std::chrono::steady_clock::time_point AnswerBefore(
    std::chrono::system_clock::time_point deadline,
    std::chrono::steady_clock::time_point now = std::chrono::steady_clock::now()) {
  using std::chrono::system_clock;
  // gRPC's "no deadline" is the far future; a year ahead counts as none.
  if (deadline >= system_clock::time_point::max() - std::chrono::hours(24 * 365)) {
    return std::chrono::steady_clock::time_point::max();
  }
  const auto remaining = std::max(deadline - system_clock::now(), system_clock::duration::zero());
  const auto margin =
      std::min<system_clock::duration>(std::chrono::milliseconds(500), remaining / 10);
  return now + std::chrono::duration_cast<std::chrono::steady_clock::duration>(remaining - margin);
}

}  // namespace layercast::server
