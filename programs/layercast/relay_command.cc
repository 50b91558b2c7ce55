#include <pthread.h>
#include <signal.h>

#include <cstdio>
#include <fstream>

#include "absl/strings/str_join.h"
#include "client/model_mirror.h"
#include "platform/byte_size.h"
#include "platform/log.h"
#include "platform/status_macros.h"
#include "programs/layercast/commands.h"
#include "programs/layercast/connect.h"
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

// A relay that presents a client certificate upstream reads from shards
// that authenticate their readers; serving those reads to anyone would end
// that authentication at the relay, so it takes a CA for its own readers,
// or a flag that says the operator means it.
absl::Status CheckReaderAuthentication(const tools::CliFlags& flags) {
  const bool client_ca = flags.Has("serve-tls-client-ca-file");
  const bool without = flags.Has("serve-without-client-certificates");
  if (client_ca && without) {
    return absl::InvalidArgumentError(
        "--serve-tls-client-ca-file requires readers' certificates and "
        "--serve-without-client-certificates serves readers without one: give one of the two");
  }
  if (flags.Has("tls-cert-file") && !client_ca && !without) {
    return absl::FailedPreconditionError(
        "the shards are read with a client certificate (--tls-cert-file), so they authenticate "
        "their readers, and this relay would serve what they hold to readers without one: give "
        "--serve-tls-client-ca-file (the CA that signs readers' certificates, beside "
        "--serve-tls-cert-file and --serve-tls-key-file), or "
        "--serve-without-client-certificates to serve unauthenticated readers on purpose");
  }
  return absl::OkStatus();
}

// The shard's limits, from the flags of the same names, with the shard's
// defaults (RelayLimits::Defaults).
absl::StatusOr<relay::RelayLimits> RelayLimitsFromFlags(const tools::CliFlags& flags) {
  relay::RelayLimits limits = relay::RelayLimits::Defaults();
  const auto get = [&](const char* flag, uint32_t& into) -> absl::Status {
    ASSIGN_OR_RETURN(const uint64_t value, flags.GetUint(flag, into));
    if (value == 0 || value > UINT32_MAX) {
      return absl::InvalidArgumentError(
          absl::StrCat("--", flag, " is ", value, ": give 1 to ", UINT32_MAX));
    }
    into = static_cast<uint32_t>(value);
    return absl::OkStatus();
  };
  RETURN_IF_ERROR(get("max-streams", limits.max_streams));
  RETURN_IF_ERROR(get("max-parked-streams", limits.max_parked_streams));
  RETURN_IF_ERROR(get("max-waits-per-connection", limits.max_waits_per_connection));
  RETURN_IF_ERROR(get("max-version-lead", limits.max_version_lead));
  uint32_t wait_ms = static_cast<uint32_t>(limits.max_version_wait.count());
  RETURN_IF_ERROR(get("max-version-wait-ms", wait_ms));
  limits.max_version_wait = std::chrono::milliseconds(wait_ms);
  uint32_t stall_ms = static_cast<uint32_t>(limits.write_progress_timeout.count());
  RETURN_IF_ERROR(get("write-progress-timeout-ms", stall_ms));
  limits.write_progress_timeout = std::chrono::milliseconds(stall_ms);
  if (flags.Has("memory-budget")) {
    ASSIGN_OR_RETURN(limits.memory_budget, ParseByteSize(flags.Get("memory-budget")));
  }
  return limits;
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
          args,
          WithShardSetFlags({"upstream", "listen", "keep-versions", "dtype", "metrics-listen",
                             "layer-timeout-ms", "max-version-wait-ms", "port-file", "max-streams",
                             "max-parked-streams", "max-waits-per-connection", "max-version-lead",
                             "write-progress-timeout-ms", "memory-budget", "serve-tls-cert-file",
                             "serve-tls-key-file", "serve-tls-client-ca-file", "fallback"}),
          // Switches: a value would be read as the next flag's.
          {"serve-plaintext", "serve-without-client-certificates"}));
  // Before connecting: a relay that would refuse to serve need not wait for
  // the shards to say so.
  RETURN_IF_ERROR(CheckReaderAuthentication(flags));
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
  ASSIGN_OR_RETURN(const std::chrono::milliseconds layer_timeout,
                   TimeoutFromFlags(flags, "layer-timeout-ms", 10000));
  std::optional<DType> dtype;
  if (flags.Has("dtype")) {
    ASSIGN_OR_RETURN(dtype, DTypeFromName(flags.Get("dtype")));
  }

  auto registry = std::make_shared<prometheus::Registry>();
  ASSIGN_OR_RETURN(std::vector<std::string> shard_addresses, ShardAddressesFromFlags(flags));
  client::ShardSetOptions connect;
  ASSIGN_OR_RETURN(connect.connect_timeout, TimeoutFromFlags(flags, "connect-timeout-ms", 30000));
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
  ASSIGN_OR_RETURN(options.limits, RelayLimitsFromFlags(flags));
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
  if (options.tls_client_ca_file.empty()) {
    Log()->info("relay: readers are not authenticated{}",
                flags.Has("serve-without-client-certificates")
                    ? ": --serve-without-client-certificates"
                    : " (serve with --serve-tls-client-ca-file to require certificates)");
  } else {
    Log()->info("relay: readers must present a certificate signed by a CA in {}",
                options.tls_client_ca_file);
  }
  for (size_t i = 0; i < relay->addresses().size(); ++i) {
    std::printf("relay: shard %zu of %zu served at %s\n", i, relay->addresses().size(),
                relay->addresses()[i].c_str());
  }
  std::fflush(stdout);
  if (flags.Has("port-file")) {
    RETURN_IF_ERROR(WritePortFile(flags.Get("port-file"), relay->addresses()));
  }

  client::MirrorOptions mirror_options;
  mirror_options.layer_timeout = layer_timeout;
  mirror_options.dtype = dtype;
  mirror_options.listener = relay.get();
  // No reader reads the relay's own mirror (its children read the relay's
  // held versions): pulled in place, an update costs no staging copy.
  mirror_options.staging_bytes = 0;
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
