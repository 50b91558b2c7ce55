#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <optional>
#include <random>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "platform/clock.h"

namespace layercast::platform {

// A set of status codes, one bit per code (absl's codes are gRPC's, 0-16).
constexpr uint32_t StatusCodes(std::initializer_list<absl::StatusCode> codes) {
  uint32_t set = 0;
  for (const absl::StatusCode code : codes) set |= uint32_t{1} << static_cast<int>(code);
  return set;
}
// Every code but OK: a loop that retries whatever went wrong.
inline constexpr uint32_t kEveryError = ~uint32_t{1};

// The rule of one kind of retry loop: which failures are worth another
// attempt, how many attempts at most (the first included), and the waits
// between them: from `first_wait` doubling to `max_wait`, each drawn from
// [half, full] so that callers that failed together do not retry in
// lockstep. Every loop also has a deadline, and gives up when the next wait
// would end at or past it: the one margin.
struct RetryPolicy {
  uint32_t retry_on = 0;  // StatusCodes(...)
  int max_attempts = 1;
  std::chrono::milliseconds first_wait{50};
  std::chrono::milliseconds max_wait{2000};

  bool Retries(const absl::Status& status) const {
    const auto code = static_cast<uint32_t>(status.code());  // a peer may send any number
    return !status.ok() && code < 32 && ((retry_on >> code) & 1) != 0;
  }
};

// A cap no loop bounded by a deadline reaches first (a wait is at least
// 25 ms, and 1 s once grown): the count only keeps such a loop finite when
// its deadline is far away.
inline constexpr int kUntilDeadline = 100000;

// The policies of this project, one per kind of loop, side by side.
//
// Why not gRPC's own retry (the service config's retryPolicy) for all of
// them: gRPC makes at most 5 attempts, each wait drawn from [0, backoff],
// so it cannot reliably wait out a shard that restarts or loads for
// seconds to minutes; it retries a streaming call only while what was sent
// fits its retry buffer (256 KiB), so never a gradient push or a resumed
// gather; and it cannot set a fresh per-attempt deadline or replace a
// channel. It does carry kUnaryCall.

// gRPC's own retry of the shard set's read-only unary calls (the channel's
// service config, client/grpc_retry_config.h): a dropped connection or a
// shard not ready, a few quick attempts under the loops below.
inline constexpr RetryPolicy kUnaryCall{.retry_on = StatusCodes({absl::StatusCode::kUnavailable}),
                                        .max_attempts = 4};
// Connecting to a shard set: a shard unreachable or still loading (an
// attempt cut short by its own 10 s) is asked for its manifest again until
// the connect timeout.
inline constexpr RetryPolicy kConnect{
    .retry_on = StatusCodes({absl::StatusCode::kUnavailable, absl::StatusCode::kDeadlineExceeded}),
    .max_attempts = kUntilDeadline};
// One shard's stream of a gather: the shard died, restarted, is draining
// or loading (UNAVAILABLE, or CANCELLED by its own shutdown), or a chunk
// failed its checksum (DATA_LOSS); resumed until the gather's deadline.
inline constexpr RetryPolicy kGatherStream{
    .retry_on = StatusCodes({absl::StatusCode::kUnavailable, absl::StatusCode::kDataLoss,
                             absl::StatusCode::kCancelled}),
    .max_attempts = kUntilDeadline};
// A worker's gradient push and the clipping calls: the shard went away,
// was busy, or the attempt ran out of time; none of them staged anything,
// so the whole push is sent again until the sink's timeout.
inline constexpr RetryPolicy kGradientPush{
    .retry_on = StatusCodes({absl::StatusCode::kUnavailable, absl::StatusCode::kResourceExhausted,
                             absl::StatusCode::kAborted, absl::StatusCode::kCancelled,
                             absl::StatusCode::kDeadlineExceeded}),
    .max_attempts = kUntilDeadline};
// A publisher's CommitPublish, an idempotent call: the shard was
// unreachable, or an attempt (2 s at most) ran out of time before the
// publish's deadline.
inline constexpr RetryPolicy kPublishCommit{
    .retry_on = StatusCodes({absl::StatusCode::kUnavailable, absl::StatusCode::kDeadlineExceeded}),
    .max_attempts = 20};
// A publisher's BeginPublish: as kPublishCommit, and the shard may also
// be settling a publish whose publisher stopped, which takes a few
// attempts of its own: shorter waits, more of them.
inline constexpr RetryPolicy kPublishBegin{
    .retry_on = StatusCodes({absl::StatusCode::kUnavailable, absl::StatusCode::kDeadlineExceeded}),
    .max_attempts = 60,
    .max_wait = std::chrono::milliseconds(800)};
// Shard 0 handing a commit on to a peer that is restarting, for up to 15 s.
inline constexpr RetryPolicy kPeerCommit{.retry_on = StatusCodes({absl::StatusCode::kUnavailable}),
                                         .max_attempts = 40,
                                         .first_wait = std::chrono::milliseconds(100),
                                         .max_wait = std::chrono::milliseconds(800)};
// A shard settling a publish nobody finishes: the set is asked again about
// once a second, whatever kept it from answering, for up to 10 min.
inline constexpr RetryPolicy kPeerSettle{.retry_on = kEveryError,
                                         .max_attempts = kUntilDeadline,
                                         .first_wait = std::chrono::seconds(1),
                                         .max_wait = std::chrono::seconds(1)};
// A model mirror following its source: a failed poll or update is tried
// again, whatever failed, for as long as it follows (the defaults of
// MirrorOptions::backoff and max_backoff).
inline constexpr RetryPolicy kMirrorFollow{.retry_on = kEveryError,
                                           .max_attempts = kUntilDeadline,
                                           .first_wait = std::chrono::milliseconds(100),
                                           .max_wait = std::chrono::milliseconds(5000)};

// The waits of one retry loop: for loops that cannot block in Retry (a
// gather's streams, a follower that waits on its own condition).
//
// Not thread-safe: one per loop.
class Backoff {
 public:
  explicit Backoff(const RetryPolicy& policy) : Backoff(policy.first_wait, policy.max_wait) {}
  Backoff(std::chrono::milliseconds first, std::chrono::milliseconds max)
      : first_(first), max_(max) {}

