#include "client/weight_publisher.h"

#include <algorithm>
#include <random>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "client/bearer_token.h"
#include "core/crc32c.h"
#include "core/layout.h"
#include "layercast/v1/admin.grpc.pb.h"
#include "platform/failpoint.h"
#include "platform/fan_out.h"
#include "platform/log.h"
#include "platform/retry.h"
#include "platform/status_macros.h"
#include "wire/grpc_status.h"

namespace layercast::client {
namespace {

std::unique_ptr<grpc::ClientContext> AdminContext(const std::string& token,
                                                  std::chrono::steady_clock::time_point deadline) {
  auto context = std::make_unique<grpc::ClientContext>();
  context->AddMetadata("authorization", absl::StrCat("Bearer ", token));
  context->set_deadline(std::chrono::system_clock::now() +
                        (deadline - std::chrono::steady_clock::now()));
  return context;
}

// One attempt of an idempotent admin call (BeginPublish, CommitPublish:
// a shard answers one it already took again): it waits for the shard to be
// reachable, for at most 2 s and within `deadline`. A shard restarting
// after a death then answers as soon as it listens; a call that fails at
// once instead found the channel's reconnection torn down again and again
// (16 s to reach a shard back in 0.1 s). An attempt that ran out of its
// 2 s is DEADLINE_EXCEEDED, which the publish policies retry; the call's
// own deadline ends the retries (platform::Retry).
std::unique_ptr<grpc::ClientContext> StartAttempt(const std::string& token,
                                                  std::chrono::steady_clock::time_point deadline) {
  auto context = AdminContext(
      token, std::min(deadline, std::chrono::steady_clock::now() + std::chrono::seconds(2)));
  context->set_wait_for_ready(true);
  return context;
}

std::string NewPublishId() {
  std::random_device random;
  return absl::StrFormat("%08x%08x%08x%08x", random(), random(), random(), random());
}

}  // namespace

WeightPublisher::WeightPublisher(const ShardSet& shards, PublishOptions options)
    : shards_(shards), options_(std::move(options)) {}

absl::StatusOr<std::vector<uint64_t>> WeightPublisher::ShardVersions(
    std::chrono::steady_clock::time_point deadline) const {
  const auto n = static_cast<uint32_t>(shards_.addresses().size());
  std::vector<uint64_t> versions(n);
  const std::vector<absl::Status> answers = FanOut(n, [&](uint32_t shard) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() +
                         (deadline - std::chrono::steady_clock::now()));
    layercast::v1::Manifest manifest;
    const grpc::Status status = shards_.stub(shard).GetManifest(&context, {}, &manifest);
    versions[shard] = manifest.version();
    return wire::FromGrpcStatus(
        status, absl::StrCat("shard ", shard, " (", shards_.addresses()[shard], ")"));
  });
  for (const absl::Status& answer : answers) RETURN_IF_ERROR(answer);
  return versions;
}

absl::StatusOr<PublishResult> WeightPublisher::Publish(const TensorValues& values,
                                                       std::optional<uint64_t> base_version) {
  ASSIGN_OR_RETURN(token_, CleanBearerToken(options_.admin_token, "the admin token"));
  RETURN_IF_ERROR(CheckTokenTransport(shards_.tls(), options_.insecure, "insecure"));
  const ModelSpec& model = shards_.model();
  std::vector<uint32_t> layers;
  size_t matched = 0;
  for (uint32_t l = 0; l < model.layers.size(); ++l) {
    size_t given = 0;
    for (const TensorSpec& tensor : model.layers[l].tensors) {
      const auto it = values.find(tensor.name);
      if (it == values.end()) continue;
      if (it->second.size() != tensor.num_elements) {
        return absl::InvalidArgumentError(absl::StrCat("tensor ", tensor.name, " has ",
                                                       tensor.num_elements, " elements; ",
                                                       it->second.size(), " were given"));
      }
      ++given;
    }
    if (given == 0) continue;
    if (given != model.layers[l].tensors.size()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "layer ", model.layers[l].name, " is given in part (", given, " of its ",
          model.layers[l].tensors.size(), " tensors): a publish replaces whole layers"));
    }
    layers.push_back(l);
    matched += given;
  }
  if (matched != values.size()) {
    for (const auto& [name, unused] : values) {
      bool known = false;
      for (const LayerSpec& layer : model.layers) {
        for (const TensorSpec& tensor : layer.tensors) known = known || tensor.name == name;
      }
      if (!known) {
        return absl::InvalidArgumentError(
            absl::StrCat("tensor ", name, " is not in the model the shards serve"));
      }
    }
  }
  const auto deadline = std::chrono::steady_clock::now() + options_.timeout;
  if (!base_version) {
    ASSIGN_OR_RETURN(const std::vector<uint64_t> versions, ShardVersions(deadline));
    const auto [lowest, highest] = std::minmax_element(versions.begin(), versions.end());
    // A shard behind the set (restarted without its checkpoint) takes a
    // publish of every layer on the set's version: it comes out level.
    if (*lowest != *highest && layers.size() != model.layers.size()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "shard ", lowest - versions.begin(), " serves version ", *lowest, " and shard ",
          highest - versions.begin(), " version ", *highest,
          ": a shard is behind the set (it restarted without its checkpoint); publish every "
          "layer, which brings it level, before publishing some"));
    }
    base_version = *highest;
  }
  const uint64_t base = *base_version;
  absl::StatusOr<PublishResult> whole = PublishLayers(values, layers, base, deadline);
  if (whole.ok() || !absl::IsResourceExhausted(whole.status()) || layers.size() < 2) return whole;
  // A shard has no room to stage every layer at once: one layer at a time,
  // each its own version, atomic across shards layer by layer.
  Log()->warn("publishing layer by layer, {} versions: {}", layers.size(),
              whole.status().message());
  PublishResult result{.version = base, .layer_by_layer = true, .versions = 0};
  for (const uint32_t layer : layers) {
    ASSIGN_OR_RETURN(const PublishResult one,
                     PublishLayers(values, {layer}, result.version, deadline));
    result.version = one.version;
    result.changed_elements += one.changed_elements;
    ++result.versions;
  }
  return result;
}

