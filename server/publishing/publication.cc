#include "server/publishing/publication.h"

#include <algorithm>
#include <cstring>
#include <new>

#include "absl/strings/str_cat.h"
#include "core/cast.h"
#include "core/crc32c.h"
#include "platform/byte_size.h"
#include "platform/failpoint.h"
#include "platform/log.h"
#include "platform/status_macros.h"

namespace layercast::server {
namespace {

constexpr std::chrono::milliseconds kDefaultTimeout{60000};

// On the shard's background thread, or one of its own on `links.clock`.
DeadlineTimers TimersFor(const Publications::Links& links) {
  if (links.background != nullptr) return DeadlineTimers(links.background);
  return DeadlineTimers(links.clock != nullptr ? *links.clock : platform::Clock::Steady());
}

}  // namespace

Publications::Publications(Links links) : Publications(links, SetOptions{}) {}

Publications::Publications(Links links, SetOptions set)
    : links_(links),
      master_({.store = links.store,
               .gate = links.gate,
               .changes = links.changes,
               .pinned = links.pinned}),
      idle_(set.idle),
      peers_(std::move(set.peers)),
      timers_(TimersFor(links)) {}

Publications::~Publications() {
  absl::MutexLock lock(&mu_);
  // Reset, so that a settle that ends while peers_ goes (its calls_ waits
  // for the call under way) finds nothing.
  if (open_) links_.budget->Release(open_->staging_bytes);
  open_.reset();
}

absl::StatusOr<uint64_t> Publications::Begin(const layercast::v1::BeginPublishRequest& request) {
  const ParameterStore& store = *links_.store;
  const auto layers = static_cast<uint32_t>(store.model().layers.size());
  if (request.publish_id().empty()) {
    return absl::InvalidArgumentError("a publish needs a publish_id, the same on every shard");
  }
  absl::MutexLock lock(&mu_);
  const auto now = timers_.Now();
  if (open_ && open_->id == request.publish_id()) {
    open_->last_call = now;
    return open_->staging_bytes;
  }
  if (open_ && peers_ == nullptr) {
    return absl::AbortedError(absl::StrCat(
        "publish ", open_->id, " is open on this shard; commit or abort it first (it times out ",
        "by itself)"));
  }
  if (open_) {
    const auto idle = std::chrono::duration_cast<std::chrono::milliseconds>(now - open_->last_call);
    if (idle >= idle_) {
      SettleOpen(absl::StrCat("its publisher stopped (no call for ", idle.count(),
                              " ms) and publish ", request.publish_id(), " begins"));
    }
    if (open_) {
      return absl::UnavailableError(absl::StrCat(
          "publish ", open_->id, " is open on this shard (its last call ", idle.count(),
          " ms ago); once ", idle_.count(),
          " ms idle it is settled with the set, committed or aborted: begin again shortly"));
    }
  }
  if (const Decision* decided = Decided(request.publish_id())) {
    return absl::AbortedError(absl::StrCat("publish ", request.publish_id(), " was ",
                                           decided->committed ? "committed" : "aborted",
                                           " here already: publish again under a new publish_id"));
  }
  std::vector<bool> selected(layers, request.layers().empty());
  for (const uint32_t layer : request.layers()) {
    if (layer >= layers) {
      return absl::InvalidArgumentError(
          absl::StrCat("layer ", layer, " does not exist: this model has ", layers, " layers"));
    }
    selected[layer] = true;
  }
  const bool every_layer =
      std::all_of(selected.begin(), selected.end(), [](bool layer) { return layer; });
  bool levels = false;
  for (uint32_t l = 0; l < layers; ++l) {
    const uint64_t version = links_.gate->version(l);
    if (version == request.base_version()) continue;
    // A shard behind the set (restarted without its checkpoint) takes a
    // publish that replaces every layer: afterwards it holds the set's values.
    if (version < request.base_version() && every_layer) {
      levels = true;
      continue;
    }
    return absl::FailedPreconditionError(absl::StrCat(
        "layer ", l, " of this shard is at version ", version, ", not the publish's base_version ",
        request.base_version(), ": publish on top of the version the shards serve (the ",
        "manifest's)",
        version < request.base_version()
            ? "; this shard is behind the set: a publish of every layer brings it level"
            : ""));
  }
  uint64_t bytes = 0;
  for (uint32_t l = 0; l < layers; ++l) {
    if (!selected[l]) continue;
    for (uint32_t t = 0; t < store.model().layers[l].tensors.size(); ++t) {
      bytes += store.owned(l, t).size() * sizeof(float);
    }
  }
  if (!links_.budget->TryAcquire(bytes)) {
    const std::optional<uint64_t> budget = links_.budget->budget();
    return absl::ResourceExhaustedError(absl::StrCat(
        "staging this publish takes ", FormatBytes(bytes), " of fp32 on this shard, more than ",
        "the room its --memory-budget of ", budget ? FormatBytes(*budget) : "unlimited",
        " has left now (", FormatBytes(links_.budget->in_use()),
        " in use): publish fewer layers at a time, or raise the budget"));
  }
  Open open;
  open.id = request.publish_id();
  open.base_version = request.base_version();
  open.selected = selected;
  open.staging_bytes = bytes;
  open.levels = levels;
  open.begun = now;
  open.last_call = now;
  try {
    open.staged.resize(layers);
    open.next.resize(layers);
    for (uint32_t l = 0; l < layers; ++l) {
      if (!selected[l]) continue;
      for (uint32_t t = 0; t < store.model().layers[l].tensors.size(); ++t) {
        open.staged[l].emplace_back(store.owned(l, t).size());
        open.next[l].push_back(store.owned(l, t).begin);
      }
    }
  } catch (const std::bad_alloc&) {
    links_.budget->Release(bytes);
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot allocate ", FormatBytes(bytes),
                     " to stage this publish; publish fewer layers at a "
                     "time"));
  }
  const std::chrono::milliseconds timeout =
      request.timeout_ms() == 0 ? kDefaultTimeout : std::chrono::milliseconds(request.timeout_ms());
  open.timer = timers_.Schedule(now + timeout, [this, id = request.publish_id(), timeout] {
    absl::MutexLock lock(&mu_);
    if (!open_ || open_->id != id) return;
    SettleOpen(absl::StrCat("not committed within its timeout of ", timeout.count(), " ms"));
  });
  open_ = std::move(open);
  Log()->info("publish {}: staging {} for version {}{}", request.publish_id(), FormatBytes(bytes),
              request.base_version() + 1,
              levels ? " (this shard is behind: the publish brings it level)" : "");
  return bytes;
}

