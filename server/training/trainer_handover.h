#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>

#include "absl/status/status.h"
#include "core/layout.h"
#include "server/training/trainer_layers.h"

namespace layercast::server {

// The trainer's side of a live hand-over to a set of another size
// (ShardAdmin.HandOver, docs/decisions.md): the freeze that stops its state
// at a step boundary, and the reads a new set fills itself with.
// Thread-safe.
class TrainerHandOver {
 public:
  explicit TrainerHandOver(TrainerLayers& layers) : layers_(layers) {}

  // From now on every push for a step at or after `version` is refused
  // (FAILED_PRECONDITION, telling the worker to move to the new set), so
  // the state stops changing once every layer reaches it.
  // FAILED_PRECONDITION, freezing nothing, when a layer is past `version`
  // or its step `version` has begun, or when frozen at another version.
  absl::Status Freeze(uint64_t version);
  // Takes pushes again (the hand-over was abandoned).
  void Unfreeze() { layers_.set_frozen_at(TrainerLayers::kNoPush); }
  std::optional<uint64_t> frozen_at() const;
  // Frozen, and every layer at frozen_at() with no push staged or in flight:
  // the state is one consistent cut, and stays so.
  bool AtFrozenBoundary() const;
  // Elements `range` of tensor `tensor` of `layer`: its master (`buffer`
  // empty) or its optimizer state buffer `buffer`, into `dst`.
  // FAILED_PRECONDITION unless AtFrozenBoundary(); OUT_OF_RANGE for a range
  // outside this shard's slice; NOT_FOUND for no such tensor or buffer.
  absl::Status ReadFrozen(uint32_t layer, uint32_t tensor, const std::string& buffer,
                          ElementRange range, std::span<float> dst) const;

 private:
  TrainerLayers& layers_;
};

}  // namespace layercast::server