  // The wait before the next attempt; each call doubles the next, up to
  // the maximum.
  std::chrono::milliseconds Next();
  // After a success: the next wait is the first again.
  void Reset() { waits_ = 0; }

 private:
  std::chrono::milliseconds first_;
  std::chrono::milliseconds max_;
  uint32_t waits_ = 0;
  // Seeded at the first wait: a gather holds one of these per shard, and
  // most never retry.
  std::optional<std::mt19937_64> rng_;
};

// What a Retry loop waits on, and who hears of each retry.
struct RetryHooks {
  // The clock the deadline is on; never null. Retry waits on it: real time
  // for the steady clock, the test's jumps for a ManualClock.
  Clock* clock = &Clock::Steady();
  // Waits `wait` instead of Retry: false ends the loop (its owner is
  // stopping), which returns the last attempt's status.
  std::function<bool(std::chrono::milliseconds wait)> sleep;
  // Told before each wait: the failed attempt's status and number (from 1),
  // and the wait.
  std::function<void(const absl::Status& failed, int attempt, std::chrono::milliseconds wait)>
      on_retry;
};

// Calls `attempt` (given its number, from 1) until it returns OK, a code
// `policy` does not retry, policy.max_attempts attempts were made, or the
// next wait would end at or past `deadline` (on hooks.clock); returns the
// last attempt's status. Makes at least one attempt. Blocks the calling
// thread for the waits.
absl::Status Retry(const RetryPolicy& policy, Clock::TimePoint deadline,
                   absl::FunctionRef<absl::Status(int attempt)> attempt,
                   const RetryHooks& hooks = {});

// Waits until `clock` reads `until`: real time on the steady clock, jumps
// on a ManualClock.
void SleepUntil(Clock& clock, Clock::TimePoint until);

}  // namespace layercast::platform
