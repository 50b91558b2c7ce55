#include "core/content_fingerprint.h"

#include <openssl/evp.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"

namespace layercast {

absl::StatusOr<ContentFingerprint> ParameterSource::Fingerprint() const {
  return SampleFingerprint(*this);
}

absl::StatusOr<ContentFingerprint> SampleFingerprint(const ParameterSource& source) {
  // A length-prefixed serialisation, as in LayoutDigest, so no two models
  // hash the same bytes by accident of concatenation.
  std::string bytes;
  const auto append_u64 = [&](uint64_t v) {
    for (int i = 0; i < 8; ++i) bytes.push_back(static_cast<char>(v >> (8 * i)));
  };
  const ModelSpec& model = source.model();
  append_u64(model.layers.size());
  for (uint32_t l = 0; l < model.layers.size(); ++l) {
    const LayerSpec& layer = model.layers[l];
    append_u64(layer.tensors.size());
    for (uint32_t t = 0; t < layer.tensors.size(); ++t) {
      const TensorSpec& tensor = layer.tensors[t];
      append_u64(tensor.name.size());
      bytes += tensor.name;
      append_u64(tensor.shape.size());
      for (int64_t dim : tensor.shape) append_u64(static_cast<uint64_t>(dim));
      const uint64_t n = tensor.num_elements;
      const uint64_t samples = std::min(n, kFingerprintSamples);
      for (uint64_t j = 0; j < samples; ++j) {
        // floor(j*n/S) without overflow: n < 2^63 and S is small.
        const uint64_t element =
            ShardElementRange(n, static_cast<uint32_t>(j), static_cast<uint32_t>(samples)).begin;
        float value = 0;
        if (absl::Status read =
                source.Read(l, t, ElementRange{element, element + 1}, std::span<float>(&value, 1));
            !read.ok()) {
          return absl::Status(read.code(), absl::StrCat("fingerprinting tensor ", tensor.name, ": ",
                                                        read.message()));
        }
        uint32_t bits = 0;
        std::memcpy(&bits, &value, sizeof(bits));
        append_u64(bits);
      }
    }
  }
  ContentFingerprint digest{};
  unsigned int length = 0;
  EVP_Digest(bytes.data(), bytes.size(), digest.data(), &length, EVP_sha256(), nullptr);
  return digest;
}

std::string FingerprintHex(const ContentFingerprint& fingerprint, size_t bytes) {
  return absl::BytesToHexString(absl::string_view(reinterpret_cast<const char*>(fingerprint.data()),
                                                  std::min(bytes, fingerprint.size())));
}

std::optional<ContentFingerprint> ParseFingerprintHex(const std::string& hex) {
  if (hex.size() != 64 || !std::all_of(hex.begin(), hex.end(), [](char c) {
        return absl::ascii_isdigit(c) || (c >= 'a' && c <= 'f');
      })) {
    return std::nullopt;
  }
  const std::string raw = absl::HexStringToBytes(hex);
  ContentFingerprint out{};
  std::memcpy(out.data(), raw.data(), out.size());
  return out;
}

}  // namespace layercast
