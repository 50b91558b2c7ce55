// Versions kept for pinned readers, alone: a kept version holds exactly the
// compute-dtype bits of the layer before its change, is charged to the
// budget only when room is left beside it, at most two a layer beside those
// a reader leased, and goes (its bytes back) when it expires, when a stream
// needs the memory, or when the last reader lets go after that; a version a
// change left as it was is found in the next kept one.

#include "server/versions/pinned_versions.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <boost/asio/thread_pool.hpp>
#include <cstring>

#include "core/cast.h"
#include "core/synthetic_model.h"
#include "platform/clock.h"
#include "server/serving/deadline_timers.h"

namespace layercast::server {
namespace {

using std::chrono::milliseconds;

constexpr char kModel[] = "llama:layers=1,hidden=40,ffn=56,vocab=44,seed=5";
constexpr uint32_t kLayer = 1;  // norms (float32) and matrices (bfloat16)

std::unique_ptr<ParameterStore> Store() {
  auto model = SyntheticModel::Create(kModel);
  EXPECT_TRUE(model.ok()) << model.status();
  auto store = ParameterStore::Load(**model, 1, 3, *Policy::Parse("c=bf16;*norm*=f32"));
  EXPECT_TRUE(store.ok()) << store.status();
  return *std::move(store);
}

// Bytes of the layer's slice in its compute dtypes.
uint64_t SliceBytes(const ParameterStore& store, uint32_t layer) {
  uint64_t bytes = 0;
  for (uint32_t t = 0; t < store.layout(layer).tensors().size(); ++t) {
    bytes +=
        store.owned(layer, t).size() * DTypeSize(store.layout(layer).tensors()[t].compute_dtype);
  }
  return bytes;
}

struct Fixture {
  explicit Fixture(std::optional<uint64_t> room = std::nullopt,
                   std::chrono::steady_clock::duration retention = std::chrono::seconds(60),
                   uint32_t delta_versions = 2)
      : store(Store()),
        budget(room ? std::optional<uint64_t>(store->master_bytes() + *room) : std::nullopt,
               store->master_bytes(), grants.get_executor()),
        log(*store, delta_versions),
        pinned(*store, retention, /*per_layer=*/2, budget, metrics, &timers) {}

  // Doubles every owned value of kLayer (`factor` 1: changes nothing), as a
  // change would, and keeps the version before as `version`; returns each
  // tensor's cast bits before.
  std::vector<std::vector<uint8_t>> Change(uint64_t version, float factor = 2) {
    std::vector<std::vector<uint8_t>> before;
    for (uint32_t t = 0; t < store->layout(kLayer).tensors().size(); ++t) {
      const DType dtype = store->layout(kLayer).tensors()[t].compute_dtype;
      const uint64_t owned = store->owned(kLayer, t).size();
      before.emplace_back(owned * DTypeSize(dtype));
      EXPECT_TRUE(CastFromF32(store->master(kLayer, t), before.back().data(), owned, dtype,
                              Fp16Overflow::kInfinity)
                      .ok());
    }
    absl::WriterMutexLock lock(&store->layer_mutex(kLayer));
    ChangeLog::Snapshot snapshot = log.Take(kLayer);
    for (uint32_t t = 0; t < store->layout(kLayer).tensors().size(); ++t) {
      float* master = store->mutable_master(kLayer, t);
      for (uint64_t i = 0; i < store->owned(kLayer, t).size(); ++i) master[i] *= factor;
    }
    const uint64_t changed = log.Record(kLayer, version + 1, snapshot);
    pinned.Keep(kLayer, version, changed, std::move(snapshot));
    return before;
  }

  std::shared_ptr<const PinnedVersions::Kept> Find(uint64_t version) {
    absl::ReaderMutexLock lock(&store->layer_mutex(kLayer));
    return pinned.Find(kLayer, version, log);
  }

