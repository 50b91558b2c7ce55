#pragma once

// In-process shard servers on 127.0.0.1 for the GPU tests, as in
// tests/client/layer_stream_server_test.cc.

#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "server/shard_server.h"

namespace layercast::gpu {

inline constexpr char kTestPolicy[] = "c=bf16;*norm*=f32";

class TestShards {
 public:
  TestShards(uint32_t n, const std::string& model) {
    for (uint32_t i = 0; i < n; ++i) {
      layercast::v1::ShardConfig config;
      config.set_listen("127.0.0.1:0");
      config.set_shard_index(i);
      config.set_num_shards(n);
      config.set_synthetic(model);
      config.set_policy(kTestPolicy);
      auto settings = server::ResolveShardConfig(config);
      EXPECT_TRUE(settings.ok()) << settings.status();
      auto server = server::ShardServer::Create(*std::move(settings));
      EXPECT_TRUE(server.ok()) << server.status();
      EXPECT_TRUE((*server)->Start().ok());
      EXPECT_TRUE((*server)->Load(nullptr).ok());
      addresses_.push_back("127.0.0.1:" + std::to_string((*server)->port()));
      servers_.push_back(*std::move(server));
    }
  }
  ~TestShards() {
    for (auto& server : servers_) server->Shutdown(std::chrono::seconds(5));
  }

  const std::vector<std::string>& addresses() const { return addresses_; }

 private:
  std::vector<std::unique_ptr<server::ShardServer>> servers_;
  std::vector<std::string> addresses_;
};

}  // namespace layercast::gpu
