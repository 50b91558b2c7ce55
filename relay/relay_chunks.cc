#include "relay/relay_chunks.h"

#include <algorithm>
#include <bit>
#include <cstdlib>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/crc32c.h"
#include "core/dtype.h"
#include "platform/byte_size.h"
#include "platform/failpoint.h"
#include "platform/status_macros.h"
#include "server/serving/fetch_plan.h"
#include "wire/delta_chunks.h"
#include "wire/incarnation.h"

namespace layercast::relay {

namespace {

template <typename T>
std::optional<T> Optional(bool has, T value) {
  return has ? std::optional<T>(value) : std::nullopt;
}

// Bits [begin, begin + n) of `bits` into `span`, from bit 0, the bits past
// n clear.
void SpanBits(const std::vector<uint64_t>& bits, uint64_t begin, uint64_t n,
              std::vector<uint64_t>& span) {
  span.assign((n + 63) / 64, 0);
  const uint64_t first = begin / 64, shift = begin % 64;
  for (size_t w = 0; w < span.size(); ++w) {
    uint64_t word = bits[first + w] >> shift;
    if (shift != 0 && first + w + 1 < bits.size()) word |= bits[first + w + 1] << (64 - shift);
    span[w] = word;
  }
  if (n % 64 != 0) span.back() &= (uint64_t{1} << (n % 64)) - 1;
}

// A slice of a held version's bytes: the version stays alive (and counted
// in the relay's budget) until gRPC has sent the last slice of it.
grpc::Slice SliceOf(const std::shared_ptr<const std::vector<uint8_t>>& bytes, uint64_t offset,
                    uint64_t size) {
  auto* owner = new std::shared_ptr<const std::vector<uint8_t>>(bytes);
  return grpc::Slice(
      const_cast<uint8_t*>(bytes->data() + offset), size,
      [](void* held) { delete static_cast<std::shared_ptr<const std::vector<uint8_t>>*>(held); },
      owner);
}

}  // namespace

RelayChunks::RelayChunks(const RelayedVersions& versions, const AssembledLayout& layout,
                         uint32_t shard, uint32_t num_shards,
                         const layercast::v1::FetchLayerRequest& request,
                         grpc::CallbackServerContext* context,
                         std::shared_ptr<std::atomic<uint64_t>> sent)
    : versions_(versions),
      layout_(layout),
      shard_(shard),
      num_shards_(num_shards),
      layer_(request.layer()),
      exact_version_(Optional(request.has_exact_version(), request.exact_version())),
      base_version_(Optional(request.has_base_version(), request.base_version())),
      base_incarnation_(Optional(request.has_base_incarnation(), request.base_incarnation())),
      context_(context),
      sent_(std::move(sent)) {}

std::string RelayChunks::WaitingFor() const {
  return absl::StrCat("this relay holds version ", versions_.Newest(layer_), " of layer ", layer_,
                      " and its upstream has sent nothing newer (it may be slow or gone); read "
                      "it again, or from the shards");
}

absl::StatusOr<uint64_t> RelayChunks::Start(uint64_t reached) {
  if (versions_.closed()) {
    return absl::UnavailableError(
        "this relay is stopping: read from the shards, or from another relay");
  }
  // The newest version held, cast by the incarnations the relay serves now
  // (a layer that has not landed since the shards restarted is not served).
  const std::optional<HeldLayer> newest = versions_.WaitNewest(layer_, 0, absl::InfinitePast());
  if (!newest || newest->version < std::min(reached, exact_version_.value_or(reached))) {
    return absl::UnavailableError(
        absl::StrCat("layer ", layer_,
                     " at this relay is between the shards' incarnations (their numbers "
                     "started again): read it again in a moment, or from the shards"));
  }
  if (exact_version_ && *exact_version_ != newest->version) {
    std::optional<HeldLayer> exact = versions_.At(layer_, *exact_version_);
    if (!exact) {
      return absl::AbortedError(
          absl::StrCat("this relay no longer holds version ", *exact_version_, " of layer ", layer_,
                       " (it keeps the newest and --keep-versions before it); it is at ",
                       newest->version, ": walk again at version ", newest->version));
    }
    target_ = *std::move(exact);
  } else {
    target_ = *newest;
  }
  if (target_.incarnations.size() <= shard_) {
    return absl::InternalError(
        absl::StrCat("this relay's mirror did not record which incarnation of shard ", shard_,
                     " served layer ", layer_, ": read from the shards, and report this"));
  }
  if (base_version_) {
    // Its identity only: a delta needs the changes, which are kept, not the
    // base's bytes, which would be rebuilt.
    const std::optional<HeldLayer> base = versions_.Identity(layer_, *base_version_);
    if (base) changed_ = versions_.ChangedBetween(layer_, *base_version_, target_);
    const bool same_shard =
        changed_ && base->incarnations.size() > shard_ &&
        base->incarnations[shard_] == target_.incarnations[shard_] &&
        base_incarnation_.value_or(base->incarnations[shard_]) == base->incarnations[shard_];
    if (!same_shard) {
      return absl::OutOfRangeError(absl::StrCat(
          "this relay no longer holds version ", *base_version_, " of layer ", layer_,
          " as the delta's base names it (it keeps the newest and --keep-versions before it, "
          "each with the incarnation of the shard that cast it); pull the layer in full"));
    }
  }
  if (base_version_) RETURN_IF_ERROR(DeltaPays());
  // Sent with the first chunk's write, which has not started.
  context_->AddInitialMetadata(wire::kIncarnationMetadata,
                               absl::StrCat(target_.incarnations[shard_]));
  return target_.version;
}

absl::Status RelayChunks::DeltaPays() const {
  server::DeltaCost cost;
  std::vector<uint64_t> bits;
  // Bits [begin, end) of `marks`, values of `size` bytes.
  const auto add = [&](const std::vector<uint64_t>& marks, uint64_t begin, uint64_t end,
                       size_t size) {
    if (end <= begin) return;
    SpanBits(marks, begin, end - begin, bits);
    uint64_t changed = 0;
    for (const uint64_t word : bits) changed += static_cast<uint64_t>(std::popcount(word));
    cost.Add(changed, end - begin, size);
  };
  for (uint32_t t = 0; t < layout_.tensors().size(); ++t) {
    const AssembledTensor& tensor = layout_.tensors()[t];
    const ElementRange owned = Owned(t);
    // Unlike a shard's change log, a relay's marks are of the bits it holds:
    // an 8-bit float's codes and scales count exactly. The whole slice is
    // judged, as a reader asks for it; a stream resumed midway is judged
    // by its slice too.
    add(changed_->elements[t], owned.begin, owned.end, DTypeSize(tensor.compute_dtype));
    if (tensor.block_size != 0 && owned.end > owned.begin) {
      add(changed_->scales[t], owned.begin / tensor.block_size,
          (owned.end + tensor.block_size - 1) / tensor.block_size, sizeof(float));
    }
  }
  return cost.Check(layer_, *base_version_, "this relay");
}

ElementRange RelayChunks::Owned(uint32_t tensor) const {
  return ShardElementRange(layout_.tensors()[tensor].num_elements, shard_, num_shards_);
}

std::optional<absl::StatusOr<server::CastChunk>> RelayChunks::Get(const server::ChunkKey& key,
                                                                  uint64_t, Resume) {
  const AssembledTensor& placed = layout_.tensors()[key.tensor];
  absl::StatusOr<server::CastChunk> chunk =
      key.base_version == server::ChunkKey::kWhole ? Full(key, placed) : Delta(key, placed);
  pending_bytes_ = chunk.ok() ? chunk->data.size() : 0;
  return chunk;
}

void RelayChunks::Sent() {
  *sent_ += pending_bytes_;
  if (base_version_) FailPoint("relay.mid_delta", shard_);
}

absl::StatusOr<server::CastChunk> RelayChunks::Full(const server::ChunkKey& key,
                                                    const AssembledTensor& placed) const {
  const size_t size = DTypeSize(placed.compute_dtype);
  const uint64_t offset = placed.byte_offset + key.element_begin * size;
  const uint64_t value_bytes = key.elements * size;
  uint32_t crc = Crc32c(target_.bytes->data() + offset, value_bytes);
  if (placed.block_size == 0) {
    return server::CastChunk{SliceOf(target_.bytes, offset, value_bytes), crc};
  }
  // An 8-bit float chunk carries the scales of the blocks it touches after
  // its codes: held apart, so these are copied (a chunk's worth).
  const uint64_t first = key.element_begin / placed.block_size;
  const uint64_t end =
      (key.element_begin + key.elements + placed.block_size - 1) / placed.block_size;
  const uint64_t scale_bytes = (end - first) * sizeof(float);
  const uint8_t* scales = target_.bytes->data() + placed.scale_offset + first * sizeof(float);
  crc = Crc32c(scales, scale_bytes, crc);
  auto* data = static_cast<uint8_t*>(std::malloc(value_bytes + scale_bytes));
  if (data == nullptr) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "out of memory for a chunk of ", FormatBytes(value_bytes + scale_bytes), "; retry later"));
  }
  std::memcpy(data, target_.bytes->data() + offset, value_bytes);
  std::memcpy(data + value_bytes, scales, scale_bytes);
  return server::CastChunk{grpc::Slice(data, value_bytes + scale_bytes, std::free), crc,
                           /*framed=*/false, scale_bytes};
}

