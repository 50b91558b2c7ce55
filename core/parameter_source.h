#pragma once

#include <array>
#include <cstdint>
#include <span>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/layout.h"
#include "core/model.h"

namespace layercast {

// SHA-256 identifying the parameter values a source holds (see
// SampleFingerprint in core/content_fingerprint.h).
using ContentFingerprint = std::array<uint8_t, 32>;

// Where a shard's initial fp32 parameters come from: a checkpoint on disk or a
// synthetic generator. A shard asks for exactly the element ranges it owns,
// so a source never reads or makes more than that. Implementations are
// thread-safe for concurrent Read calls.
class ParameterSource {
 public:
  virtual ~ParameterSource() = default;

  // The model's layers and tensors, in manifest order.
  virtual const ModelSpec& model() const = 0;

  // Fills `dst` with elements `range` of tensor `tensor` of layer `layer`,
  // as fp32. REQUIRES: indices valid, range within the tensor,
  // dst.size() == range.size().
  virtual absl::Status Read(uint32_t layer, uint32_t tensor, ElementRange range,
                            std::span<float> dst) const = 0;

  // Identifies the values this source holds, the same on every shard of a
  // set: by default SampleFingerprint(*this), which reads a few elements of
  // every tensor. A source holding only one shard's slice (a checkpoint)
  // returns the fingerprint of the model it descends from.
  virtual absl::StatusOr<ContentFingerprint> Fingerprint() const;
};

}  // namespace layercast
