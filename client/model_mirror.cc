#include "client/model_mirror.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/time.h"
#include "platform/log.h"
#include "platform/retry.h"
#include "platform/status_macros.h"
#include "wire/grpc_status.h"
#include "wire/incarnation.h"

namespace layercast::client {

namespace {

// Whether `failed` says the set a mirror pulls from died (or stopped
// answering), so that it goes on from its fallback.
bool SourceDied(const absl::Status& failed) {
  return absl::IsUnavailable(failed) || absl::IsDeadlineExceeded(failed);
}

void LogFallBack(const ShardSet& from, const ShardSet& to, const absl::Status& failed,
                 ClientMetrics* metrics) {
  Log()->warn("mirror: the upstream {} failed ({}); following {} from now on",
              absl::StrJoin(from.addresses(), ","), failed.message(),
              absl::StrJoin(to.addresses(), ","));
  if (metrics != nullptr) metrics->RecordMirrorFallback();
}

// Checks a layer `source` gave at `version` against options.verify_with's
// digests. Bytes that differ are pulled again in full (with `gather`, so its
// outputs count the new pull) from the next source, `fallback` or else
// the verifying shards, at the same version; bytes the shards can no
// longer vouch for (one restarted since, or no longer keeps the version)
// are pulled again from the verifying shards at their newest. Then checked
// again, once.
absl::StatusOr<uint64_t> Verified(const ShardSet& source, const ShardSet* fallback,
                                  const MirrorOptions& options, ClientMetrics* metrics,
                                  uint32_t layer, const AssembledLayout& layout,
                                  GatherOptions gather, uint64_t version,
                                  std::span<uint8_t> bytes) {
  if (options.verify_with == nullptr) return version;
  const ShardSet& shards = *options.verify_with;
  const absl::Status checked =
      shards.CheckDigests(layer, version, options.dtype, layout, bytes, gather.incarnations);
  if (checked.ok()) return version;
  const bool altered = absl::IsDataLoss(checked);
  if (!altered && !absl::IsAborted(checked)) return checked;
  const ShardSet& next = altered && fallback != nullptr ? *fallback : shards;
  Log()->warn("mirror: layer {} from {}: {}; pulling it again in full from {}", layer,
              absl::StrJoin(source.addresses(), ","), checked.message(),
              absl::StrJoin(next.addresses(), ","));
  if (altered && metrics != nullptr) {
    metrics->RecordReread(ClientMetrics::Reread::kDigestMismatch);
  }
  gather.base_version.reset();
  gather.min_version = version;
  if (altered) {
    gather.exact_version = version;
  } else {
    gather.exact_version.reset();
  }
  ASSIGN_OR_RETURN(const uint64_t again, next.GatherInto(layer, gather, bytes));
  const absl::Status rechecked =
      shards.CheckDigests(layer, again, options.dtype, layout, bytes, gather.incarnations);
  if (!rechecked.ok()) {
    return absl::Status(rechecked.code(),
                        absl::StrCat(rechecked.message(), " (pulled again from ",
                                     absl::StrJoin(next.addresses(), ","), " too)"));
  }
  return again;
}

}  // namespace

absl::StatusOr<std::unique_ptr<ModelMirror>> ModelMirror::Create(const ShardSet& shards,
                                                                 MirrorOptions options) {
  std::vector<const ShardSet*> sources = {&shards};
  for (const ShardSet* fallback : options.fallbacks) {
    if (fallback != nullptr) sources.push_back(fallback);
  }
  if (options.fallback != nullptr &&
      std::find(sources.begin(), sources.end(), options.fallback) == sources.end()) {
    sources.push_back(options.fallback);
  }
  for (size_t i = 1; i < sources.size(); ++i) {
    const ShardSet& fallback = *sources[i];
    if (fallback.manifests().size() != shards.manifests().size() ||
        fallback.manifests()[0].layout_digest() != shards.manifests()[0].layout_digest() ||
        fallback.manifests()[0].content_fingerprint() !=
            shards.manifests()[0].content_fingerprint()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "fallback ", i, " (", absl::StrJoin(fallback.addresses(), ","),
          ") is not the set the upstream (", absl::StrJoin(shards.addresses(), ","),
          ") serves (shards, layout or model differ): give the shards a relay follows, or "
          "relays of them"));
    }
  }
  absl::StatusOr<std::unique_ptr<ModelMirror>> mirror = Walk(sources, 0, options, shards.metrics());
  for (size_t at = 1; at < sources.size() && !mirror.ok() && SourceDied(mirror.status()); ++at) {
    LogFallBack(*sources[at - 1], *sources[at], mirror.status(), shards.metrics());
    mirror = Walk(sources, at, options, shards.metrics());
  }
  return mirror;
}

