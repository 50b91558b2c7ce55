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

namespace layercast::client {

// One shard's FetchLayer stream within a gather. Decodes each LayerChunk
// straight from gRPC's receive buffer into its place in the caller's
// assembled buffer (one copy, no intermediate message), checking that the
// shard sends exactly the runs it owns, in order, each element once, and
// that each chunk's CRC-32C holds.
//
// Why raw: a parsed LayerChunk would allocate and copy every chunk's bytes
// once more before they could be placed.
//
// Lifetime: the gather owns it and must keep it alive until `on_done` has run.
// Thread-safety: gRPC serialises the reactor callbacks; Cancel() may be called
// from any thread.
class ShardStream final : public grpc::ClientBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  // A run of elements this shard must send, and where they go.
  struct Run {
    uint32_t tensor;
    ElementRange elements;
    uint64_t byte_offset;  // of the tensor in the assembled buffer
    size_t element_size;
  };

  // `describe` names the shard in messages, e.g. "shard 1 (host:port)".
  // `on_chunk` (optional) runs on a gRPC thread for each chunk placed.
  ShardStream(std::string describe, std::vector<Run> runs, std::span<uint8_t> buffer,
              std::function<void()> on_done, std::function<void(uint64_t bytes)> on_chunk = {});

  // Starts the call on `stub`; `on_done` runs once when it has ended.
  void Start(grpc::GenericStub& stub, const layercast::v1::FetchLayerRequest& request,
             std::chrono::system_clock::time_point deadline);
  void Cancel() { context_.TryCancel(); }

  // Valid after on_done: OK, or what went wrong, naming the shard.
  const absl::Status& status() const { return status_; }
  // Version of the chunks received; nullopt if the shard sent none.
  std::optional<uint64_t> version() const { return version_; }
  // Valid after on_done: what has not arrived intact yet, for resuming.
  std::vector<Run> RemainingRuns() const;

  void OnReadDone(bool ok) override;
  void OnDone(const grpc::Status& status) override;

 private:
  // Places one encoded chunk; DATA_LOSS when the shard broke the contract.
  absl::Status Accept(grpc::ByteBuffer& chunk);
  // Where `bytes` of tensor `tensor` from element `offset` go, after
  // checking they are the next thing due.
  absl::StatusOr<uint8_t*> Destination(uint32_t tensor, uint64_t offset, uint64_t bytes);
  void Advance(uint64_t bytes);

  const std::string describe_;
  const std::vector<Run> runs_;
  const std::span<uint8_t> buffer_;
  const std::function<void()> on_done_;
  const std::function<void(uint64_t bytes)> on_chunk_;

  grpc::ClientContext context_;
  grpc::ByteBuffer request_;
  grpc::ByteBuffer incoming_;
  size_t run_ = 0;             // next run to fill
  uint64_t next_element_ = 0;  // next element expected in runs_[run_]
  std::optional<uint64_t> version_;
  absl::Status protocol_error_;  // set when the shard broke the contract
  absl::Status status_;
};

}  // namespace layercast::client
