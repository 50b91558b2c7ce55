#include "client/shard_set.h"

#include "wire/slice_digest.h"

#include <algorithm>
#include <functional>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "client/grpc_retry_config.h"
#include "client/layer_gather.h"
#include "core/dtype.h"
#include "platform/fan_out.h"
#include "platform/log.h"
#include "platform/retry.h"
#include "platform/status_macros.h"
#include "wire/grpc_status.h"

namespace layercast::client {
namespace {

// Chunks are at most 3 MiB; leave room for framing and future growth.
constexpr int kMaxReceiveMessageBytes = 16 << 20;

std::string Describe(const std::vector<std::string>& addresses, size_t i) {
  return absl::StrCat("shard ", i, " (", addresses[i], ")");
}

// Asks one shard for its manifest until it answers or `deadline` passes,
// retrying while it is unreachable or still loading, and saying once, after
// a second, what it waits for. `channel` is the shard's, and is replaced by
// one from `make_channel` after a refused connection: gRPC 1.51's channel,
// once its first connect was refused, took 5 s to connect to a shard that
// had come up in the meantime (a fresh channel connects at once).
absl::StatusOr<layercast::v1::Manifest> FetchManifest(
    std::shared_ptr<grpc::Channel>& channel,
    const std::function<std::shared_ptr<grpc::Channel>()>& make_channel,
    const std::string& describe, const std::string& address, const ShardSetOptions& options) {
  const std::chrono::milliseconds timeout = options.connect_timeout;
  auto stub = layercast::v1::ShardService::NewStub(channel);
  const auto start = std::chrono::steady_clock::now();
  const auto deadline = start + timeout;
  // The clearest cause seen: the last attempt may have been cut short by
  // the deadline, which says nothing of why.
  std::string cause;
  std::string last_message;
  const auto why = [&] {
    return cause.empty() ? absl::StrCat("unreachable (", last_message, ")") : cause;
  };
  layercast::v1::Manifest manifest;
  platform::RetryHooks hooks;
  bool said = false;
  hooks.on_retry = [&](const absl::Status&, int, std::chrono::milliseconds) {
    if (!said && std::chrono::steady_clock::now() - start >= std::chrono::seconds(1)) {
      Log()->warn("waiting for {}: {}; retrying for up to {} ms ({})", describe, why(),
                  timeout.count(), options.connect_timeout_name);
      said = true;
    }
  };
  // Not gRPC's retry policy: a shard loads for longer than its 5 attempts
  // can wait, and a refused connection needs a fresh channel (below).
  const absl::Status answered = platform::Retry(
      platform::kConnect, deadline,
      [&](int) {
        grpc::ClientContext context;
        // Not wait_for_ready: a shard that cannot be reached fails at once,
        // with the reason, instead of in silence at the deadline.
        context.set_deadline(
            std::chrono::system_clock::now() +
            std::min<std::chrono::steady_clock::duration>(
                deadline - std::chrono::steady_clock::now(), std::chrono::seconds(10)));
        const grpc::Status status =
            stub->GetManifest(&context, layercast::v1::GetManifestRequest(), &manifest);
        if (status.ok()) return absl::OkStatus();
        last_message = status.error_message();
        if (std::string known = UnreachableCause(last_message, address); !known.empty()) {
          cause = std::move(known);
        }
        if (absl::StrContains(last_message, "Connection refused")) {
          channel = make_channel();
          stub = layercast::v1::ShardService::NewStub(channel);
        }
        return wire::FromGrpcStatus(status, absl::StrCat(describe, " did not answer GetManifest"));
      },
      hooks);
  if (answered.ok()) return manifest;
  if (absl::IsUnavailable(answered) || absl::IsDeadlineExceeded(answered)) {
    return absl::Status(answered.code(),
                        absl::StrCat(describe, " did not answer within ", timeout.count(),
                                     " ms: ", why(), ". Start it, fix ", options.shards_name,
                                     ", or wait longer (", options.connect_timeout_name, ")"));
  }
  return answered;
}

}  // namespace

absl::StatusOr<std::vector<std::string>> ParseShardList(absl::string_view list) {
  std::vector<std::string> addresses = absl::StrSplit(list, ',');
  for (const std::string& address : addresses) {
    if (address.empty() || address.find(':') == std::string::npos) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--shards '", list, "' must list host:port addresses in shard order, comma-separated"));
    }
  }
  return addresses;
}

