#pragma once

#include <gtest/gtest.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "tests/integration/shard_fixture.h"
#include "tools/local_shard_set.h"

namespace layercast::testing {

// Restarts every shard of a LocalShardSet that dies, as a StatefulSet's
// controller would, from construction until Stop(), and records how each
// died, so that a test can tell its failpoint's death from any other. A
// shard that dies other than by SIGKILL (a sanitizer's abort, an error
// exit) is recorded and left dead: the test fails on it rather than on a
// crash loop. The set must outlive the restarter and, while it runs, no
// one else may reap, kill or restart its shards.
//
// deaths() and Stop() are thread-safe.
class ShardRestarter {
 public:
  struct Death {
    size_t shard;
    int wait_status;  // waitpid(2)'s
  };

  explicit ShardRestarter(tools::LocalShardSet& processes);
  ~ShardRestarter() { Stop(); }

  // Stops restarting (a shard that dies from now on stays dead) and
  // returns once the restarter no longer touches the set.
  void Stop();

  std::vector<Death> deaths() const;

 private:
  void Run(std::stop_token stop);

  tools::LocalShardSet& processes_;
  mutable absl::Mutex mutex_;
  std::vector<Death> deaths_ ABSL_GUARDED_BY(mutex_);
  std::jthread thread_;  // last: it starts once the rest is built
};

// The shard a failpoint spec (NAME@I or NAME@I:N, platform/failpoint.h)
// kills: I.
size_t ShardOf(const std::string& failpoint);

// Fails the test unless the failpoint fired (its LAYERCAST_FAILPOINT_ONCE
// marker `fired` exists) and `deaths` holds one death, of the shard its
// spec `failpoint` names, by SIGKILL.
void ExpectOnlyDeathAt(const std::string& failpoint, const std::string& fired,
                       const std::vector<ShardRestarter::Death>& deaths);

inline ShardRestarter::ShardRestarter(tools::LocalShardSet& processes)
    : processes_(processes), thread_([this](std::stop_token stop) { Run(stop); }) {}

inline void ShardRestarter::Run(std::stop_token stop) {
  const size_t shards = processes_.addresses().size();
  std::vector<bool> dead(shards, false);
  while (!stop.stop_requested()) {
    for (size_t shard = 0; shard < shards; ++shard) {
      if (dead[shard]) continue;
      int wait_status = 0;
      if (!processes_.WaitForExitForTest(shard, std::chrono::milliseconds(20), &wait_status).ok()) {
        continue;
      }
      {
        absl::MutexLock lock(&mutex_);
        deaths_.push_back({shard, wait_status});
      }
      if (!KilledBySigkill(wait_status)) {
        dead[shard] = true;
        continue;
      }
      const absl::Status restarted = processes_.RestartForTest(shard);
      EXPECT_TRUE(restarted.ok()) << "shard " << shard << ": " << restarted;
      if (!restarted.ok()) dead[shard] = true;
    }
  }
}

inline void ShardRestarter::Stop() {
  thread_.request_stop();
  if (thread_.joinable()) thread_.join();
}

inline std::vector<ShardRestarter::Death> ShardRestarter::deaths() const {
  absl::MutexLock lock(&mutex_);
  return deaths_;
}

inline size_t ShardOf(const std::string& failpoint) {
  const size_t at = failpoint.find('@');
  return at == std::string::npos ? SIZE_MAX : std::strtoul(failpoint.c_str() + at + 1, nullptr, 10);
}

inline void ExpectOnlyDeathAt(const std::string& failpoint, const std::string& fired,
                              const std::vector<ShardRestarter::Death>& deaths) {
  EXPECT_TRUE(std::filesystem::exists(fired)) << "the failpoint " << failpoint << " never fired";
  std::string described;
  for (const ShardRestarter::Death& death : deaths) {
    described +=
        "\n  shard " + std::to_string(death.shard) + ": " + DescribeWaitStatus(death.wait_status);
  }
  ASSERT_EQ(deaths.size(), 1u) << "one shard should have died, at " << failpoint
                               << "; the deaths:" << described;
  EXPECT_EQ(deaths[0].shard, ShardOf(failpoint)) << described;
  EXPECT_TRUE(KilledBySigkill(deaths[0].wait_status))
      << "shard " << deaths[0].shard << " died by " << DescribeWaitStatus(deaths[0].wait_status)
      << ", not by the failpoint's SIGKILL";
}

}  // namespace layercast::testing