absl::Status Publications::Stage(const layercast::v1::PublishChunk& chunk) {
  const ParameterStore& store = *links_.store;
  absl::MutexLock lock(&mu_);
  if (!open_ || open_->id != chunk.publish_id()) {
    return absl::NotFoundError(absl::StrCat(
        "publish ", chunk.publish_id(), " is not open on this shard (never begun, or committed, ",
        "aborted or timed out since): begin it again"));
  }
  Open& open = *open_;
  open.last_call = timers_.Now();
  if (chunk.layer() >= open.selected.size() || !open.selected[chunk.layer()]) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer ", chunk.layer(), " is not one publish ", open.id, " replaces"));
  }
  const uint32_t layer = chunk.layer();
  if (chunk.tensor() >= open.staged[layer].size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor ", chunk.tensor(), " of layer ", layer, " does not exist"));
  }
  const uint32_t tensor = chunk.tensor();
  const DType compute = store.layout(layer).tensors()[tensor].compute_dtype;
  const auto dtype = static_cast<DType>(chunk.dtype());
  // 8-bit codes without their scales have no values: FLOAT32 only.
  if (dtype != DType::kFloat32 && (dtype != compute || IsFloat8(dtype))) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tensor ", store.model().layers[layer].tensors[tensor].name, " is published in FLOAT32",
        IsFloat8(compute) ? "" : absl::StrCat(" or its compute dtype ", DTypeName(compute)),
        ", not dtype ", chunk.dtype()));
  }
  const uint64_t size = DTypeSize(dtype);
  const ElementRange owned = store.owned(layer, tensor);
  uint64_t& next = open.next[layer][tensor];
  const uint64_t offset = chunk.element_offset();
  const uint64_t count = chunk.data().size() / size;
  if (chunk.data().size() % size != 0 || count == 0 || (offset != next && offset != owned.begin) ||
      offset < owned.begin || count > owned.end - offset) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tensor ", store.model().layers[layer].tensors[tensor].name, ": ", chunk.data().size(),
        " bytes from element ", offset, " where this shard owns [", owned.begin, ", ", owned.end,
        ") and expects element ", next, " next (or ", owned.begin, " to start over)"));
  }
  if (chunk.has_crc32c() && Crc32c(chunk.data().data(), chunk.data().size()) != chunk.crc32c()) {
    return absl::DataLossError(
        absl::StrCat("the chunk of tensor ", store.model().layers[layer].tensors[tensor].name,
                     " from element ", offset, " fails its CRC-32C; send it again"));
  }
  CastToF32(chunk.data().data(), dtype, open.staged[layer][tensor].data() + (offset - owned.begin),
            count);
  next = offset + count;
  return absl::OkStatus();
}

