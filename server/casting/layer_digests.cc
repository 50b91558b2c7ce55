#include "server/casting/layer_digests.h"

#include <vector>

#include "absl/strings/str_cat.h"
#include "server/casting/chunk_caster.h"
#include "server/serving/shared_chunks.h"

namespace layercast::server {

LayerDigests::LayerDigests(Links links) : links_(links), work_(links.background) {}

LayerDigests::~LayerDigests() = default;

layercast::v1::LayerDigest LayerDigests::Answer(const Key& key,
                                                const wire::SliceDigest::Sha256& sha) const {
  layercast::v1::LayerDigest digest;
  digest.set_layer(key.layer);
  digest.set_version(key.version);
  digest.set_incarnation(links_.store->incarnation());
  digest.set_sha256(sha.data(), sha.size());
  return digest;
}

void LayerDigests::Get(const layercast::v1::GetLayerDigestRequest& request, Done done) {
  // Planned as a whole-layer pull pinned to the version: the same checks,
  // and the same runs, as the stream whose bytes the digest stands for.
  layercast::v1::FetchLayerRequest pull;
  pull.set_layer(request.layer());
  pull.set_exact_version(request.version());
  pull.set_dtype(request.dtype());
  absl::StatusOr<FetchPlan> plan = PlanFetch(*links_.store, pull);
  if (!plan.ok()) {
    done(plan.status());
    return;
  }
  const Key key{request.layer(), request.version(),
                plan->dtype ? static_cast<int>(*plan->dtype) : 0};
  if (const std::optional<wire::SliceDigest::Sha256> kept = Cached(key); kept) {
    done(Answer(key, *kept));
    return;
  }
  work_.Post([this, key, plan = *std::move(plan), done = std::move(done)] {
    // Asked for twice before the first was done: the second finds it.
    if (const std::optional<wire::SliceDigest::Sha256> kept = Cached(key); kept) {
      done(Answer(key, *kept));
      return;
    }
    absl::StatusOr<wire::SliceDigest::Sha256> sha = Compute(plan, key.version);
    if (!sha.ok()) {
      done(sha.status());
      return;
    }
    {
      absl::MutexLock lock(&mu_);
      cached_.emplace_back(key, *sha);
      if (cached_.size() > kCached) cached_.pop_front();
    }
    done(Answer(key, *sha));
  });
}

std::optional<wire::SliceDigest::Sha256> LayerDigests::Cached(const Key& key) const {
  absl::MutexLock lock(&mu_);
  for (const auto& [kept, sha] : cached_) {
    if (kept == key) return sha;
  }
  return std::nullopt;
}

absl::StatusOr<std::shared_ptr<const PinnedVersions::Kept>> LayerDigests::SourceOf(
    uint32_t layer, uint64_t version, bool kept_bits_serve) const {
  const uint64_t now = links_.gate->version(layer);
  if (now == version) return nullptr;
  if (now < version) {
    return absl::OutOfRangeError(absl::StrCat("layer ", layer, " is at version ", now,
                                              " and has not reached version ", version,
                                              ": ask for the digest of a version you hold"));
  }
  if (links_.changes != nullptr && links_.changes->ChangedNothing(layer, version, now)) {
    return nullptr;
  }
  std::shared_ptr<const PinnedVersions::Kept> kept;
  if (kept_bits_serve && links_.changes != nullptr && links_.pinned != nullptr) {
    kept = links_.pinned->Find(layer, version, *links_.changes);
  }
  if (kept == nullptr) {
    return absl::AbortedError(absl::StrCat(
        "layer ", layer, " is at version ", now, " and this shard no longer keeps version ",
        version, " (raise --pin-retention-ms or --pin-versions): pull version ", now,
        " and ask for its digest"));
  }
  return kept;
}

absl::StatusOr<wire::SliceDigest::Sha256> LayerDigests::Compute(const FetchPlan& plan,
                                                                uint64_t version) const {
  // Cast as a stream of this request would, its casts not counted again.
  const ChunkCaster caster(*links_.store, *links_.metrics,
                           {.chunk_bytes = links_.chunk_bytes, .own_dtype = true});
  wire::SliceDigest digest;
  std::vector<uint8_t> chunk;
  for (const TensorElementRange& run : plan.runs) {
    const AssembledTensor& placed = plan.layout.tensors()[run.tensor];
    const ChunkGrid grid(links_.chunk_bytes, placed, links_.store->owned(plan.layer, run.tensor));
    const uint64_t width = DTypeSize(placed.compute_dtype);
    digest.BeginTensor(run.tensor, placed.block_size != 0);
    for (uint64_t element = run.elements.begin; element < run.elements.end;) {
      if (links_.stopping != nullptr && links_.stopping->load()) {
        return absl::UnavailableError(
            "this shard is shutting down: ask its replacement for the digest");
      }
      const ChunkKey key{.layer = plan.layer,
                         .tensor = run.tensor,
                         .element_begin = element,
                         .elements = std::min(run.elements.end, grid.ChunkEnd(element)) - element,
                         .version = version,
                         .dtype = placed.compute_dtype};
      chunk.resize(
          SentBytes(placed, ElementRange{key.element_begin, key.element_begin + key.elements}));
      {
        absl::ReaderMutexLock lock(&links_.store->layer_mutex(plan.layer));
        absl::StatusOr<std::shared_ptr<const PinnedVersions::Kept>> kept =
            SourceOf(plan.layer, version, plan.kept_bits_serve);
        if (!kept.ok()) return kept.status();
        uint32_t* no_crc = nullptr;
        if (absl::Status cast = caster.CastInto(key, placed, kept->get(), chunk.data(), no_crc);
            !cast.ok()) {
          return cast;
        }
      }
      const std::span<const uint8_t> bytes(chunk);
      digest.AddElements(bytes.first(key.elements * width));
      if (placed.block_size != 0) digest.AddScales(bytes.subspan(key.elements * width));
      element += key.elements;
    }
  }
  return digest.Finish();
}

}  // namespace layercast::server