absl::StatusOr<std::unique_ptr<ModelMirror>> ModelMirror::Walk(std::vector<const ShardSet*> sources,
                                                               size_t at,
                                                               const MirrorOptions& options,
                                                               ClientMetrics* metrics) {
  const ShardSet& shards = *sources[at];
  const ShardSet* next = at + 1 < sources.size() ? sources[at + 1] : nullptr;
  // Every layer at the version the shards serve now, pinned, so a publish
  // committed during the walk does not split it; a layer whose version the
  // shards no longer keep is pulled at its newest, and the update below
  // brings the rest there.
  ASSIGN_OR_RETURN(const uint64_t start, shards.CurrentVersion());
  if (options.listener != nullptr) options.listener->Pulling(start);
  const wire::ShardSetView& view = shards.view();
  // Moved into the mirror whole: the layers' pointers stay valid.
  std::vector<AssembledLayout> layouts;
  if (options.dtype) {
    for (const AssembledLayout& served : view.layouts) {
      ASSIGN_OR_RETURN(AssembledLayout layout,
                       LayoutIn(served, *options.dtype, view.policy.fp8_block()));
      layouts.push_back(std::move(layout));
    }
  }
  std::vector<Layer> layers;
  std::vector<std::vector<uint64_t>> incarnations(shards.model().layers.size());
  uint64_t newest = start;
  for (uint32_t layer = 0; layer < shards.model().layers.size(); ++layer) {
    GatherOptions gather;
    gather.timeout = options.layer_timeout;
    gather.exact_version = start;
    gather.will_pull_deltas = true;
    gather.incarnations = &incarnations[layer];
    gather.dtype = options.dtype;
    uint64_t received = 0;
    gather.on_chunk = [&received](uint64_t chunk) { received += chunk; };
    const AssembledLayout& layout = options.dtype ? layouts[layer] : view.layouts[layer];
    ASSIGN_OR_RETURN(LayerBuffer buffer, LayerBuffer::Allocate(layout.total_bytes()));
    const std::span<uint8_t> bytes(buffer.data(), buffer.size());
    absl::StatusOr<uint64_t> pulled = shards.GatherInto(layer, gather, bytes);
    if (absl::IsAborted(pulled.status())) {
      gather.exact_version.reset();
      gather.min_version = newest;
      pulled = shards.GatherInto(layer, gather, bytes);
    }
    if (!pulled.ok()) return pulled.status();
    pulled = Verified(shards, next, options, metrics, layer, layout, gather, *pulled, bytes);
    if (!pulled.ok()) return pulled.status();
    newest = std::max(newest, *pulled);
    if (options.listener != nullptr) {
      options.listener->Pulled({.layer = layer,
                                .version = *pulled,
                                .changed = true,
                                .bytes = bytes,
                                .incarnations = &incarnations[layer],
                                .received = received});
    }
    layers.emplace_back(layer, &view.model.layers[layer], &layout, *pulled, std::move(buffer));
  }
  std::unique_ptr<ModelMirror> mirror(new ModelMirror(std::move(sources), at, metrics, options,
                                                      std::move(layouts), std::move(layers),
                                                      std::move(incarnations)));
  // A publish committed during the walk: the layers before it are brought
  // to the same version.
  if (mirror->version() < newest) RETURN_IF_ERROR(mirror->Update(newest).status());
  return mirror;
}

ModelMirror::ModelMirror(std::vector<const ShardSet*> sources, size_t at, ClientMetrics* metrics,
                         MirrorOptions options, std::vector<AssembledLayout> layouts,
                         std::vector<Layer> layers, std::vector<std::vector<uint64_t>> incarnations)
    : options_(std::move(options)),
      sources_(std::move(sources)),
      at_(at),
      metrics_(metrics),
      layouts_(std::move(layouts)),
      layers_(std::move(layers)),
      torn_(layers_.size(), false),
      incarnations_(std::move(incarnations)) {
  absl::ReaderMutexLock lock(&mu_);
  version_.store(VersionLocked());
  for (uint32_t i = 0; i < layers_.size(); ++i) {
    told_.emplace_back(layers_[i].version(), incarnations_[i]);
  }
}

