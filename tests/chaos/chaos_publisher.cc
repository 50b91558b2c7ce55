// The publisher the fault tests kill: publishes the test model of
// tests/integration/test_model.h, every value nudged, to a shard set, as a
// trainer with its own optimizer would. Its failpoints are armed by the
// environment its test starts it with (platform/failpoint.h).
//
//   chaos_publisher SHARDS TOKEN NUM_LAYERS SEED NUDGE SCRATCH_DIR
//
// Exits 0 once published, 1 with the error on stderr.

#include <cstdio>
#include <cstdlib>
#include <string>

#include "absl/strings/str_split.h"
#include "client/weight_publisher.h"
#include "platform/failpoint.h"
#include "tests/chaos/nudged_model.h"

int main(int argc, char** argv) {
  if (argc != 7) {
    std::fprintf(stderr, "usage: %s SHARDS TOKEN NUM_LAYERS SEED NUDGE SCRATCH_DIR\n", argv[0]);
    return 2;
  }
  using namespace layercast;
  ArmFailPoints(std::getenv("LAYERCAST_FAILPOINT"), std::getenv("LAYERCAST_FAILPOINT_ONCE"));
  const std::vector<std::string> addresses = absl::StrSplit(argv[1], ',');
  const auto values =
      testing::NudgedModel(std::string(argv[6]) + "/model.safetensors", std::atoi(argv[3]),
                           std::strtoull(argv[4], nullptr, 10), std::strtof(argv[5], nullptr));
  client::ShardSetOptions connect;
  connect.connect_timeout = std::chrono::seconds(30);
  auto set = client::ShardSet::Connect(addresses, connect);
  if (!set.ok()) {
    std::fprintf(stderr, "%s\n", set.status().ToString().c_str());
    return 1;
  }
  client::WeightPublisher publisher(**set, {.admin_token = argv[2], .insecure = true});
  client::TensorValues view;
  for (const auto& [name, tensor] : values) view.emplace(name, tensor);
  const absl::StatusOr<client::PublishResult> published = publisher.Publish(view);
  if (!published.ok()) {
    std::fprintf(stderr, "%s\n", published.status().ToString().c_str());
    return 1;
  }
  std::printf("published version %llu\n", static_cast<unsigned long long>(published->version));
  return 0;
}
