#include "server/serving/fetch_plan.h"

#include <algorithm>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "core/content_fingerprint.h"
#include "platform/byte_size.h"
#include "platform/status_macros.h"
#include "wire/incarnation.h"
#include "wire/owned_runs.h"

namespace layercast::server {

uint64_t SentBytes(const AssembledTensor& tensor, ElementRange elements) {
  uint64_t bytes = elements.size() * DTypeSize(tensor.compute_dtype);
  if (tensor.block_size != 0 && !elements.empty()) {
    const uint64_t blocks = (elements.end + tensor.block_size - 1) / tensor.block_size -
                            elements.begin / tensor.block_size;
    bytes += blocks * sizeof(float);
  }
  return bytes;
}

uint64_t ElementsPerChunk(uint64_t chunk_bytes, const AssembledTensor& tensor) {
  const uint64_t size = DTypeSize(tensor.compute_dtype);
  if (tensor.block_size != 0) {
    constexpr uint64_t kEndScales = 2 * sizeof(float);
    const uint64_t room = chunk_bytes > kEndScales ? chunk_bytes - kEndScales : 0;
    const uint64_t blocks = room / (tensor.block_size * size + sizeof(float));
    return std::max<uint64_t>(1, blocks) * tensor.block_size;
  }
  return std::max<uint64_t>(1, chunk_bytes / size);
}

uint64_t GridChunks(const std::vector<AssembledLayout>& layouts, uint32_t shard_index,
                    uint32_t num_shards, uint64_t chunk_bytes) {
  uint64_t chunks = 0;
  for (const AssembledLayout& layout : layouts) {
    for (const AssembledTensor& tensor : layout.tensors()) {
      const ChunkGrid grid(chunk_bytes, tensor,
                           ShardElementRange(tensor.num_elements, shard_index, num_shards));
      if (__builtin_add_overflow(chunks, grid.chunks(), &chunks)) {
        return UINT64_MAX;
      }
    }
  }
  return chunks;
}

absl::StatusOr<FetchPlan> PlanFetch(const ParameterStore& store,
                                    const layercast::v1::FetchLayerRequest& request) {
  return PlanFetch(FetchFacts{.model = &store.model(),
                              .policy = &store.policy(),
                              .layouts = store.layouts(),
                              .content_fingerprint = store.content_fingerprint(),
                              .shard_index = store.shard_index(),
                              .num_shards = store.num_shards(),
                              .incarnation = store.incarnation()},
                   request);
}

absl::StatusOr<FetchPlan> PlanFetch(const FetchFacts& facts,
                                    const layercast::v1::FetchLayerRequest& request) {
  const ModelSpec& model = *facts.model;
  const uint64_t num_layers = model.layers.size();
  if (request.layer() >= num_layers) {
    return absl::NotFoundError(
        num_layers == 0
            ? absl::StrCat("layer ", request.layer(), " does not exist: this model has no layers")
            : absl::StrCat("layer ", request.layer(), " does not exist: this model has ",
                           num_layers, " layers (0-", num_layers - 1, ")"));
  }
  const LayerSpec& layer = model.layers[request.layer()];
  const AssembledLayout& layout = facts.layouts[request.layer()];

  const ContentFingerprint& fingerprint = facts.content_fingerprint;
  if (!request.expect_content_fingerprint().empty() &&
      request.expect_content_fingerprint() != std::string(fingerprint.begin(), fingerprint.end())) {
    return absl::FailedPreconditionError(absl::StrCat(
        "this shard serves other parameter values (content fingerprint ",
        FingerprintHex(fingerprint, 8), "...) than the worker's shard set was connected to (",
        absl::BytesToHexString(request.expect_content_fingerprint()).substr(0, 16),
        "...): it restarted with another model or checkpoint. Connect the shard set again"));
  }

  if (request.expect_dtype() != layercast::v1::DTYPE_UNSPECIFIED) {
    if (!layercast::v1::DType_IsValid(request.expect_dtype())) {
      return absl::InvalidArgumentError(absl::StrCat(
          "expect_dtype ", static_cast<int>(request.expect_dtype()),
          " is not a DType: use FLOAT32, BFLOAT16, FLOAT16, FLOAT8_E4M3FN or FLOAT8_E5M2"));
    }
    const auto expected = static_cast<DType>(request.expect_dtype());
    for (uint32_t t = 0; t < layer.tensors.size(); ++t) {
      const DType actual = layout.tensors()[t].compute_dtype;
      if (actual != expected) {
        return absl::FailedPreconditionError(absl::StrCat(
            "expect_dtype is ", DTypeName(expected), " but the policy '", facts.policy->ToString(),
            "' gives tensor ", layer.tensors[t].name, " ", DTypeName(actual),
            "; omit expect_dtype or expect the manifest's compute dtypes"));
      }
    }
  }

  FetchPlan plan;
  plan.layer = request.layer();
  plan.layout = layout;
  if (request.dtype() != layercast::v1::DTYPE_UNSPECIFIED) {
    if (!layercast::v1::DType_IsValid(request.dtype())) {
      return absl::InvalidArgumentError(
          absl::StrCat("dtype ", static_cast<int>(request.dtype()),
                       " is not a DType: use FLOAT32, BFLOAT16, FLOAT16, FLOAT8_E4M3FN or "
                       "FLOAT8_E5M2, or leave it unset for the policy's dtypes"));
    }
    const auto wanted = static_cast<DType>(request.dtype());
    if (std::any_of(layout.tensors().begin(), layout.tensors().end(),
                    [wanted](const AssembledTensor& t) { return t.compute_dtype != wanted; })) {
      ASSIGN_OR_RETURN(plan.layout, LayoutIn(layout, wanted, facts.policy->fp8_block()));
      RETURN_IF_ERROR(CheckBlocksWithinShards(layer, plan.layout, facts.num_shards));
      plan.dtype = wanted;
      plan.kept_bits_serve = std::all_of(layout.tensors().begin(), layout.tensors().end(),
                                         [wanted](const AssembledTensor& t) {
                                           return KeptDType(t.compute_dtype) == KeptDType(wanted);
                                         });
    }
  }
  if (request.has_base_version() && plan.dtype) {
    return absl::OutOfRangeError(absl::StrCat(
        "this shard records what changed between versions in the policy's dtypes, not in ",
        DTypeName(*plan.dtype), ", so it serves no delta in it; pull layer ", request.layer(),
        " in full"));
  }
  uint64_t begin = request.range_begin(), end = request.range_end();
  if (begin == 0 && end == 0) {
    end = plan.layout.total_bytes();
  } else if (end == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("range_begin is ", begin, " but range_end is 0: give both ends, or 0,0 ",
                     "for the whole layer of ", plan.layout.total_bytes(), " bytes"));
  }
  std::vector<TensorElementRange> selected;
  if (end != 0) {  // else a layer with no tensors
    ASSIGN_OR_RETURN(selected, plan.layout.MapByteRange(begin, end));
  }
  // Last: a malformed request is told so first.
  if (request.has_base_version() && request.has_base_incarnation() &&
      request.base_incarnation() != facts.incarnation) {
    return absl::OutOfRangeError(absl::StrCat(
        "the delta's base, version ", request.base_version(), " of layer ", request.layer(),
        ", was served by an earlier start of this shard (incarnation ",
        wire::IncarnationName(request.base_incarnation()), "; now ",
        wire::IncarnationName(facts.incarnation),
        "): version numbers restart with the shard, so that "
        "version may name other values here; pull the layer in full"));
  }
  plan.runs = wire::OwnedRuns(plan.layout, selected, facts.shard_index, facts.num_shards);
  for (const TensorElementRange& run : plan.runs) {
    plan.bytes += SentBytes(plan.layout.tensors()[run.tensor], run.elements);
  }
  return plan;
}