void ModelMirror::Tell(uint32_t layer, const Pulled& pulled, bool changed,
                       std::span<const uint8_t> bytes) {
  // Once per version: a staged layer told as it landed is not told again
  // as it is copied in, nor when a failed update is tried again.
  if (told_[layer].first == pulled.version && told_[layer].second == pulled.incarnations) {
    return;
  }
  told_[layer] = {pulled.version, pulled.incarnations};
  options_.listener->Pulled({.layer = layer,
                             .version = pulled.version,
                             .changed = changed,
                             .bytes = bytes,
                             .incarnations = &told_[layer].second,
                             .received = pulled.received});
}

ModelMirror::~ModelMirror() { StopFollowing(); }

uint64_t ModelMirror::VersionLocked() const {
  uint64_t lowest = UINT64_MAX;
  for (const Layer& layer : layers_) lowest = std::min(lowest, layer.version());
  return layers_.empty() ? 0 : lowest;
}

uint64_t ModelMirror::HeldIncarnationLocked() const {
  return incarnations_.empty() || incarnations_[0].empty() ? 0 : incarnations_[0][0];
}

absl::StatusOr<ModelMirror::Polled> ModelMirror::Poll(uint64_t min_version, uint64_t incarnation,
                                                      Cancellation& cancel) {
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + options_.poll);
  const uint64_t cancel_id = cancel.Register([&context] { context.TryCancel(); });
  layercast::v1::WaitVersionRequest request;
  request.set_min_version(min_version);
  if (incarnation != 0) request.set_incarnation(incarnation);
  layercast::v1::WaitVersionResponse response;
  const ShardSet& source = this->source();
  const grpc::Status status = source.stub(0).WaitVersion(&context, request, &response);
  if (cancel_id != 0) cancel.Unregister(cancel_id);
  RETURN_IF_ERROR(
      wire::FromGrpcStatus(status, absl::StrCat("shard 0 (", source.addresses()[0], ")")));
  return Polled{response.version(), response.incarnation()};
}

ModelMirror::Pulled ModelMirror::Pull(uint32_t layer, uint64_t target, std::optional<uint64_t> base,
                                      std::vector<uint64_t> base_incarnations,
                                      std::span<uint8_t> bytes, Cancellation* cancel) const {
  std::atomic<uint64_t> received{0};
  Pulled pulled;
  GatherOptions gather;
  gather.timeout = options_.layer_timeout;
  // Pinned: a publish committed during the walk leaves the layers after
  // it at `target` too, so the walk ends with one version. A shard that no
  // longer keeps it (ABORTED) gives the layer at its newest instead.
  gather.exact_version = target;
  gather.base_version = base;
  // A shard restarted since refuses the delta (its versions may name
  // other values) and the layer comes in full.
  gather.base_incarnations = std::move(base_incarnations);
  gather.incarnations = &pulled.incarnations;
  gather.will_pull_deltas = true;
  gather.dtype = options_.dtype;
  gather.on_chunk = [&received](uint64_t chunk) { received += chunk; };
  gather.changed_elements = &pulled.changed;
  gather.cancellation = cancel;
  const ShardSet& source = this->source();
  absl::StatusOr<uint64_t> version = source.GatherInto(layer, gather, bytes);
  // Chunks applied before the refusal are repaired by the second pull: a
  // delta from the same base gives the newer values exactly.
  if (absl::IsAborted(version.status()) && (cancel == nullptr || !cancel->cancelled())) {
    gather.exact_version.reset();
    gather.min_version = target;
    version = source.GatherInto(layer, gather, bytes);
  }
  if (version.ok()) {
    const AssembledLayout& layout = options_.dtype ? layouts_[layer] : source.view().layouts[layer];
    version = Verified(source, NextAfter(source), options_, metrics_, layer, layout, gather,
                       *version, bytes);
  }
  pulled.received = received.load();
  pulled.status = version.status();
  if (version.ok()) pulled.version = *version;
  return pulled;
}

