#include "server/publishing/publish_peers.h"

#include <pthread.h>

#include <fstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "platform/fan_out.h"
#include "platform/log.h"
#include "platform/retry.h"
#include "platform/status_macros.h"
#include "server/access/peer_credentials.h"
#include "wire/grpc_status.h"

namespace layercast::server {
namespace {

using layercast::v1::ResolvePublishResponse;

// One call to a peer: long enough for a commit of a large layer set, short
// enough that a dead peer does not hold up the others for long.
constexpr std::chrono::seconds kCallDeadline{10};
// A peer that is restarting (UNAVAILABLE) is tried again for this long.
constexpr std::chrono::seconds kHandOnFor{15};

std::vector<std::string> SplitAddresses(absl::string_view text, absl::string_view separators) {
  std::vector<std::string> addresses;
  for (absl::string_view part : absl::StrSplit(text, absl::ByAnyChar(separators))) {
    part = absl::StripAsciiWhitespace(part);
    if (!part.empty()) addresses.emplace_back(part);
  }
  return addresses;
}

}  // namespace

absl::StatusOr<std::unique_ptr<PublishPeers>> PublishPeers::FromConfig(
    const layercast::v1::ShardConfig& config, platform::Clock& clock) {
  if (config.peers().empty() && config.peers_file().empty()) return nullptr;
  if (!config.peers().empty() && !config.peers_file().empty()) {
    return absl::InvalidArgumentError("give --peers or --peers-file, not both");
  }
  if (config.admin_token_file().empty()) {
    // Without a token ShardAdmin takes no publishes: nothing to settle.
    return nullptr;
  }
  Options options;
  options.clock = &clock;
  options.self = config.shard_index();
  options.num_shards = config.num_shards();
  options.addresses_file = config.peers_file();
  if (absl::StrContains(config.peers(), "{i}")) {
    // One name for the set, e.g. the StatefulSet's layercast-{i}.layercast:7070.
    for (uint32_t shard = 0; shard < config.num_shards(); ++shard) {
      options.addresses.push_back(
          absl::StrReplaceAll(config.peers(), {{"{i}", absl::StrCat(shard)}}));
    }
  } else if (!config.peers().empty()) {
    options.addresses = SplitAddresses(config.peers(), ",");
    if (options.addresses.size() != config.num_shards()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--peers lists ", options.addresses.size(), " addresses for --num-shards ",
          config.num_shards(), ": list every shard of the set in shard order, this one included"));
    }
  }
  ASSIGN_OR_RETURN(PeerCalls calls, PeerCallsFromConfig(config, "--peers/--peers-file"));
  options.token = std::move(calls.token);
  options.credentials = std::move(calls.credentials);
  return std::unique_ptr<PublishPeers>(new PublishPeers(std::move(options)));
}

PublishPeers::PublishPeers(Options options) : options_(std::move(options)), self_(options_.self) {
  // Beside gRPC's threads, in `ps -L`.
  calls_.Post([] { pthread_setname_np(pthread_self(), "lc-publish-peer"); });
}

PublishPeers::~PublishPeers() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  // Then calls_ goes first: it waits for the call under way, which the
  // stop cuts short, and drops the rest.
}

