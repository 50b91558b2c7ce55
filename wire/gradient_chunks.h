#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include <grpcpp/support/byte_buffer.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/layout.h"
#include "layercast/v1/shard.pb.h"

namespace layercast::wire {

// Data bytes per chunk a worker sends a shard by default, gradients and
// publishes alike. A shard that takes writes (a training shard, or one with
// an admin token) accepts messages of twice this by default, framing
// included (--max-receive-message-bytes).
inline constexpr uint64_t kWriteChunkBytes = 1 << 20;

// Cuts one worker's gradient of one layer, given in the layer's gradient
// layout (core/layout.h GradientLayout: each tensor in its compute dtype,
// an 8-bit float one in float32), into the GradientChunks one shard must receive: exactly the
// elements it owns of every tensor, in tensor and element order, each chunk at most `chunk_bytes`
// of data with its CRC-32C; a shard that owns no element of the layer gets one chunk without data,
// so that its step still counts the push. Copies each chunk's bytes once, when Next() makes it, so
// a sender holds one chunk at a time.
//
// Not thread-safe.
class GradientChunker {
 public:
  struct Stream {
    uint64_t step;
    uint32_t worker;
    uint32_t layer;
    uint32_t shard;
    uint32_t num_shards;
  };

  // REQUIRES: `gradient` holds layout.total_bytes(); shard < num_shards;
  // chunk_bytes >= 4. Both must outlive the chunker.
  GradientChunker(const AssembledLayout& layout, std::span<const uint8_t> gradient, Stream stream,
                  uint64_t chunk_bytes);

  // The next chunk, or false when the shard's part has been cut entirely.
  bool Next(layercast::v1::GradientChunk* chunk);

  // Bytes of data the shard receives in all.
  uint64_t total_bytes() const { return total_bytes_; }

 private:
  const AssembledLayout& layout_;
  const std::span<const uint8_t> gradient_;
  const Stream stream_;
  const uint64_t chunk_bytes_;
  const std::vector<TensorElementRange> runs_;
  uint64_t total_bytes_ = 0;
  size_t run_ = 0;
  uint64_t next_element_ = 0;
  bool sent_empty_ = false;
};

// One GradientChunk as gRPC received it, its fields read and its data left
// where it lies in the receive buffer (`data_at` bytes into the encoding).
struct GradientChunkView {
  uint64_t step = 0;
  uint32_t worker = 0;
  uint32_t layer = 0;
  uint32_t tensor = 0;
  uint64_t element_offset = 0;
  int dtype = 0;  // the wire value: proto3 enums are open
  std::optional<uint32_t> crc32c;
  uint32_t data_at = 0;
  uint32_t data_bytes = 0;
  grpc::ByteBuffer* encoded = nullptr;  // must outlive the view
};

// Reads the fields of an encoded GradientChunk without copying its data.
// Why by hand: a parsed GradientChunk would allocate and copy every chunk's
// data once more before it was widened (ChunkDecoder, for LayerChunks, says
// the same). INVALID_ARGUMENT for bytes that are not a GradientChunk.
absl::StatusOr<GradientChunkView> ReadGradientChunk(grpc::ByteBuffer& encoded);

// Checks the GradientChunks of one PushGradients stream against what the
// shard owns of the layer and widens each, exactly, to fp32 in place in the
// shard's staging slice (one float per owned element; the owned runs of the
// layer back to back in tensor order), straight from gRPC's receive buffer.
// Untrusted input: whatever the chunks say, it writes only inside
// `staging`, each element at most once, and only data whose CRC-32C holds.
//
// Not thread-safe: one stream's reads are serialised by gRPC.
class GradientDecoder {
 public:
  // `owned`: OwnedRuns of the whole layer for this shard. REQUIRES:
  // staging.size() == the sum of the runs' sizes.
  GradientDecoder(const AssembledLayout& layout, std::vector<TensorElementRange> owned,
                  std::span<float> staging);

  // Takes the next chunk of the stream. A shard that owns no element of the
  // layer takes exactly one chunk, without data.
  //   INVALID_ARGUMENT  step, worker or layer differ from the stream's first
  //                     chunk; a tensor or element that is not the next one
  //                     this shard owns (a gap, an overlap, a repeat, out of
  //                     order); data that is not whole elements or runs past
  //                     the owned range; no data;
  //   FAILED_PRECONDITION  a dtype that is neither the tensor's compute
  //                     dtype nor FLOAT32;
  //   DATA_LOSS         the data does not match its CRC-32C.
  // Every message says what was due. After an error the stream is over.
  absl::Status Accept(const GradientChunkView& chunk);

  // Whether every owned element has arrived.
  bool done() const { return run_ == runs_.size() && (!runs_.empty() || empty_taken_); }
  // What the stream still owes, for messages: "tensor 2 from element 17".
  std::string Due() const;

 private:
  const AssembledLayout& layout_;
  const std::vector<TensorElementRange> runs_;
  const std::span<float> staging_;
  size_t run_ = 0;
  uint64_t next_element_ = 0;
  uint64_t staged_ = 0;  // floats of staging filled
  bool started_ = false;
  bool empty_taken_ = false;
  uint64_t step_ = 0;
  uint32_t worker_ = 0;
  uint32_t layer_ = 0;
};

}  // namespace layercast::wire