const ShardSet* ModelMirror::NextAfter(const ShardSet& from) const {
  const auto it = std::find(sources_.begin(), sources_.end(), &from);
  return it == sources_.end() || it + 1 == sources_.end() ? nullptr : *(it + 1);
}

bool ModelMirror::FallBack(const absl::Status& failed) {
  const size_t at = at_.load();
  // A probe found the source dead and cancelled what was waiting on it.
  const bool found_dead = absl::IsCancelled(failed) && dead_.load() == at;
  if (at + 1 >= sources_.size() || !(SourceDied(failed) || found_dead)) return false;
  LogFallBack(*sources_[at], *sources_[at + 1], failed, metrics_);
  dead_.store(SIZE_MAX);
  back_to_.store(SIZE_MAX);
  at_.store(at + 1);
  return true;
}

absl::StatusOr<MirrorUpdate> ModelMirror::Update(std::optional<uint64_t> min_version) {
  return UpdateWith(min_version, /*following=*/false);
}

std::shared_ptr<Cancellation> ModelMirror::NewTurn(bool updating) {
  absl::MutexLock lock(&follow_mu_);
  if (stopping_) return nullptr;
  turn_ = std::make_shared<Cancellation>();
  updating_ = updating;
  // A probe found the source dead between turns: this one ends at once,
  // and falls back.
  if (dead_.load() == at_.load()) turn_->Cancel();
  return turn_;
}

absl::StatusOr<MirrorUpdate> ModelMirror::UpdateWith(std::optional<uint64_t> min_version,
                                                     bool following) {
  absl::MutexLock update_lock(&update_mu_);
  const auto start = std::chrono::steady_clock::now();
  MirrorUpdate update;
  // The follower's update is cancelled by StopFollowing and by a probe that
  // finds the source dead: each source tried gets its own turn.
  std::shared_ptr<Cancellation> turn;
  const auto next_turn = [&]() -> absl::Status {
    if (!following) return absl::OkStatus();
    turn = NewTurn(/*updating=*/true);
    if (turn == nullptr) return absl::CancelledError("the mirror stopped following");
    return absl::OkStatus();
  };
  absl::Status status = next_turn();
  if (status.ok()) status = UpdateFrom(min_version, start, turn.get(), update);
  // What the dead source left undone (a layer torn midway included) is
  // pulled from the next, from the same bases; `update` keeps what the
  // source did bring.
  for (size_t tries = 0; tries < sources_.size() && !status.ok() && FallBack(status); ++tries) {
    status = next_turn();
    if (status.ok()) status = UpdateFrom(min_version, start, turn.get(), update);
  }
  RETURN_IF_ERROR(status);
  return update;
}

