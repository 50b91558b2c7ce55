#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "platform/file_system.h"

// OpenSSL's EVP_MD_CTX, kept out of this header.
struct evp_md_ctx_st;

namespace layercast::server {

// The on-disk form of a shard checkpoint, shared by CheckpointWriter and
// CheckpointSource.
//
// Shard i of N writes `<dir>/shard-<i>-of-<N>.safetensors`: a standard
// safetensors file with one F32 tensor per model tensor, named as in the
// model, of 1-D shape [elements this shard owns] (the range follows from the
// shard math, ShardElementRange), in manifest order, and this `__metadata__`:
//
//   format          "layercast-shard-checkpoint"
//   format_version  "1"
//   model_id        the model's id
//   num_shards      decimal N
//   shard_index     decimal i
//   version         decimal parameter version (optimizer steps applied)
//   policy          the canonical precision policy
//   layout_digest   64 lowercase hex digits of LayoutDigest(model, policy)
//   content_fingerprint  64 lowercase hex digits: the content fingerprint of
//                   the model this shard's values descend from (see
//                   SampleFingerprint); absent in checkpoints written before
//                   it existed
//   checksum        "sha256:" + 64 lowercase hex digits: SHA-256 of the data
//                   section, i.e. every byte after the header, in file order
//   block_crc32c    "<B>:" + 8 lowercase hex digits per B bytes of the data
//                   section (the last block may be shorter): each block's
//                   CRC-32C, so that a shard loading a range of the file
//                   (a resharded load) checks what it read without reading
//                   the rest; absent in checkpoints written before it
//
// A training shard (--optimizer) adds its optimizer state, so that a shard
// restarted from the file continues bit for bit: after the master's
// tensors, one F32 tensor per state buffer of each tensor it trains, named
// OptimizerStateName(buffer, tensor) ("__optimizer__/exp_avg/<tensor>";
// buffers as torch names them: momentum_buffer, or exp_avg and exp_avg_sq),
// of the same 1-D shape as the tensor's slice, and these fields:
//
//   optimizer        the canonical optimizer spec it trained with
//   layer_versions   every layer's version (steps applied), comma-separated
//   optimizer_steps  every layer's optimizer step count (torch's
//                    state['step']), comma-separated
//
// `version` is then the model's: its lowest layer's. Pushes staged for a
// layer step not yet applied are saved too, so that a shard stopped in the
// middle of a step completes it when the other workers' pushes arrive: one
// F32 tensor per staged push, StagedPushName(layer, worker)
// ("__staged__/<layer>/<worker>"), of the layer's owned elements widened (or,
// with clipping, the layer's reduced mean waiting for the scale,
// "__staged__/<layer>/mean"), and
//
//   staged_pushes   those tensors' "<layer>/<worker>" or "<layer>/mean",
//                   comma-separated; empty when no step was open
//
// It is written under `.shard-<i>-of-<N>.safetensors.tmp-<pid>-<nonce>` in
// the same directory, created new and private (FileSystem::CreatePrivate),
// and renamed into place, so a file with the final name is always complete
// and only its owner may read it.

inline constexpr char kCheckpointFormat[] = "layercast-shard-checkpoint";
inline constexpr char kCheckpointFormatVersion[] = "1";
inline constexpr char kOptimizerStatePrefix[] = "__optimizer__/";
inline constexpr char kStagedPushPrefix[] = "__staged__/";
// What StagedPushName calls a layer's reduced mean.
inline constexpr char kStagedMean[] = "mean";

// "__optimizer__/<buffer>/<tensor>".
std::string OptimizerStateName(const std::string& buffer, const std::string& tensor);

// "__staged__/<layer>/<part>": `part` a worker index or kStagedMean.
std::string StagedPushName(uint32_t layer, const std::string& part);

// "shard-<i>-of-<N>.safetensors".
std::string CheckpointFileName(uint32_t shard_index, uint32_t num_shards);
// `dir` + "/" + CheckpointFileName(...).
std::string CheckpointPath(const std::string& dir, uint32_t shard_index, uint32_t num_shards);
// `dir` + "/.shard-<i>-of-<N>.safetensors.tmp-<pid>-<nonce>", `nonce` as 16
// lowercase hex digits. The pid says whose write it was (for
// CheckpointManager::RemoveStaleTemporaries); a random nonce makes the name
// one nobody can plant a file or link at in advance.
std::string TempCheckpointPath(const std::string& dir, uint32_t shard_index, uint32_t num_shards,
                               int64_t pid, uint64_t nonce);

// The shard count of a checkpoint file name "shard-<i>-of-<M>.safetensors"
// whose index is `shard_index`, or nullopt for any other name.
std::optional<uint32_t> CheckpointShardCount(const std::string& file_name, uint32_t shard_index);

// The shard index and count of a checkpoint file name
// "shard-<i>-of-<N>.safetensors", or nullopt for any other name.
std::optional<std::pair<uint32_t, uint32_t>> ParseCheckpointFileName(const std::string& file_name);

// Lowercase hex of `bytes`.
std::string HexString(std::span<const uint8_t> bytes);

// Incremental SHA-256 (OpenSSL EVP). Not thread-safe.
class Sha256 {
 public:
  Sha256();
  ~Sha256();
  Sha256(const Sha256&) = delete;
  Sha256& operator=(const Sha256&) = delete;

  void Update(std::span<const uint8_t> bytes);
  // "sha256:" + 64 lowercase hex digits. Ends the computation: call once.
  std::string Finish();

 private:
  evp_md_ctx_st* ctx_;
};

// Bytes per block_crc32c block: a resharded load reads at most this much
// beyond its own ranges at either end of each, once per block. 8 hex
// digits per block keep the header at 32 bytes per MiB of data (3.2 MB for
// a 100 GB file, under the reader's 100 MB limit).
inline constexpr uint64_t kChecksumBlockBytes = 256 << 10;

// The block_crc32c field, computed as the data goes by. Not thread-safe.
class BlockCrc32c {
 public:
  explicit BlockCrc32c(uint64_t block_bytes = kChecksumBlockBytes) : block_bytes_(block_bytes) {}
  void Update(std::span<const uint8_t> bytes);
  // "<B>:<hex>...". Ends the computation: call once.
  std::string Finish();

 private:
  uint64_t block_bytes_;
  uint64_t in_block_ = 0;  // bytes of the current block so far
  uint32_t crc_ = 0;
  std::string hex_;
};

// A parsed block_crc32c field; nullopt when `text` is not one.
struct BlockChecksums {
  uint64_t block_bytes = 0;
  std::vector<uint32_t> crcs;
};
std::optional<BlockChecksums> ParseBlockChecksums(const std::string& text);

// The checkpoint's stored bytes of a float span, little-endian (checked at
// compile time: layercast only builds for little-endian hosts).
std::span<const uint8_t> FloatBytes(std::span<const float> values);

}  // namespace layercast::server
