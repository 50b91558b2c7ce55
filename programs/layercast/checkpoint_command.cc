#include <cstdio>
#include <thread>

#include <grpcpp/grpcpp.h>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "client/bearer_token.h"
#include "client/shard_set.h"
#include "layercast/v1/admin.grpc.pb.h"
#include "platform/byte_size.h"
#include "platform/fan_out.h"
#include "platform/file_system.h"
#include "platform/secret_file.h"
#include "platform/status_macros.h"
#include "programs/layercast/commands.h"
#include "programs/layercast/connect.h"
#include "wire/grpc_status.h"

namespace layercast::cli {
namespace {

// A token file holds one token and perhaps a newline.
constexpr uint64_t kMaxTokenFileBytes = 8192;

absl::StatusOr<std::string> ReadToken(const std::string& path) {
  ASSIGN_OR_RETURN(auto file, DefaultFileSystem().OpenForRead(path));
  RETURN_IF_ERROR(CheckSecretFilePermissions(*file, "token-file"));
  if (file->size() == 0 || file->size() > kMaxTokenFileBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("--token-file ", path, " is ", file->size(), " bytes; expected one token"));
  }
  std::string token(file->size(), '\0');
  RETURN_IF_ERROR(
      file->ReadAt(0, std::span<uint8_t>(reinterpret_cast<uint8_t*>(token.data()), token.size())));
  return client::CleanBearerToken(token, absl::StrCat("--token-file ", path));
}

struct Target {
  std::string describe;  // "shard i (host:port)"
  std::string address;   // "host:port"
  std::shared_ptr<grpc::Channel> channel;
};

absl::StatusOr<layercast::v1::CheckpointResponse> CheckpointOne(
    const Target& target, const std::string& token, std::chrono::milliseconds connect_timeout,
    std::chrono::seconds timeout) {
  if (!target.channel->WaitForConnected(std::chrono::system_clock::now() + connect_timeout)) {
    // One call that fails at once says why: nothing listens, no such host,
    // or (a connection that never became a channel) TLS.
    grpc::ClientContext probe;
    probe.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(1));
    layercast::v1::CheckpointResponse ignored;
    const grpc::Status failed =
        layercast::v1::ShardAdmin::NewStub(target.channel)->Checkpoint(&probe, {}, &ignored);
    const std::string cause = client::UnreachableCause(failed.error_message(), target.address);
    return absl::UnavailableError(absl::StrCat(
        target.describe, " did not accept a connection within ", connect_timeout.count(), " ms: ",
        cause.empty() ? "is it running, and do --tls-ca-file/--tls-cert-file match its TLS "
                        "settings?"
                      : cause));
  }
  auto stub = layercast::v1::ShardAdmin::NewStub(target.channel);
  grpc::ClientContext context;
  context.AddMetadata("authorization", absl::StrCat("Bearer ", token));
  context.set_deadline(std::chrono::system_clock::now() + timeout);
  layercast::v1::CheckpointResponse response;
  const grpc::Status status = stub->Checkpoint(&context, {}, &response);
  if (!status.ok()) return wire::FromGrpcStatus(status, target.describe);
  return response;
}

}  // namespace

absl::Status RunCheckpoint(const std::vector<std::string>& args) {
  ASSIGN_OR_RETURN(
      tools::CliFlags flags,
      tools::CliFlags::Parse(args, WithShardSetFlags({"token-file", "timeout-seconds"}),
                             /*switches=*/{"insecure"}));
  if (!flags.Has("token-file")) {
    return absl::InvalidArgumentError(
        "--token-file FILE is required: the file holding the shards' admin token (their "
        "--admin-token-file)");
  }
  ASSIGN_OR_RETURN(std::vector<std::string> addresses, ShardAddressesFromFlags(flags));
  ASSIGN_OR_RETURN(const std::chrono::milliseconds connect_timeout,
                   TimeoutFromFlags(flags, "connect-timeout-ms", 30000));
  ASSIGN_OR_RETURN(uint64_t timeout_s, flags.GetUint("timeout-seconds", 3600));
  ASSIGN_OR_RETURN(std::shared_ptr<grpc::ChannelCredentials> credentials,
                   ChannelCredentialsFromFlags(flags));
  // Whoever reads the token off the wire can write checkpoints, and later
  // push parameters: plaintext is for loopback, and must be asked for.
  RETURN_IF_ERROR(
      client::CheckTokenTransport(credentials != nullptr, flags.Has("insecure"), "--insecure"));
  if (credentials == nullptr) credentials = grpc::InsecureChannelCredentials();
  ASSIGN_OR_RETURN(std::string token, ReadToken(flags.Get("token-file")));

  std::vector<Target> targets;
  for (size_t i = 0; i < addresses.size(); ++i) {
    targets.push_back({absl::StrCat("shard ", i, " (", addresses[i], ")"), addresses[i],
                       grpc::CreateChannel(addresses[i], credentials)});
  }
  // Every shard writes at once: the checkpoint takes as long as the slowest.
  const std::vector<absl::StatusOr<layercast::v1::CheckpointResponse>> answers =
      FanOut(static_cast<uint32_t>(targets.size()), [&](uint32_t i) {
        return CheckpointOne(targets[i], token, connect_timeout, std::chrono::seconds(timeout_s));
      });
  absl::Status first_error;
  for (size_t i = 0; i < answers.size(); ++i) {
    if (!answers[i].ok()) {
      // The first error is what the command returns (and main prints).
      if (first_error.ok()) {
        first_error = answers[i].status();
      } else {
        std::fprintf(stderr, "%s\n", std::string(answers[i].status().message()).c_str());
      }
      continue;
    }
    const layercast::v1::CheckpointResponse& response = *answers[i];
    std::printf("shard %u/%u  version %llu  %s in %.2f s  %s  %s\n", response.shard_index(),
                response.num_shards(), static_cast<unsigned long long>(response.version()),
                FormatBytes(response.bytes()).c_str(), response.seconds(), response.path().c_str(),
                response.checksum().c_str());
  }
  return first_error;
}

}  // namespace layercast::cli