absl::Status ModelMirror::UpdateFrom(std::optional<uint64_t> min_version,
                                     std::chrono::steady_clock::time_point start,
                                     Cancellation* cancel, MirrorUpdate& update) {
  // Which incarnations serve now: a layer from others holds a number
  // whose bits the set may no longer serve.
  ASSIGN_OR_RETURN(const ShardSet::Identity now,
                   source().CurrentIdentity(std::min<std::chrono::milliseconds>(
                                                options_.layer_timeout, std::chrono::seconds(10)),
                                            cancel));
  const size_t num_layers = source().model().layers.size();
  std::vector<bool> restarted(num_layers, false);
  {
    absl::ReaderMutexLock lock(&mu_);
    for (uint32_t i = 0; i < layers_.size(); ++i) {
      restarted[i] = wire::OtherIncarnations(incarnations_[i], now.incarnations);
    }
  }
  const auto n = std::count(restarted.begin(), restarted.end(), true);
  // After a restart the set's count is the one to reach: a min_version
  // asked for before it counts in the old numbers.
  const uint64_t target = n > 0 ? now.version : min_version.value_or(now.version);
  if (options_.listener != nullptr) options_.listener->Pulling(target);
  std::vector<uint32_t> behind;
  {
    absl::ReaderMutexLock lock(&mu_);
    for (uint32_t i = 0; i < layers_.size(); ++i) {
      if (layers_[i].version() < target || torn_[i] || restarted[i]) behind.push_back(i);
    }
  }
  if (n > 0) {
    Log()->warn(
        "mirror: the set serves other incarnations ({}) than {} layer(s) came from: it "
        "restarted, and its version numbers may name other values now; pulling those layers in "
        "full at version {}",
        absl::StrJoin(now.incarnations, ","), n, target);
    if (metrics_ != nullptr) metrics_->RecordReread(ClientMetrics::Reread::kSetRestarted, n);
  }
  const auto base_of = [&](uint32_t i) ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    return restarted[i] ? std::nullopt : std::optional<uint64_t>(layers_[i].version());
  };
  std::vector<bool> done(num_layers, false);
  // Readers read on while the layers that fit in staging_bytes are pulled
  // into copies of themselves (only this thread writes the layers: it holds
  // update_mu_).
  struct Staged {
    uint32_t layer;
    LayerBuffer copy;
    Pulled pulled;
  };
  std::vector<Staged> staged;
  uint64_t staging = 0;
  for (const uint32_t i : behind) {
    std::optional<uint64_t> base;
    std::vector<uint64_t> base_incarnations;
    std::span<const uint8_t> live;
    {
      absl::ReaderMutexLock lock(&mu_);
      live = layers_[i].bytes();
      base = base_of(i);
      base_incarnations = incarnations_[i];
    }
    if (live.size() > options_.staging_bytes - staging) continue;  // in place, below
    ASSIGN_OR_RETURN(LayerBuffer copy, LayerBuffer::Allocate(live.size()));
    {
      absl::ReaderMutexLock lock(&mu_);
      std::memcpy(copy.data(), live.data(), live.size());
    }
    Pulled pulled =
        Pull(i, target, base, std::move(base_incarnations), {copy.data(), copy.size()}, cancel);
    update.bytes += pulled.received;
    // A failure here leaves the live layers as they were.
    RETURN_IF_ERROR(pulled.status);
    staging += live.size();
    // A relay serves each layer on as it lands, not once the whole update
    // has: told here, from the copy, rather than as it is copied in.
    if (options_.listener != nullptr) {
      bool changed = pulled.changed > 0;
      {
        absl::ReaderMutexLock lock(&mu_);
        // What it was told last may not be what the layer holds (an
        // update that failed after telling it): its values may differ.
        changed = changed || torn_[i] || told_[i].first != layers_[i].version();
      }
      Tell(i, pulled, changed, {copy.data(), copy.size()});
    }
    staged.push_back({i, std::move(copy), std::move(pulled)});
  }
  // Readers are held off from here: none sees some layers new and others
  // old. Staged layers are copied in; the rest are pulled in place.
  const auto pause_start = std::chrono::steady_clock::now();
  absl::MutexLock lock(&mu_);
  const auto settle = [&](uint32_t i, Pulled& pulled) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_,
                                                                                    update_mu_) {
    layers_[i].set_version(pulled.version);
    incarnations_[i] = std::move(pulled.incarnations);
    ++update.layers;
    const bool changed = pulled.changed > 0 || torn_[i];
    torn_[i] = false;
    if (changed) update.changed_layers.push_back(i);
    if (options_.listener != nullptr) {
      pulled.incarnations = incarnations_[i];
      Tell(i, pulled, changed || told_[i].first != pulled.version, layers_[i].bytes());
    }
  };
  for (Staged& s : staged) {
    if (s.pulled.changed > 0 || torn_[s.layer]) {
      std::memcpy(layers_[s.layer].mutable_bytes().data(), s.copy.data(), s.copy.size());
    }
    ++update.staged_layers;
    settle(s.layer, s.pulled);
    done[s.layer] = true;
  }
  staged.clear();  // the copies' memory goes back before the in-place pulls
  version_.store(VersionLocked());
  for (const uint32_t i : behind) {
    if (done[i]) continue;  // staged above
    Pulled pulled =
        Pull(i, target, base_of(i), incarnations_[i], layers_[i].mutable_bytes(), cancel);
    update.bytes += pulled.received;
    if (!pulled.status.ok()) {
      // Chunks already applied leave a mix; a delta from the same base
      // repairs it (ChunkDecoder), so the base stays.
      if (pulled.received > 0) torn_[i] = true;
      version_.store(VersionLocked());
      return pulled.status;
    }
    settle(i, pulled);
  }
  std::sort(update.changed_layers.begin(), update.changed_layers.end());
  update.changed_layers.erase(
      std::unique(update.changed_layers.begin(), update.changed_layers.end()),
      update.changed_layers.end());
  update.version = VersionLocked();
  version_.store(update.version);
  const auto end = std::chrono::steady_clock::now();
  update.pause = end - pause_start;
  update.duration = end - start;
  if (ClientMetrics* metrics = metrics_; metrics != nullptr) {
    metrics->RecordMirrorUpdate(update.version, target,
                                std::chrono::duration<double>(update.pause).count(),
                                std::chrono::duration<double>(update.duration).count());
  }
  return absl::OkStatus();
}

