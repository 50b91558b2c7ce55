#include "relay/relay_service.h"

#include <algorithm>
#include <optional>

#include "absl/strings/str_cat.h"
#include "core/crc32c.h"
#include "core/dtype.h"
#include "platform/failpoint.h"
#include "platform/status_macros.h"
#include "server/answer_before.h"
#include "wire/delta_chunks.h"
#include "wire/grpc_status.h"
#include "wire/incarnation.h"

namespace layercast::relay {

namespace {

using layercast::v1::LayerChunk;

grpc::Status ReadsOnly(absl::string_view what) {
  return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                      absl::StrCat("this is a relay, which serves reads only: send ", what,
                                   " to the shards themselves"));
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

// The most versions ahead of a layer a read may ask for: a relay follows
// its upstream, and a version far ahead of it cannot come soon.
constexpr uint32_t kMaxVersionLead = 1024;

}  // namespace

RelayService::RelayService(const layercast::v1::Manifest& manifest, const wire::ShardSetView& view,
                           const std::vector<AssembledLayout>& layouts,
                           const RelayedVersions& versions, RelayMetrics& metrics, Options options)
    : manifest_(manifest),
      view_(view),
      layouts_(layouts),
      versions_(versions),
      metrics_(metrics),
      options_(options),
      shard_(manifest.shard_index()) {
  facts_ = {.model = &view_.model,
            .policy = &view_.policy,
            .layouts = view_.layouts,
            .shard_index = shard_,
            .num_shards = manifest.num_shards()};
  std::copy_n(manifest.content_fingerprint().begin(),
              std::min(manifest.content_fingerprint().size(), facts_.content_fingerprint.size()),
              facts_.content_fingerprint.begin());
  held_facts_ = facts_;
  held_facts_.layouts = layouts_;
}

absl::Time RelayService::Deadline(const grpc::ServerContext& context) const {
  const auto answer = server::AnswerBefore(context.deadline());
  const auto now = std::chrono::steady_clock::now();
  const auto wait = std::min<std::chrono::steady_clock::duration>(
      answer == std::chrono::steady_clock::time_point::max() ? options_.max_version_wait
                                                             : answer - now,
      options_.max_version_wait);
  return absl::Now() + absl::FromChrono(wait);
}

grpc::Status RelayService::GetManifest(grpc::ServerContext*,
                                       const layercast::v1::GetManifestRequest*,
                                       layercast::v1::Manifest* manifest) {
  *manifest = manifest_;
  manifest->set_version(versions_.heading());
  return grpc::Status::OK;
}

grpc::Status RelayService::WaitVersion(grpc::ServerContext* context,
                                       const layercast::v1::WaitVersionRequest* request,
                                       layercast::v1::WaitVersionResponse* response) {
  const std::optional<uint64_t> incarnation =
      request->has_incarnation() ? std::optional<uint64_t>(request->incarnation()) : std::nullopt;
  response->set_version(
      versions_.WaitHeading(request->min_version(), Deadline(*context), shard_, incarnation));
  response->set_incarnation(versions_.IncarnationOf(shard_));
  if (versions_.closed()) {
    return grpc::Status(grpc::StatusCode::UNAVAILABLE,
                        "this relay is stopping: follow the shards, or another relay");
  }
  return grpc::Status::OK;
}

grpc::Status RelayService::GetLayerDigest(grpc::ServerContext*,
                                          const layercast::v1::GetLayerDigestRequest*,
                                          layercast::v1::LayerDigest*) {
  return grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                      "a relay does not vouch for the bytes it carries: ask the shards for "
                      "digests (MirrorOptions::verify_with; layercast fetch --verify-shards)");
}

