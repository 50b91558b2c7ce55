#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "layercast/v1/admin.grpc.pb.h"
#include "layercast/v1/config.pb.h"
#include "platform/clock.h"
#include "server/serving/deadline_timers.h"

namespace layercast::server {

// The other shards of the set, as one shard's publishes see them: how a
// publish whose publisher stopped is settled without a human
// (docs/recovery.md).
//
// Shard 0 decides. A publish is committed once shard 0 has committed it:
// shard 0 then hands the commit on to every other shard (HandOn), so a
// publisher that dies after its first commit leaves no shard behind. A shard
// that holds a publish nobody finishes asks the set (Settle): committed if
// any shard committed it, else shard 0 fences it (aborts it for good, so a
// late commit cannot split the set) and every shard drops it.
//
// The calls run one at a time on a thread of this class (a DeadlineTimers
// of its own, with the shard's stop rule), never on gRPC's; each one is
// bounded in time, and a settle that cannot reach shard 0 tries again about
// once a second for up to kSettleFor (platform::kPeerSettle). A thread of
// its own rather than the shard's background thread: a settle blocks on
// peers for up to kSettleFor, which would hold up the shard's checkpoint
// writes and publish timeouts queued behind it. Its windows (kSettleFor,
// the hand-on's) are read on the shard's clock; the pause between two
// attempts is real time, so that a stop ends it.
//
// Thread-safe.
class PublishPeers {
 public:
  // How long a shard keeps asking before it gives a publish up.
  static constexpr std::chrono::minutes kSettleFor{10};

  // Nullptr when `config` names no peers, or has no --admin-token-file (no
  // publishes to settle). INVALID_ARGUMENT for a peer list of the wrong
  // length, or both peers and peers_file. `clock` (the shard's) must
  // outlive this.
  static absl::StatusOr<std::unique_ptr<PublishPeers>> FromConfig(
      const layercast::v1::ShardConfig& config, platform::Clock& clock = platform::Clock::Steady());
  // Waits for the call in progress; drops the rest.
  ~PublishPeers();

  uint32_t self() const { return self_; }
  bool decides() const { return self_ == 0; }

  // Commits publish `id` on every other shard (shard 0, after its own
  // commit). A shard that cannot take it is logged: the publisher, if it
  // lives, stages it there again.
  void HandOn(const std::string& id);

  // Asks the set what became of publish `id`, then calls `settled(true)`
  // (committed somewhere: commit it), `settled(false)` (fenced by shard 0:
  // drop it), or `settled(nullopt)` when the set could not be reached for
  // kSettleFor: keep it, and settle it later. Never called once this is
  // being destroyed.
  void Settle(const std::string& id, std::function<void(std::optional<bool> committed)> settled);

 private:
  struct Options {
    uint32_t self = 0;
    uint32_t num_shards = 0;
    std::vector<std::string> addresses;  // empty: read addresses_file
    std::string addresses_file;
    std::string token;
    std::shared_ptr<grpc::ChannelCredentials> credentials;
    platform::Clock* clock = &platform::Clock::Steady();  // the windows' clock
  };
  explicit PublishPeers(Options options);

  // The set's addresses now; UNAVAILABLE while the file is missing or short.
  absl::StatusOr<std::vector<std::string>> Addresses() const;
  layercast::v1::ShardAdmin::Stub& Stub(const std::string& address);
  absl::StatusOr<layercast::v1::ResolvePublishResponse> Ask(const std::string& address,
                                                            const std::string& id, bool fence);
  absl::Status Commit(const std::string& address, const std::string& id);
  // One settle attempt: the decision, or UNAVAILABLE to try again.
  absl::StatusOr<bool> SettleOnce(const std::string& id);
  // Waits up to `wait`; true once this is being destroyed.
  bool Stopped(absl::Duration wait);

  const Options options_;
  const uint32_t self_;
  absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;  // ends a call's waits
  absl::Mutex stubs_mu_;
  std::map<std::string, std::unique_ptr<layercast::v1::ShardAdmin::Stub>> stubs_
      ABSL_GUARDED_BY(stubs_mu_);
  // Last: see DeadlineTimers. Steady, whatever the shard's clock: nothing
  // is scheduled on it, and a test's clock jump must not wait for a settle.
  DeadlineTimers calls_;
};

}  // namespace layercast::server