bool ModelMirror::WaitForVersion(uint64_t version, std::chrono::milliseconds timeout) const {
  const auto reached = [this, version]()
                           ABSL_SHARED_LOCKS_REQUIRED(mu_) { return VersionLocked() >= version; };
  const bool ok =
      mu_.ReaderLockWhenWithTimeout(absl::Condition(&reached), absl::FromChrono(timeout));
  mu_.ReaderUnlock();
  return ok;
}

void ModelMirror::Follow(std::function<void(const MirrorUpdate&)> on_update) {
  absl::MutexLock lock(&follower_mu_);
  if (follower_.joinable()) return;
  {
    absl::MutexLock follow_lock(&follow_mu_);
    stopping_ = false;
  }
  follower_ = std::thread([this, on_update = std::move(on_update)] { FollowLoop(on_update); });
  if (sources_.size() > 1 && options_.probe > std::chrono::milliseconds(0)) {
    auto stop = std::make_shared<Cancellation>();
    {
      absl::MutexLock follow_lock(&follow_mu_);
      stop_probes_ = stop;
    }
    prober_ = std::thread([this, stop] { ProbeLoop(stop); });
  }
}

void ModelMirror::StopFollowing() {
  absl::MutexLock lock(&follower_mu_);
  if (!follower_.joinable()) return;
  std::shared_ptr<Cancellation> turn, probes;
  {
    absl::MutexLock follow_lock(&follow_mu_);
    stopping_ = true;
    turn = turn_;
    probes = std::move(stop_probes_);
  }
  // Outside follow_mu_: a gather's cancel callback takes the gather's lock.
  if (turn != nullptr) turn->Cancel();
  if (probes != nullptr) probes->Cancel();
  follower_.join();
  if (prober_.joinable()) prober_.join();
}

void ModelMirror::CancelTurn(bool updates) {
  std::shared_ptr<Cancellation> turn;
  {
    absl::MutexLock lock(&follow_mu_);
    if (updating_ && !updates) return;
    turn = turn_;
  }
  if (turn != nullptr) turn->Cancel();
}

namespace {

// What `source`'s shard 0 serves now, within `timeout`: a cheap call that
// a stopped process, or one that refuses connections, fails.
absl::StatusOr<uint64_t> Probe(const ShardSet& source, std::chrono::milliseconds timeout,
                               Cancellation& cancel) {
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + timeout);
  const uint64_t cancel_id = cancel.Register([&context] { context.TryCancel(); });
  layercast::v1::WaitVersionRequest request;  // min_version 0: answered at once
  layercast::v1::WaitVersionResponse response;
  const grpc::Status status = source.stub(0).WaitVersion(&context, request, &response);
  if (cancel_id != 0) cancel.Unregister(cancel_id);
  RETURN_IF_ERROR(
      wire::FromGrpcStatus(status, absl::StrCat("shard 0 (", source.addresses()[0], ")")));
  return response.version();
}

}  // namespace

void ModelMirror::ProbeLoop(std::shared_ptr<Cancellation> stop) {
  // Bounded by StopFollowing: each turn waits options_.probe or ends at
  // stopping_, and each probe ends within options_.probe.
  for (;;) {
    {
      absl::MutexLock lock(&follow_mu_);
      follow_mu_.AwaitWithTimeout(absl::Condition(&stopping_), absl::FromChrono(options_.probe));
      if (stopping_) return;
    }
    const size_t at = at_.load();
    // The last source is followed whatever it does: there is no other.
    if (at + 1 < sources_.size() && dead_.load() != at) {
      const absl::StatusOr<uint64_t> answered = Probe(*sources_[at], options_.probe, *stop);
      if (!answered.ok() && SourceDied(answered.status()) && at_.load() == at) {
        Log()->warn("mirror: probing {}: {}; leaving it",
                    absl::StrJoin(sources_[at]->addresses(), ","), answered.status().message());
        dead_.store(at);
        CancelTurn(/*updates=*/true);
        continue;
      }
    }
    // A source preferred to the one followed: gone back to once it answers
    // at the mirror's version or newer (a relay that restarted and caught
    // up), between updates.
    const uint64_t held = version();
    for (size_t preferred = 0; preferred < at && back_to_.load() == SIZE_MAX; ++preferred) {
      const absl::StatusOr<uint64_t> answered = Probe(*sources_[preferred], options_.probe, *stop);
      if (answered.ok() && *answered >= held) {
        back_to_.store(preferred);
        CancelTurn(/*updates=*/false);
      }
    }
  }
}

