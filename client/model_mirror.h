#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "client/cancellation.h"
#include "client/client_defaults.h"
#include "client/layer.h"
#include "client/shard_set.h"
#include "platform/retry.h"

namespace layercast::client {

// Told of each layer a mirror pulls as it lands, so that a relay (relay/)
// serves it on at once rather than after the whole update (a staged layer
// as it lands in its copy, before the mirror's readers see it). Called on
// the thread that pulls, one call at a time, perhaps with the mirror's lock
// held: it must not call back into the mirror, and should only copy what it
// keeps.
class MirrorListener {
 public:
  virtual ~MirrorListener() = default;
  // A walk of the model toward `version` begins (Create, or an update).
  virtual void Pulling(uint64_t version) = 0;
  struct PulledLayer {
    uint32_t layer = 0;
    uint64_t version = 0;
    // Its values may differ from those told before (always, the first
    // time); else only its version moved.
    bool changed = false;
    std::span<const uint8_t> bytes;  // the assembled layer; valid during the call
    // Per shard, the incarnation that served it.
    const std::vector<uint64_t>* incarnations = nullptr;
    uint64_t received = 0;  // chunk bytes the pull took
  };
  virtual void Pulled(const PulledLayer& layer) = 0;
};

struct MirrorOptions {
  // Each layer's pull, retries included, ends by then.
  std::chrono::milliseconds layer_timeout = kLayerTimeout;
  // How long one long poll for a newer version (WaitVersion) lasts before
  // it is asked again; what Stop waits at most for a poll in flight is far
  // less (the poll is cancelled).
  std::chrono::milliseconds poll = kMirrorPoll;
  // After a failed poll or update, the follower waits about this long,
  // doubling up to max_backoff (platform::kMirrorFollow), before trying
  // again.
  std::chrono::milliseconds backoff = platform::kMirrorFollow.first_wait;
  std::chrono::milliseconds max_backoff = platform::kMirrorFollow.max_wait;
  // Every tensor in this dtype instead of the policy's (GatherOptions::
  // dtype): an inference fleet following in fp8 the shards that trainers
  // gather in bfloat16. Shards serve no delta in such a dtype, so each
  // update pulls the layers that moved in full, unless the source is a
  // relay that holds the model in it (`layercast relay --dtype`), which
  // serves deltas in it.
  std::optional<DType> dtype = std::nullopt;
  // Staged updates: an update pulls the layers that moved into copies of
  // themselves, up to this many bytes of copies, while readers read on,
  // then holds readers off only to copy the changed ones in (the pause),
  // so a reader never sees a torn model and never waits on the network,
  // whatever the source does (a relay stopped mid-update included). The
  // default stages every layer that moves, at the cost of a transient copy
  // of those layers during the update. Layers past a smaller budget are
  // pulled in place with readers held off for their pulls (0: no second
  // copy of anything, readers wait on the network); a cancelled or failed
  // staged pull leaves the live layers as they were.
  static constexpr uint64_t kStageAll = UINT64_MAX;
  uint64_t staging_bytes = kStageAll;
  // Told of each layer as it lands; must outlive the mirror.
  MirrorListener* listener = nullptr;
  // One more fallback, for callers that name one: followed after
  // `fallbacks` (below) unless among them.
  const ShardSet* fallback = nullptr;
  // The shards every layer is checked against before the mirror exposes it
  // (and a relay serves it): their digests of its version
  // (ShardSet::LayerDigests), slice by slice. Bytes that differ (a relay,
  // or a bug, changed them) are counted
  // (layercast_client_rereads_total{cause="digest_mismatch"}), logged with
  // the set they came from, pulled again in full from the fallback (else
  // from these shards) and checked again; they are never exposed. Null: not
  // checked. Must serve the same layout, and outlive the mirror.
  const ShardSet* verify_with = nullptr;
  // Where to follow from, in order of preference after the upstream given
  // to Create, when the source dies (an update or a poll ends UNAVAILABLE
  // or DEADLINE_EXCEEDED, Create's first pull does, or a probe below finds
  // it unreachable or silent): the mirror logs it and follows the next one,
  // the pull that failed resumed from it. Relays forward the shards'
  // incarnations, so deltas from one source's versions go on from another.
  // Each must serve the same layout, and outlive the mirror.
  std::vector<const ShardSet*> fallbacks = {};
  // While following with fallbacks: how often the mirror probes its source
  // (a WaitVersion answered at once, within `probe`), so that one that
  // refuses connections or stopped answering (a stopped process) is left
  // within about this long plus `probe`, its poll or update cancelled,
  // rather than after a poll or layer timeout; and probes the sources it
  // prefers to the one it follows, going back to the first that answers
  // at a version no lower than the mirror's (between updates). 0: no
  // probes (a source is left only when a call to it fails; never returned
  // to).
  std::chrono::milliseconds probe = kMirrorProbe;
};

// What one update brought.
struct MirrorUpdate {
  uint64_t version = 0;  // the lowest layer's, now
  uint32_t layers = 0;   // layers pulled (those behind the target version)
  // Of those, the ones whose values changed, in model order (a publish
  // advances every layer's version, most of them changing nothing); one
  // pulled in full counts as changed.
  std::vector<uint32_t> changed_layers;
  uint64_t bytes = 0;  // chunk bytes received for them
  std::chrono::steady_clock::duration duration{};
  // Of `layers`, those pulled into staging copies (MirrorOptions::
  // staging_bytes).
  uint32_t staged_layers = 0;
  // How long readers were held off: the copy of staged layers in, and the
  // in-place pulls of the rest.
  std::chrono::steady_clock::duration pause{};
};

// A whole model held on the host at the shards' newest version, for an
// inference worker: pulled in full once, then kept current by delta pulls
// (FetchLayerRequest.base_version) written in place, so each update moves
// only the compute-dtype values that changed (of an 8-bit float tensor, the
// codes and block scales that changed). Tensor views (Layer::tensor) stay
// valid across updates: the buffers never move.
//
// Readers take a Reading, which holds updates off while it lives. An update
// pulls into staging copies while readers read on (MirrorOptions::
// staging_bytes) and holds readers off only to copy them in; it pins its
// walk to one version
// (GatherOptions.exact_version), so a publish committed meanwhile does not
// leave the layers after it newer than those before; only where a shard no
// longer keeps that version is a layer pulled at its newest. An update that
// fails leaves the layers it did not reach at their older version (each
// layer whole, Layer::version() says which); a layer whose pull failed
// midway holds a mix of its old and new values, which Reading::status()
// reports until the next update repairs it (a delta from the same base
// gives the new values exactly).
//
// Thread-safe.
class ModelMirror {
 public:
  // Pulls every layer in full. `shards` must outlive the mirror.
  static absl::StatusOr<std::unique_ptr<ModelMirror>> Create(const ShardSet& shards,
                                                             MirrorOptions options = {});
  // Stops following.
  ~ModelMirror();