absl::StatusOr<server::CastChunk> RelayChunks::Delta(const server::ChunkKey& key,
                                                     const AssembledTensor& placed) const {
  const size_t size = DTypeSize(placed.compute_dtype);
  const uint8_t* values = target_.bytes->data() + placed.byte_offset + key.element_begin * size;
  thread_local std::vector<uint64_t> span_changed, span_scales;
  SpanBits(changed_->elements[key.tensor], key.element_begin, key.elements, span_changed);
  // An 8-bit float span's scales: those of every block it touches.
  std::optional<wire::DeltaScales> scales;
  if (placed.block_size != 0) {
    const uint64_t first = key.element_begin / placed.block_size;
    const uint64_t blocks =
        (key.element_begin + key.elements + placed.block_size - 1) / placed.block_size - first;
    SpanBits(changed_->scales[key.tensor], first, blocks, span_scales);
    scales = wire::DeltaScales{{target_.bytes->data() + placed.scale_offset + first * sizeof(float),
                                blocks * sizeof(float)},
                               span_scales};
  }
  return server::CastChunk{wire::EncodeDeltaChunk({.tensor = key.tensor,
                                                   .element_offset = key.element_begin,
                                                   .span_elements = key.elements,
                                                   .version = key.version,
                                                   .base_version = key.base_version,
                                                   .gaps_allowed = key.gaps},
                                                  {values, key.elements * size}, size, span_changed,
                                                  scales ? &*scales : nullptr),
                           0, /*framed=*/true};
}

}  // namespace layercast::relay
