#include "server/publication.h"

#include <cstring>
#include <new>

#include "absl/strings/str_cat.h"
#include "core/byte_size.h"
#include "core/cast.h"
#include "core/crc32c.h"
#include "core/log.h"

namespace layercast::server {
namespace {

constexpr std::chrono::milliseconds kDefaultTimeout{60000};

}  // namespace

Publications::Publications(Links links) : links_(links) {}

Publications::~Publications() {
  absl::MutexLock lock(&mu_);
  if (open_) links_.budget->Release(open_->staging_bytes);
}

absl::StatusOr<uint64_t> Publications::Begin(const layercast::v1::BeginPublishRequest& request) {
  const ParameterStore& store = *links_.store;
  const auto layers = static_cast<uint32_t>(store.model().layers.size());
  if (request.publish_id().empty()) {
    return absl::InvalidArgumentError("a publish needs a publish_id, the same on every shard");
  }
  absl::MutexLock lock(&mu_);
  if (open_) {
    if (open_->id == request.publish_id()) return open_->staging_bytes;
    return absl::AbortedError(absl::StrCat(
        "publish ", open_->id, " is open on this shard; commit or abort it first (it times out ",
        "by itself)"));
  }
  std::vector<bool> selected(layers, request.layers().empty());
  for (const uint32_t layer : request.layers()) {
    if (layer >= layers) {
      return absl::InvalidArgumentError(
          absl::StrCat("layer ", layer, " does not exist: this model has ", layers, " layers"));
    }
    selected[layer] = true;
  }
  for (uint32_t l = 0; l < layers; ++l) {
    if (const uint64_t version = links_.gate->version(l); version != request.base_version()) {
      return absl::FailedPreconditionError(
          absl::StrCat("layer ", l, " of this shard is at version ", version,
                       ", not the publish's base_version ", request.base_version(),
                       ": publish on top of the version the shards serve (the "
                       "manifest's)"));
    }
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
  open.begun = std::chrono::steady_clock::now();
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
  open.timer = timers_.Schedule(
      std::chrono::steady_clock::now() + timeout, [this, id = request.publish_id(), timeout] {
        Abort(id, absl::StrCat("not committed within its timeout of ", timeout.count(), " ms"));
      });
  open_ = std::move(open);
  Log()->info("publish {}: staging {} for version {}", request.publish_id(), FormatBytes(bytes),
              request.base_version() + 1);
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
  if (last_committed_ && last_committed_->first == publish_id) return last_committed_->second;
  if (!open_ || open_->id != publish_id) {
    return absl::NotFoundError(
        absl::StrCat("publish ", publish_id,
                     " is not open on this shard (never begun, aborted or timed out); "
                     "abort it on every shard and publish again"));
  }
  const auto commit_start = std::chrono::steady_clock::now();
  absl::StatusOr<Committed> committed = CommitLocked(*open_);
  if (!committed.ok()) return committed.status();
  timers_.Cancel(open_->timer);
  links_.budget->Release(open_->staging_bytes);
  if (links_.metrics != nullptr) {
    links_.metrics->RecordPublish(
        std::chrono::duration<double>(commit_start - open_->begun).count(),
        std::chrono::duration<double>(std::chrono::steady_clock::now() - commit_start).count());
  }
  open_.reset();
  last_committed_.emplace(publish_id, *committed);
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
    absl::WriterMutexLock master_lock(&store.layer_mutex(l));
    if (open.selected[l]) {
      std::optional<ChangeLog::Snapshot> before;
      if (links_.changes != nullptr) {
        try {
          before = links_.changes->Take(l);
        } catch (const std::bad_alloc&) {
          Log()->warn("no memory to record what publish {} changes in layer {}", open.id, l);
        }
      }
      for (uint32_t t = 0; t < open.staged[l].size(); ++t) {
        // A tensor this shard owns none of stages nothing (and has no data()).
        if (open.staged[l][t].empty()) continue;
        std::memcpy(store.mutable_master(l, t), open.staged[l][t].data(),
                    open.staged[l][t].size() * sizeof(float));
      }
      if (before) {
        const uint64_t changed = links_.changes->Record(l, committed.version, *before);
        committed.changed_elements += changed;
        // Every layer is at the base Begin checked until this commit.
        if (links_.pinned != nullptr) {
          links_.pinned->Keep(l, open.base_version, changed, *std::move(before));
        }
      }
    } else if (links_.changes != nullptr) {
      links_.changes->RecordUnchanged(l, committed.version);
    }
    links_.gate->Advance(l, committed.version);
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
  timers_.Cancel(open_->timer);
  links_.budget->Release(open_->staging_bytes);
  Log()->warn("publish {} {}; version {} still serves", publish_id, why, open_->base_version);
  open_.reset();
}

}  // namespace layercast::server