absl::StatusOr<std::vector<std::string>> ExpandShardPattern(absl::string_view pattern,
                                                            uint64_t num_shards) {
  if (pattern.find("{i}") == absl::string_view::npos ||
      pattern.find(':') == absl::string_view::npos || num_shards == 0 || num_shards > 4096) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--shards-pattern '", pattern, "' with --num-shards ", num_shards,
        ": the pattern must hold {i} and a port, e.g. 'layercast-{i}.layercast:7070', and "
        "--num-shards must be 1-4096"));
  }
  std::vector<std::string> addresses;
  for (uint64_t i = 0; i < num_shards; ++i) {
    addresses.push_back(absl::StrReplaceAll(pattern, {{"{i}", absl::StrCat(i)}}));
  }
  return addresses;
}

absl::StatusOr<std::unique_ptr<ShardSet>> ShardSet::Connect(std::vector<std::string> addresses,
                                                            ShardSetOptions options) {
  if (addresses.empty()) return absl::InvalidArgumentError("a shard set needs at least one shard");
  auto set = std::unique_ptr<ShardSet>(new ShardSet());
  set->addresses_ = std::move(addresses);
  set->tls_ = options.credentials != nullptr;
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(kMaxReceiveMessageBytes);
  // Reconnect quickly to a shard that restarts at the same address: gRPC's
  // default first backoff is a second, longer than a gather should stall.
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  // Each ShardSet gets connections of its own: several workers in one
  // process should not share (and serialise on) one HTTP/2 connection.
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  args.SetServiceConfigJSON(UnaryRetryServiceConfig());
  const auto make_channel = [&](const std::string& address) {
    return grpc::CreateCustomChannel(
        address, options.credentials ? options.credentials : grpc::InsecureChannelCredentials(),
        args);
  };
  const size_t n = set->addresses_.size();
  set->channels_.resize(n);
  std::vector<absl::StatusOr<layercast::v1::Manifest>> answers =
      FanOut(static_cast<uint32_t>(n), [&](uint32_t i) {
        const std::string& address = set->addresses_[i];
        set->channels_[i] = make_channel(address);
        return FetchManifest(
            set->channels_[i], [&] { return make_channel(address); }, Describe(set->addresses_, i),
            address, options);
      });
  for (const std::shared_ptr<grpc::Channel>& channel : set->channels_) {
    set->stubs_.push_back(layercast::v1::ShardService::NewStub(channel));
    set->generic_stubs_.push_back(std::make_unique<grpc::GenericStub>(channel));
  }
  for (auto& answer : answers) {
    if (!answer.ok()) return answer.status();
    set->manifests_.push_back(*std::move(answer));
  }
  ASSIGN_OR_RETURN(set->view_, wire::CheckShardSet(set->manifests_, set->addresses_));
  if (options.registry) set->metrics_ = std::make_unique<ClientMetrics>(*options.registry);
  Log()->info("connected to {} shard(s) serving {} ({} layers, policy {})", n,
              set->view_.model.model_id, set->view_.model.layers.size(),
              set->view_.policy.ToString());
  return set;
}

absl::Status ShardSet::CheckLayerIndex(uint32_t layer) const {
  if (layer < view_.layouts.size()) return absl::OkStatus();
  return absl::NotFoundError(absl::StrCat("layer ", layer, " does not exist: this model has ",
                                          view_.layouts.size(), " layers (0-",
                                          view_.layouts.size() - 1, ")"));
}

