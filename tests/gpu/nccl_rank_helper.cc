// One local rank of the hierarchical gather, as its own process (NCCL wants
// one process per GPU here): the K > 1 test in nccl_test.cc starts K of these.
//
// Usage: nccl_rank_helper RANK NRANKS ID_FILE SHARDS
//   SHARDS: host:port,host:port,... in shard order.
// Exit 0 when every check passed (a summary on stdout); 1 with the error on
// stderr otherwise; 2 on bad usage.

#include <cstdio>
#include <string>

#include "client/shard_set.h"
#include "tests/gpu/gpu_test_util.h"

int main(int argc, char** argv) {
  if (argc != 5) {
    std::fprintf(stderr, "usage: %s RANK NRANKS ID_FILE SHARDS\n", argv[0]);
    return 2;
  }
  const int rank = std::atoi(argv[1]);
  const int nranks = std::atoi(argv[2]);
  auto shards = layercast::client::ParseShardList(argv[4]);
  if (!shards.ok()) {
    std::fprintf(stderr, "%s\n", shards.status().ToString().c_str());
    return 2;
  }
  std::string summary;
  const absl::Status status = layercast::gpu::RunNcclRank(rank, nranks, argv[3], *shards, &summary);
  if (!status.ok()) {
    std::fprintf(stderr, "rank %d of %d: %s\n", rank, nranks, status.ToString().c_str());
    return 1;
  }
  std::printf("%s\n", summary.c_str());
  return 0;
}
