#include "programs/layercast/admin_calls.h"

#include "absl/strings/str_cat.h"
#include "client/bearer_token.h"
#include "client/client_defaults.h"
#include "client/shard_set.h"
#include "platform/file_system.h"
#include "platform/secret_file.h"
#include "platform/status_macros.h"
#include "programs/layercast/connect.h"

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

}  // namespace

absl::StatusOr<AdminCalls> AdminCallsFromFlags(const tools::CliFlags& flags) {
  if (!flags.Has("token-file")) {
    return absl::InvalidArgumentError(
        "--token-file FILE is required: the file holding the shards' admin token (their "
        "--admin-token-file)");
  }
  ASSIGN_OR_RETURN(std::vector<std::string> addresses, ShardAddressesFromFlags(flags));
  AdminCalls calls;
  ASSIGN_OR_RETURN(calls.connect_timeout,
                   TimeoutFromFlags(flags, "connect-timeout-ms",
                                    static_cast<uint64_t>(client::kConnectTimeout.count())));
  ASSIGN_OR_RETURN(std::shared_ptr<grpc::ChannelCredentials> credentials,
                   ChannelCredentialsFromFlags(flags));
  // Whoever reads the token off the wire can write checkpoints, freeze the
  // set and push parameters: plaintext is for loopback, and must be asked
  // for.
  RETURN_IF_ERROR(
      client::CheckTokenTransport(credentials != nullptr, flags.Has("insecure"), "--insecure"));
  if (credentials == nullptr) credentials = grpc::InsecureChannelCredentials();
  ASSIGN_OR_RETURN(calls.token, ReadToken(flags.Get("token-file")));
  for (size_t i = 0; i < addresses.size(); ++i) {
    calls.targets.push_back({absl::StrCat("shard ", i, " (", addresses[i], ")"), addresses[i],
                             grpc::CreateChannel(addresses[i], credentials)});
  }
  return calls;
}

absl::Status Connect(const AdminTarget& target, std::chrono::milliseconds timeout,
                     const std::function<grpc::Status(grpc::ClientContext&)>& probe) {
  if (target.channel->WaitForConnected(std::chrono::system_clock::now() + timeout)) {
    return absl::OkStatus();
  }
  // One call that fails at once says why: nothing listens, no such host,
  // or (a connection that never became a channel) TLS.
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(1));
  const grpc::Status failed = probe(context);
  const std::string cause = client::UnreachableCause(failed.error_message(), target.address);
  return absl::UnavailableError(absl::StrCat(
      target.describe, " did not accept a connection within ", timeout.count(), " ms: ",
      cause.empty() ? "is it running, and do --tls-ca-file/--tls-cert-file match its TLS "
                      "settings?"
                    : cause));
}

std::unique_ptr<grpc::ClientContext> AdminContext(const std::string& token,
                                                  std::chrono::milliseconds timeout) {
  auto context = std::make_unique<grpc::ClientContext>();
  context->AddMetadata("authorization", absl::StrCat("Bearer ", token));
  context->set_deadline(std::chrono::system_clock::now() + timeout);
  return context;
}

}  // namespace layercast::cli
