#include "core/content_fingerprint.h"

#include <gtest/gtest.h>

#include "core/synthetic_model.h"

namespace layercast {
namespace {

ContentFingerprint Of(const std::string& spec) {
  auto model = SyntheticModel::Create(spec);
  EXPECT_TRUE(model.ok()) << model.status();
  absl::StatusOr<ContentFingerprint> fingerprint = (*model)->Fingerprint();
  EXPECT_TRUE(fingerprint.ok()) << fingerprint.status();
  return *fingerprint;
}

// One tensor of `elements` values, all 1 but element `changed`.
class OneTensor final : public ParameterSource {
 public:
  OneTensor(uint64_t elements, uint64_t changed, float value) : changed_(changed), value_(value) {
    model_.model_id = "one";
    model_.layers.push_back(LayerSpec{"layer", {TensorSpec{"w", {int64_t(elements)}, elements}}});
  }
  const ModelSpec& model() const override { return model_; }
  absl::Status Read(uint32_t, uint32_t, ElementRange range, std::span<float> dst) const override {
    for (uint64_t i = range.begin; i < range.end; ++i) {
      dst[i - range.begin] = i == changed_ ? value_ : 1.0f;
    }
    ++reads_;
    return absl::OkStatus();
  }
  mutable int reads_ = 0;

 private:
  ModelSpec model_;
  uint64_t changed_;
  float value_;
};

TEST(ContentFingerprintTest, SameValuesSameFingerprintOtherValuesAnother) {
  const std::string spec = "llama:layers=2,hidden=64,ffn=128,vocab=256,seed=";
  EXPECT_EQ(Of(spec + "1"), Of(spec + "1"));
  EXPECT_NE(Of(spec + "1"), Of(spec + "2"));
}

TEST(ContentFingerprintTest, ReadsOnlyItsSamples) {
  constexpr uint64_t kElements = uint64_t{1} << 40;  // never allocated: only samples are read
  OneTensor source(kElements, 0, 1.0f);
  ASSERT_TRUE(SampleFingerprint(source).ok());
  EXPECT_EQ(source.reads_, static_cast<int>(kFingerprintSamples));
}

TEST(ContentFingerprintTest, ASampledElementChangesItAndAnUnsampledOneDoesNot) {
  constexpr uint64_t kElements = 1000;
  const ContentFingerprint base = *SampleFingerprint(OneTensor(kElements, 999, 1.0f));
  // Element floor(5 * 1000 / 32) = 156 is sampled; 157 is not.
  EXPECT_NE(*SampleFingerprint(OneTensor(kElements, 156, 2.0f)), base);
  EXPECT_EQ(*SampleFingerprint(OneTensor(kElements, 157, 2.0f)), base);
}

TEST(ContentFingerprintTest, HexRoundTrips) {
  const ContentFingerprint fingerprint = Of("llama:layers=1,hidden=64,seed=3");
  EXPECT_EQ(ParseFingerprintHex(FingerprintHex(fingerprint)), fingerprint);
  EXPECT_EQ(FingerprintHex(fingerprint, 4).size(), 8u);
  EXPECT_FALSE(ParseFingerprintHex("xyz").has_value());
  EXPECT_FALSE(ParseFingerprintHex(std::string(64, 'G')).has_value());
}

}  // namespace
}  // namespace layercast
