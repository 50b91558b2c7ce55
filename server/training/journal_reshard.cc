#include "server/training/journal_reshard.h"

#include <algorithm>
#include <bit>
#include <map>
#include <set>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "core/layout.h"
#include "platform/status_macros.h"
#include "server/checkpoints/checkpoint_reshard.h"

namespace layercast::server {
namespace {

// One push being put together from the N journals' pieces.
struct Assembly {
  std::vector<float> values;
  // The overlapping journals that held a piece (a push journaled twice,
  // after a failed sync, is one piece).
  std::set<uint32_t> pieces;
};

}  // namespace

absl::StatusOr<ReshardedRecords> ReadReshardedJournals(
    const std::string& dir, const layercast::v1::JournalIdentity& identity, const ModelSpec& model,
    uint32_t from_count, const std::vector<uint32_t>& from_shards, FileSystem& fs) {
  const uint32_t to_shard = identity.shard_index();
  const uint32_t to_count = identity.num_shards();
  // Per layer: this shard's elements, and which of the N hold any of them.
  std::vector<uint64_t> owned(model.layers.size(), 0);
  std::vector<std::vector<uint32_t>> holders(model.layers.size());
  std::vector<std::map<uint32_t, std::vector<SliceOverlap>>> overlaps(model.layers.size());
  for (uint32_t l = 0; l < model.layers.size(); ++l) {
    for (const TensorSpec& tensor : model.layers[l].tensors) {
      owned[l] += ShardElementRange(tensor.num_elements, to_shard, to_count).size();
    }
    for (uint32_t i : from_shards) {
      auto pieces = LayerOverlaps(model.layers[l], i, from_count, to_shard, to_count);
      if (!pieces.empty()) {
        holders[l].push_back(i);
        overlaps[l][i] = std::move(pieces);
      }
    }
    // A layer of which this shard holds nothing still counts its pushes.
    if (holders[l].empty()) holders[l] = from_shards;
  }
  // (step, layer, worker) -> the push.
  std::map<std::tuple<uint64_t, uint32_t, uint32_t>, Assembly> pushes;
  std::map<uint64_t, float> scales;
  ReshardedRecords out;
  for (uint32_t i : from_shards) {
    layercast::v1::JournalIdentity theirs = identity;
    theirs.set_shard_index(i);
    theirs.set_num_shards(from_count);
    ASSIGN_OR_RETURN(std::unique_ptr<PushJournal> journal,
                     PushJournal::Open(dir, theirs, fs, PushJournal::Durability{}));
    RETURN_IF_ERROR(journal->CheckIdentity());
    const auto visit = [&](PushJournal::Record record) -> absl::Status {
      ++out.read;
      if (record.kind == PushJournal::Record::Kind::kClipScale) {
        if (record.values.size() != 1) {
          return absl::DataLossError(absl::StrCat("the push journal of shard ", i, " of ",
                                                  from_count, " holds a clip-scale record of step ",
                                                  record.step, " without one scale"));
        }
        const auto [it, added] = scales.emplace(record.step, record.values[0]);
        if (!added &&
            std::bit_cast<uint32_t>(it->second) != std::bit_cast<uint32_t>(record.values[0])) {
          return absl::DataLossError(absl::StrCat(
              "the push journals of the ", from_count, " shards record step ", record.step,
              " clipped with scales ", it->second, " and ", record.values[0],
              ": they are not one set's; start from their checkpoints without the journals"));
        }
        return absl::OkStatus();
      }
      if (record.layer >= model.layers.size()) {
        return absl::DataLossError(absl::StrCat("the push journal of shard ", i, " of ", from_count,
                                                " holds a push for layer ", record.layer,
                                                ", which the model lacks"));
      }
      uint64_t theirs_owned = 0;
      for (const TensorSpec& tensor : model.layers[record.layer].tensors) {
        theirs_owned += ShardElementRange(tensor.num_elements, i, from_count).size();
      }
      if (record.values.size() != theirs_owned) {
        return absl::DataLossError(absl::StrCat("the push journal of shard ", i, " of ", from_count,
                                                " holds a push of ", record.values.size(),
                                                " values for layer ", record.layer,
                                                ", which it owns ", theirs_owned, " of"));
      }
      const auto& layer_holders = holders[record.layer];
      if (std::find(layer_holders.begin(), layer_holders.end(), i) == layer_holders.end()) {
        return absl::OkStatus();
      }
      Assembly& assembly = pushes[{record.step, record.layer, record.worker}];
      assembly.values.resize(owned[record.layer]);
      for (const SliceOverlap& piece : overlaps[record.layer][i]) {
        std::copy_n(record.values.begin() + static_cast<ptrdiff_t>(piece.from_offset), piece.count,
                    assembly.values.begin() + static_cast<ptrdiff_t>(piece.to_offset));
      }
      assembly.pieces.insert(i);
      return absl::OkStatus();
    };
    ASSIGN_OR_RETURN(const PushJournal::Replayed replayed,
                     journal->Replay(visit, PushJournal::OnDamage::kRefuse));
    (void)replayed;
  }
  // A step's pushes, then its scale: the map's order is (step, layer,
  // worker).
  auto scale = scales.begin();
  const auto flush_scales_before = [&](uint64_t step) {
    for (; scale != scales.end() && scale->first < step; ++scale) {
      PushJournal::Record record;
      record.kind = PushJournal::Record::Kind::kClipScale;
      record.step = scale->first;
      record.values = {scale->second};
      out.records.push_back(std::move(record));
    }
  };
  for (auto& [key, assembly] : pushes) {
    const auto& [step, layer, worker] = key;
    flush_scales_before(step);
    if (assembly.pieces.size() != holders[layer].size()) {
      ++out.incomplete;
      continue;
    }
    PushJournal::Record record;
    record.kind = PushJournal::Record::Kind::kPush;
    record.layer = layer;
    record.worker = worker;
    record.step = step;
    record.values = std::move(assembly.values);
    out.records.push_back(std::move(record));
  }
  flush_scales_before(UINT64_MAX);
  return out;
}

}  // namespace layercast::server
