#pragma once

// Real layercast-shard processes on 127.0.0.1 for the GPU tests, as the
// integration tests run them.

#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "tools/local_shard_set.h"

namespace layercast::gpu {

inline constexpr char kTestPolicy[] = "c=bf16;*norm*=f32";

class TestShards {
 public:
  TestShards(uint32_t n, const std::string& model, const std::string& policy = kTestPolicy) {
    tools::LocalShardSet::Options options;
    options.shard_binary = LAYERCAST_SHARD_BINARY;
    options.num_shards = n;
    options.extra_flags = {"--synthetic", model, "--policy", policy};
    auto shards = tools::LocalShardSet::Start(options);
    EXPECT_TRUE(shards.ok()) << shards.status();
    if (shards.ok()) shards_ = *std::move(shards);
  }

  // Empty if the shards did not start (the test has failed already).
  const std::vector<std::string>& addresses() const {
    static const std::vector<std::string> kNone;
    return shards_ != nullptr ? shards_->addresses() : kNone;
  }

 private:
  std::unique_ptr<tools::LocalShardSet> shards_;
};

}  // namespace layercast::gpu
