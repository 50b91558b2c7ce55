#include "server/checkpoints/peer_state.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <chrono>
#include <cstring>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/layout.h"
#include "platform/status_macros.h"
#include "server/checkpoints/checkpoint_format.h"
#include "wire/grpc_status.h"

namespace layercast::server {
namespace {

using layercast::v1::HandOverResponse;

// One call to an old shard: long enough for a 2 MiB answer on a slow link,
// short enough that a dead shard refuses the start soon.
constexpr std::chrono::seconds kCallDeadline{30};
// Elements per ReadState: the old shard's limit (shard_admin_handover.cc).
constexpr uint64_t kReadElements = uint64_t{1} << 19;

std::string WhatToDo(const std::string& addresses) {
  return absl::StrCat(
      ". Freeze every old shard at one version (ShardAdmin.HandOver with at_version) and call "
      "it again until each answers at_boundary, then start this set with --hand-over-from ",
      addresses, "; or fill this set from the old set's checkpoints instead (a resharded load)");
}

// Whether two old shards' training headers say the same.
bool SameHeader(const HandOverResponse& a, const HandOverResponse& b) {
  return a.frozen_at() == b.frozen_at() && a.optimizer() == b.optimizer() &&
         std::equal(a.layer_versions().begin(), a.layer_versions().end(),
                    b.layer_versions().begin(), b.layer_versions().end()) &&
         std::equal(a.optimizer_steps().begin(), a.optimizer_steps().end(),
                    b.optimizer_steps().begin(), b.optimizer_steps().end()) &&
         a.workers() == b.workers() && a.has_last_clip_step() == b.has_last_clip_step() &&
         a.last_clip_step() == b.last_clip_step() &&
         a.last_clip_scale_bits() == b.last_clip_scale_bits();
}

}  // namespace

absl::StatusOr<std::unique_ptr<PeerState>> PeerState::Open(std::vector<std::string> addresses,
                                                           PeerCalls calls,
                                                           std::unique_ptr<ParameterSource> values,
                                                           uint32_t shard_index,
                                                           uint32_t num_shards) {
  auto state = std::unique_ptr<PeerState>(new PeerState());
  const std::string listed = absl::StrJoin(addresses, ",");
  state->path_ = absl::StrCat("hand-over from ", listed);
  state->addresses_ = std::move(addresses);
  state->authorization_ = absl::StrCat("Bearer ", calls.token);
  state->values_ = std::move(values);
  state->shard_index_ = shard_index;
  state->num_shards_ = num_shards;
  const ModelSpec& model = state->values_->model();
  for (uint32_t l = 0; l < model.layers.size(); ++l) {
    for (uint32_t t = 0; t < model.layers[l].tensors.size(); ++t) {
      state->tensors_[model.layers[l].tensors[t].name] = {l, t};
    }
  }
  const auto count = static_cast<uint32_t>(state->addresses_.size());
  std::optional<HandOverResponse> first;
  for (uint32_t i = 0; i < count; ++i) {
    const std::string& address = state->addresses_[i];
    state->stubs_.push_back(
        layercast::v1::ShardAdmin::NewStub(grpc::CreateChannel(address, calls.credentials)));
    grpc::ClientContext context;
    context.AddMetadata("authorization", state->authorization_);
    context.set_deadline(std::chrono::system_clock::now() + kCallDeadline);
    HandOverResponse answer;
    const grpc::Status status =
        state->stubs_.back()->HandOver(&context, layercast::v1::HandOverRequest(), &answer);
    const auto refuse = [&](auto&&... why) {
      return absl::FailedPreconditionError(absl::StrCat("--hand-over-from: old shard ", i, " (",
                                                        address, ") ", why..., WhatToDo(listed)));
    };
    if (!status.ok()) {
      return refuse("answered HandOver with ", wire::StatusCodeName(status.error_code()), ": ",
                    status.error_message());
    }
    if (!answer.at_boundary()) {
      return refuse("is frozen at version ", answer.frozen_at(),
                    " but has not reached it yet (a step is still open)");
    }
    if (answer.shard_index() != i || answer.num_shards() != count) {
      return refuse("is shard ", answer.shard_index(), " of ", answer.num_shards(), ", not shard ",
                    i, " of ", count, ": list every old shard, in shard order");
    }
    if (answer.model_id() != model.model_id ||
        static_cast<size_t>(answer.layer_versions_size()) != model.layers.size()) {
      return refuse("trains model ", answer.model_id(), ", not ", model.model_id,
                    ": start this set with the old set's --model");
    }
    if (first && !SameHeader(*first, answer)) {
      return refuse("disagrees with old shard 0 on its versions, steps, optimizer or clip state");
    }
    if (!first) first = answer;
  }
  if (!first) {
    return absl::InvalidArgumentError("--hand-over-from lists no address: list the old set's");
  }
  CheckpointTraining training;
  training.optimizer = first->optimizer();
  training.layer_versions.assign(first->layer_versions().begin(), first->layer_versions().end());
  training.optimizer_steps.assign(first->optimizer_steps().begin(), first->optimizer_steps().end());
  training.workers = first->workers();
  if (first->has_last_clip_step()) {
    training.last_clip = {first->last_clip_step(),
                          std::bit_cast<float>(first->last_clip_scale_bits())};
  }
  state->version_ = first->frozen_at();
  state->training_ = std::move(training);
  return state;
}

absl::Status PeerState::Read(uint32_t layer, uint32_t tensor, ElementRange range,
                             std::span<float> dst) const {
  return Fetch(layer, tensor, "", range, dst);
}

absl::Status PeerState::ReadState(const std::string& name, std::vector<float>& values) const {
  // "__optimizer__/<buffer>/<tensor>"; a tensor name may hold '/'.
  const auto not_found = [&] {
    return absl::NotFoundError(absl::StrCat(path_, " holds no ", name));
  };
  if (!absl::StartsWith(name, kOptimizerStatePrefix)) return not_found();
  const std::string rest = name.substr(std::strlen(kOptimizerStatePrefix));
  const size_t slash = rest.find('/');
  if (slash == std::string::npos) return not_found();
  const auto found = tensors_.find(rest.substr(slash + 1));
  if (found == tensors_.end()) return not_found();
  const auto [layer, tensor] = found->second;
  const ElementRange owned = ShardElementRange(model().layers[layer].tensors[tensor].num_elements,
                                               shard_index_, num_shards_);
  values.resize(owned.size());
  return Fetch(layer, tensor, rest.substr(0, slash), owned, values);
}

absl::Status PeerState::Fetch(uint32_t layer, uint32_t tensor, const std::string& buffer,
                              ElementRange range, std::span<float> dst) const {
  const uint64_t n = model().layers[layer].tensors[tensor].num_elements;
  const auto count = static_cast<uint32_t>(stubs_.size());
  for (uint32_t i = 0; i < count; ++i) {
    const ElementRange both = Intersect(range, ShardElementRange(n, i, count));
    for (uint64_t begin = both.begin; begin < both.end; begin += kReadElements) {
      const uint64_t end = std::min(both.end, begin + kReadElements);
      layercast::v1::ReadStateRequest request;
      request.set_layer(layer);
      request.set_tensor(tensor);
      request.set_buffer(buffer);
      request.set_begin(begin);
      request.set_end(end);
      grpc::ClientContext context;
      context.AddMetadata("authorization", authorization_);
      context.set_deadline(std::chrono::system_clock::now() + kCallDeadline);
      layercast::v1::ReadStateResponse answer;
      const grpc::Status status = stubs_[i]->ReadState(&context, request, &answer);
      const std::string what =
          absl::StrCat(buffer.empty() ? "master" : buffer, " of ",
                       model().layers[layer].tensors[tensor].name, " [", begin, ", ", end, ")");
      if (!status.ok()) {
        return absl::FailedPreconditionError(absl::StrCat(
            "--hand-over-from: old shard ", i, " (", addresses_[i], ") refused ReadState of ", what,
            ": ", wire::StatusCodeName(status.error_code()), ": ", status.error_message(),
            WhatToDo(absl::StrJoin(addresses_, ","))));
      }
      if (answer.data().size() != (end - begin) * sizeof(float)) {
        return absl::DataLossError(absl::StrCat("--hand-over-from: old shard ", i, " (",
                                                addresses_[i], ") answered ", answer.data().size(),
                                                " bytes for ", what, "; start this shard again"));
      }
      std::memcpy(dst.data() + (begin - range.begin), answer.data().data(), answer.data().size());
      elements_read_.fetch_add(end - begin);
    }
  }
  return absl::OkStatus();
}

}  // namespace layercast::server
