// The pause training sees when a set of 2 training shards moves to 4
// (issue 68): a live hand-over (HandOver freezes the 2 at a step boundary,
// 4 new shards fill themselves from them over ShardAdmin.ReadState and
// serve) against a stop-and-load of the same state (the 2 write their
// checkpoints, stop, and 4 start on those files, resharded). Each pause
// runs from the first admin call to the moment a worker is connected to
// the 4, ready to push; both start the 4 processes, so the difference is
// the state's path: over loopback gRPC from memory, or through a file
// written, fsynced and read back. In the same run, on this machine.
//
//   handover_bench [--synthetic SPEC] [--rounds 2]
//
// Every shard runs on this machine: on a machine of its own each new shard
// would fill itself in parallel with the others, as here, but off its own
// cores and network link.

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <future>
#include <string>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/shard_set.h"
#include "layercast/v1/admin.grpc.pb.h"
#include "platform/status_macros.h"
#include "tools/cli_flags.h"
#include "tools/local_shard_set.h"
#include "wire/grpc_status.h"

namespace layercast {
namespace {

using Clock = std::chrono::steady_clock;

constexpr char kToken[] = "handover-bench-admin-token-0123456789abcdef";
constexpr char kOptimizer[] = "adamw:lr=1e-4,weight_decay=0.1;*norm*:weight_decay=0";

struct Args {
  std::string synthetic = "llama:layers=4,hidden=1024,ffn=2816,vocab=8000,seed=3";
  uint64_t rounds = 2;
};

double Seconds(Clock::time_point since) {
  return std::chrono::duration<double>(Clock::now() - since).count();
}

absl::StatusOr<std::unique_ptr<tools::LocalShardSet>> Start(const Args& args, uint32_t count,
                                                            const std::string& token,
                                                            const std::string& dir,
                                                            std::vector<std::string> more) {
  tools::LocalShardSet::Options options;
  options.shard_binary = LAYERCAST_SHARD_BINARY;
  options.num_shards = count;
  options.extra_flags = {
      "--synthetic", args.synthetic,       "--optimizer", kOptimizer,         "--checkpoint-dir",
      dir,           "--admin-token-file", token,         "--peers-insecure", "true"};
  options.extra_flags.insert(options.extra_flags.end(), more.begin(), more.end());
  return tools::LocalShardSet::Start(options);
}

// Waits until the set serves: what a worker's reconnect waits for.
absl::Status Connect(const tools::LocalShardSet& shards) {
  client::ShardSetOptions options;
  options.connect_timeout = std::chrono::seconds(300);
  return client::ShardSet::Connect(shards.addresses(), options).status();
}

// `call` on every shard of `shards` at once, each with the admin token.
template <typename Call>
absl::Status OnEveryShard(const tools::LocalShardSet& shards, Call call) {
  std::vector<std::future<grpc::Status>> calls;
  for (const std::string& address : shards.addresses()) {
    calls.push_back(std::async(std::launch::async, [address, &call] {
      auto admin = layercast::v1::ShardAdmin::NewStub(
          grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
      grpc::ClientContext context;
      context.AddMetadata("authorization", absl::StrCat("Bearer ", kToken));
      return call(*admin, context);
    }));
  }
  for (auto& answered : calls) RETURN_IF_ERROR(wire::FromGrpcStatus(answered.get()));
  return absl::OkStatus();
}

struct Round {
  double live = 0;
  double stop_and_load = 0;
};

absl::StatusOr<Round> RunRound(const Args& args, const std::string& base, uint64_t round) {
  Round measured;
  const std::string token = absl::StrCat(base, "/token");
  {
    // Live: freeze the 2, start the 4 from them, connect.
    const std::string dir = absl::StrCat(base, "/live-", round);
    std::filesystem::create_directories(dir + "/old");
    std::filesystem::create_directories(dir + "/new");
    ASSIGN_OR_RETURN(auto old_set, Start(args, 2, token, dir + "/old", {}));
    RETURN_IF_ERROR(Connect(*old_set));
    const auto start = Clock::now();
    RETURN_IF_ERROR(OnEveryShard(*old_set, [](auto& admin, grpc::ClientContext& context) {
      layercast::v1::HandOverRequest request;
      request.set_at_version(0);
      layercast::v1::HandOverResponse answer;
      return admin.HandOver(&context, request, &answer);
    }));
    ASSIGN_OR_RETURN(auto new_set,
                     Start(args, 4, token, dir + "/new",
                           {"--hand-over-from", absl::StrJoin(old_set->addresses(), ",")}));
    RETURN_IF_ERROR(Connect(*new_set));
    measured.live = Seconds(start);
    RETURN_IF_ERROR(new_set->Stop());
    RETURN_IF_ERROR(old_set->Stop());
  }
  {
    // Stop and load: checkpoint the 2, stop them, start the 4 on their
    // files, connect.
    const std::string dir = absl::StrCat(base, "/stop-", round);
    std::filesystem::create_directories(dir);
    ASSIGN_OR_RETURN(auto old_set,
                     Start(args, 2, token, dir, {"--checkpoint-on-sigterm", "false"}));
    RETURN_IF_ERROR(Connect(*old_set));
    const auto start = Clock::now();
    RETURN_IF_ERROR(OnEveryShard(*old_set, [](auto& admin, grpc::ClientContext& context) {
      layercast::v1::CheckpointResponse answer;
      return admin.Checkpoint(&context, layercast::v1::CheckpointRequest(), &answer);
    }));
    RETURN_IF_ERROR(old_set->Stop());
    ASSIGN_OR_RETURN(auto new_set, Start(args, 4, token, dir, {}));
    RETURN_IF_ERROR(Connect(*new_set));
    measured.stop_and_load = Seconds(start);
    RETURN_IF_ERROR(new_set->Stop());
  }
  return measured;
}

absl::Status Run(int argc, char** argv) {
  ASSIGN_OR_RETURN(tools::CliFlags flags,
                   tools::CliFlags::Parse(std::vector<std::string>(argv + 1, argv + argc),
                                          {"synthetic", "rounds"}));
  Args args;
  args.synthetic = flags.Get("synthetic", args.synthetic);
  ASSIGN_OR_RETURN(args.rounds, flags.GetUint("rounds", args.rounds));
  if (args.rounds == 0 || args.rounds > 20) {
    return absl::InvalidArgumentError("--rounds must be 1-20");
  }
  const std::string base =
      (std::filesystem::temp_directory_path() / absl::StrCat("handover_bench-", getpid())).string();
  std::filesystem::create_directories(base);
  {
    std::FILE* file = std::fopen((base + "/token").c_str(), "w");
    if (file == nullptr) return absl::InternalError("cannot write the admin token file");
    std::fputs(kToken, file);
    std::fclose(file);
    std::filesystem::permissions(
        base + "/token", std::filesystem::perms::owner_read | std::filesystem::perms::owner_write);
  }
  double best_live = 1e30, best_stop = 1e30;
  for (uint64_t round = 0; round < args.rounds; ++round) {
    ASSIGN_OR_RETURN(const Round measured, RunRound(args, base, round));
    std::printf("round %llu: live hand-over %.3f s, checkpoint + stop + resharded load %.3f s\n",
                static_cast<unsigned long long>(round), measured.live, measured.stop_and_load);
    best_live = std::min(best_live, measured.live);
    best_stop = std::min(best_stop, measured.stop_and_load);
  }
  std::printf(
      "%s, AdamW, 2 shards -> 4: pause (best of %llu) live %.3f s, stop-and-load %.3f s: "
      "live is %.2fx the stop-and-load's\n",
      args.synthetic.c_str(), static_cast<unsigned long long>(args.rounds), best_live, best_stop,
      best_live / best_stop);
  std::filesystem::remove_all(base);
  return absl::OkStatus();
}

}  // namespace
}  // namespace layercast

int main(int argc, char** argv) {
  if (absl::Status status = layercast::Run(argc, argv); !status.ok()) {
    std::fprintf(stderr, "handover_bench: %s\n", std::string(status.message()).c_str());
    return 1;
  }
  return 0;
}
