#pragma once

// gather_bench's baseline (a): minimal gRPC servers that stream pre-made
// LayerChunk frames of exactly the bytes and chunks each real shard would
// send, through the same raw FetchLayer path, so that the client side of the
// measurement is identical and the servers do nothing but hand bytes to the
// kernel. Forked before the benchmark creates any gRPC object, so their CPU
// is their own.

#include <sys/types.h>

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace layercast::bench {

struct BaselineProcess {
  pid_t pid = -1;
  int to_child = -1;    // manifest, then end of file to stop
  int from_child = -1;  // its port
};

// Forks `n` baseline servers that wait for their manifests. Must run before
// this process creates any gRPC object.
std::vector<BaselineProcess> ForkBaselines(uint32_t n);

// The running baselines, and the model they serve.
struct BaselineSet {
  std::vector<std::string> addresses;
  std::vector<pid_t> pids;
  uint64_t assembled = 0;  // bytes of every layer, assembled
  size_t num_layers = 0;
};

// Hands baseline i the manifest of the real shard i at `addresses`, whose
// bytes and chunks it then stands in for.
absl::StatusOr<BaselineSet> ServeBaselines(const std::vector<BaselineProcess>& baselines,
                                           const std::vector<std::string>& addresses);

// Stops the baselines (end of file on their pipes) and reaps them.
void StopBaselines(std::vector<BaselineProcess>& children);

}  // namespace layercast::bench