absl::StatusOr<std::vector<std::string>> PublishPeers::Addresses() const {
  if (!options_.addresses.empty()) return options_.addresses;
  std::ifstream file(options_.addresses_file);
  const std::string text((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
  std::vector<std::string> addresses = SplitAddresses(text, "\n");
  if (addresses.size() != options_.num_shards) {
    return absl::UnavailableError(absl::StrCat("--peers-file ", options_.addresses_file, " lists ",
                                               addresses.size(), " of the ", options_.num_shards,
                                               " shards"));
  }
  return addresses;
}

layercast::v1::ShardAdmin::Stub& PublishPeers::Stub(const std::string& address) {
  absl::MutexLock lock(&stubs_mu_);
  std::unique_ptr<layercast::v1::ShardAdmin::Stub>& stub = stubs_[address];
  if (stub == nullptr) {
    stub = layercast::v1::ShardAdmin::NewStub(grpc::CreateChannel(address, options_.credentials));
  }
  return *stub;
}

absl::StatusOr<ResolvePublishResponse> PublishPeers::Ask(const std::string& address,
                                                         const std::string& id, bool fence) {
  grpc::ClientContext context;
  context.AddMetadata("authorization", absl::StrCat("Bearer ", options_.token));
  context.set_deadline(std::chrono::system_clock::now() + kCallDeadline);
  layercast::v1::ResolvePublishRequest request;
  request.set_publish_id(id);
  request.set_fence(fence);
  ResolvePublishResponse response;
  RETURN_IF_ERROR(wire::FromGrpcStatus(Stub(address).ResolvePublish(&context, request, &response),
                                       absl::StrCat("shard ", address)));
  return response;
}

absl::Status PublishPeers::Commit(const std::string& address, const std::string& id) {
  grpc::ClientContext context;
  context.AddMetadata("authorization", absl::StrCat("Bearer ", options_.token));
  context.set_deadline(std::chrono::system_clock::now() + kCallDeadline);
  layercast::v1::CommitPublishRequest request;
  request.set_publish_id(id);
  layercast::v1::CommitPublishResponse response;
  return wire::FromGrpcStatus(Stub(address).CommitPublish(&context, request, &response),
                              absl::StrCat("shard ", address));
}

void PublishPeers::HandOn(const std::string& id) {
  calls_.Post([this, id] {
    // Queued when the stop came: dropped, as calls_ drops the rest.
    if (Stopped(absl::ZeroDuration())) return;
    absl::StatusOr<std::vector<std::string>> addresses = Addresses();
    if (!addresses.ok()) {
      Log()->warn("publish {}: cannot hand the commit on: {}", id, addresses.status().message());
      return;
    }
    FanOut(static_cast<uint32_t>(addresses->size()), [&](uint32_t shard) {
      if (shard == self_) return;
      // Not gRPC's retry policy: its 5 attempts cannot wait out 15 s of a
      // restart, nor end early when this shard stops.
      platform::RetryHooks hooks;
      hooks.clock = options_.clock;
      hooks.sleep = [this](std::chrono::milliseconds wait) {
        return !Stopped(absl::FromChrono(wait));
      };
      const absl::Status status = platform::Retry(
          platform::kPeerCommit, options_.clock->Now() + kHandOnFor,
          [&](int) { return Commit((*addresses)[shard], id); }, hooks);
      if (!status.ok()) {
        Log()->warn(
            "publish {}: shard {} did not take the commit ({}); its publisher stages "
            "it there again, or the next publish brings it level",
            id, shard, status.message());
      }
    });
  });
}

absl::StatusOr<bool> PublishPeers::SettleOnce(const std::string& id) {
  ASSIGN_OR_RETURN(const std::vector<std::string> addresses, Addresses());
  // Any shard that committed it (shard 0 did before it, or before its
  // restart), or that holds shard 0's abort: the publish is decided, and a
  // shard cut off from shard 0 settles through any peer that is not.
  for (uint32_t shard = 0; shard < addresses.size(); ++shard) {
    if (shard == self_) continue;
    absl::StatusOr<ResolvePublishResponse> answer = Ask(addresses[shard], id, /*fence=*/false);
    if (!answer.ok()) continue;
    if (answer->state() == ResolvePublishResponse::COMMITTED) return true;
    if (answer->state() == ResolvePublishResponse::ABORTED && answer->set_decision()) return false;
  }
  ASSIGN_OR_RETURN(const ResolvePublishResponse decision, Ask(addresses[0], id, /*fence=*/true));
  switch (decision.state()) {
    case ResolvePublishResponse::COMMITTED:
      return true;
    case ResolvePublishResponse::ABORTED:
      return false;
    default:
      return absl::UnavailableError(absl::StrCat("shard 0 answered state ", decision.state()));
  }
}

void PublishPeers::Settle(const std::string& id, std::function<void(std::optional<bool>)> settled) {
  calls_.Post([this, id, settled = std::move(settled)] {
    if (Stopped(absl::ZeroDuration())) return;  // as above
    bool stopped = false;
    platform::RetryHooks hooks;
    hooks.clock = options_.clock;
    hooks.sleep = [this, &stopped](std::chrono::milliseconds wait) {
      stopped = Stopped(absl::FromChrono(wait));
      return !stopped;
    };
    hooks.on_retry = [&id](const absl::Status& failed, int attempt, std::chrono::milliseconds) {
      if (attempt % 30 == 1) {
        Log()->warn(
            "publish {}: cannot settle it with the set yet: no peer knows shard 0's decision, "
            "and shard 0 does not answer ({}); asking every shard again about every second, "
            "for up to {} min",
            id, failed.message(), kSettleFor.count());
      }
    };
    std::optional<bool> committed;
    const absl::Status status = platform::Retry(
        platform::kPeerSettle, options_.clock->Now() + kSettleFor,
        [&](int) -> absl::Status {
          absl::StatusOr<bool> answer = SettleOnce(id);
          if (!answer.ok()) return answer.status();
          committed = *answer;
          return absl::OkStatus();
        },
        hooks);
    if (status.ok()) {
      Log()->info("publish {}: settled with the set: {}", id, *committed ? "committed" : "aborted");
      settled(*committed);
      return;
    }
    if (stopped) return;
    Log()->error(
        "publish {}: not settled within {} min; its staging is kept until "
        "another publish begins and settles it",
        id, kSettleFor.count());
    settled(std::nullopt);
  });
}

bool PublishPeers::Stopped(absl::Duration wait) {
  absl::MutexLock lock(&mu_);
  return mu_.AwaitWithTimeout(absl::Condition(&stopping_), wait);
}

}  // namespace layercast::server