void ModelMirror::FollowLoop(std::function<void(const MirrorUpdate&)> on_update) {
  // platform::kMirrorFollow's waits, as the options set them; not Retry:
  // the loop follows until StopFollowing, whose wait below it ends.
  platform::Backoff backoff(options_.backoff, options_.max_backoff);
  // Bounded by StopFollowing: each turn is one poll (at most options_.poll)
  // or one update, each cancelled by it, and every wait ends at stopping_.
  for (;;) {
    if (const size_t back = back_to_.exchange(SIZE_MAX); back < at_.load()) {
      Log()->info("mirror: {} answers again at version {} or newer; following it again",
                  absl::StrJoin(sources_[back]->addresses(), ","), version());
      dead_.store(SIZE_MAX);
      at_.store(back);
    }
    uint64_t held = 0, incarnation = 0;
    bool mixed = false;
    {
      absl::ReaderMutexLock lock(&mu_);
      held = VersionLocked();
      incarnation = HeldIncarnationLocked();
      // Layers of two incarnations (a pull that landed from a source still
      // catching up with a restart): the update pulls the older again.
      for (const std::vector<uint64_t>& layer : incarnations_) {
        mixed = mixed || wire::OtherIncarnations(layer, incarnations_[0]);
      }
    }
    const std::shared_ptr<Cancellation> turn = NewTurn(/*updating=*/false);
    if (turn == nullptr) return;
    absl::StatusOr<Polled> newest = Poll(mixed ? 0 : held + 1, incarnation, *turn);
    absl::Status failed;
    // Another incarnation counts again: its version is news even when lower.
    if (newest.ok() &&
        (newest->version > held || mixed ||
         (incarnation != 0 && newest->incarnation != 0 && newest->incarnation != incarnation))) {
      absl::StatusOr<MirrorUpdate> update = UpdateWith(newest->version, /*following=*/true);
      if (!update.ok()) {
        failed = update.status();
      } else if (mixed && update->layers == 0) {
        // Nothing to pull again against what the set names now (a source
        // that names no incarnation): wait, rather than ask at once again.
        failed = absl::FailedPreconditionError(
            "layers hold versions of two incarnations of a shard and the source names none of "
            "them as its own; asking again");
      } else if (on_update) {
        on_update(*update);
      }
    } else if (!newest.ok()) {
      failed = newest.status();
      // A dead source is seen here first while nothing is new; a poll
      // cancelled to go back to a preferred source is no failure.
      if (FallBack(failed) || (absl::IsCancelled(failed) && back_to_.load() != SIZE_MAX)) {
        failed = absl::OkStatus();
      }
    }
    absl::MutexLock lock(&follow_mu_);
    turn_ = nullptr;
    if (stopping_) return;
    if (failed.ok()) {
      backoff.Reset();
      continue;
    }
    const std::chrono::milliseconds wait = backoff.Next();
    Log()->warn("mirror at version {}: {}; retrying in {} ms", held, failed.message(),
                wait.count());
    follow_mu_.AwaitWithTimeout(absl::Condition(&stopping_), absl::FromChrono(wait));
    if (stopping_) return;
  }
}

absl::Status ModelMirror::Reading::status() const ABSL_NO_THREAD_SAFETY_ANALYSIS {
  std::vector<uint32_t> torn;
  for (uint32_t i = 0; i < mirror_->torn_.size(); ++i) {
    if (mirror_->torn_[i]) torn.push_back(i);
  }
  if (torn.empty()) return absl::OkStatus();
  return absl::DataLossError(absl::StrCat(
      "layer(s) ", absl::StrJoin(torn, ", "),
      " hold a mix of two versions: their last pull failed midway; the next update repairs them"));
}

}  // namespace layercast::client
