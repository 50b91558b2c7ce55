#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>

#include "absl/status/status.h"
#include "core/layout.h"
#include "layercast/v1/shard.pb.h"
#include "wire/chunk_decoder.h"

namespace layercast::client {

// One shard's FetchLayer stream within a gather: reads raw chunks and hands
// each to a ChunkDecoder, which places it in the caller's assembled buffer.
//
// Lifetime: the gather owns it and must keep it alive until `on_done` has run.
// Thread-safety: gRPC serialises the reactor callbacks; Cancel() may be called
// from any thread.
class ShardStream final : public grpc::ClientBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  using Run = wire::ChunkDecoder::Run;

  // `describe` names the shard in messages, e.g. "shard 1 (host:port)".
  // `on_chunk` (optional) runs on a gRPC thread for each chunk placed.
  // With `base_version`, a delta pull: `buffer` holds the layer at that
  // version, and the request must carry it.
  ShardStream(std::string describe, std::vector<Run> runs, std::span<uint8_t> buffer,
              std::function<void()> on_done, std::function<void(uint64_t bytes)> on_chunk = {},
              std::optional<uint64_t> base_version = std::nullopt);

  // Starts the call on `stub`; `on_done` runs once when it has ended.
  void Start(grpc::GenericStub& stub, const layercast::v1::FetchLayerRequest& request,
             std::chrono::system_clock::time_point deadline);
  void Cancel() { context_.TryCancel(); }

  // Valid after on_done: OK, or what went wrong, naming the shard.
  const absl::Status& status() const { return status_; }
  // Version of the chunks received; nullopt if the shard sent none.
  std::optional<uint64_t> version() const { return decoder_.version(); }
  uint64_t changed_elements() const { return decoder_.changed_elements(); }
  // Valid after on_done: the incarnation of the shard that served the
  // stream (its "layercast-incarnation" metadata); nullopt when it sent
  // none.
  std::optional<uint64_t> incarnation() const { return incarnation_; }
  // Valid after on_done: what has not arrived intact yet, for resuming.
  std::vector<Run> RemainingRuns() const { return decoder_.RemainingRuns(); }

  void OnReadDone(bool ok) override;
  void OnDone(const grpc::Status& status) override;

 private:
  const std::string describe_;
  wire::ChunkDecoder decoder_;
  const std::function<void()> on_done_;
  const std::function<void(uint64_t bytes)> on_chunk_;

  grpc::ClientContext context_;
  grpc::ByteBuffer request_;
  grpc::ByteBuffer incoming_;
  absl::Status protocol_error_;  // set when the shard broke the contract
  absl::Status status_;
  std::optional<uint64_t> incarnation_;
};

}  // namespace layercast::client