  boost::asio::thread_pool grants{1};
  // Retentions pass when the test moves this clock, never by themselves.
  platform::ManualClock clock;
  DeadlineTimers timers{clock};
  ServerMetrics metrics;
  std::unique_ptr<ParameterStore> store;
  MemoryBudget budget;
  ChangeLog log;
  PinnedVersions pinned;
};

TEST(PinnedVersionsTest, KeepsTheCastBitsOfTheVersionBeforeTheChange) {
  Fixture f;
  const auto before = f.Change(0);
  const std::shared_ptr<const PinnedVersions::Kept> kept = f.Find(0);
  ASSERT_NE(kept, nullptr);
  for (uint32_t t = 0; t < before.size(); ++t) {
    EXPECT_EQ(std::memcmp(kept->tensor(t), before[t].data(), before[t].size()), 0)
        << "tensor " << t;
  }
  EXPECT_EQ(f.Find(1), nullptr) << "the version now is the master's";
  {
    absl::ReaderMutexLock lock(&f.store->layer_mutex(0));
    EXPECT_EQ(f.pinned.Find(0, 0, f.log), nullptr) << "another layer";
  }
  EXPECT_EQ(f.budget.in_use(), f.store->master_bytes() + SliceBytes(*f.store, kLayer));
  EXPECT_EQ(f.metrics.pinned_versions().Value(), 1);
  EXPECT_EQ(f.metrics.pinned_version_bytes().Value(),
            static_cast<double>(SliceBytes(*f.store, kLayer)));
  EXPECT_GT(f.metrics.pinned_version_oldest_timestamp().Value(), 1.7e9);
}

TEST(PinnedVersionsTest, KeepsNothingUnlessAsMuchRoomAgainIsLeftInTheBudget) {
  // Room for the version, not for as much again beside it.
  Fixture f(/*room=*/2 * SliceBytes(*Store(), kLayer) - 1);
  f.Change(0);
  EXPECT_EQ(f.Find(0), nullptr);
  EXPECT_EQ(f.budget.in_use(), f.store->master_bytes());
  EXPECT_EQ(f.metrics.pinned_versions().Value(), 0);
}

TEST(PinnedVersionsTest, AnExpiredVersionGoesButAReaderKeepsItsBytesUntilItLetsGo) {
  Fixture f(std::nullopt, milliseconds(100));
  f.Change(0);
  std::shared_ptr<const PinnedVersions::Kept> reader = f.Find(0);
  ASSERT_NE(reader, nullptr);
  f.clock.Advance(milliseconds(99));
  EXPECT_NE(f.Find(0), nullptr) << "within its retention";
  f.clock.Advance(milliseconds(1));
  EXPECT_EQ(f.Find(0), nullptr);
  EXPECT_EQ(f.metrics.pinned_versions().Value(), 0);
  EXPECT_EQ(f.metrics.pinned_version_oldest_timestamp().Value(), 0);
  EXPECT_EQ(f.budget.in_use(), f.store->master_bytes() + reader->bytes()) << "still read";
  reader.reset();
  EXPECT_EQ(f.budget.in_use(), f.store->master_bytes());
}

// An evicted version's bytes wait for the layer's next snapshot, counted in
// the gauge, and go when the layer's last kept version expires.
TEST(PinnedVersionsTest, ASpareGoesWithItsLayersLastVersion) {
  Fixture f(std::nullopt, milliseconds(100));
  f.Change(0);
  f.Change(1);
  f.Change(2);  // evicts version 0: its bytes become the spare
  const uint64_t slice = SliceBytes(*f.store, kLayer);
  EXPECT_EQ(f.metrics.pinned_version_bytes().Value(), static_cast<double>(3 * slice));
  EXPECT_EQ(f.budget.in_use(), f.store->master_bytes() + 3 * slice);
  f.clock.Advance(milliseconds(100));
  EXPECT_EQ(f.budget.in_use(), f.store->master_bytes());
  EXPECT_EQ(f.metrics.pinned_version_bytes().Value(), 0);
  EXPECT_TRUE(f.pinned.TakeSpare(kLayer).empty());
}

TEST(PinnedVersionsTest, DropAllGivesEveryKeptVersionBack) {
  Fixture f;
  f.Change(0);
  f.Change(1);
  EXPECT_NE(f.Find(0), nullptr);
  EXPECT_NE(f.Find(1), nullptr);
  EXPECT_EQ(f.metrics.pinned_versions().Value(), 2);
  f.pinned.DropAll();
  EXPECT_EQ(f.Find(0), nullptr);
  EXPECT_EQ(f.Find(1), nullptr);
  EXPECT_EQ(f.budget.in_use(), f.store->master_bytes());
}

TEST(PinnedVersionsTest, KeepsTheTwoNewestVersionsOfALayer) {
  Fixture f;
  f.Change(0);
  f.Change(1);
  f.Change(2);
  EXPECT_EQ(f.Find(0), nullptr) << "the oldest of three goes";
  EXPECT_NE(f.Find(1), nullptr);
  EXPECT_NE(f.Find(2), nullptr);
  EXPECT_EQ(f.metrics.pinned_versions().Value(), 2);
  // The evicted version's bytes wait, charged, for the layer's next
  // snapshot; taken, their charge goes with them.
  const uint64_t slice = SliceBytes(*f.store, kLayer);
  EXPECT_EQ(f.budget.in_use(), f.store->master_bytes() + 3 * slice);
  EXPECT_EQ(f.pinned.TakeSpare(kLayer).size(), slice);
  EXPECT_EQ(f.budget.in_use(), f.store->master_bytes() + 2 * slice);
  EXPECT_TRUE(f.pinned.TakeSpare(kLayer).empty()) << "one spare, taken once";
  EXPECT_TRUE(f.pinned.TakeSpare(0).empty()) << "nothing of another layer was evicted";

  // A version a reader holds when it is evicted stays the reader's.
  const std::shared_ptr<const PinnedVersions::Kept> held = f.Find(1);
  ASSERT_NE(held, nullptr);
  const std::vector<uint8_t> held_bits(held->tensor(0), held->tensor(0) + held->bytes());
  f.Change(3);
  EXPECT_EQ(f.Find(1), nullptr);
  EXPECT_TRUE(f.pinned.TakeSpare(kLayer).empty());
  EXPECT_EQ(std::memcmp(held->tensor(0), held_bits.data(), held_bits.size()), 0);
  // Dropping everything gives the spare's charge back too.
  f.Change(4);
  f.pinned.DropAll();
  EXPECT_EQ(f.budget.in_use(), f.store->master_bytes() + held->bytes());
}

// A walk at version 0 holds it (its lease) while versions 1-3 commit: the
// two newest unleased stay beside it, and it outlives its retention while
// the walk keeps reading.
TEST(PinnedVersionsTest, ALeasedVersionStaysBesideTheNewestWhileItsReaderReads) {
  Fixture f(std::nullopt, std::chrono::milliseconds(500));
  f.pinned.Lease(0);
  for (uint64_t version = 0; version < 4; ++version) f.Change(version);
  EXPECT_NE(f.Find(0), nullptr) << "leased";
  EXPECT_EQ(f.Find(1), nullptr) << "the oldest unleased goes";
  EXPECT_NE(f.Find(2), nullptr);
  EXPECT_NE(f.Find(3), nullptr);
  EXPECT_EQ(f.metrics.pinned_versions().Value(), 3);

  f.clock.Advance(milliseconds(300));
  f.pinned.Lease(0);  // the walk reads on, until 800 ms
  f.clock.Advance(milliseconds(300));
  EXPECT_NE(f.Find(0), nullptr) << "past its retention, but within the renewed lease";
  EXPECT_EQ(f.Find(2), nullptr) << "unleased, past its retention";
  // Then the walk stops reading: it goes when the renewed lease ends.
  f.clock.Advance(milliseconds(199));
  EXPECT_NE(f.Find(0), nullptr) << "1 ms left of the lease";
  f.clock.Advance(milliseconds(1));
  EXPECT_EQ(f.Find(0), nullptr);
}

// A walk at version 0 of a layer the first change left as it was is served
// by the version kept under 1: the lease holds that one. Leases keep no
// more than --pin-versions beside the unleased ones.
TEST(PinnedVersionsTest, ALeaseHoldsTheKeptVersionThatServesItAndNoMoreThanPerLayer) {
  // The change log remembers every change here, so version 0 can be found
  // under 1.
  Fixture f(std::nullopt, std::chrono::seconds(60), /*delta_versions=*/8);
  f.pinned.Lease(0);
  f.Change(0, /*factor=*/1);  // version 1 changed nothing: nothing kept
  for (uint64_t version = 1; version < 5; ++version) f.Change(version);
  EXPECT_NE(f.Find(0), nullptr) << "served by the version kept under 1, which the lease holds";
  EXPECT_EQ(f.Find(2), nullptr) << "the oldest unleased goes";
  EXPECT_EQ(f.metrics.pinned_versions().Value(), 3);
  f.pinned.Lease(3);
  f.pinned.Lease(4);
  f.Change(5);  // leased 1, 3, 4 and unleased 5: the oldest leased goes
  EXPECT_EQ(f.Find(0), nullptr);
  EXPECT_NE(f.Find(3), nullptr);
  EXPECT_NE(f.Find(4), nullptr);
  EXPECT_NE(f.Find(5), nullptr);
  EXPECT_EQ(f.metrics.pinned_versions().Value(), 3);
}

TEST(PinnedVersionsTest, AVersionAChangeLeftAsItWasIsFoundInTheNextKeptOne) {
  Fixture f;
  const auto before = f.Change(0, /*factor=*/1);  // version 1: nothing changed, nothing kept
  EXPECT_EQ(f.metrics.pinned_versions().Value(), 0);
  f.Change(1);  // version 2: keeps version 1, whose bits are version 0's
  const std::shared_ptr<const PinnedVersions::Kept> kept = f.Find(0);
  ASSERT_NE(kept, nullptr);
  EXPECT_EQ(kept, f.Find(1));
  for (uint32_t t = 0; t < before.size(); ++t) {
    EXPECT_EQ(std::memcmp(kept->tensor(t), before[t].data(), before[t].size()), 0)
        << "tensor " << t;
  }
  f.Change(2);  // version 3 changed: version 2's bits are not version 0's
  EXPECT_NE(f.Find(2), kept);
  EXPECT_EQ(f.Find(1), kept);
  // The log keeps two versions' changes: it no longer knows that version 1
  // changed nothing, so version 0 is not served from version 1's bits.
  EXPECT_EQ(f.Find(0), nullptr);
}

}  // namespace
}  // namespace layercast::server