namespace {

// A delta chunk's fields beside its values and bitmap: tags, varints and
// the CRC, well under this.
constexpr uint64_t kDeltaHeaderBytes = 64;

}  // namespace

uint64_t DeltaExtraBytes(uint64_t elements, uint64_t blocks) {
  return elements / 8 + blocks / 8 + 2 + kDeltaHeaderBytes;
}

void DeltaCost::Add(uint64_t changed, uint64_t elements, size_t size) {
  delta_bytes_ += changed * size + (elements + 7) / 8;
  full_bytes_ += elements * size;
  changed_ += changed;
  elements_ += elements;
}

absl::Status DeltaCost::Check(uint32_t layer, uint64_t base_version, absl::string_view what) const {
  if (delta_bytes_ <= full_bytes_) return absl::OkStatus();
  return absl::OutOfRangeError(absl::StrCat("layer ", layer, " changed in ", changed_, " of the ",
                                            elements_, " values ", what, " sends since version ",
                                            base_version, ": a delta (", FormatBytes(delta_bytes_),
                                            ") would be larger than the values (",
                                            FormatBytes(full_bytes_), "); pull the layer in full"));
}

uint64_t MaxStreamBufferBytes(uint64_t chunk_bytes, bool deltas) {
  // A delta chunk adds a bit per element and per 8-bit float block scale,
  // each at least a byte of the chunk (8-bit codes are the narrowest).
  return 2 * (deltas ? chunk_bytes + chunk_bytes / 8 + 2 + kDeltaHeaderBytes : chunk_bytes);
}