  // The lowest version any layer holds; answered at once, whatever an
  // update in flight or the source does.
  uint64_t version() const { return version_.load(); }

  // The set the mirror pulls from now: the upstream given to Create, or one
  // of MirrorOptions::fallbacks while it follows one.
  const ShardSet& source() const { return *sources_[at_.load()]; }

  // Brings every layer to at least `min_version` (default: the version the
  // shards serve now) by delta pulls. Layers already there are left alone,
  // unless other incarnations of the shards serve now than those they came
  // from (the set restarted and counts again): those are pulled in full at
  // the set's version, even a lower one, so the mirror never keeps a number
  // whose bits the shards no longer serve.
  // Errors are the gather's (ShardSet::GatherInto); the layers done before
  // the error keep their new version.
  absl::StatusOr<MirrorUpdate> Update(std::optional<uint64_t> min_version = std::nullopt);

  // Waits until version() >= `version`; false when `timeout` passed first.
  bool WaitForVersion(uint64_t version, std::chrono::milliseconds timeout) const;

  // Starts a thread that long-polls the shards for a newer version and
  // updates to it, calling `on_update` (on that thread, with no lock held)
  // after each update. Failures are logged and retried with backoff. Calling
  // it again while following changes nothing.
  void Follow(std::function<void(const MirrorUpdate&)> on_update = {});
  // Stops the follower, cancelling the poll or update in flight (an update
  // cancelled midway leaves staged layers as they were); returns once the
  // follower ended, within a fraction of a second.
  void StopFollowing();

