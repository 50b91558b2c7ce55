#include "server/checkpoints/checkpoint_format.h"

#include <openssl/evp.h>

#include <algorithm>
#include <bit>
#include <charconv>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "core/crc32c.h"

namespace layercast::server {

static_assert(std::endian::native == std::endian::little,
              "checkpoints store fp32 little-endian, straight from memory");

std::string CheckpointFileName(uint32_t shard_index, uint32_t num_shards) {
  return absl::StrCat("shard-", shard_index, "-of-", num_shards, ".safetensors");
}

std::string CheckpointPath(const std::string& dir, uint32_t shard_index, uint32_t num_shards) {
  return absl::StrCat(dir, "/", CheckpointFileName(shard_index, num_shards));
}

std::string TempCheckpointPath(const std::string& dir, uint32_t shard_index, uint32_t num_shards,
                               int64_t pid, uint64_t nonce) {
  return absl::StrCat(dir, "/.", CheckpointFileName(shard_index, num_shards), ".tmp-", pid, "-",
                      absl::Hex(nonce, absl::kZeroPad16));
}

std::optional<uint32_t> CheckpointShardCount(const std::string& file_name, uint32_t shard_index) {
  const std::string prefix = absl::StrCat("shard-", shard_index, "-of-");
  constexpr char kSuffix[] = ".safetensors";
  if (!absl::StartsWith(file_name, prefix) || !absl::EndsWith(file_name, kSuffix)) {
    return std::nullopt;
  }
  const char* begin = file_name.data() + prefix.size();
  const char* end = file_name.data() + file_name.size() - (sizeof(kSuffix) - 1);
  uint32_t count = 0;
  auto [parsed_end, ec] = std::from_chars(begin, end, count);
  if (begin >= end || ec != std::errc() || parsed_end != end) return std::nullopt;
  return count;
}

std::optional<std::pair<uint32_t, uint32_t>> ParseCheckpointFileName(const std::string& file_name) {
  constexpr char kPrefix[] = "shard-";
  if (!absl::StartsWith(file_name, kPrefix)) return std::nullopt;
  const char* begin = file_name.data() + sizeof(kPrefix) - 1;
  const char* end = file_name.data() + file_name.size();
  uint32_t index = 0;
  auto [index_end, ec] = std::from_chars(begin, end, index);
  if (index_end == begin || ec != std::errc()) return std::nullopt;
  const std::optional<uint32_t> count = CheckpointShardCount(file_name, index);
  // "shard-01-of-2" is not a name any shard writes.
  if (!count || file_name != CheckpointFileName(index, *count)) return std::nullopt;
  return std::make_pair(index, *count);
}

std::string HexString(std::span<const uint8_t> bytes) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string hex;
  hex.reserve(bytes.size() * 2);
  for (uint8_t byte : bytes) {
    hex.push_back(kDigits[byte >> 4]);
    hex.push_back(kDigits[byte & 0xF]);
  }
  return hex;
}

Sha256::Sha256() : ctx_(EVP_MD_CTX_new()) { EVP_DigestInit_ex(ctx_, EVP_sha256(), nullptr); }

Sha256::~Sha256() { EVP_MD_CTX_free(ctx_); }

void Sha256::Update(std::span<const uint8_t> bytes) {
  EVP_DigestUpdate(ctx_, bytes.data(), bytes.size());
}

std::string Sha256::Finish() {
  std::array<uint8_t, EVP_MAX_MD_SIZE> digest{};
  unsigned int length = 0;
  EVP_DigestFinal_ex(ctx_, digest.data(), &length);
  return absl::StrCat("sha256:", HexString(std::span<const uint8_t>(digest.data(), length)));
}

std::span<const uint8_t> FloatBytes(std::span<const float> values) {
  return std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(values.data()),
                                  values.size_bytes());
}

void BlockCrc32c::Update(std::span<const uint8_t> bytes) {
  while (!bytes.empty()) {
    const size_t n =
        static_cast<size_t>(std::min<uint64_t>(bytes.size(), block_bytes_ - in_block_));
    crc_ = Crc32c(bytes.data(), n, crc_);
    in_block_ += n;
    bytes = bytes.subspan(n);
    if (in_block_ == block_bytes_) {
      absl::StrAppend(&hex_, absl::Hex(crc_, absl::kZeroPad8));
      in_block_ = 0;
      crc_ = 0;
    }
  }
}

std::string BlockCrc32c::Finish() {
  if (in_block_ > 0) absl::StrAppend(&hex_, absl::Hex(crc_, absl::kZeroPad8));
  return absl::StrCat(block_bytes_, ":", hex_);
}

std::optional<BlockChecksums> ParseBlockChecksums(const std::string& text) {
  const size_t colon = text.find(':');
  BlockChecksums parsed;
  if (colon == std::string::npos || !absl::SimpleAtoi(text.substr(0, colon), &parsed.block_bytes) ||
      parsed.block_bytes == 0 || parsed.block_bytes % sizeof(float) != 0 ||
      (text.size() - colon - 1) % 8 != 0) {
    return std::nullopt;
  }
  for (size_t at = colon + 1; at < text.size(); at += 8) {
    uint32_t crc = 0;
    if (!absl::SimpleHexAtoi(text.substr(at, 8), &crc)) return std::nullopt;
    parsed.crcs.push_back(crc);
  }
  return parsed;
}

std::string OptimizerStateName(const std::string& buffer, const std::string& tensor) {
  return absl::StrCat(kOptimizerStatePrefix, buffer, "/", tensor);
}

std::string StagedPushName(uint32_t layer, const std::string& part) {
  return absl::StrCat(kStagedPushPrefix, layer, "/", part);
}

}  // namespace layercast::server