uint64_t StreamBufferBytes(const FetchPlan& plan, uint64_t chunk_bytes, bool delta) {
  uint64_t largest = 0;
  for (const TensorElementRange& run : plan.runs) {
    const AssembledTensor& placed = plan.layout.tensors()[run.tensor];
    const uint64_t elements = std::min(run.elements.size(), ElementsPerChunk(chunk_bytes, placed));
    // A chunk off the block grid (a ranged stream's first) touches one
    // block more than whole blocks would.
    const uint64_t scales =
        placed.block_size == 0 ? 0 : (elements / placed.block_size + 2) * sizeof(float);
    largest =
        std::max(largest, elements * DTypeSize(placed.compute_dtype) + scales +
                              (delta ? DeltaExtraBytes(elements, scales / sizeof(float)) : 0));
  }
  return 2 * largest;
}

absl::StatusOr<FetchWait> PlanWait(const layercast::v1::FetchLayerRequest& request,
                                   uint64_t current, uint32_t max_version_lead,
                                   bool keeps_changes) {
  if (request.has_exact_version() && request.min_version() > request.exact_version()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "min_version ", request.min_version(), " is above exact_version ", request.exact_version(),
        ": give one of them, or a min_version at most ", "the exact one"));
  }
  if (request.has_exact_version() && request.has_base_version() &&
      request.base_version() > request.exact_version()) {
    return absl::InvalidArgumentError(
        absl::StrCat("base_version ", request.base_version(), " is above exact_version ",
                     request.exact_version(), ": a delta goes from an older version to a newer"));
  }
  const uint64_t wait_for =
      request.has_exact_version() ? request.exact_version() : request.min_version();
  if (wait_for > current && wait_for - current > max_version_lead) {
    return absl::OutOfRangeError(absl::StrCat(
        request.has_exact_version() ? "exact_version " : "min_version ", wait_for, " is more than ",
        max_version_lead, " versions ahead of layer ", request.layer(), "'s version ", current,
        " (--max-version-lead): it cannot come soon. If this shard ",
        "restarted from older parameters, restart the job from its checkpoint"));
  }
  if (request.has_base_version() && !keeps_changes) {
    return absl::OutOfRangeError(
        "this shard keeps no changes between versions (started with --delta-versions 0), so it "
        "serves no delta pulls; pull the layer in full");
  }
  return FetchWait{.version = wait_for, .parked = wait_for > current};
}

}  // namespace layercast::server