  // Holds updates off while it lives: `auto reading = mirror.Read();`.
  // Neither copied nor moved.
  class Reading {
   public:
    // The lowest layer's version: after a publish every layer holds the
    // same; on training shards each layer's own is Layer::version().
    uint64_t version() const ABSL_NO_THREAD_SAFETY_ANALYSIS { return mirror_->VersionLocked(); }
    // REQUIRES: layer < num_layers(). Valid while the mirror lives; its
    // values are this Reading's while it lives.
    const Layer& layer(uint32_t layer) const ABSL_NO_THREAD_SAFETY_ANALYSIS {
      return mirror_->layers_[layer];
    }
    uint32_t num_layers() const ABSL_NO_THREAD_SAFETY_ANALYSIS {
      return static_cast<uint32_t>(mirror_->layers_.size());
    }
    // DATA_LOSS naming the layers whose last pull failed midway.
    absl::Status status() const;

   private:
    friend class ModelMirror;
    explicit Reading(const ModelMirror* mirror) ABSL_NO_THREAD_SAFETY_ANALYSIS
        : mirror_(mirror),
          lock_(&mirror->mu_) {}
    const ModelMirror* mirror_;
    absl::ReaderMutexLock lock_;
  };
  Reading Read() const { return Reading(this); }

 private:
  // The first pull of every layer from `shards`; the mirror's metrics go
  // to `metrics` (the upstream's, when this is its fallback).
  static absl::StatusOr<std::unique_ptr<ModelMirror>> Walk(std::vector<const ShardSet*> sources,
                                                           size_t at, const MirrorOptions& options,
                                                           ClientMetrics* metrics);
  ModelMirror(std::vector<const ShardSet*> sources, size_t at, ClientMetrics* metrics,
              MirrorOptions options, std::vector<AssembledLayout> layouts,
              std::vector<Layer> layers, std::vector<std::vector<uint64_t>> incarnations);
  uint64_t VersionLocked() const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // Update; the follower's (`following`) is cancelled by StopFollowing and
  // by probes.
  absl::StatusOr<MirrorUpdate> UpdateWith(std::optional<uint64_t> min_version, bool following);
  // The follower's next poll or update (`updating`), as turn_; null once
  // stopping.
  std::shared_ptr<Cancellation> NewTurn(bool updating);
  // One attempt at an update, from the source now, adding what it brings
  // to `update` (so a failed attempt's progress is still reported).
  absl::Status UpdateFrom(std::optional<uint64_t> min_version,
                          std::chrono::steady_clock::time_point start, Cancellation* cancel,
                          MirrorUpdate& update) ABSL_EXCLUSIVE_LOCKS_REQUIRED(update_mu_);
  // Switches to the next source when `failed` says the source died (or was
  // cancelled because a probe found it dead); false when there is none.
  bool FallBack(const absl::Status& failed);
  // The source a layer that failed its digests is pulled again from: the
  // one after `from`, else null.
  const ShardSet* NextAfter(const ShardSet& from) const;
  // One layer's pull into `bytes` (the layer at `base`, or a copy of it):
  // a delta pinned to `target`, or the layer at its newest where the shards
  // no longer keep `target`.
  struct Pulled {
    absl::Status status;
    uint64_t version = 0;
    uint64_t received = 0;  // chunk bytes, whether it succeeded or not
    uint64_t changed = 0;   // elements that may differ from `bytes` before
    std::vector<uint64_t> incarnations;
  };
  // No `base`: in full (the layer's bits are another incarnation's).
  Pulled Pull(uint32_t layer, uint64_t target, std::optional<uint64_t> base,
              std::vector<uint64_t> base_incarnations, std::span<uint8_t> bytes,
              Cancellation* cancel) const;
  // The follower's long poll: the version shard 0 serves once it reaches
  // `min_version` or the poll ends (then below it), and its incarnation; at
  // once when that is not `incarnation` (the set restarted). StopFollowing
  // cancels it.
  struct Polled {
    uint64_t version = 0;
    uint64_t incarnation = 0;
  };
  absl::StatusOr<Polled> Poll(uint64_t min_version, uint64_t incarnation, Cancellation& cancel);
  // Tells options_.listener of `layer` as `pulled` brought it, in `bytes`,
  // unless it was told of that version last.
  void Tell(uint32_t layer, const Pulled& pulled, bool changed, std::span<const uint8_t> bytes)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(update_mu_);
  // The incarnation of shard 0 that served layer 0 (0: unknown).
  uint64_t HeldIncarnationLocked() const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  void FollowLoop(std::function<void(const MirrorUpdate&)> on_update);
  // While following with fallbacks: probes the source and the sources
  // preferred to it every options_.probe (MirrorOptions::probe).
  void ProbeLoop(std::shared_ptr<Cancellation> stop);
  // Cancels the follower's poll, or (with `updates`) its update too.
  void CancelTurn(bool updates);

