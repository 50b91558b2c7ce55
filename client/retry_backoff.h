#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <optional>
#include <random>
#include <string>

namespace layercast::client {

// How long the worker library waits before each retry of a call to a shard,
// in every retry loop (gathers, pushes, clip scales, connecting, a mirror
// following the set): from `first`, doubling to at most `cap`, each wait
// drawn from [half, full] so that workers that failed together do not retry
// in lockstep. A loop gives up when the next wait would end past its
// deadline (GivesUpBefore): the one margin.
//
// Not thread-safe: one per loop.
class RetryBackoff {
 public:
  static constexpr std::chrono::milliseconds kFirst{50};
  static constexpr std::chrono::milliseconds kCap{2000};

  explicit RetryBackoff(std::chrono::milliseconds first = kFirst,
                        std::chrono::milliseconds cap = kCap)
      : first_(first), cap_(cap) {}

  // The wait before the next attempt; each call doubles the next.
  std::chrono::milliseconds Next() {
    // Seeded at the first retry: a gather holds one of these per shard, and
    // most never retry.
    if (!rng_) rng_.emplace(std::random_device{}());
    const int64_t full =
        std::min<int64_t>(cap_.count(), first_.count() << std::min<uint32_t>(attempts_++, 20));
    return std::chrono::milliseconds(std::uniform_int_distribution<int64_t>(full / 2, full)(*rng_));
  }
  // After a success: the next wait is `first` again.
  void Reset() { attempts_ = 0; }

  // Whether waiting `wait` from now ends at or past `deadline`.
  template <typename Clock, typename Duration>
  static bool GivesUpBefore(std::chrono::milliseconds wait,
                            std::chrono::time_point<Clock, Duration> deadline) {
    return Clock::now() + wait >= deadline;
  }

 private:
  const std::chrono::milliseconds first_;
  const std::chrono::milliseconds cap_;
  uint32_t attempts_ = 0;
  std::optional<std::mt19937_64> rng_;
};

// The shard set's channels' service config: gRPC itself retries the
// read-only unary calls of ShardService (GetManifest, WaitVersion,
// GetCastError, GetGradientNorm) on UNAVAILABLE, the code of a connection
// that dropped or a shard that is not ready, with RetryBackoff's first wait
// and cap, up to 4 attempts. The loops above it still wait out what gRPC's
// retries cannot: a shard loading for minutes, a step waiting for pushes,
// a publish in another's hands.
std::string UnaryRetryServiceConfig();

}  // namespace layercast::client
