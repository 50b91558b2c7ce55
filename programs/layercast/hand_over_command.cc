#include <cstdio>
#include <optional>
#include <thread>

#include <grpcpp/grpcpp.h>

#include "absl/strings/str_cat.h"
#include "layercast/v1/admin.grpc.pb.h"
#include "platform/fan_out.h"
#include "platform/status_macros.h"
#include "programs/layercast/admin_calls.h"
#include "programs/layercast/commands.h"
#include "programs/layercast/connect.h"
#include "wire/grpc_status.h"

namespace layercast::cli {
namespace {

constexpr std::chrono::seconds kCallTimeout{30};
// How often a shard not yet at its boundary is asked again.
constexpr std::chrono::milliseconds kPoll{200};

// HandOver on one shard: with `at_version` it freezes the shard there;
// without, it reports how far the freeze has come.
absl::StatusOr<layercast::v1::HandOverResponse> HandOverOne(const AdminCalls& calls,
                                                            const AdminTarget& target,
                                                            std::optional<uint64_t> at_version) {
  auto stub = layercast::v1::ShardAdmin::NewStub(target.channel);
  RETURN_IF_ERROR(Connect(target, calls.connect_timeout, [&](grpc::ClientContext& probe) {
    layercast::v1::HandOverResponse ignored;
    return stub->HandOver(&probe, {}, &ignored);
  }));
  layercast::v1::HandOverRequest request;
  if (at_version) request.set_at_version(*at_version);
  const auto context = AdminContext(calls.token, kCallTimeout);
  layercast::v1::HandOverResponse response;
  const grpc::Status status = stub->HandOver(context.get(), request, &response);
  if (!status.ok()) return wire::FromGrpcStatus(status, target.describe);
  return response;
}

absl::Status UnfreezeOne(const AdminCalls& calls, const AdminTarget& target) {
  auto stub = layercast::v1::ShardAdmin::NewStub(target.channel);
  RETURN_IF_ERROR(Connect(target, calls.connect_timeout, [&](grpc::ClientContext& probe) {
    layercast::v1::UnfreezeResponse ignored;
    return stub->Unfreeze(&probe, {}, &ignored);
  }));
  const auto context = AdminContext(calls.token, kCallTimeout);
  layercast::v1::UnfreezeResponse response;
  const grpc::Status status = stub->Unfreeze(context.get(), {}, &response);
  if (!status.ok()) return wire::FromGrpcStatus(status, target.describe);
  return absl::OkStatus();
}

}  // namespace

absl::Status RunHandOver(const std::vector<std::string>& args) {
  ASSIGN_OR_RETURN(
      tools::CliFlags flags,
      tools::CliFlags::Parse(args, WithShardSetFlags({"token-file", "at-version", "wait-seconds"}),
                             /*switches=*/{"insecure", "unfreeze"}));
  ASSIGN_OR_RETURN(const AdminCalls calls, AdminCallsFromFlags(flags));
  const uint32_t shards = static_cast<uint32_t>(calls.targets.size());
  if (flags.Has("unfreeze")) {
    if (flags.Has("at-version")) {
      return absl::InvalidArgumentError(
          "--unfreeze and --at-version together: freeze with --at-version, or abandon a "
          "hand-over with --unfreeze");
    }
    RETURN_IF_ERROR(FirstError(
        FanOut(shards, [&](uint32_t i) { return UnfreezeOne(calls, calls.targets[i]); })));
    std::printf("%u shard(s) unfrozen: the set trains on\n", shards);
    return absl::OkStatus();
  }
  if (!flags.Has("at-version")) {
    return absl::InvalidArgumentError(
        "--at-version V is required: the version the workers step to next (the old set takes "
        "no push for that step); or --unfreeze to abandon a hand-over");
  }
  ASSIGN_OR_RETURN(const uint64_t at_version, flags.GetUint("at-version", 0));
  ASSIGN_OR_RETURN(const uint64_t wait_s, flags.GetUint("wait-seconds", 600));
  // Every shard freezes at once, then is asked until its steps before the
  // version are done (bounded by --wait-seconds).
  std::vector<absl::StatusOr<layercast::v1::HandOverResponse>> answers =
      FanOut(shards, [&](uint32_t i) { return HandOverOne(calls, calls.targets[i], at_version); });
  RETURN_IF_ERROR(FirstError(answers));
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(wait_s);
  for (uint32_t i = 0; i < shards; ++i) {
    while (!answers[i]->at_boundary()) {
      if (std::chrono::steady_clock::now() >= give_up) {
        return absl::DeadlineExceededError(absl::StrCat(
            calls.targets[i].describe, " is frozen at version ", answers[i]->frozen_at(),
            " but its steps before it are not done after ", wait_s,
            " s (a worker's pushes for them are missing?): run this again to wait, or "
            "--unfreeze to abandon the hand-over"));
      }
      std::this_thread::sleep_for(kPoll);
      answers[i] = HandOverOne(calls, calls.targets[i], std::nullopt);
      RETURN_IF_ERROR(answers[i].status());
    }
  }
  for (const auto& answer : answers) {
    std::printf("shard %u/%u  frozen at version %llu, at its step boundary\n",
                answer->shard_index(), answer->num_shards(),
                static_cast<unsigned long long>(answer->frozen_at()));
  }
  std::printf(
      "the set is frozen: start the new set with --hand-over-from, then move the workers to it\n");
  return absl::OkStatus();
}

}  // namespace layercast::cli