  const MirrorOptions options_;
  // What the mirror may pull from, in order of preference: the upstream
  // given to Create, then the fallbacks; at_ is the one followed now.
  const std::vector<const ShardSet*> sources_;
  std::atomic<size_t> at_;
  // Set by a probe that found source at_ dead (SIZE_MAX: none): the
  // follower's turn it cancelled falls back.
  std::atomic<size_t> dead_{SIZE_MAX};
  // Set by a probe that found a source preferred to at_ answering again
  // (SIZE_MAX: none): the follower goes back to it between updates.
  std::atomic<size_t> back_to_{SIZE_MAX};
  // version(): VersionLocked() as of the last change to the layers.
  std::atomic<uint64_t> version_{0};
  // The upstream's, kept after a fall back: one mirror's series.
  ClientMetrics* const metrics_;
  // With options_.dtype, every layer's layout in it (the layers point
  // here); empty otherwise (they point into the shard set's view).
  const std::vector<AssembledLayout> layouts_;
  // One update at a time; taken before mu_.
  absl::Mutex update_mu_ ABSL_ACQUIRED_BEFORE(mu_);
  mutable absl::Mutex mu_;
  std::vector<Layer> layers_ ABSL_GUARDED_BY(mu_);
  std::vector<bool> torn_ ABSL_GUARDED_BY(mu_);
  // Per layer, per shard: the incarnation that served the layer's version,
  // named as the base of its next delta.
  std::vector<std::vector<uint64_t>> incarnations_ ABSL_GUARDED_BY(mu_);
  // Per layer, the version and incarnations options_.listener was told of
  // last.
  std::vector<std::pair<uint64_t, std::vector<uint64_t>>> told_ ABSL_GUARDED_BY(update_mu_);

  absl::Mutex follow_mu_;
  bool stopping_ ABSL_GUARDED_BY(follow_mu_) = false;
  // The follower's poll or update in flight, cancelled by StopFollowing
  // and by probes; `updating_` says which.
  std::shared_ptr<Cancellation> turn_ ABSL_GUARDED_BY(follow_mu_);
  bool updating_ ABSL_GUARDED_BY(follow_mu_) = false;
  // Cancels the prober's probe in flight (StopFollowing).
  std::shared_ptr<Cancellation> stop_probes_ ABSL_GUARDED_BY(follow_mu_);
  absl::Mutex follower_mu_ ABSL_ACQUIRED_BEFORE(follow_mu_);  // Follow, StopFollowing
  std::thread follower_ ABSL_GUARDED_BY(follower_mu_);
  std::thread prober_ ABSL_GUARDED_BY(follower_mu_);
};

}  // namespace layercast::client
