// The change log alone: a record marks exactly the elements whose compute-
// dtype bits changed, spans cut anywhere read the right bits, and only the
// last K consecutive versions are covered.

#include "server/serving/change_log.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <random>
#include <string_view>

#include "core/cast.h"
#include "core/optimizer.h"
#include "core/optimizer_spec.h"
#include "core/synthetic_model.h"

namespace layercast::server {
namespace {

constexpr char kModel[] = "llama:layers=1,hidden=40,ffn=56,vocab=44,seed=5";

std::unique_ptr<ParameterStore> Store(const char* spec = kModel,
                                      const char* policy = "c=bf16;*norm*=f32") {
  auto model = SyntheticModel::Create(spec);
  EXPECT_TRUE(model.ok()) << model.status();
  auto store = ParameterStore::Load(**model, 1, 3, *Policy::Parse(policy));
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

// K records and the one the next change fills.
TEST(ChangeLogTest, BytesForIsOneBitPerOwnedElementPerVersionAndOneMore) {
  std::unique_ptr<ParameterStore> store = Store();
  uint64_t words = 0;
  for (uint32_t l = 0; l < store->model().layers.size(); ++l) {
    uint64_t owned = 0;
    for (uint32_t t = 0; t < store->model().layers[l].tensors.size(); ++t) {
      owned += store->owned(l, t).size();
    }
    words += (owned + 63) / 64;
  }
  EXPECT_EQ(ChangeLog::BytesFor(store->model(), 1, 3, 4), 5 * 8 * words);
  EXPECT_EQ(ChangeLog::BytesFor(store->model(), 1, 3, 0), 0u) << "no log, no bitmaps";
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

// Every owned element of `layer` cast one at a time, tensor by tensor: the
// bits a snapshot holds, computed without the log's block casts.
std::vector<uint8_t> CastOneByOne(const ParameterStore& store, uint32_t layer) {
  std::vector<uint8_t> bits;
  for (uint32_t t = 0; t < store.model().layers[layer].tensors.size(); ++t) {
    const DType dtype = KeptDType(store.layout(layer).tensors()[t].compute_dtype);
    for (uint64_t i = 0; i < store.owned(layer, t).size(); ++i) {
      uint8_t one[4];
      EXPECT_TRUE(
          CastFromF32(&store.master(layer, t)[i], one, 1, dtype, Fp16Overflow::kInfinity).ok());
      bits.insert(bits.end(), one, one + DTypeSize(dtype));
    }
  }
  return bits;
}

// An optimizer step recorded in its own pass (ChangeLog::Recording): the
// same master bits as the step unobserved, exactly the elements whose cast
// bits changed marked, and the bits before kept whole: into a new buffer,
// into the last snapshot's bytes handed back (as PinnedVersions::TakeSpare
// does), or not at all. The tensors span several of the optimizer's blocks
// and sit at bit offsets that are no multiple of 64, in 2-byte (bfloat16)
// and 4-byte (float32) kept dtypes both.
TEST(ChangeLogTest, ARecordedStepMarksWhatItChangedAndKeepsTheBitsBefore) {
  constexpr char kWide[] = "llama:layers=1,hidden=128,ffn=200,vocab=44,seed=5";
  for (const char* policy : {"c=bf16;*norm*=f32", "c=f32;*norm*=bf16"}) {
    SCOPED_TRACE(policy);
    std::unique_ptr<ParameterStore> store = Store(kWide, policy);
    std::unique_ptr<ParameterStore> unobserved = Store(kWide, policy);
    const uint32_t layer = 1;
    ASSERT_GT(store->owned(layer, 1).size(), 2 * TensorOptimizer::kObservedBlock);
    ChangeLog log(*store, 2);
    const OptimizerSpec spec = *OptimizerSpec::Parse("adamw:lr=1e-5");
    const uint32_t tensors = static_cast<uint32_t>(store->model().layers[layer].tensors.size());
    std::vector<uint8_t> last_snapshot;
    for (uint64_t version = 1; version <= 3; ++version) {
      const std::vector<uint8_t> expected_before = CastOneByOne(*store, layer);
      // Version 1 keeps into a new buffer, 2 into version 1's, 3 nothing.
      const bool keep = version < 3;
      const uint8_t* reused = last_snapshot.data();
      ChangeLog::Recording recording(log, layer, keep, std::move(last_snapshot));
      for (uint32_t t = 0; t < tensors; ++t) {
        const uint64_t n = store->owned(layer, t).size();
        std::vector<float> grad(n);
        for (uint64_t i = 0; i < n; ++i) grad[i] = (i % 7 == 0 ? -1e-2f : 1e-5f) * (1 + i % 3);
        const OptimizerHyper hyper = spec.HyperFor(store->model().layers[layer].tensors[t].name);
        TensorOptimizer observed(spec.kind(), hyper, n), plain(spec.kind(), hyper, n);
        std::vector<float> scratch(n, 0.5f);
        for (uint64_t s = 1; s < version; ++s) {  // state as after the steps before
          ASSERT_TRUE(plain.Step(1e-5, scratch, grad).ok());
        }
        ASSERT_TRUE(
            observed
                .Restore(plain.steps(),
                         {std::vector<float>(plain.exp_avg().begin(), plain.exp_avg().end()),
                          std::vector<float>(plain.exp_avg_sq().begin(), plain.exp_avg_sq().end())})
                .ok());
        ASSERT_TRUE(
            observed.Step(1e-5, {store->mutable_master(layer, t), n}, grad, recording.ForTensor(t))
                .ok());
        ASSERT_TRUE(plain.Step(1e-5, {unobserved->mutable_master(layer, t), n}, grad).ok());
        ASSERT_EQ(std::memcmp(store->master(layer, t), unobserved->master(layer, t), n * 4), 0)
            << "version " << version << " tensor " << t << ": observing changed the update";
        // The next version's store starts from the same values.
        std::memcpy(unobserved->mutable_master(layer, t), store->master(layer, t), n * 4);
      }
      const std::vector<uint8_t> after = CastOneByOne(*store, layer);
      const uint64_t changed = recording.Commit(version);
      ChangeLog::Snapshot before = std::move(recording).TakeBefore();
      ASSERT_EQ(before.whole(), keep) << "version " << version;
      last_snapshot = std::move(before).TakeBits();
      if (keep) {
        EXPECT_EQ(last_snapshot, expected_before) << "version " << version;
      }
      if (version == 2) {
        EXPECT_EQ(last_snapshot.data(), reused) << "cast into the bytes given";
      }

      uint64_t expected_changed = 0, elements = 0, at = 0;
      std::vector<uint64_t> bits;
      for (uint32_t t = 0; t < tensors; ++t) {
        const ElementRange owned = store->owned(layer, t);
        const size_t size = DTypeSize(KeptDType(store->layout(layer).tensors()[t].compute_dtype));
        log.ChangedSince(layer, version - 1, version, t, owned.begin, owned.size(), bits);
        for (uint64_t i = 0; i < owned.size(); ++i, at += size, ++elements) {
          const bool differs = std::memcmp(&expected_before[at], &after[at], size) != 0;
          expected_changed += differs;
          ASSERT_EQ(Bit(bits, i), differs)
              << "version " << version << " tensor " << t << " element " << i;
        }
      }
      EXPECT_EQ(changed, expected_changed);
      ASSERT_GT(changed, 0u);
      if (std::string_view(policy) == "c=bf16;*norm*=f32") {
        ASSERT_LT(changed, elements / 2) << "lr 1e-5 leaves most bfloat16 values as they were";
      }
    }
    EXPECT_TRUE(log.Covers(layer, 1, 3)) << "consecutive records";
  }
}

// Without a reader of deltas or pinned versions for `idle`, steps are not
// worth recording; a request starts it again. The clock is the test's.
std::chrono::steady_clock::time_point test_now;
std::chrono::steady_clock::time_point TestNow() { return test_now; }

TEST(ChangeLogTest, WantedOnlyWhileReadersAskedWithinTheIdleTime) {
  std::unique_ptr<ParameterStore> store = Store();
  test_now = std::chrono::steady_clock::time_point(std::chrono::hours(1));
  ChangeLog log(*store, 2, nullptr, std::chrono::minutes(10), &TestNow);
  EXPECT_FALSE(log.Wanted()) << "no reader has asked yet";
  log.NoteAsked();
  EXPECT_TRUE(log.Wanted());
  test_now += std::chrono::minutes(9);
  EXPECT_TRUE(log.Wanted());
  test_now += std::chrono::minutes(1);
  EXPECT_FALSE(log.Wanted()) << "ten minutes without a request";
  test_now += std::chrono::hours(1000);
  EXPECT_FALSE(log.Wanted());
  log.NoteAsked();
  EXPECT_TRUE(log.Wanted());
  test_now += std::chrono::minutes(10);
  EXPECT_FALSE(log.Wanted());

  ChangeLog always(*store, 2, nullptr, std::chrono::steady_clock::duration::zero(), &TestNow);
  test_now += std::chrono::hours(100);
  EXPECT_TRUE(always.Wanted()) << "an idle time of 0 records every step";
}

}  // namespace
}  // namespace layercast::server
