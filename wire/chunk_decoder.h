#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <vector>

#include <google/protobuf/io/coded_stream.h>
#include <grpcpp/support/byte_buffer.h>

#include "absl/status/statusor.h"
#include "core/layout.h"

namespace layercast::wire {

// Decodes the LayerChunk frames of one shard's FetchLayer stream straight
// from gRPC's receive buffer into their place in the assembled buffer (one
// copy, no intermediate message), checking that the shard sends exactly the
// runs it owns, in order, each element once, and that each chunk's CRC-32C
// holds. Untrusted input: whatever the bytes, it writes only inside
// `buffer`, and only inside the runs of the plan and the block scales of
// their blocks (tests/fuzz checks both).
//
// Why by hand: a parsed LayerChunk would allocate and copy every chunk's
// bytes once more before they could be placed.
//
// Not thread-safe: one stream's reads are serialised by gRPC.
class ChunkDecoder {
 public:
  // A run of elements this shard must send, and where they go.
  struct Run {
    uint32_t tensor;
    ElementRange elements;
    uint64_t byte_offset;  // of the tensor in the assembled buffer
    size_t element_size;
    // 8-bit floats only: elements per block scale, and where the tensor's
    // scales are in the assembled buffer (AssembledTensor's).
    uint32_t block_size = 0;
    uint64_t scale_offset = 0;
  };

  // REQUIRES: every run (and an 8-bit float run's block scales) lies within
  // `buffer`. With `base_version` (the
  // request's), `buffer` holds the layer at that version, and every chunk
  // must be a delta chunk from it (wire/delta_chunks.h), applied in place.
  ChunkDecoder(std::vector<Run> runs, std::span<uint8_t> buffer,
               std::optional<uint64_t> base_version = std::nullopt);

  // Places one encoded chunk and returns its data's size in bytes; DATA_LOSS
  // (saying what was wrong) when the shard broke the contract. A chunk counts
  // as received only once its checksum holds.
  // A delta chunk counts its whole span as received.
  absl::StatusOr<uint64_t> Accept(grpc::ByteBuffer& chunk);

  // Whether every run has arrived.
  bool done() const { return run_ == runs_.size(); }
  // What has not arrived intact yet, for resuming.
  std::vector<Run> RemainingRuns() const;
  // Version of the chunks received; nullopt before the first.
  std::optional<uint64_t> version() const { return version_; }
  // Elements written so far that may differ from what the buffer held:
  // every element of a full chunk, the changed ones of a delta chunk (and
  // one for each block scale it changed).
  uint64_t changed_elements() const { return changed_elements_; }
  // Where the next element is due, for messages.
  const Run* next_run() const { return done() ? nullptr : &runs_[run_]; }
  uint64_t next_element() const { return next_element_; }

 private:
  // Where `bytes` of tensor `tensor` from element `offset` go, after
  // checking they are the next thing due.
  absl::StatusOr<uint8_t*> Destination(uint32_t tensor, uint64_t offset, uint64_t bytes);
  void Advance(uint64_t bytes);
  // Accept for a delta stream: parsed whole (a delta is small by design),
  // then applied. Returns the message's size.
  absl::StatusOr<uint64_t> AcceptDelta(grpc::ByteBuffer& chunk);
  // Places the block scales of `elements` of `run` (the chunk just placed)
  // from `in`, extending `*crc` over them.
  absl::Status PlaceScales(google::protobuf::io::CodedInputStream& in, const Run& run,
                           ElementRange elements, uint32_t* crc);
  // The version check every chunk passes.
  absl::Status CheckVersion(uint64_t version);

  const std::vector<Run> runs_;
  const std::span<uint8_t> buffer_;
  const std::optional<uint64_t> base_version_;
  size_t run_ = 0;             // next run to fill
  uint64_t next_element_ = 0;  // next element expected in runs_[run_]
  std::optional<uint64_t> version_;
  uint64_t changed_elements_ = 0;
};

}  // namespace layercast::wire
