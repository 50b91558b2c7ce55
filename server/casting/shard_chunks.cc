#include "server/casting/shard_chunks.h"

#include <algorithm>
#include <bit>
#include <cstdlib>
#include <new>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/changed_bits.h"
#include "platform/byte_size.h"
#include "platform/status_macros.h"

namespace layercast::server {

ShardChunks::ShardChunks(const ParameterStore& store, const VersionGate& gate,
                         ServerMetrics& metrics, FetchPlan plan, Options options)
    : store_(store),
      gate_(gate),
      metrics_(metrics),
      plan_(std::move(plan)),
      options_(std::move(options)),
      caster_(store, metrics,
              {.chunk_bytes = options_.chunk_bytes,
               .cast_errors = options_.cast_errors,
               .recast = options_.recast,
               .own_dtype = plan_.dtype.has_value(),
               .sample_every = options_.cast_error_sample_every}),
      // The cache holds the policy's casts, whole; a recast trusts none.
      cache_(options_.recast || plan_.dtype || options_.base_version ? nullptr : options_.cache) {
  // The worker saw a chunk of this layer fail its checksum: the cached
  // bytes may be what failed.
  if (options_.recast && options_.cache != nullptr) options_.cache->DropLayer(plan_.layer);
  // What keeps a training shard recording its steps (ChangeLog::Wanted).
  if (options_.changes != nullptr &&
      (options_.base_version || options_.exact_version || options_.will_pull_deltas)) {
    options_.changes->NoteAsked();
  }
  if (options_.shared != nullptr) options_.shared->BeginStream(plan_.layer);
}

ShardChunks::~ShardChunks() {
  if (pinned_) metrics_.pinned_readers().Decrement();
  if (options_.shared != nullptr) options_.shared->EndStream(plan_.layer);
}

absl::StatusOr<uint64_t> ShardChunks::Start(uint64_t reached) {
  RETURN_IF_ERROR(HoldExactVersion(reached));
  const uint64_t target = options_.exact_version.value_or(reached);
  if (options_.base_version &&
      !options_.changes->Covers(plan_.layer, *options_.base_version, target)) {
    return absl::OutOfRangeError(absl::StrCat(
        "this shard no longer holds the changes of layer ", plan_.layer, " since base_version ",
        *options_.base_version, " to version ", target, ": it keeps the last ",
        options_.changes->versions(), " versions' changes (--delta-versions; a delta to ", target,
        " can start from version ", options_.changes->OldestBase(plan_.layer, target),
        "); pull the layer in full"));
  }
  if (options_.base_version) RETURN_IF_ERROR(DeltaPays(*options_.base_version, target));
  return target;
}

absl::Status ShardChunks::DeltaPays(uint64_t base, uint64_t target) const {
  DeltaCost cost;
  std::vector<uint64_t> bits;
  for (const TensorElementRange& run : plan_.runs) {
    const AssembledTensor& tensor = plan_.layout.tensors()[run.tensor];
    // The log records an 8-bit float's fp32 values: one that changed may
    // leave its code as it was, so the count proves nothing there.
    if (tensor.block_size != 0) return absl::OkStatus();
    const uint64_t n = run.elements.end - run.elements.begin;
    options_.changes->ChangedSince(plan_.layer, base, target, run.tensor, run.elements.begin, n,
                                   bits);
    uint64_t count = 0;
    for (const uint64_t word : bits) count += static_cast<uint64_t>(std::popcount(word));
    cost.Add(count, n, DTypeSize(tensor.compute_dtype));
  }
  return cost.Check(plan_.layer, base, "this shard");
}

std::string ShardChunks::WaitingFor() const {
  return options_.waiting_for ? options_.waiting_for(plan_.layer) : std::string();
}

CastCache::Layer* ShardChunks::CachedLayer(const ChunkKey& key) {
  if (cache_ == nullptr || key.base_version != ChunkKey::kWhole) return nullptr;
  if (!cache_looked_up_) {
    cache_looked_up_ = true;
    cached_ = cache_->ForVersion(key.layer, key.version);
  }
  return cached_ != nullptr && cached_->version() == key.version ? cached_.get() : nullptr;
}

std::optional<absl::StatusOr<CastChunk>> ShardChunks::Get(const ChunkKey& key, uint64_t bytes,
                                                          Resume resume) {
  if (CastCache::Layer* cached = CachedLayer(key); cached != nullptr) {
    if (std::optional<CastChunk> hit = cached->Find(key)) {
      metrics_.RecordChunkCached();
      return *std::move(hit);
    }
  }
  const auto cast = [this, &key] { return Cast(key); };
  if (options_.shared == nullptr) return cast();
  // Another stream casting this very chunk resumes this one when it is done
  // (posted: nothing runs on that stream's thread). A chunk of a layer the
  // cast cache holds is cast into the cache, whose budget holds it already:
  // kept for other streams at no charge, or it would be charged twice.
  const uint64_t charged = CachedLayer(key) != nullptr ? 0 : bytes;
  return options_.shared->GetOrCast(key, charged, cast, std::move(resume));
}

std::string ShardChunks::WhyNotKept() const {
  if (options_.pinned != nullptr) {
    return absl::StrCat("it keeps a layer's ", options_.pinned->per_layer(),
                        " newest superseded versions (--pin-versions) and those a pinned reader "
                        "read within --pin-retention-ms, while its memory budget has room: raise "
                        "--pin-versions or --pin-retention-ms, or give it more memory");
  }
  return options_.changes == nullptr ? "it keeps none: --delta-versions 0"
                                     : "it keeps none: --pin-retention-ms 0";
}

absl::Status ShardChunks::NotInThisDType(uint64_t version, uint64_t current) const {
  return absl::AbortedError(
      absl::StrCat("layer ", plan_.layer, " is at parameter version ", current,
                   ", and what this shard keeps of version ", version,
                   " (the policy's dtypes) cannot give ", DTypeName(*plan_.dtype), "; ",
                   options_.exact_version ? "walk the model again at version "
                                          : "gather the layer again with min_version ",
                   current));
}

void ShardChunks::LeaseExactVersion() {
  // A walk at this version holds it on the layers it has not read yet; a
  // stream whose dtype the kept bits cannot give would hold it for nothing.
  if (options_.pinned != nullptr && plan_.kept_bits_serve) {
    options_.pinned->Lease(*options_.exact_version);
  }
}

absl::Status ShardChunks::HoldExactVersion(uint64_t current) {
  if (!options_.exact_version) return absl::OkStatus();
  const uint64_t exact = *options_.exact_version;
  if (exact == current || plan_.bytes == 0) {
    LeaseExactVersion();
    return absl::OkStatus();
  }
  if (!plan_.kept_bits_serve) return NotInThisDType(exact, current);
  absl::ReaderMutexLock master_lock(&store_.layer_mutex(plan_.layer));
  if (options_.changes != nullptr) {
    if (options_.changes->ChangedNothing(plan_.layer, exact, current)) {
      LeaseExactVersion();
      return absl::OkStatus();
    }
    if (options_.pinned != nullptr) {
      held_ = options_.pinned->Find(plan_.layer, exact, *options_.changes);
    }
  }
  if (held_ != nullptr) {
    LeaseExactVersion();
    return absl::OkStatus();
  }
  if (options_.pinned != nullptr) metrics_.RecordPinnedRead("gone");
  return absl::AbortedError(absl::StrCat("layer ", plan_.layer, " is at parameter version ",
                                         current, " and this shard no longer keeps version ", exact,
                                         " (", WhyNotKept(), "); walk the model again at version ",
                                         current));
}

absl::StatusOr<std::shared_ptr<const PinnedVersions::Kept>> ShardChunks::SourceOf(
    const ChunkKey& key) {
  const uint64_t now = gate_.version(key.layer);
  if (now == key.version) return nullptr;
  if (!plan_.kept_bits_serve) return NotInThisDType(key.version, now);
  std::shared_ptr<const PinnedVersions::Kept> kept;
  if (options_.changes != nullptr &&
      !options_.changes->ChangedNothing(key.layer, key.version, now)) {
    kept = held_;
    if (kept == nullptr && options_.pinned != nullptr) {
      kept = options_.pinned->Find(key.layer, key.version, *options_.changes);
    }
    if (kept == nullptr) {
      // Overtaken: the steps after this one keep what such a stream needs.
      options_.changes->NoteAsked();
      if (options_.pinned != nullptr) metrics_.RecordPinnedRead("gone");
      return absl::AbortedError(absl::StrCat(
          "layer ", key.layer, " moved from parameter version ", key.version, " to ", now,
          " while this stream sent it, and this shard no longer keeps version ", key.version, " (",
          WhyNotKept(), "); ",
          options_.exact_version ? absl::StrCat("walk the model again at version ", now)
                                 : absl::StrCat("gather the layer again with min_version ", now)));
    }
  } else if (options_.changes == nullptr) {
    return absl::AbortedError(absl::StrCat("layer ", key.layer, " moved from parameter version ",
                                           key.version, " to ", now, " while this stream sent it (",
                                           WhyNotKept(),
                                           "); gather the layer again with min_version ", now));
  }
  if (!pinned_.exchange(true)) {
    metrics_.pinned_readers().Increment();
    metrics_.RecordPinnedRead("served");
  }
  return kept;
}

absl::StatusOr<CastChunk> ShardChunks::Cast(const ChunkKey& key) {
  if (key.base_version != ChunkKey::kWhole) return CastDelta(key);
  // Shared with other readers, exclusive of an optimizer step: the chunk is
  // cast from one version, and it is the stream's.
  absl::ReaderMutexLock master_lock(&store_.layer_mutex(key.layer));
  ASSIGN_OR_RETURN(const std::shared_ptr<const PinnedVersions::Kept> kept, SourceOf(key));
  const AssembledTensor& placed = plan_.layout.tensors()[key.tensor];
  if (CastCache::Layer* cached = CachedLayer(key); cached != nullptr) {
    if (uint8_t* into = cached->Claim(key); into != nullptr) {
      uint32_t crc = 0;
      if (absl::Status cast = caster_.CastInto(key, placed, kept.get(), into, &crc); !cast.ok()) {
        cached->Abandon(key);
        return cast;
      }
      return cached->Fill(key, crc);
    }
  }
  const size_t bytes =
      SentBytes(placed, ElementRange{key.element_begin, key.element_begin + key.elements});
  uint8_t* data = nullptr;
  CastChunk chunk;
  if (options_.pool != nullptr) {
    // Back to the pool when the last stream sending it is done.
    ASSIGN_OR_RETURN(ChunkPool::Lent lent, options_.pool->Take(bytes));
    chunk.data = std::move(lent.slice);
    data = lent.data;
  } else {
    data = static_cast<uint8_t*>(std::malloc(bytes));
    if (data == nullptr) {
      return absl::ResourceExhaustedError(
          absl::StrCat("out of memory for a chunk of ", FormatBytes(bytes), "; retry later"));
    }
    // Owned by gRPC from here: freed when the last stream sending it is done.
    chunk.data = grpc::Slice(data, bytes, std::free);
  }
  chunk.scale_bytes = bytes - key.elements * DTypeSize(key.dtype);
  RETURN_IF_ERROR(caster_.CastInto(key, placed, kept.get(), data, &chunk.crc32c));
  return chunk;
}

absl::StatusOr<CastChunk> ShardChunks::CastDelta(const ChunkKey& key) {
  absl::ReaderMutexLock master_lock(&store_.layer_mutex(key.layer));
  // When neither the master nor a kept version holds key.version: gathered
  // again from the same base, a delta applied twice, or over a copy already
  // partly newer, still gives the newest version exactly.
  ASSIGN_OR_RETURN(const std::shared_ptr<const PinnedVersions::Kept> kept, SourceOf(key));
  // Checked again under the layer's lock: changes recorded since the stream
  // began may have pushed (base, version] out of the log, and a delta
  // without them would leave changed values unsent.
  if (!options_.changes->Covers(key.layer, key.base_version, key.version)) {
    return absl::OutOfRangeError(absl::StrCat(
        "layer ", key.layer, " moved on while this stream sent a delta from version ",
        key.base_version, " to ", key.version,
        ", and this shard no longer holds the changes between them; pull the layer in full"));
  }
  // The span is cast whole (the kernels run on contiguous elements) into
  // scratch that stays with the thread, then only its changed elements are
  // packed into the chunk.
  thread_local std::vector<uint8_t> values;
  thread_local std::vector<uint64_t> changed;
  const AssembledTensor& placed = plan_.layout.tensors()[key.tensor];
  const wire::DeltaSpan span{.tensor = key.tensor,
                             .element_offset = key.element_begin,
                             .span_elements = key.elements,
                             .version = key.version,
                             .base_version = key.base_version,
                             .gaps_allowed = key.gaps};
  try {
    values.resize(SentBytes(placed, {key.element_begin, key.element_begin + key.elements}));
    RETURN_IF_ERROR(caster_.CastInto(key, placed, kept.get(), values.data(), nullptr));
    options_.changes->ChangedSince(key.layer, key.base_version, key.version, key.tensor,
                                   key.element_begin, key.elements, changed);
    if (placed.block_size != 0) return CastFp8Delta(key, placed, span, values, changed);
    return CastChunk{wire::EncodeDeltaChunk(span, values, DTypeSize(key.dtype), changed), 0,
                     /*framed=*/true};
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError(absl::StrCat("out of memory for a delta chunk of ",
                                                     key.elements, " elements; retry later"));
  }
}

absl::StatusOr<CastChunk> ShardChunks::CastFp8Delta(const ChunkKey& key,
                                                    const AssembledTensor& placed,
                                                    const wire::DeltaSpan& span,
                                                    std::span<const uint8_t> quantized,
                                                    std::vector<uint64_t>& changed) {
  const uint64_t first = key.element_begin / placed.block_size;
  const uint64_t blocks =
      (key.element_begin + key.elements + placed.block_size - 1) / placed.block_size - first;
  const std::span<const uint8_t> scales = quantized.subspan(key.elements, blocks * sizeof(float));
  thread_local std::vector<uint64_t> scales_changed;
  // `changed` holds the span's fp32 values that changed (what the log
  // records of an 8-bit float tensor): with none in a span of whole blocks,
  // no code or scale of it moved. (A span that starts or ends inside a
  // block, a ranged pull's, shares the block's scale with elements outside
  // it.) Else the base is quantized again, and the codes and scales
  // compared.
  const bool whole_blocks = key.element_begin % placed.block_size == 0 &&
                            ((key.element_begin + key.elements) % placed.block_size == 0 ||
                             key.element_begin + key.elements == placed.num_elements);
  if (whole_blocks &&
      std::all_of(changed.begin(), changed.end(), [](uint64_t word) { return word == 0; })) {
    scales_changed.assign((blocks + 63) / 64, 0);
  } else {
    ASSIGN_OR_RETURN(const std::shared_ptr<const PinnedVersions::Kept> base, BaseOf(key));
    thread_local std::vector<uint8_t> was;
    was.resize(quantized.size());
    ChunkKey at_base = key;
    at_base.version = key.base_version;
    caster_.Quantize(at_base, placed, base.get(), was.data());
    MarkChangedBits(quantized.data(), was.data(), key.elements, 1, changed);
    MarkChangedBits(scales.data(), was.data() + key.elements, blocks, sizeof(float),
                    scales_changed);
  }
  const wire::DeltaScales delta_scales{scales, scales_changed};
  return CastChunk{
      wire::EncodeDeltaChunk(span, quantized.first(key.elements), 1, changed, &delta_scales), 0,
      /*framed=*/true};
}

absl::StatusOr<std::shared_ptr<const PinnedVersions::Kept>> ShardChunks::BaseOf(
    const ChunkKey& key) {
  if (options_.changes->ChangedNothing(key.layer, key.base_version, gate_.version(key.layer))) {
    return nullptr;  // the master holds the base's values
  }
  std::shared_ptr<const PinnedVersions::Kept> kept;
  if (options_.pinned != nullptr) {
    kept = options_.pinned->Find(key.layer, key.base_version, *options_.changes);
  }
  if (kept == nullptr) {
    options_.changes->NoteAsked();
    return absl::OutOfRangeError(absl::StrCat(
        "layer ", key.layer, " has tensor ",
        store_.model().layers[key.layer].tensors[key.tensor].name, " in ", DTypeName(key.dtype),
        ", whose delta quantizes the base again from the fp32 this shard kept of it, and it no "
        "longer keeps version ",
        key.base_version, " (", WhyNotKept(), "); pull the layer in full"));
  }
  return kept;
}

}  // namespace layercast::server