absl::StatusOr<Layer> ShardSet::Gather(uint32_t layer, const GatherOptions& options) const {
  RETURN_IF_ERROR(CheckLayerIndex(layer));
  if (options.dtype) {
    return absl::InvalidArgumentError(
        "Gather lays a layer out in the policy's dtypes: for a pull in another dtype, GatherInto "
        "a buffer laid out by LayoutIn (or mirror with MirrorOptions::dtype)");
  }
  // No budget here: the size was capped by CheckManifest, and what the host
  // cannot give is RESOURCE_EXHAUSTED.
  ASSIGN_OR_RETURN(LayerBuffer buffer, LayerBuffer::Allocate(view_.layouts[layer].total_bytes()));
  ASSIGN_OR_RETURN(uint64_t version,
                   GatherInto(layer, options, std::span<uint8_t>(buffer.data(), buffer.size())));
  return MakeLayer(layer, version, std::move(buffer));
}

absl::StatusOr<uint64_t> ShardSet::GatherInto(uint32_t layer, const GatherOptions& options,
                                              std::span<uint8_t> buffer) const {
  const auto start = std::chrono::steady_clock::now();
  absl::StatusOr<uint64_t> version = GatherStreams(layer, options, buffer);
  if (metrics_ != nullptr && layer < view_.layouts.size()) {
    const uint64_t bytes = options.byte_range
                               ? options.byte_range->second - options.byte_range->first
                               : view_.layouts[layer].total_bytes();
    metrics_->RecordGather(
        version.ok(), bytes,
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  return version;
}

absl::StatusOr<uint64_t> ShardSet::GatherStreams(uint32_t layer, const GatherOptions& options,
                                                 std::span<uint8_t> buffer) const {
  RETURN_IF_ERROR(CheckLayerIndex(layer));
  std::optional<AssembledLayout> own_layout;
  if (options.dtype) {
    ASSIGN_OR_RETURN(own_layout,
                     LayoutIn(view_.layouts[layer], *options.dtype, view_.policy.fp8_block()));
  }
  const AssembledLayout& layout = own_layout ? *own_layout : view_.layouts[layer];
  // A relay lists each tensor in the dtype it holds it in (held_dtype) and
  // serves no other: named here, before every shard refuses by index.
  if (manifests_[0].has_held_dtype()) {
    const layercast::v1::Layer& listed = manifests_[0].layers(static_cast<int>(layer));
    for (size_t t = 0; t < layout.tensors().size(); ++t) {
      const auto holds = static_cast<DType>(listed.tensors(static_cast<int>(t)).compute_dtype());
      const DType asked = layout.tensors()[t].compute_dtype;
      if (holds == asked) continue;
      return absl::FailedPreconditionError(absl::StrCat(
          "the relay at ", absl::StrJoin(addresses_, ","), " holds layer ", layer, " (",
          listed.name(), ")'s tensor ", t, " (", listed.tensors(static_cast<int>(t)).name(),
          ") in ", DTypeName(holds), ", not ", DTypeName(asked), ": read in ", DTypeName(holds),
          " (GatherOptions::dtype, MirrorOptions::dtype), or read ", DTypeName(asked),
          " from the shards or a relay started with --dtype ", DTypeName(asked)));
    }
  }
  if (buffer.size() < layout.total_bytes()) {
    return absl::InvalidArgumentError(absl::StrCat("buffer of ", buffer.size(),
                                                   " bytes is smaller than layer ", layer, "'s ",
                                                   layout.total_bytes(), " assembled bytes"));
  }
  std::vector<LayerGather::Shard> shards;
  for (size_t i = 0; i < generic_stubs_.size(); ++i) {
    shards.push_back(LayerGather::Shard{generic_stubs_[i].get(), Describe(addresses_, i),
                                        manifests_[i].content_fingerprint()});
  }
  // A gather never mixes versions; when the layer moved on under it (an
  // optimizer step applied mid-gather), it is gathered again at the newest
  // version any shard sent, a few times at most, within the same timeout.
  constexpr int kVersionRetries = 3;
  const auto deadline = std::chrono::steady_clock::now() + options.timeout;
  GatherOptions attempt = options;
  // Shards record changes in the policy's dtypes and send no delta in a
  // dtype of the reader's own: ask for the whole layer at once rather than
  // for a refusal from every shard first. A relay that holds the layers in
  // that dtype (Manifest.held_dtype) serves deltas in it.
  const bool held = options.dtype && manifests_[0].has_held_dtype() &&
                    manifests_[0].held_dtype() == static_cast<int>(*options.dtype);
  if (own_layout && !held &&
      std::any_of(view_.layouts[layer].tensors().begin(), view_.layouts[layer].tensors().end(),
                  [&options](const AssembledTensor& tensor) {
                    return tensor.compute_dtype != *options.dtype;
                  })) {
    attempt.base_version.reset();
  }
  bool fell_back = false;
  // The fallback to a full pull is no version retry: it spends none of them.
  int retries = 0;
  uint64_t skew = 0;  // over every attempt
  for (;;) {
    LayerGather gather(shards, layout, layer, attempt, buffer, manifests_[0].version());
    absl::StatusOr<uint64_t> version = gather.Run();
    skew = std::max(skew, gather.version_skew());
    if (const uint64_t rereads = gather.rereads(); rereads > 0 && metrics_ != nullptr) {
      metrics_->RecordReread(ClientMetrics::Reread::kShardRestarted, rereads);
    }
    const bool cancelled = options.cancellation != nullptr && options.cancellation->cancelled();
    if (!version.ok() && absl::IsOutOfRange(version.status()) && attempt.base_version &&
        !cancelled && std::chrono::steady_clock::now() < deadline) {
      // A shard no longer holds the changes since the base (or keeps none):
      // the whole layer, once, overwriting whatever deltas were applied.
      Log()->info("gathering layer {} in full: {}", layer, version.status().message());
      fell_back = true;
      attempt.base_version.reset();
      attempt.will_pull_deltas = true;  // the next delta should be served
      attempt.timeout = std::chrono::duration_cast<std::chrono::milliseconds>(
          deadline - std::chrono::steady_clock::now());
      continue;
    }
    // A pinned read is at its version or not at all.
    if (version.ok() || version.status().code() != absl::StatusCode::kAborted ||
        attempt.exact_version || retries == kVersionRetries || cancelled ||
        std::chrono::steady_clock::now() >= deadline) {
      // Counted once the full pull got the layer: an OUT_OF_RANGE it shares
      // with the delta (a min_version too far ahead) was no delta refusal.
      if (fell_back && version.ok() && metrics_ != nullptr) metrics_->RecordDeltaFallback();
      if (metrics_ != nullptr) metrics_->RecordVersionSkew(skew);
      return version;
    }
    Log()->info("gathering layer {} again at version {} or newer: {}", layer,
                std::max(attempt.min_version, gather.newest_version()), version.status().message());
    attempt.min_version = std::max(attempt.min_version, gather.newest_version());
    ++retries;
    attempt.timeout = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
  }
}

absl::StatusOr<layercast::v1::WaitVersionResponse> ShardSet::VersionNow(
    size_t shard, std::chrono::system_clock::time_point deadline, Cancellation* cancel) const {
  grpc::ClientContext context;
  context.set_deadline(deadline);
  const uint64_t cancel_id =
      cancel != nullptr ? cancel->Register([&context] { context.TryCancel(); }) : 0;
  layercast::v1::WaitVersionRequest request;  // min_version 0: answered at once
  layercast::v1::WaitVersionResponse response;
  const grpc::Status status = stubs_[shard]->WaitVersion(&context, request, &response);
  if (cancel_id != 0) cancel->Unregister(cancel_id);
  RETURN_IF_ERROR(wire::FromGrpcStatus(status, Describe(addresses_, shard)));
  return response;
}

absl::StatusOr<uint64_t> ShardSet::CurrentVersion(std::chrono::milliseconds timeout) const {
  ASSIGN_OR_RETURN(const layercast::v1::WaitVersionResponse now,
                   VersionNow(0, std::chrono::system_clock::now() + timeout));
  return now.version();
}

absl::StatusOr<ShardSet::Identity> ShardSet::CurrentIdentity(std::chrono::milliseconds timeout,
                                                             Cancellation* cancel) const {
  Identity identity;
  const auto deadline = std::chrono::system_clock::now() + timeout;
  for (size_t shard = 0; shard < stubs_.size(); ++shard) {
    ASSIGN_OR_RETURN(const layercast::v1::WaitVersionResponse now,
                     VersionNow(shard, deadline, cancel));
    if (shard == 0) identity.version = now.version();
    identity.incarnations.push_back(now.incarnation());
  }
  return identity;
}

absl::StatusOr<std::vector<layercast::v1::LayerDigest>> ShardSet::LayerDigests(
    uint32_t layer, uint64_t version, std::optional<DType> dtype,
    std::chrono::milliseconds timeout) const {
  RETURN_IF_ERROR(CheckLayerIndex(layer));
  std::vector<layercast::v1::LayerDigest> digests(stubs_.size());
  const auto deadline = std::chrono::system_clock::now() + timeout;
  for (size_t shard = 0; shard < stubs_.size(); ++shard) {
    grpc::ClientContext context;
    context.set_deadline(deadline);
    layercast::v1::GetLayerDigestRequest request;
    request.set_layer(layer);
    request.set_version(version);
    if (dtype) request.set_dtype(static_cast<layercast::v1::DType>(*dtype));
    RETURN_IF_ERROR(
        wire::FromGrpcStatus(stubs_[shard]->GetLayerDigest(&context, request, &digests[shard]),
                             Describe(addresses_, shard)));
  }
  return digests;
}

absl::Status ShardSet::CheckDigests(uint32_t layer, uint64_t version, std::optional<DType> dtype,
                                    const AssembledLayout& layout, std::span<const uint8_t> bytes,
                                    const std::vector<uint64_t>* served_by) const {
  ASSIGN_OR_RETURN(const std::vector<layercast::v1::LayerDigest> digests,
                   LayerDigests(layer, version, dtype));
  const auto n = static_cast<uint32_t>(digests.size());
  for (uint32_t shard = 0; shard < n; ++shard) {
    const uint64_t served =
        served_by != nullptr && shard < served_by->size() ? (*served_by)[shard] : 0;
    if (served != 0 && served != digests[shard].incarnation()) {
      return absl::AbortedError(absl::StrCat(
          Describe(addresses_, shard), " restarted since it served layer ", layer, " (incarnation ",
          served, ", now ", digests[shard].incarnation(), "): its version ", version,
          " may name other bits now; pull the layer again"));
    }
  }
  for (uint32_t shard = 0; shard < n; ++shard) {
    const wire::SliceDigest::Sha256 held = wire::SliceDigestOf(layout, bytes, shard, n);
    if (digests[shard].sha256() != std::string(held.begin(), held.end())) {
      return absl::DataLossError(
          absl::StrCat(Describe(addresses_, shard), "'s slice of layer ", layer, " at version ",
                       version, " is not what that shard's digest says (SHA-256 of incarnation ",
                       digests[shard].incarnation(), "): the bytes came altered"));
    }
  }
  return absl::OkStatus();
}

std::string UnreachableCause(const std::string& message, const std::string& address) {
  if (absl::StrContains(message, "Connection refused")) {
    return absl::StrCat("connection refused: nothing listens at ", address,
                        " (is the shard running, on that port?)");
  }
  if (absl::StrContains(message, "DNS resolution failed") ||
      absl::StrContains(message, "Name or service not known") ||
      absl::StrContains(message, "not resolve")) {
    return absl::StrCat("no such host: the name in ", address, " does not resolve");
  }
  if (absl::StrContains(message, "still loading")) return message;
  return "";
}

}  // namespace layercast::client