absl::StatusOr<PublishResult> WeightPublisher::PublishLayers(
    const TensorValues& values, const std::vector<uint32_t>& layers, uint64_t base_version,
    std::chrono::steady_clock::time_point deadline) {
  const auto n = static_cast<uint32_t>(shards_.addresses().size());
  const std::string id = NewPublishId();
  const auto describe = [this](uint32_t shard) {
    return absl::StrCat("shard ", shard, " (", shards_.addresses()[shard], ")");
  };
  // Phase one: everything staged everywhere, or aborted everywhere.
  const std::vector<absl::Status> staged = FanOut(n, [&](uint32_t shard) {
    return StageOnShard(shard, id, values, layers, base_version, deadline);
  });
  for (uint32_t shard = 0; shard < n; ++shard) {
    if (staged[shard].ok()) continue;
    AbortEverywhere(id);
    return absl::Status(staged[shard].code(),
                        absl::StrCat("publish ", id, " aborted on every shard, which still serve ",
                                     ServedNow(), ": ", staged[shard].message()));
  }
  FailPoint("publish.after_stage");
  // Phase two. Shard 0 first: its commit decides the publish, and it hands
  // the commit on to the others (--peers) should this publisher die now.
  std::vector<uint64_t> changed(n);
  const auto commit = [&](uint32_t shard) {
    absl::Status status = CommitOnShard(shard, id, deadline, &changed[shard]);
    // The shard restarted since it staged: this publisher still holds the
    // values, so it stages them there again (the publish is decided).
    if (absl::IsNotFound(status)) {
      Log()->warn("publish {}: {} lost what it staged ({}); staging it there again", id,
                  describe(shard), status.message());
      status = StageOnShard(shard, id, values, layers, base_version, deadline);
      if (status.ok()) status = CommitOnShard(shard, id, deadline, &changed[shard]);
    }
    return status;
  };
  std::vector<absl::Status> committed(n);
  committed[0] = commit(0);
  if (committed[0].ok()) {
    FailPoint("publish.after_first_commit");
    const std::vector<absl::Status> rest =
        FanOut(n - 1, [&](uint32_t other) { return commit(other + 1); });
    std::copy(rest.begin(), rest.end(), committed.begin() + 1);
  } else if (!absl::IsUnavailable(committed[0]) && !absl::IsDeadlineExceeded(committed[0])) {
    // Shard 0 refused it, so no shard commits it: drop it everywhere.
    AbortEverywhere(id);
    return absl::Status(committed[0].code(),
                        absl::StrCat("publish ", id, " aborted on every shard, which still serve ",
                                     ServedNow(), ": ", committed[0].message()));
  }
  PublishResult result{.version = base_version + 1};
  for (uint32_t shard = 0; shard < n; ++shard) {
    if (!committed[shard].ok()) {
      return absl::Status(
          committed[shard].code(),
          absl::StrCat("publish ", id, " staged everywhere but not committed on ", describe(shard),
                       ": ", committed[shard].message(),
                       shard == 0 ? "; shard 0 decides it: its peers settle it with it once it "
                                    "answers (docs/recovery.md)"
                                  : "; shard 0 committed it and hands it on (with --peers); a "
                                    "shard that cannot take it is brought level by the next "
                                    "publish of every layer"));
    }
    result.changed_elements += changed[shard];
  }
  return result;
}