absl::StatusOr<Publications::Committed> Publications::Commit(const std::string& publish_id) {
  absl::MutexLock lock(&mu_);
  if (const Decision* decided = Decided(publish_id)) {
    if (decided->committed) return *decided->committed;
    return absl::AbortedError(absl::StrCat(
        "publish ", publish_id, " was aborted on this shard",
        peers_ != nullptr && peers_->decides() ? " (the set's decision: it is never committed)"
                                               : "",
        "; the shards keep their version: publish again under a new publish_id"));
  }
  if (!open_ || open_->id != publish_id) {
    return absl::NotFoundError(
        absl::StrCat("publish ", publish_id,
                     " is not open on this shard (never begun, aborted, timed out, or the shard "
                     "restarted): stage it here again, or abort it everywhere and publish again"));
  }
  FailPoint("publish.shard_before_commit", links_.store->shard_index());
  ASSIGN_OR_RETURN(const Committed committed, CommitOpen("committed"));
  FailPoint("publish.shard_after_commit", links_.store->shard_index());
  if (peers_ != nullptr && peers_->decides()) {
    peers_->HandOn(publish_id);
    // Shard 0 only: the hand-on is under way (sent to some peers, all or
    // none), the publisher not answered.
    FailPoint("publish.shard_after_hand_on", links_.store->shard_index());
  }
  return committed;
}

absl::StatusOr<Publications::Committed> Publications::CommitOpen(absl::string_view outcome) {
  const auto commit_start = timers_.Now();
  absl::StatusOr<Committed> committed = CommitLocked(*open_);
  if (!committed.ok()) return committed.status();
  timers_.Cancel(open_->timer);
  links_.budget->Release(open_->staging_bytes);
  if (links_.metrics != nullptr) {
    links_.metrics->RecordPublish(
        std::chrono::duration<double>(commit_start - open_->begun).count(),
        std::chrono::duration<double>(timers_.Now() - commit_start).count());
    links_.metrics->RecordPublishOutcome(outcome);
    if (open_->levels) links_.metrics->RecordPublishOutcome("leveled");
  }
  Remember({.id = open_->id, .committed = *committed});
  open_.reset();
  return committed;
}

absl::StatusOr<Publications::Committed> Publications::CommitLocked(Open& open) {
  ParameterStore& store = *links_.store;
  const auto layers = static_cast<uint32_t>(open.selected.size());
  for (uint32_t l = 0; l < layers; ++l) {
    for (uint32_t t = 0; t < open.next[l].size(); ++t) {
      if (open.next[l][t] != store.owned(l, t).end) {
        return absl::FailedPreconditionError(absl::StrCat(
            "publish ", open.id, " is not staged whole on this shard: tensor ",
            store.model().layers[l].tensors[t].name, " has its elements up to ", open.next[l][t],
            " of [", store.owned(l, t).begin, ", ", store.owned(l, t).end,
            "); stage the rest, or abort the publish on every shard"));
      }
    }
  }
  Committed committed{.version = open.base_version + 1};
  for (uint32_t l = 0; l < layers; ++l) {
    if (open.levels) {
      master_.Jump(l, committed.version, open.staged[l]);
    } else if (open.selected[l]) {
      // Every layer is at the base Begin checked until this commit.
      committed.changed_elements +=
          master_.Replace(l, open.base_version, committed.version, open.staged[l]);
    } else {
      master_.Keep(l, committed.version);
    }
  }
  Log()->info("publish {}: committed version {} ({} elements changed on this shard)", open.id,
              committed.version, committed.changed_elements);
  return committed;
}

