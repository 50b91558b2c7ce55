// The change log alone: a record marks exactly the elements whose compute-
// dtype bits changed, spans cut anywhere read the right bits, and only the
// last K consecutive versions are covered.

#include "server/change_log.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <random>

#include "core/cast.h"
#include "core/synthetic_model.h"

namespace layercast::server {
namespace {

constexpr char kModel[] = "llama:layers=1,hidden=40,ffn=56,vocab=44,seed=5";

std::unique_ptr<ParameterStore> Store() {
  auto model = SyntheticModel::Create(kModel);
  EXPECT_TRUE(model.ok()) << model.status();
  auto store = ParameterStore::Load(**model, 1, 3, *Policy::Parse("c=bf16;*norm*=f32"));
  EXPECT_TRUE(store.ok()) << store.status();
  return *std::move(store);
}

// Nudges about `share` of every owned element of `layer` by a relative
// `step`, as an optimizer does; returns, per tensor, which elements' cast
// bits changed (computed here, independently of the log).
std::vector<std::vector<bool>> Nudge(ParameterStore& store, uint32_t layer, double share,
                                     float step, uint32_t seed) {
  std::mt19937 random(seed);
  std::bernoulli_distribution pick(share);
  std::vector<std::vector<bool>> changed;
  for (uint32_t t = 0; t < store.model().layers[layer].tensors.size(); ++t) {
    const DType dtype = store.layout(layer).tensors()[t].compute_dtype;
    float* master = store.mutable_master(layer, t);
    changed.emplace_back(store.owned(layer, t).size());
    for (uint64_t i = 0; i < store.owned(layer, t).size(); ++i) {
      uint32_t before = 0, after = 0;
      EXPECT_TRUE(CastFromF32(&master[i], &before, 1, dtype, Fp16Overflow::kInfinity).ok());
      if (pick(random)) master[i] *= 1 + step;
      EXPECT_TRUE(CastFromF32(&master[i], &after, 1, dtype, Fp16Overflow::kInfinity).ok());
      changed[t][i] = before != after;
    }
  }
  return changed;
}

bool Bit(const std::vector<uint64_t>& bits, uint64_t i) { return (bits[i / 64] >> (i % 64)) & 1; }

TEST(ChangeLogTest, MarksExactlyTheElementsWhoseCastBitsChanged) {
  std::unique_ptr<ParameterStore> store = Store();
  ChangeLog log(*store, 2);
  // The embedding's layer (0) holds one tensor; layer 1 holds norms (float32)
  // and matrices (bfloat16).
  const uint32_t layer = 1;
  ChangeLog::Snapshot before = log.Take(layer);
  // A relative step of 2^-10 changes some bfloat16 values (8 bits of
  // mantissa), not all, and every float32 one it touches.
  const auto expected = Nudge(*store, layer, 0.5, 1.0f / 1024, 7);
  uint64_t expected_count = 0;
  for (const auto& tensor : expected)
    expected_count += std::count(tensor.begin(), tensor.end(), true);
  EXPECT_EQ(log.Record(layer, 1, before), expected_count);
  ASSERT_GT(expected_count, 0u);

  std::vector<uint64_t> bits;
  for (uint32_t t = 0; t < expected.size(); ++t) {
    const ElementRange owned = store->owned(layer, t);
    // Spans cut at odd places, so the word shifts are exercised.
    for (uint64_t begin = owned.begin; begin < owned.end; begin += 37) {
      const uint64_t count = std::min<uint64_t>(101, owned.end - begin);
      log.ChangedSince(layer, 0, 1, t, begin, count, bits);
      ASSERT_EQ(bits.size(), (count + 63) / 64);
      for (uint64_t i = 0; i < count; ++i) {
        ASSERT_EQ(Bit(bits, i), expected[t][begin - owned.begin + i])
            << "tensor " << t << " element " << begin + i;
      }
      if (count % 64 != 0) {
        EXPECT_EQ(bits.back() >> (count % 64), 0u) << "bits past the span";
      }
    }
  }
}

TEST(ChangeLogTest, CoversTheLastKConsecutiveVersions) {
  std::unique_ptr<ParameterStore> store = Store();
  ChangeLog log(*store, 2);
  EXPECT_TRUE(log.Covers(0, 0, 0));
  EXPECT_FALSE(log.Covers(0, 0, 1)) << "nothing recorded yet";
  std::vector<std::vector<std::vector<bool>>> steps;
  for (uint64_t v = 1; v <= 3; ++v) {
    ChangeLog::Snapshot before = log.Take(0);
    steps.push_back(Nudge(*store, 0, 0.05, 0.25f, static_cast<uint32_t>(v)));
    log.Record(0, v, before);
  }
  EXPECT_TRUE(log.Covers(0, 1, 3));
  EXPECT_TRUE(log.Covers(0, 2, 3));
  EXPECT_FALSE(log.Covers(0, 0, 3)) << "only K = 2 versions are kept";
  EXPECT_FALSE(log.Covers(0, 4, 3)) << "a base ahead of the shard";
  EXPECT_EQ(log.OldestBase(0, 3), 1u);
  // From version 1 to 3: the union of steps 2 and 3.
  std::vector<uint64_t> bits;
  const ElementRange owned = store->owned(0, 0);
  log.ChangedSince(0, 1, 3, 0, owned.begin, owned.size(), bits);
  for (uint64_t i = 0; i < owned.size(); ++i) {
    ASSERT_EQ(Bit(bits, i), steps[1][0][i] || steps[2][0][i]) << "element " << i;
  }
  // A version that was not recorded breaks the chain: nothing before it.
  log.RecordUnchanged(0, 5);
  EXPECT_FALSE(log.Covers(0, 3, 5));
  EXPECT_TRUE(log.Covers(0, 4, 5));
  log.ChangedSince(0, 4, 5, 0, owned.begin, owned.size(), bits);
  EXPECT_EQ(std::count(bits.begin(), bits.end(), 0u), static_cast<ptrdiff_t>(bits.size()));
}

TEST(ChangeLogTest, BytesForIsOneBitPerOwnedElementPerVersion) {
  std::unique_ptr<ParameterStore> store = Store();
  uint64_t words = 0;
  for (uint32_t l = 0; l < store->model().layers.size(); ++l) {
    uint64_t owned = 0;
    for (uint32_t t = 0; t < store->model().layers[l].tensors.size(); ++t) {
      owned += store->owned(l, t).size();
    }
    words += (owned + 63) / 64;
  }
  EXPECT_EQ(ChangeLog::BytesFor(store->model(), 1, 3, 4), 4 * 8 * words);
}

TEST(ChangeLogTest, ChangedNothingLooksOnlyAtTheVersionsBetween) {
  std::unique_ptr<ParameterStore> store = Store();
  ChangeLog log(*store, 3);
  const uint32_t layer = 1;
  log.RecordUnchanged(layer, 1);
  EXPECT_TRUE(log.ChangedNothing(layer, 0, 1));
  ChangeLog::Snapshot before = log.Take(layer);
  Nudge(*store, layer, 1.0, 1.0f / 4, 7);
  ASSERT_GT(log.Record(layer, 2, before), 0u);
  EXPECT_TRUE(log.ChangedNothing(layer, 0, 1)) << "a current older than the newest record";
  EXPECT_FALSE(log.ChangedNothing(layer, 0, 2));
  EXPECT_FALSE(log.ChangedNothing(layer, 1, 2));
  EXPECT_TRUE(log.ChangedNothing(layer, 2, 2));
  EXPECT_FALSE(log.ChangedNothing(layer, 2, 3)) << "a version not recorded yet";
  EXPECT_TRUE(log.Covers(layer, 0, 1));
  EXPECT_EQ(log.OldestBase(layer, 1), 0u);
}

}  // namespace
}  // namespace layercast::server
