#include "wire/slice_digest.h"

#include <openssl/evp.h>

#include "wire/owned_runs.h"

namespace layercast::wire {
namespace {

struct ContextDeleter {
  void operator()(EVP_MD_CTX* context) const { EVP_MD_CTX_free(context); }
};
using Context = std::unique_ptr<EVP_MD_CTX, ContextDeleter>;

Context NewSha256() {
  Context context(EVP_MD_CTX_new());
  EVP_DigestInit_ex(context.get(), EVP_sha256(), nullptr);
  return context;
}

SliceDigest::Sha256 FinishSha256(EVP_MD_CTX* context) {
  SliceDigest::Sha256 digest{};
  unsigned int length = 0;
  EVP_DigestFinal_ex(context, digest.data(), &length);
  return digest;
}

}  // namespace

// EVP contexts stay out of the header (as in server/checkpoints/checkpoint_format.h).
struct SliceDigest::Contexts {
  Context outer = NewSha256();
  Context elements;
  Context scales;
};

SliceDigest::SliceDigest() : contexts_(std::make_unique<Contexts>()) {}
SliceDigest::~SliceDigest() = default;

void SliceDigest::BeginTensor(uint32_t tensor, bool scaled) {
  EndTensor();
  const uint8_t index[4] = {static_cast<uint8_t>(tensor), static_cast<uint8_t>(tensor >> 8),
                            static_cast<uint8_t>(tensor >> 16), static_cast<uint8_t>(tensor >> 24)};
  EVP_DigestUpdate(contexts_->outer.get(), index, sizeof(index));
  contexts_->elements = NewSha256();
  contexts_->scales = scaled ? NewSha256() : nullptr;
  in_tensor_ = true;
  scaled_ = scaled;
}

void SliceDigest::AddElements(std::span<const uint8_t> bytes) {
  EVP_DigestUpdate(contexts_->elements.get(), bytes.data(), bytes.size());
}

void SliceDigest::AddScales(std::span<const uint8_t> bytes) {
  EVP_DigestUpdate(contexts_->scales.get(), bytes.data(), bytes.size());
}

void SliceDigest::EndTensor() {
  if (!in_tensor_) return;
  const Sha256 elements = FinishSha256(contexts_->elements.get());
  EVP_DigestUpdate(contexts_->outer.get(), elements.data(), elements.size());
  if (scaled_) {
    const Sha256 scales = FinishSha256(contexts_->scales.get());
    EVP_DigestUpdate(contexts_->outer.get(), scales.data(), scales.size());
  }
  in_tensor_ = false;
}

SliceDigest::Sha256 SliceDigest::Finish() {
  EndTensor();
  return FinishSha256(contexts_->outer.get());
}

SliceDigest::Sha256 SliceDigestOf(const AssembledLayout& layout, std::span<const uint8_t> buffer,
                                  uint32_t shard, uint32_t num_shards) {
  SliceDigest digest;
  for (const TensorElementRange& run : OwnedLayerRuns(layout, shard, num_shards)) {
    const AssembledTensor& placed = layout.tensors()[run.tensor];
    const uint64_t width = DTypeSize(placed.compute_dtype);
    digest.BeginTensor(run.tensor, placed.block_size != 0);
    digest.AddElements(buffer.subspan(placed.byte_offset + run.elements.begin * width,
                                      run.elements.size() * width));
    if (placed.block_size != 0) {
      const uint64_t first = run.elements.begin / placed.block_size;
      const uint64_t end = (run.elements.end + placed.block_size - 1) / placed.block_size;
      digest.AddScales(buffer.subspan(placed.scale_offset + first * 4, (end - first) * 4));
    }
  }
  return digest.Finish();
}

}  // namespace layercast::wire
