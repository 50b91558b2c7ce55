#include "server/checkpoints/checkpoint_writer.h"

#include <sys/random.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/safetensors.h"
#include "platform/failpoint.h"
#include "platform/status_macros.h"
#include "server/checkpoints/checkpoint_format.h"

namespace layercast::server {
namespace {

// Bytes per Append: keeps each write(2) bounded however large a tensor is.
constexpr size_t kAppendBytes = 4 << 20;

std::span<const float> Owned(const ParameterStore& store, uint32_t layer, uint32_t tensor) {
  return std::span<const float>(store.master(layer, tensor), store.owned(layer, tensor).size());
}

std::map<std::string, std::string> Metadata(const ParameterStore& store, uint64_t version,
                                            const std::string& checksum,
                                            const std::string& block_checksums,
                                            const CheckpointExtras& extras) {
  std::map<std::string, std::string> metadata{
      {"format", kCheckpointFormat},
      {"format_version", kCheckpointFormatVersion},
      {"model_id", store.model().model_id},
      {"num_shards", absl::StrCat(store.num_shards())},
      {"shard_index", absl::StrCat(store.shard_index())},
      {"version", absl::StrCat(version)},
      {"policy", store.policy().ToString()},
      {"layout_digest", HexString(store.layout_digest())},
      {"content_fingerprint", HexString(store.content_fingerprint())},
      {"checksum", checksum},
      {"block_crc32c", block_checksums},
  };
  for (const auto& [key, value] : extras.metadata) {
    // The format's own fields are never overridden (CheckpointExtras keys
    // are the trainer's: optimizer, layer_versions, optimizer_steps).
    metadata.emplace(key, value);
  }
  return metadata;
}

// Appends `values`, hashing each piece into `written` as it goes out: the
// hash of what the file holds, from the same pass as its data.
absl::Status AppendFloats(SafetensorsWriter& writer, std::span<const float> values,
                          Sha256& written) {
  std::span<const uint8_t> bytes = FloatBytes(values);
  while (!bytes.empty()) {
    const size_t n = std::min(bytes.size(), kAppendBytes);
    written.Update(bytes.first(n));
    RETURN_IF_ERROR(writer.Append(bytes.first(n)));
    bytes = bytes.subspan(n);
  }
  return absl::OkStatus();
}

// A nonce for the temporary file's name that nobody can predict, so that
// nobody can plant a file or link there first (CreatePrivate would refuse
// it, but the checkpoint would then fail). From the kernel (getrandom(2),
// which cannot throw as std::random_device may); should it fail, the clock
// still makes the name unique, and CreatePrivate keeps it safe.
uint64_t RandomNonce() {
  uint64_t nonce = 0;
  if (getrandom(&nonce, sizeof(nonce), 0) != static_cast<ssize_t>(sizeof(nonce))) {
    nonce = static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
  }
  return nonce;
}

// Steps 2 and 3 of WriteCheckpoint: the temporary file, whole and synced,
// renamed into place. Returns the file's size. Sets `*created` once `tmp`
// exists because of this call (and so is this call's to remove).
absl::StatusOr<uint64_t> WriteAndRename(const ParameterStore& store,
                                        const std::vector<SafetensorsWriter::TensorHeader>& headers,
                                        const std::map<std::string, std::string>& metadata,
                                        const CheckpointExtras& extras, const std::string& tmp,
                                        const std::string& path, FileSystem& fs, bool* created) {
  ASSIGN_OR_RETURN(std::unique_ptr<WritableFile> file, fs.CreatePrivate(tmp));
  *created = true;
  ASSIGN_OR_RETURN(auto writer, SafetensorsWriter::Create(std::move(file), tmp, headers, metadata));
  const std::vector<LayerSpec>& layers = store.model().layers;
  Sha256 hashed;
  for (uint32_t l = 0; l < layers.size(); ++l) {
    for (uint32_t t = 0; t < layers[l].tensors.size(); ++t) {
      RETURN_IF_ERROR(AppendFloats(*writer, Owned(store, l, t), hashed));
    }
  }
  // The master written, the optimizer state not, nothing renamed.
  FailPoint("checkpoint.mid_write", store.shard_index());
  for (const auto& [name, values] : extras.tensors) {
    RETURN_IF_ERROR(AppendFloats(*writer, values, hashed));
  }
  // The header's checksum was computed in a first pass: data that changed
  // since (a writer of the master that did not wait for the checkpoint)
  // would make a file that fails its own check at the next start. Such a
  // file never replaces the previous checkpoint.
  if (const std::string checksum = hashed.Finish(); checksum != metadata.at("checksum")) {
    return absl::AbortedError("the master changed while it was written (its data hashes to " +
                              checksum + ", not the header's " + metadata.at("checksum") +
                              "); write the checkpoint again");
  }
  RETURN_IF_ERROR(writer->Finish());
  ASSIGN_OR_RETURN(auto written, fs.OpenForRead(tmp));
  const uint64_t size = written->size();
  RETURN_IF_ERROR(fs.Rename(tmp, path));
  return size;
}

}  // namespace

absl::StatusOr<CheckpointInfo> WriteCheckpoint(const ParameterStore& store, uint64_t version,
                                               const std::string& dir, FileSystem& fs,
                                               const CheckpointExtras& extras) {
  const auto started = std::chrono::steady_clock::now();
  std::vector<SafetensorsWriter::TensorHeader> headers;
  Sha256 sha;
  BlockCrc32c blocks;
  const std::vector<LayerSpec>& layers = store.model().layers;
  for (uint32_t l = 0; l < layers.size(); ++l) {
    for (uint32_t t = 0; t < layers[l].tensors.size(); ++t) {
      const std::span<const float> owned = Owned(store, l, t);
      headers.push_back({.name = layers[l].tensors[t].name,
                         .dtype = DType::kFloat32,
                         .shape = {static_cast<int64_t>(owned.size())}});
      sha.Update(FloatBytes(owned));
      blocks.Update(FloatBytes(owned));
    }
  }
  for (const auto& [name, values] : extras.tensors) {
    headers.push_back(
        {.name = name, .dtype = DType::kFloat32, .shape = {static_cast<int64_t>(values.size())}});
    sha.Update(FloatBytes(values));
    blocks.Update(FloatBytes(values));
  }
  CheckpointInfo info;
  info.version = version;
  info.checksum = sha.Finish();
  info.path = CheckpointPath(dir, store.shard_index(), store.num_shards());
  const std::string tmp =
      TempCheckpointPath(dir, store.shard_index(), store.num_shards(), getpid(), RandomNonce());

  bool created = false;
  absl::StatusOr<uint64_t> size = WriteAndRename(
      store, headers, Metadata(store, version, info.checksum, blocks.Finish(), extras), extras, tmp,
      info.path, fs, &created);
  if (!size.ok()) {
    // Never what someone else put at the name: CreatePrivate refused it.
    if (created && fs.Exists(tmp)) (void)fs.Remove(tmp);
    return absl::Status(
        size.status().code(),
        absl::StrCat("writing checkpoint ", info.path, " failed (", size.status().message(),
                     "); the previous checkpoint, if any, is unchanged"));
  }
  info.bytes = *size;
  if (absl::Status synced = fs.SyncDir(dir); !synced.ok()) {
    return absl::Status(synced.code(),
                        absl::StrCat("checkpoint ", info.path,
                                     " was written but its directory could not be synced (",
                                     synced.message(), "); it may not survive a power loss"));
  }
  info.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  return info;
}

}  // namespace layercast::server