absl::StatusOr<HeldLayer> RelayService::Target(const layercast::v1::FetchLayerRequest& request,
                                               absl::Time deadline) const {
  const uint32_t layer = request.layer();
  // What the relay heads for counts: its layers land one by one.
  const uint64_t newest = std::max(versions_.Newest(layer), versions_.heading());
  RETURN_IF_ERROR(server::PlanWait(request, newest, kMaxVersionLead, true).status());
  const uint64_t wanted =
      request.has_exact_version() ? request.exact_version() : request.min_version();
  const std::optional<HeldLayer> reached = versions_.WaitNewest(layer, wanted, deadline);
  if (!reached && versions_.closed()) {
    return absl::UnavailableError(
        "this relay is stopping: read from the shards, or from another relay");
  }
  if (!reached) {
    return absl::DeadlineExceededError(
        absl::StrCat("layer ", layer, " has not reached version ", wanted,
                     " at this relay in time (it holds ", versions_.Newest(layer),
                     "; its upstream may be slow or gone): read it again, or from the shards"));
  }
  if (!request.has_exact_version()) return *reached;
  std::optional<HeldLayer> exact = versions_.At(layer, request.exact_version());
  if (!exact) {
    return absl::AbortedError(
        absl::StrCat("this relay no longer holds version ", request.exact_version(), " of layer ",
                     layer, " (it keeps the newest and --keep-versions before it); it is at ",
                     reached->version, ": walk again at version ", reached->version));
  }
  return *exact;
}

grpc::Status RelayService::FetchLayer(grpc::ServerContext* context,
                                      const layercast::v1::FetchLayerRequest* request,
                                      grpc::ServerWriter<LayerChunk>* writer) {
  uint64_t sent = 0;
  const absl::Status status = [&]() -> absl::Status {
    // The base's incarnation is checked against the version kept (below),
    // not one of the relay's own.
    layercast::v1::FetchLayerRequest planned = *request;
    planned.clear_base_incarnation();
    const bool held_dtype =
        manifest_.has_held_dtype() && request->dtype() == manifest_.held_dtype();
    ASSIGN_OR_RETURN(const server::FetchPlan plan,
                     server::PlanFetch(held_dtype ? held_facts_ : facts_, planned));
    const AssembledLayout& held = layouts_[request->layer()];
    for (uint32_t t = 0; t < held.tensors().size(); ++t) {
      const DType has = held.tensors()[t].compute_dtype;
      const DType asked = plan.layout.tensors()[t].compute_dtype;
      if (has != asked) {
        return absl::FailedPreconditionError(
            absl::StrCat("this relay holds layer ", request->layer(), "'s tensor ", t, " in ",
                         DTypeName(has), ", not ", DTypeName(asked),
                         ": ask the shards, or a relay that follows in ", DTypeName(asked)));
      }
    }
    ASSIGN_OR_RETURN(const HeldLayer target, Target(*request, Deadline(*context)));
    if (target.incarnations.size() <= shard_) {
      return absl::InternalError(absl::StrCat(
          "this relay's mirror did not record which incarnation of shard ", shard_,
          " served layer ", request->layer(), ": read from the shards, and report this"));
    }
    std::shared_ptr<const ChangedElements> changed;
    if (request->has_base_version()) {
      const std::optional<HeldLayer> base = versions_.At(request->layer(), request->base_version());
      if (base) {
        changed = versions_.ChangedBetween(request->layer(), request->base_version(), target);
      }
      const bool same_shard = changed && base->incarnations.size() > shard_ &&
                              base->incarnations[shard_] == target.incarnations[shard_] &&
                              (!request->has_base_incarnation() ||
                               request->base_incarnation() == base->incarnations[shard_]);
      if (!same_shard) {
        return absl::OutOfRangeError(absl::StrCat(
            "this relay no longer holds version ", request->base_version(), " of layer ",
            request->layer(),
            " as the delta's base names it (it keeps the newest and "
            "--keep-versions before it, each with the incarnation of the shard that cast it); "
            "pull the layer in full"));
      }
    }
    context->AddInitialMetadata(wire::kIncarnationMetadata,
                                absl::StrCat(target.incarnations[shard_]));
    return Send(plan, target, changed.get(), request->base_version(),
                request->accepts_changed_gaps(), writer, &sent);
  }();
  metrics_.RecordServed(status.ok(), sent);
  return wire::ToGrpcStatus(status);
}

