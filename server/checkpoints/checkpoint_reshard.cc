#include "server/checkpoints/checkpoint_reshard.h"

#include <algorithm>
#include <bit>
#include <charconv>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/content_fingerprint.h"
#include "core/layout.h"
#include "platform/log.h"
#include "platform/status_macros.h"
#include "server/checkpoints/checkpoint_format.h"

namespace layercast::server {
namespace {

std::string WhatToDo(uint32_t from_count, uint32_t num_shards) {
  return absl::StrCat(
      ": the ", from_count, " checkpoints must be one set written at one step to load into ",
      num_shards, " shards. Start the ", from_count, " shards again (--num-shards ", from_count,
      "), write their checkpoints together (layercast checkpoint), stop them and start the ",
      num_shards, " again; or move the shard-*-of-", from_count,
      " files away to start from --model/--synthetic");
}

std::string ClipText(const std::optional<std::pair<uint64_t, float>>& clip) {
  return clip ? absl::StrCat("step ", clip->first, " scale ", clip->second) : "none";
}

}  // namespace

std::vector<SliceOverlap> LayerOverlaps(const LayerSpec& layer, uint32_t from_shard,
                                        uint32_t from_count, uint32_t to_shard, uint32_t to_count) {
  std::vector<SliceOverlap> overlaps;
  uint64_t from_offset = 0, to_offset = 0;
  for (uint32_t t = 0; t < layer.tensors.size(); ++t) {
    const uint64_t n = layer.tensors[t].num_elements;
    const ElementRange from = ShardElementRange(n, from_shard, from_count);
    const ElementRange to = ShardElementRange(n, to_shard, to_count);
    const ElementRange both = Intersect(from, to);
    if (!both.empty()) {
      overlaps.push_back({.tensor = t,
                          .element = both.begin,
                          .from_offset = from_offset + both.begin - from.begin,
                          .to_offset = to_offset + both.begin - to.begin,
                          .count = both.size()});
    }
    from_offset += from.size();
    to_offset += to.size();
  }
  return overlaps;
}

absl::StatusOr<std::unique_ptr<ReshardedCheckpoint>> ReshardedCheckpoint::Open(
    const std::string& dir, uint32_t from_count, const ModelSpec& model, uint32_t shard_index,
    uint32_t num_shards, const Policy& policy, std::optional<ContentFingerprint> lineage,
    FileSystem& fs) {
  auto checkpoint = std::unique_ptr<ReshardedCheckpoint>(new ReshardedCheckpoint());
  checkpoint->path_ = absl::StrCat(dir, "/shard-*-of-", from_count, ".safetensors");
  checkpoint->model_ = model;
  checkpoint->shard_index_ = shard_index;
  checkpoint->num_shards_ = num_shards;
  for (uint32_t i = 0; i < from_count; ++i) {
    const std::string path = CheckpointPath(dir, i, from_count);
    if (!fs.Exists(path)) {
      return absl::FailedPreconditionError(
          absl::StrCat("checkpoint ", path, " is missing: shard ", shard_index, " of ", num_shards,
                       " loads the checkpoints ", from_count, " shards wrote in ", dir,
                       " and needs every one of them; put it back, or move the shard-*-of-",
                       from_count, " files away to start from --model/--synthetic"));
    }
    ASSIGN_OR_RETURN(auto part,
                     CheckpointSource::Open(path, model, i, from_count, policy, lineage, fs));
    checkpoint->parts_.push_back(std::move(part));
  }
  for (uint32_t i = 0; i < from_count; ++i) {
    const bool overlaps = std::any_of(model.layers.begin(), model.layers.end(), [&](const auto& l) {
      return !LayerOverlaps(l, i, from_count, shard_index, num_shards).empty();
    });
    if (overlaps) checkpoint->overlapping_.push_back(i);
  }
  RETURN_IF_ERROR(checkpoint->CheckAgreement());
  RETURN_IF_ERROR(checkpoint->MergeStaged());
  return checkpoint;
}

absl::Status ReshardedCheckpoint::CheckAgreement() {
  const CheckpointSource& first = *parts_[0];
  const auto disagree = [&](const CheckpointSource& other, absl::string_view what,
                            const std::string& first_value, const std::string& other_value) {
    return absl::FailedPreconditionError(
        absl::StrCat("checkpoint ", first.path(), " holds ", what, " ", first_value, " and ",
                     other.path(), " holds ", other_value, WhatToDo(from_count(), num_shards_)));
  };
  for (size_t i = 1; i < parts_.size(); ++i) {
    const CheckpointSource& other = *parts_[i];
    if (other.version() != first.version()) {
      return disagree(other, "version", absl::StrCat(first.version()),
                      absl::StrCat(other.version()));
    }
    if (other.recorded_fingerprint() != first.recorded_fingerprint()) {
      const auto hex = [](const std::optional<ContentFingerprint>& f) {
        return f ? FingerprintHex(*f, 8) + "..." : std::string("none");
      };
      return disagree(other, "a model with content fingerprint", hex(first.recorded_fingerprint()),
                      hex(other.recorded_fingerprint()));
    }
    const auto& a = first.training();
    const auto& b = other.training();
    if (a.has_value() != b.has_value()) {
      return disagree(other, "optimizer state:", a ? "some" : "none", b ? "some" : "none");
    }
    if (!a) continue;
    if (a->optimizer != b->optimizer)
      return disagree(other, "optimizer", a->optimizer, b->optimizer);
    if (a->layer_versions != b->layer_versions) {
      return disagree(other, "layer versions", absl::StrJoin(a->layer_versions, ","),
                      absl::StrJoin(b->layer_versions, ","));
    }
    if (a->optimizer_steps != b->optimizer_steps) {
      return disagree(other, "optimizer steps", absl::StrJoin(a->optimizer_steps, ","),
                      absl::StrJoin(b->optimizer_steps, ","));
    }
    if (a->workers != b->workers) {
      return disagree(other, "data-parallel workers", absl::StrCat(a->workers),
                      absl::StrCat(b->workers));
    }
    // Compared as bits: the scale is applied as it is.
    const auto clip_bits = [](const std::optional<std::pair<uint64_t, float>>& clip) {
      return clip ? std::optional(std::pair(clip->first, std::bit_cast<uint32_t>(clip->second)))
                  : std::nullopt;
    };
    if (clip_bits(a->last_clip) != clip_bits(b->last_clip)) {
      return disagree(other, "last clipped", ClipText(a->last_clip), ClipText(b->last_clip));
    }
  }
  return absl::OkStatus();
}

absl::Status ReshardedCheckpoint::MergeStaged() {
  if (!parts_[0]->training()) return absl::OkStatus();
  CheckpointTraining training = *parts_[0]->training();
  training.staged.clear();
  std::vector<std::pair<uint32_t, std::string>> candidates;
  for (const auto& part : parts_) {
    for (const auto& staged : part->training()->staged) {
      if (std::find(candidates.begin(), candidates.end(), staged) == candidates.end()) {
        candidates.push_back(staged);
      }
    }
  }
  std::sort(candidates.begin(), candidates.end());
  for (const auto& candidate : candidates) {
    const uint32_t layer = candidate.first;
    // The files that hold some of this shard's elements of the layer; all
    // N when it holds none (its push is empty, and counts all the same).
    std::vector<uint32_t> holders;
    for (uint32_t i = 0; i < parts_.size(); ++i) {
      if (!LayerOverlaps(model_.layers[layer], i, from_count(), shard_index_, num_shards_)
               .empty()) {
        holders.push_back(i);
      }
    }
    if (holders.empty()) {
      for (uint32_t i = 0; i < parts_.size(); ++i) holders.push_back(i);
    }
    size_t held = 0;
    for (uint32_t i : holders) {
      const auto& list = parts_[i]->training()->staged;
      if (std::find(list.begin(), list.end(), candidate) != list.end()) ++held;
    }
    if (held == holders.size()) {
      training.staged.push_back(candidate);
    } else if (candidate.second == kStagedMean) {
      return absl::FailedPreconditionError(absl::StrCat(
          "checkpoints ", path_, " hold layer ", layer,
          "'s step reduced (waiting for its clip scale) in some files and not in others",
          WhatToDo(from_count(), num_shards_)));
    } else {
      Log()->warn(
          "checkpoints {} hold worker {}'s push for layer {}'s open step in {} of the {} files "
          "this shard reads: it was never taken by the whole set, so it is left out and the "
          "worker pushes it again",
          path_, candidate.second, layer, held, holders.size());
    }
  }
  training_ = std::move(training);
  return absl::OkStatus();
}

absl::StatusOr<ContentFingerprint> ReshardedCheckpoint::Fingerprint() const {
  return parts_[0]->Fingerprint();
}

absl::Status ReshardedCheckpoint::Read(uint32_t layer, uint32_t tensor, ElementRange range,
                                       std::span<float> dst) const {
  const uint64_t n = model_.layers[layer].tensors[tensor].num_elements;
  for (uint32_t i = 0; i < parts_.size(); ++i) {
    const ElementRange both = Intersect(range, ShardElementRange(n, i, from_count()));
    if (both.empty()) continue;
    RETURN_IF_ERROR(
        parts_[i]->Read(layer, tensor, both, dst.subspan(both.begin - range.begin, both.size())));
  }
  return absl::OkStatus();
}

std::optional<std::pair<uint32_t, uint32_t>> ReshardedCheckpoint::FindTensor(
    const std::string& name) const {
  for (uint32_t l = 0; l < model_.layers.size(); ++l) {
    for (uint32_t t = 0; t < model_.layers[l].tensors.size(); ++t) {
      if (model_.layers[l].tensors[t].name == name) return std::pair(l, t);
    }
  }
  return std::nullopt;
}

absl::Status ReshardedCheckpoint::ReadState(const std::string& name,
                                            std::vector<float>& values) const {
  const auto not_found = [&] {
    return absl::NotFoundError(absl::StrCat("checkpoints ", path_, " have no tensor ", name));
  };
  if (absl::StartsWith(name, kOptimizerStatePrefix)) {
    // "<buffer>/<tensor>": buffer names hold no '/', tensor names may.
    const std::string rest = name.substr(sizeof(kOptimizerStatePrefix) - 1);
    const size_t slash = rest.find('/');
    if (slash == std::string::npos) return not_found();
    const auto found = FindTensor(rest.substr(slash + 1));
    if (!found) return not_found();
    const uint64_t n = model_.layers[found->first].tensors[found->second].num_elements;
    const ElementRange own = ShardElementRange(n, shard_index_, num_shards_);
    values.resize(own.size());
    for (uint32_t i = 0; i < parts_.size(); ++i) {
      const ElementRange theirs = ShardElementRange(n, i, from_count());
      const ElementRange both = Intersect(own, theirs);
      if (both.empty()) continue;
      RETURN_IF_ERROR(parts_[i]->ReadStateRange(
          name, {both.begin - theirs.begin, both.end - theirs.begin},
          std::span<float>(values).subspan(both.begin - own.begin, both.size())));
    }
    return absl::OkStatus();
  }
  if (!training_) return not_found();
  const auto staged =
      std::find_if(training_->staged.begin(), training_->staged.end(),
                   [&](const auto& s) { return StagedPushName(s.first, s.second) == name; });
  if (staged == training_->staged.end()) return not_found();
  const LayerSpec& layer = model_.layers[staged->first];
  uint64_t owned = 0;
  for (const TensorSpec& tensor : layer.tensors) {
    owned += ShardElementRange(tensor.num_elements, shard_index_, num_shards_).size();
  }
  values.resize(owned);
  for (uint32_t i = 0; i < parts_.size(); ++i) {
    for (const SliceOverlap& overlap :
         LayerOverlaps(layer, i, from_count(), shard_index_, num_shards_)) {
      RETURN_IF_ERROR(parts_[i]->ReadStateRange(
          name, {overlap.from_offset, overlap.from_offset + overlap.count},
          std::span<float>(values).subspan(overlap.to_offset, overlap.count)));
    }
  }
  return absl::OkStatus();
}

absl::Status ReshardedCheckpoint::VerifyChecksum() {
  for (uint32_t i : overlapping_) RETURN_IF_ERROR(parts_[i]->VerifyReadBlocks());
  return absl::OkStatus();
}

}  // namespace layercast::server