absl::Status WeightPublisher::CommitOnShard(uint32_t shard, const std::string& id,
                                            std::chrono::steady_clock::time_point deadline,
                                            uint64_t* changed) const {
  auto stub = layercast::v1::ShardAdmin::NewStub(shards_.channel(shard));
  const std::string describe = absl::StrCat("shard ", shard, " (", shards_.addresses()[shard], ")");
  // Not gRPC's retry policy: it cannot give each attempt a 2 s deadline of
  // its own, and its 5 attempts end long before a publish's deadline.
  return platform::Retry(platform::kPublishCommit, deadline, [&](int) {
    const std::unique_ptr<grpc::ClientContext> context = StartAttempt(token_, deadline);
    layercast::v1::CommitPublishRequest request;
    request.set_publish_id(id);
    layercast::v1::CommitPublishResponse response;
    const absl::Status status =
        wire::FromGrpcStatus(stub->CommitPublish(context.get(), request, &response), describe);
    if (status.ok()) *changed = response.changed_elements();
    return status;
  });
}

std::string WeightPublisher::ServedNow() const {
  // The publish's base may be stale (the reason it failed): ask.
  const absl::StatusOr<std::vector<uint64_t>> versions =
      ShardVersions(std::chrono::steady_clock::now() + std::chrono::seconds(5));
  if (!versions.ok()) return "the version they served before it";
  const auto [lowest, highest] = std::minmax_element(versions->begin(), versions->end());
  if (*lowest == *highest) return absl::StrCat("version ", *lowest);
  return absl::StrCat("versions ", absl::StrJoin(*versions, ", "), " (shard by shard)");
}

void WeightPublisher::AbortEverywhere(const std::string& id) const {
  const auto n = static_cast<uint32_t>(shards_.addresses().size());
  FanOut(n, [&](uint32_t shard) {
    auto stub = layercast::v1::ShardAdmin::NewStub(shards_.channel(shard));
    auto context = AdminContext(token_, std::chrono::steady_clock::now() + std::chrono::seconds(5));
    layercast::v1::AbortPublishRequest request;
    request.set_publish_id(id);
    layercast::v1::AbortPublishResponse response;
    // Best effort: a shard that cannot be told settles it by itself.
    (void)stub->AbortPublish(context.get(), request, &response);
  });
}

absl::Status WeightPublisher::StageOnShard(uint32_t shard, const std::string& id,
                                           const TensorValues& values,
                                           const std::vector<uint32_t>& layers,
                                           uint64_t base_version,
                                           std::chrono::steady_clock::time_point deadline) {
  const std::string describe = absl::StrCat("shard ", shard, " (", shards_.addresses()[shard], ")");
  const auto n = static_cast<uint32_t>(shards_.addresses().size());
  auto stub = layercast::v1::ShardAdmin::NewStub(shards_.channel(shard));
  {
    layercast::v1::BeginPublishRequest request;
    request.set_publish_id(id);
    request.set_base_version(base_version);
    for (const uint32_t layer : layers) request.add_layers(layer);
    request.set_timeout_ms(static_cast<uint64_t>(std::max<int64_t>(
        1, std::chrono::duration_cast<std::chrono::milliseconds>(deadline -
                                                                 std::chrono::steady_clock::now())
               .count())));
    // UNAVAILABLE: the shard is restarting, or settles a publish whose
    // publisher stopped (it says so); both pass.
    const absl::Status begun = platform::Retry(platform::kPublishBegin, deadline, [&](int) {
      const std::unique_ptr<grpc::ClientContext> context = StartAttempt(token_, deadline);
      layercast::v1::BeginPublishResponse response;
      return wire::FromGrpcStatus(stub->BeginPublish(context.get(), request, &response), describe);
    });
    RETURN_IF_ERROR(begun);
  }
  auto context = AdminContext(token_, deadline);
  layercast::v1::StagePublishResponse response;
  auto writer = stub->StagePublish(context.get(), &response);
  const uint64_t per_chunk = std::max<uint64_t>(1, options_.chunk_bytes / sizeof(float));
  layercast::v1::PublishChunk chunk;
  chunk.set_publish_id(id);
  chunk.set_dtype(layercast::v1::FLOAT32);
  bool writing = true;
  for (const uint32_t layer : layers) {
    const LayerSpec& spec = shards_.model().layers[layer];
    for (uint32_t t = 0; t < spec.tensors.size() && writing; ++t) {
      const ElementRange owned = ShardElementRange(spec.tensors[t].num_elements, shard, n);
      const float* source = values.at(spec.tensors[t].name).data();
      for (uint64_t at = owned.begin; at < owned.end && writing; at += per_chunk) {
        const uint64_t count = std::min(per_chunk, owned.end - at);
        chunk.set_layer(layer);
        chunk.set_tensor(t);
        chunk.set_element_offset(at);
        chunk.set_data(reinterpret_cast<const char*>(source + at), count * sizeof(float));
        chunk.set_crc32c(Crc32c(chunk.data().data(), chunk.data().size()));
        writing = writer->Write(chunk);
      }
    }
  }
  writer->WritesDone();
  return wire::FromGrpcStatus(writer->Finish(), describe);
}

}  // namespace layercast::client
