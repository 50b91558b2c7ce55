#include <cstdio>

#include <grpcpp/grpcpp.h>

#include "absl/strings/str_cat.h"
#include "layercast/v1/admin.grpc.pb.h"
#include "platform/byte_size.h"
#include "platform/fan_out.h"
#include "platform/status_macros.h"
#include "programs/layercast/admin_calls.h"
#include "programs/layercast/commands.h"
#include "programs/layercast/connect.h"
#include "wire/grpc_status.h"

namespace layercast::cli {
namespace {

absl::StatusOr<layercast::v1::CheckpointResponse> CheckpointOne(const AdminCalls& calls,
                                                                const AdminTarget& target,
                                                                std::chrono::seconds timeout) {
  auto stub = layercast::v1::ShardAdmin::NewStub(target.channel);
  RETURN_IF_ERROR(Connect(target, calls.connect_timeout, [&](grpc::ClientContext& probe) {
    layercast::v1::CheckpointResponse ignored;
    return stub->Checkpoint(&probe, {}, &ignored);
  }));
  const auto context = AdminContext(calls.token, timeout);
  layercast::v1::CheckpointResponse response;
  const grpc::Status status = stub->Checkpoint(context.get(), {}, &response);
  if (!status.ok()) return wire::FromGrpcStatus(status, target.describe);
  return response;
}

}  // namespace

absl::Status RunCheckpoint(const std::vector<std::string>& args) {
  ASSIGN_OR_RETURN(
      tools::CliFlags flags,
      tools::CliFlags::Parse(args, WithShardSetFlags({"token-file", "timeout-seconds"}),
                             /*switches=*/{"insecure"}));
  ASSIGN_OR_RETURN(const AdminCalls calls, AdminCallsFromFlags(flags));
  ASSIGN_OR_RETURN(uint64_t timeout_s, flags.GetUint("timeout-seconds", 3600));
  // Every shard writes at once: the checkpoint takes as long as the slowest.
  const std::vector<absl::StatusOr<layercast::v1::CheckpointResponse>> answers =
      FanOut(static_cast<uint32_t>(calls.targets.size()), [&](uint32_t i) {
        return CheckpointOne(calls, calls.targets[i], std::chrono::seconds(timeout_s));
      });
  for (const auto& answer : answers) {
    if (!answer.ok()) continue;
    std::printf("shard %u/%u  version %llu  %s in %.2f s  %s  %s\n", answer->shard_index(),
                answer->num_shards(), static_cast<unsigned long long>(answer->version()),
                FormatBytes(answer->bytes()).c_str(), answer->seconds(), answer->path().c_str(),
                answer->checksum().c_str());
  }
  return FirstError(answers);
}

}  // namespace layercast::cli
