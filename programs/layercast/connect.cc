#include "programs/layercast/connect.h"

#include "absl/strings/str_cat.h"
#include "client/client_defaults.h"
#include "platform/file_system.h"
#include "platform/secret_file.h"
#include "platform/status_macros.h"

namespace layercast::cli {
namespace {

// PEM files are a few KiB; a CA bundle a few hundred KiB.
constexpr uint64_t kMaxPemBytes = 4 << 20;

// `secret`: a private key, refused when other users may read it.
absl::StatusOr<std::string> ReadPem(const tools::CliFlags& flags, const std::string& flag,
                                    bool secret) {
  const std::string path = flags.Get(flag);
  absl::StatusOr<std::unique_ptr<RandomAccessFile>> file = DefaultFileSystem().OpenForRead(path);
  if (!file.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--", flag, " ", path, " cannot be read: ", file.status().message()));
  }
  if (secret) RETURN_IF_ERROR(CheckSecretFilePermissions(**file, flag));
  if ((*file)->size() == 0 || (*file)->size() > kMaxPemBytes) {
    return absl::InvalidArgumentError(absl::StrCat("--", flag, " ", path, " is ", (*file)->size(),
                                                   " bytes; expected a PEM file of 1 to ",
                                                   kMaxPemBytes));
  }
  std::string pem((*file)->size(), '\0');
  absl::Status read =
      (*file)->ReadAt(0, std::span<uint8_t>(reinterpret_cast<uint8_t*>(pem.data()), pem.size()));
  if (!read.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--", flag, " ", path, " cannot be read: ", read.message()));
  }
  return pem;
}

}  // namespace

std::set<std::string> WithShardSetFlags(std::set<std::string> own) {
  own.insert(kShardSetFlags.begin(), kShardSetFlags.end());
  return own;
}

absl::StatusOr<std::vector<std::string>> ShardAddressesFromFlags(const tools::CliFlags& flags) {
  if (flags.Has("shards") == flags.Has("shards-pattern")) {
    return absl::InvalidArgumentError(
        "name the shards with --shards host:port,host:port,... (in shard order) or with "
        "--shards-pattern 'layercast-{i}.layercast:7070' --num-shards N");
  }
  if (flags.Has("shards")) return client::ParseShardList(flags.Get("shards"));
  ASSIGN_OR_RETURN(uint64_t num_shards, flags.GetUint("num-shards", 0));
  return client::ExpandShardPattern(flags.Get("shards-pattern"), num_shards);
}

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> ChannelCredentialsFromFlags(
    const tools::CliFlags& flags) {
  const bool ca = flags.Has("tls-ca-file");
  const bool cert = flags.Has("tls-cert-file");
  const bool key = flags.Has("tls-key-file");
  if (cert != key) {
    return absl::InvalidArgumentError(
        "a client certificate needs both --tls-cert-file (PEM) and --tls-key-file (its PEM "
        "private key)");
  }
  if (!ca && !cert) return std::shared_ptr<grpc::ChannelCredentials>();
  grpc::SslCredentialsOptions options;
  if (ca) {
    ASSIGN_OR_RETURN(options.pem_root_certs, ReadPem(flags, "tls-ca-file", /*secret=*/false));
  }
  if (cert) {
    ASSIGN_OR_RETURN(options.pem_cert_chain, ReadPem(flags, "tls-cert-file", /*secret=*/false));
    ASSIGN_OR_RETURN(options.pem_private_key, ReadPem(flags, "tls-key-file", /*secret=*/true));
  }
  return grpc::SslCredentials(options);
}

absl::StatusOr<std::chrono::milliseconds> TimeoutFromFlags(const tools::CliFlags& flags,
                                                           const std::string& name,
                                                           uint64_t fallback_ms) {
  ASSIGN_OR_RETURN(const uint64_t ms, flags.GetUint(name, fallback_ms));
  // Past about 292 years the milliseconds overflow a signed 64-bit count.
  constexpr uint64_t kMaxMs = uint64_t{1} << 62;
  if (ms == 0) {
    return absl::InvalidArgumentError(absl::StrCat("--", name,
                                                   " is 0, which no call can meet: give at least 1 "
                                                   "(milliseconds; default ",
                                                   fallback_ms, ")"));
  }
  if (ms > kMaxMs) {
    return absl::InvalidArgumentError(
        absl::StrCat("--", name, " is ", ms, ": give at most ", kMaxMs, " (milliseconds)"));
  }
  return std::chrono::milliseconds(static_cast<int64_t>(ms));
}

absl::StatusOr<std::unique_ptr<client::ShardSet>> ConnectFromFlags(const tools::CliFlags& flags) {
  ASSIGN_OR_RETURN(std::vector<std::string> addresses, ShardAddressesFromFlags(flags));
  client::ShardSetOptions options;
  ASSIGN_OR_RETURN(options.connect_timeout,
                   TimeoutFromFlags(flags, "connect-timeout-ms",
                                    static_cast<uint64_t>(client::kConnectTimeout.count())));
  ASSIGN_OR_RETURN(options.credentials, ChannelCredentialsFromFlags(flags));
  return client::ShardSet::Connect(std::move(addresses), options);
}

}  // namespace layercast::cli
