#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "layercast/v1/admin.grpc.pb.h"
#include "server/access/peer_credentials.h"
#include "server/checkpoints/checkpoint_state.h"

namespace layercast::server {

// Shard j of M filling itself from a running set of N shards frozen at a
// step boundary (live hand-over, docs/decisions.md): the old set's live
// state instead of a checkpoint file. For every tensor it reads its own
// element range of the master and of every optimizer buffer from the old
// shards whose slices hold it (ShardAdmin.ReadState, only those elements),
// and takes the old set's versions, step counts and clip state, which must
// agree. A frozen set holds no staged push, so there is none to take.
//
// Open() asks every old shard (ShardAdmin.HandOver without at_version):
// one that is gone, not frozen at its boundary, of another model or set
// size, or disagreeing with the others refuses the start with one line.
//
// Thread-safe: Read and ReadState may run concurrently.
class PeerState final : public CheckpointState {
 public:
  // `addresses`: the N old shards in shard order. `values`: the --model the
  // set trains (its model and fingerprint; its values are not read).
  static absl::StatusOr<std::unique_ptr<PeerState>> Open(std::vector<std::string> addresses,
                                                         PeerCalls calls,
                                                         std::unique_ptr<ParameterSource> values,
                                                         uint32_t shard_index, uint32_t num_shards);

  const ModelSpec& model() const override { return values_->model(); }
  absl::StatusOr<ContentFingerprint> Fingerprint() const override { return values_->Fingerprint(); }
  absl::Status Read(uint32_t layer, uint32_t tensor, ElementRange range,
                    std::span<float> dst) const override;

  // "hand-over from ADDR,ADDR,...".
  const std::string& path() const override { return path_; }
  uint64_t version() const override { return version_; }
  const std::optional<CheckpointTraining>& training() const override { return training_; }
  // `name` as OptimizerStateName gives it; NOT_FOUND for any other.
  absl::Status ReadState(const std::string& name, std::vector<float>& values) const override;
  // Each answer came whole over its channel; there is no file to check.
  absl::Status VerifyChecksum() override { return absl::OkStatus(); }

  uint32_t from_count() const { return static_cast<uint32_t>(stubs_.size()); }
  // Elements read from the old set so far, and in how many calls.
  uint64_t elements_read() const { return elements_read_.load(); }

 private:
  PeerState() = default;
  // Elements `range` of tensor (layer, tensor)'s master (`buffer` empty) or
  // optimizer buffer, from the old shards whose slices hold them.
  absl::Status Fetch(uint32_t layer, uint32_t tensor, const std::string& buffer, ElementRange range,
                     std::span<float> dst) const;

  std::string path_;
  std::vector<std::string> addresses_;
  std::string authorization_;  // "Bearer <token>"
  std::vector<std::unique_ptr<layercast::v1::ShardAdmin::Stub>> stubs_;
  std::unique_ptr<ParameterSource> values_;
  uint32_t shard_index_ = 0;
  uint32_t num_shards_ = 1;
  uint64_t version_ = 0;
  std::optional<CheckpointTraining> training_;
  std::map<std::string, std::pair<uint32_t, uint32_t>> tensors_;  // by name: (layer, index)
  mutable std::atomic<uint64_t> elements_read_{0};
};

}  // namespace layercast::server
