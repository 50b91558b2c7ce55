// Loading a checkpoint resharded (issue 68): the checkpoint 4 shards wrote,
// loaded by 8 shards (each reads its half of one file's ranges and checks
// the blocks it read) against 4 shards loading their own files (each reads
// and hashes its whole file), in the same run. Each shard of a set loads in
// turn on this machine, as it would on a machine of its own: the set's
// start-up time is its slowest shard's. Goal: 8 at most 1.2x the time of 4.
//
//   reshard_bench [--spec llama:layers=8,hidden=1024,ffn=2816,vocab=8192]
//                 [--rounds 3] [--dir DIR]
//
// The files are read from the page cache after the first round: the ratio
// is of the CPU and memory work (reads, CRC-32C against SHA-256), not the
// disk's; on a cold disk each shard of 8 reads half the bytes one of 4 does.

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/policy.h"
#include "core/synthetic_model.h"
#include "platform/byte_size.h"
#include "platform/status_macros.h"
#include "server/checkpoints/checkpoint_format.h"
#include "server/checkpoints/checkpoint_reshard.h"
#include "server/checkpoints/checkpoint_source.h"
#include "server/checkpoints/checkpoint_writer.h"
#include "server/serving/parameter_store.h"

namespace layercast::server {
namespace {

constexpr uint32_t kFrom = 4;
constexpr uint32_t kTo = 8;

// One shard's load: open, read its ranges into the master, verify.
absl::StatusOr<double> LoadShard(const std::string& dir, const SyntheticModel& model,
                                 const Policy& policy, uint32_t index, uint32_t count) {
  const auto start = std::chrono::steady_clock::now();
  ASSIGN_OR_RETURN(const ContentFingerprint fingerprint, model.Fingerprint());
  std::unique_ptr<CheckpointState> checkpoint;
  if (count == kFrom) {
    ASSIGN_OR_RETURN(checkpoint,
                     CheckpointSource::Open(CheckpointPath(dir, index, count), model.model(), index,
                                            count, policy, fingerprint));
  } else {
    ASSIGN_OR_RETURN(checkpoint, ReshardedCheckpoint::Open(dir, kFrom, model.model(), index, count,
                                                           policy, fingerprint));
  }
  ASSIGN_OR_RETURN(auto store, ParameterStore::Load(*checkpoint, index, count, policy));
  RETURN_IF_ERROR(checkpoint->VerifyChecksum());
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// The slowest shard's seconds of a set of `count`.
absl::StatusOr<double> LoadSet(const std::string& dir, const SyntheticModel& model,
                               const Policy& policy, uint32_t count) {
  double slowest = 0;
  for (uint32_t i = 0; i < count; ++i) {
    ASSIGN_OR_RETURN(const double seconds, LoadShard(dir, model, policy, i, count));
    slowest = std::max(slowest, seconds);
  }
  return slowest;
}

absl::Status Run(const std::string& spec, int rounds, std::string dir) {
  ASSIGN_OR_RETURN(auto model, SyntheticModel::Create(spec));
  ASSIGN_OR_RETURN(const Policy policy, Policy::Parse("p=f32,c=bf16"));
  const bool own_dir = dir.empty();
  if (own_dir) {
    dir = (std::filesystem::temp_directory_path() / absl::StrCat("reshard-bench-", getpid()))
              .string();
  }
  std::filesystem::create_directories(dir);
  uint64_t bytes = 0;
  for (uint32_t i = 0; i < kFrom; ++i) {
    ASSIGN_OR_RETURN(auto store, ParameterStore::Load(*model, i, kFrom, policy));
    ASSIGN_OR_RETURN(const CheckpointInfo info, WriteCheckpoint(*store, 0, dir));
    bytes += info.bytes;
  }
  std::printf("checkpoint of %u shards: %s in %s\n", kFrom, FormatBytes(bytes).c_str(),
              dir.c_str());
  std::vector<double> own, resharded;
  for (int r = 0; r < rounds; ++r) {
    ASSIGN_OR_RETURN(const double a, LoadSet(dir, *model, policy, kFrom));
    ASSIGN_OR_RETURN(const double b, LoadSet(dir, *model, policy, kTo));
    own.push_back(a);
    resharded.push_back(b);
    std::printf("round %d: %u shards from their own files %.3f s, %u shards resharded %.3f s\n",
                r + 1, kFrom, a, kTo, b);
  }
  std::sort(own.begin(), own.end());
  std::sort(resharded.begin(), resharded.end());
  const double a = own[own.size() / 2], b = resharded[resharded.size() / 2];
  std::printf(
      "median slowest shard: %u own %.3f s, %u resharded %.3f s: ratio %.2fx (goal <= 1.20x)\n",
      kFrom, a, kTo, b, b / a);
  if (own_dir) std::filesystem::remove_all(dir);
  return absl::OkStatus();
}

}  // namespace
}  // namespace layercast::server

int main(int argc, char** argv) {
  std::string spec = "llama:layers=8,hidden=1024,ffn=2816,vocab=8192";
  std::string dir;
  int rounds = 3;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--spec") {
      spec = argv[i + 1];
    } else if (flag == "--rounds") {
      rounds = std::max(1, std::atoi(argv[i + 1]));
    } else if (flag == "--dir") {
      dir = argv[i + 1];
    } else {
      std::fprintf(stderr, "usage: reshard_bench [--spec S] [--rounds N] [--dir DIR]\n");
      return 1;
    }
  }
  const absl::Status status = layercast::server::Run(spec, rounds, dir);
  if (!status.ok()) {
    std::fprintf(stderr, "reshard_bench: %s\n", std::string(status.message()).c_str());
    return 1;
  }
  return 0;
}
