#pragma once

#include <cstdint>
#include <functional>
#include <thread>
#include <type_traits>
#include <vector>

namespace layercast {

// Runs `work(i)` for every i in [0, n) at once, a thread each, and returns
// their results in order (nothing for void work) once all are done: the one way this project calls
// every shard of a set at a time (connecting, publishing, checkpointing,
// handing a commit on), where each call's time is the network's and the
// set is a few dozen shards at most. A thread each rather than a pool, so
// no call waits behind a slow one.
template <typename Work>
auto FanOut(uint32_t n, const Work& work) {
  using Result = std::invoke_result_t<Work, uint32_t>;
  if constexpr (std::is_void_v<Result>) {
    std::vector<std::jthread> threads;
    threads.reserve(n);
    for (uint32_t i = 0; i < n; ++i) threads.emplace_back([&work, i] { work(i); });
  } else {
    // Its bits share words, which threads may not write at once.
    static_assert(!std::is_same_v<Result, bool>, "return something other than bool");
    std::vector<Result> results(n);
    {
      std::vector<std::jthread> threads;
      threads.reserve(n);
      for (uint32_t i = 0; i < n; ++i) {
        threads.emplace_back([&results, &work, i] { results[i] = work(i); });
      }
    }  // joins
    return results;
  }
}

}  // namespace layercast
