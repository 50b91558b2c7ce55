#include <pthread.h>
#include <signal.h>

#include <cstdio>
#include <fstream>

#include "absl/strings/str_join.h"
#include "client/cli/commands.h"
#include "client/cli/connect.h"
#include "client/model_mirror.h"
#include "platform/byte_size.h"
#include "platform/log.h"
#include "platform/status_macros.h"
#include "relay/relay.h"

namespace layercast::cli {

namespace {

absl::Status WritePortFile(const std::string& path, const std::vector<std::string>& addresses) {
  // Whole or absent: a reader polling for the file never sees half of it.
  const std::string partial = path + ".partial";
  {
    std::ofstream out(partial, std::ios::trunc);
    out << absl::StrJoin(addresses, ",") << "\n";
    if (!out.flush()) return absl::UnavailableError(absl::StrCat("cannot write ", partial));
  }
  if (std::rename(partial.c_str(), path.c_str()) != 0) {
    return absl::UnavailableError(absl::StrCat("cannot rename ", partial, " to ", path));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status RunRelay(const std::vector<std::string>& args) {
  // Before any thread starts, so that every one inherits the mask and the
  // signal waits for sigwait below.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGINT);
  sigaddset(&stop_signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);

  // A service, unlike the other commands: each version it follows is worth
  // a line.
  Log()->set_level(spdlog::level::info);
  ASSIGN_OR_RETURN(
      tools::CliFlags flags,
      tools::CliFlags::Parse(
          args, WithShardSetFlags({"upstream", "listen", "keep-versions", "dtype", "metrics-listen",
                                   "layer-timeout-ms", "max-version-wait-ms", "port-file",
                                   "serve-tls-cert-file", "serve-tls-key-file",
                                   "serve-tls-client-ca-file", "serve-plaintext", "fallback"})));
  if (!flags.Has("listen")) {
    return absl::InvalidArgumentError(
        "--listen HOST:PORT,... is required: one address per shard of the set, in shard order "
        "(port 0 picks a free one)");
  }
  ASSIGN_OR_RETURN(const std::vector<std::string> listen,
                   client::ParseShardList(flags.Get("listen")));
  ASSIGN_OR_RETURN(const uint64_t keep, flags.GetUint("keep-versions", 2));
  if (keep < 1 || keep > 64) {
    return absl::InvalidArgumentError(
        absl::StrCat("--keep-versions is ", keep, ": keep 1 to 64 versions before the newest"));
  }
  ASSIGN_OR_RETURN(const uint64_t layer_timeout_ms, flags.GetUint("layer-timeout-ms", 10000));
  ASSIGN_OR_RETURN(const uint64_t max_wait_ms, flags.GetUint("max-version-wait-ms", 10000));
  std::optional<DType> dtype;
  if (flags.Has("dtype")) {
    ASSIGN_OR_RETURN(dtype, DTypeFromName(flags.Get("dtype")));
  }

  auto registry = std::make_shared<prometheus::Registry>();
  ASSIGN_OR_RETURN(std::vector<std::string> shard_addresses, ShardAddressesFromFlags(flags));
  ASSIGN_OR_RETURN(const uint64_t connect_ms, flags.GetUint("connect-timeout-ms", 30000));
  client::ShardSetOptions connect;
  connect.connect_timeout = std::chrono::milliseconds(connect_ms);
  ASSIGN_OR_RETURN(connect.credentials, ChannelCredentialsFromFlags(flags));
  // The mirror's metrics are the upstream's (ModelMirror keeps them after a
  // fall back): the registry goes to whichever set it follows first.
  std::unique_ptr<client::ShardSet> upstream;
  if (flags.Has("upstream")) {
    ASSIGN_OR_RETURN(std::vector<std::string> addresses,
                     client::ParseShardList(flags.Get("upstream")));
    client::ShardSetOptions options = connect;
    options.registry = registry;
    options.shards_name = "--upstream";
    absl::StatusOr<std::unique_ptr<client::ShardSet>> connected =
        client::ShardSet::Connect(std::move(addresses), options);
    if (connected.ok()) {
      upstream = *std::move(connected);
    } else {
      Log()->warn("relay: the upstream did not answer ({}); following the shards",
                  connected.status().message());
    }
  }
  if (upstream == nullptr) connect.registry = registry;
  ASSIGN_OR_RETURN(std::unique_ptr<client::ShardSet> shards,
                   client::ShardSet::Connect(std::move(shard_addresses), connect));
  const client::ShardSet& source = upstream != nullptr ? *upstream : *shards;
  // Where to go when the upstream dies: the shards, or the relay named.
  std::unique_ptr<client::ShardSet> fallback;
  if (flags.Has("fallback")) {
    ASSIGN_OR_RETURN(std::vector<std::string> addresses,
                     client::ParseShardList(flags.Get("fallback")));
    client::ShardSetOptions options = connect;
    options.registry = nullptr;
    options.shards_name = "--fallback";
    ASSIGN_OR_RETURN(fallback, client::ShardSet::Connect(std::move(addresses), options));
  }

  relay::RelayOptions options;
  options.listen = listen;
  options.keep_versions = static_cast<uint32_t>(keep);
  options.service.max_version_wait = std::chrono::milliseconds(max_wait_ms);
  options.dtype = dtype;
  options.registry = registry;
  options.metrics_listen = flags.Get("metrics-listen", "");
  options.tls_cert_file = flags.Get("serve-tls-cert-file", "");
  options.tls_key_file = flags.Get("serve-tls-key-file", "");
  options.tls_client_ca_file = flags.Get("serve-tls-client-ca-file", "");
  if (shards->tls() && options.tls_cert_file.empty() && !flags.Has("serve-plaintext")) {
    return absl::FailedPreconditionError(
        "the shards are reached over TLS, and this relay would serve what they hold in "
        "plaintext: give --serve-tls-cert-file and --serve-tls-key-file, or --serve-plaintext "
        "to serve it so on purpose");
  }
  ASSIGN_OR_RETURN(std::unique_ptr<relay::Relay> relay, relay::Relay::Start(source, options));
  for (size_t i = 0; i < relay->addresses().size(); ++i) {
    std::printf("relay: shard %zu of %zu served at %s\n", i, relay->addresses().size(),
                relay->addresses()[i].c_str());
  }
  std::fflush(stdout);
  if (flags.Has("port-file")) {
    RETURN_IF_ERROR(WritePortFile(flags.Get("port-file"), relay->addresses()));
  }

  client::MirrorOptions mirror_options;
  mirror_options.layer_timeout = std::chrono::milliseconds(layer_timeout_ms);
  mirror_options.dtype = dtype;
  mirror_options.listener = relay.get();
  if (upstream != nullptr) mirror_options.fallback = fallback ? fallback.get() : shards.get();
  // A relay serves only bytes the shards vouch for: each layer is checked
  // against their digests before it is served, whoever it came from.
  mirror_options.verify_with = shards.get();
  ASSIGN_OR_RETURN(std::unique_ptr<client::ModelMirror> mirror,
                   client::ModelMirror::Create(source, mirror_options));
  Log()->info("relay: holds version {} from {}; following", mirror->version(),
              absl::StrJoin(mirror->source().addresses(), ","));
  mirror->Follow([](const client::MirrorUpdate& update) {
    Log()->info("relay: version {} ({} of {} layers changed, {} from upstream, {:.1f} ms)",
                update.version, update.changed_layers.size(), update.layers,
                FormatBytes(update.bytes),
                std::chrono::duration<double, std::milli>(update.duration).count());
  });

  int signal = 0;
  sigwait(&stop_signals, &signal);
  Log()->info("relay: received {}, stopping", signal == SIGTERM ? "SIGTERM" : "SIGINT");
  mirror->StopFollowing();
  relay->Stop();
  return absl::OkStatus();
}

}  // namespace layercast::cli