void Publications::WithoutCommits(absl::FunctionRef<void()> fn) {
  absl::MutexLock lock(&mu_);
  fn();
}

void Publications::Abort(const std::string& publish_id, const std::string& why) {
  absl::MutexLock lock(&mu_);
  if (!open_ || open_->id != publish_id) return;
  AbortOpen(why, "aborted");
}

void Publications::AbortOpen(const std::string& why, absl::string_view outcome) {
  timers_.Cancel(open_->timer);
  links_.budget->Release(open_->staging_bytes);
  Log()->warn("publish {} {}; version {} still serves", open_->id, why, open_->base_version);
  if (links_.metrics != nullptr) links_.metrics->RecordPublishOutcome(outcome);
  // "settled_aborted" is the set's abort by definition: shard 0's own, or
  // one this shard heard from the set.
  Remember({.id = open_->id, .committed = std::nullopt, .by_set = outcome == "settled_aborted"});
  open_.reset();
}

const Publications::Decision* Publications::Decided(const std::string& id) const {
  for (const Decision& decision : decided_) {
    if (decision.id == id) return &decision;
  }
  return nullptr;
}

void Publications::Remember(Decision decision) {
  decided_.push_back(std::move(decision));
  while (decided_.size() > kDecisionsKept) decided_.pop_front();
}

void Publications::SettleOpen(const std::string& why) {
  if (peers_ == nullptr || peers_->decides()) {
    // Shard 0 has not committed it, so nobody has: the set drops it.
    AbortOpen(why, peers_ == nullptr ? "aborted" : "settled_aborted");
    return;
  }
  if (open_->settling) return;
  open_->settling = true;
  Log()->warn("publish {}: {}; asking the set whether it was committed", open_->id, why);
  peers_->Settle(open_->id,
                 [this, id = open_->id](std::optional<bool> committed) { Settled(id, committed); });
}

void Publications::Settled(const std::string& id, std::optional<bool> committed) {
  absl::MutexLock lock(&mu_);
  if (!open_ || open_->id != id) return;
  open_->settling = false;
  if (!committed) return;
  if (!*committed) {
    AbortOpen("was aborted by the set (shard 0 never committed it)", "settled_aborted");
    return;
  }
  const absl::StatusOr<Committed> done = CommitOpen("settled_committed");
  if (!done.ok()) {
    Log()->error(
        "publish {} is committed on the set but cannot be here: {}; the next publish "
        "of every layer brings this shard level",
        id, done.status().message());
    AbortOpen("could not be committed here", "aborted");
  }
}

layercast::v1::ResolvePublishResponse Publications::Resolve(const std::string& publish_id,
                                                            bool fence) {
  using layercast::v1::ResolvePublishResponse;
  ResolvePublishResponse response;
  absl::MutexLock lock(&mu_);
  if (const Decision* decided = Decided(publish_id)) {
    response.set_state(decided->committed ? ResolvePublishResponse::COMMITTED
                                          : ResolvePublishResponse::ABORTED);
    if (decided->committed) response.set_version(decided->committed->version);
    response.set_set_decision(!decided->committed && decided->by_set);
    return response;
  }
  const bool open = open_ && open_->id == publish_id;
  if (!fence || peers_ == nullptr || !peers_->decides()) {
    response.set_state(open ? ResolvePublishResponse::OPEN : ResolvePublishResponse::UNKNOWN);
    return response;
  }
  if (open) {
    AbortOpen("was fenced: another shard found its publisher gone", "settled_aborted");
  } else {
    Remember({.id = publish_id, .committed = std::nullopt, .by_set = true});
  }
  response.set_state(ResolvePublishResponse::ABORTED);
  response.set_set_decision(true);
  return response;
}

}  // namespace layercast::server