absl::Status RelayService::Send(const server::FetchPlan& plan, const HeldLayer& target,
                                const ChangedElements* changed, uint64_t base_version, bool gaps,
                                grpc::ServerWriter<LayerChunk>* writer, uint64_t* sent) const {
  const uint64_t chunk_bytes = manifest_.chunk_bytes();
  if (chunk_bytes == 0) {
    return absl::FailedPreconditionError(
        "the shard this relay follows does not name its chunk size (Manifest.chunk_bytes): "
        "upgrade the shards");
  }
  std::vector<uint64_t> span_changed, span_scales;
  for (const TensorElementRange& run : plan.runs) {
    const AssembledTensor& placed = plan.layout.tensors()[run.tensor];
    const size_t size = DTypeSize(placed.compute_dtype);
    const server::ChunkGrid grid(chunk_bytes, placed,
                                 ShardElementRange(placed.num_elements, shard_, facts_.num_shards));
    for (uint64_t e = run.elements.begin; e < run.elements.end;) {
      const uint64_t n = std::min(run.elements.end, grid.ChunkEnd(e)) - e;
      const uint8_t* values = target.bytes->data() + placed.byte_offset + e * size;
      LayerChunk chunk;
      if (changed != nullptr) {
        SpanBits(changed->elements[run.tensor], e, n, span_changed);
        // An 8-bit float span's scales: those of every block it touches.
        std::optional<wire::DeltaScales> scales;
        if (placed.block_size != 0) {
          const uint64_t first = e / placed.block_size;
          const uint64_t blocks = (e + n + placed.block_size - 1) / placed.block_size - first;
          SpanBits(changed->scales[run.tensor], first, blocks, span_scales);
          scales =
              wire::DeltaScales{{target.bytes->data() + placed.scale_offset + first * sizeof(float),
                                 blocks * sizeof(float)},
                                span_scales};
        }
        const grpc::Slice encoded = wire::EncodeDeltaChunk({.tensor = run.tensor,
                                                            .element_offset = e,
                                                            .span_elements = n,
                                                            .version = target.version,
                                                            .base_version = base_version,
                                                            .gaps_allowed = gaps},
                                                           {values, n * size}, size, span_changed,
                                                           scales ? &*scales : nullptr);
        chunk.ParseFromArray(encoded.begin(), static_cast<int>(encoded.size()));
      } else {
        chunk.set_tensor(run.tensor);
        chunk.set_element_offset(e);
        chunk.set_data(values, n * size);
        chunk.set_version(target.version);
        uint32_t crc = Crc32c(values, n * size);
        if (placed.block_size != 0) {
          const uint64_t first = e / placed.block_size;
          const uint64_t end = (e + n + placed.block_size - 1) / placed.block_size;
          const uint8_t* scales =
              target.bytes->data() + placed.scale_offset + first * sizeof(float);
          chunk.set_scales(scales, (end - first) * sizeof(float));
          crc = Crc32c(scales, (end - first) * sizeof(float), crc);
        }
        chunk.set_crc32c(crc);
      }
      if (!writer->Write(chunk)) return absl::CancelledError("the reader went away mid-stream");
      *sent += chunk.ByteSizeLong();
      if (changed != nullptr) FailPoint("relay.mid_delta", shard_);
      e += n;
    }
  }
  return absl::OkStatus();
}

grpc::Status RelayService::PushGradients(grpc::ServerContext*,
                                         grpc::ServerReader<layercast::v1::GradientChunk>*,
                                         layercast::v1::PushGradientsResponse*) {
  return ReadsOnly("gradients");
}
grpc::Status RelayService::GetGradientNorm(grpc::ServerContext*,
                                           const layercast::v1::GetGradientNormRequest*,
                                           layercast::v1::GetGradientNormResponse*) {
  return ReadsOnly("GetGradientNorm");
}
grpc::Status RelayService::ApplyClippedStep(grpc::ServerContext*,
                                            const layercast::v1::ApplyClippedStepRequest*,
                                            layercast::v1::ApplyClippedStepResponse*) {
  return ReadsOnly("ApplyClippedStep");
}
grpc::Status RelayService::GetCastError(grpc::ServerContext*,
                                        const layercast::v1::GetCastErrorRequest*,
                                        layercast::v1::GetCastErrorResponse*) {
  return ReadsOnly("GetCastError (a relay casts nothing: what the casts lost is the shards')");
}

}  // namespace layercast::relay
