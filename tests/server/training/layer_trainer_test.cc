// The shard's training state without gRPC: the mean of W workers' gradients
// applied by the optimizer exactly once per step, the same bits whatever
// order the pushes arrive in, and every bad push refused changing nothing.
// In server_concurrency_test: runs under ThreadSanitizer (label concurrency).

#include "server/training/layer_trainer.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <boost/asio/io_context.hpp>

#include <bit>
#include <cstring>
#include <random>
#include <thread>

#include "core/synthetic_model.h"
#include "platform/status_macros.h"
#include "server/checkpoints/checkpoint_format.h"

namespace layercast::server {
namespace {

using ::testing::HasSubstr;

constexpr char kModel[] = "llama:layers=2,hidden=32,ffn=48,vocab=40,seed=3";

std::unique_ptr<ParameterStore> Store(uint32_t shard, uint32_t num_shards) {
  auto model = SyntheticModel::Create(kModel);
  EXPECT_TRUE(model.ok()) << model.status();
  auto store = ParameterStore::Load(**model, shard, num_shards, *Policy::Parse("c=bf16"));
  EXPECT_TRUE(store.ok()) << store.status();
  return *std::move(store);
}

// Worker `worker`'s gradient of `layer` at `step`: deterministic, varied.
std::vector<float> Gradient(const LayerTrainer& trainer, uint32_t layer, uint32_t worker,
                            uint64_t step) {
  std::mt19937 random(static_cast<uint32_t>(layer * 1000 + worker * 100 + step));
  std::normal_distribution<float> normal(0.0f, 0.1f);
  std::vector<float> g(trainer.layers().owned_elements(layer));
  for (float& v : g) v = normal(random);
  return g;
}

// Pushes `gradient` as a PushGradients stream does: admitted as a ticket,
// its step's staging reserved (at once here: reserved already, or no
// budget linked), staged and handed over.
absl::StatusOr<LayerTrainer::Pushed> PushGradient(LayerTrainer& trainer, uint32_t layer,
                                                  uint32_t worker, uint64_t step,
                                                  const std::vector<float>& gradient) {
  ASSIGN_OR_RETURN(LayerTrainer::PushTicket ticket, trainer.AdmitPush(layer, worker, step));
  bool reserved = false;
  const uint64_t id = ticket.Reserve(std::chrono::steady_clock::time_point::max(),
                                     [&reserved](bool granted) { reserved = granted; });
  if (id != 0) ticket.CancelWait(id);
  if (!reserved) return absl::InternalError("the step's staging is not reserved");
  ASSIGN_OR_RETURN(const std::span<float> staged, ticket.Stage());
  if (staged.size() != gradient.size()) return absl::InternalError("a gradient of another size");
  std::copy(gradient.begin(), gradient.end(), staged.begin());
  return ticket.Push();
}

// Every master bit of the store, layer by layer.
std::vector<uint32_t> MasterBits(const ParameterStore& store) {
  std::vector<uint32_t> bits;
  for (uint32_t l = 0; l < store.model().layers.size(); ++l) {
    for (uint32_t t = 0; t < store.model().layers[l].tensors.size(); ++t) {
      const float* master = store.master(l, t);
      for (uint64_t i = 0; i < store.owned(l, t).size(); ++i) {
        bits.push_back(std::bit_cast<uint32_t>(master[i]));
      }
    }
  }
  return bits;
}

constexpr char kAdamW[] =
    "adamw:lr=1e-2,weight_decay=0.1,beta2=0.95,warmup_steps=2;*norm*:weight_decay=0";

TEST(LayerTrainerTest, ArrivalOrderChangesNoBit) {
  auto in_order = Store(1, 2), shuffled = Store(1, 2);
  auto a = LayerTrainer::Create(*in_order, *OptimizerSpec::Parse(kAdamW), 3);
  auto b = LayerTrainer::Create(*shuffled, *OptimizerSpec::Parse(kAdamW), 3);
  ASSERT_TRUE(a.ok() && b.ok()) << a.status() << b.status();
  const std::vector<uint32_t> before = MasterBits(*in_order);
  const uint32_t layers = static_cast<uint32_t>(in_order->model().layers.size());
  for (uint64_t step = 0; step < 3; ++step) {
    for (uint32_t l = 0; l < layers; ++l) {
      for (uint32_t w : {0u, 1u, 2u}) {
        auto pushed = PushGradient(**a, l, w, step, Gradient(**a, l, w, step));
        ASSERT_TRUE(pushed.ok()) << pushed.status();
        EXPECT_EQ(pushed->applied, w == 2);
        EXPECT_EQ(pushed->layer_version, w == 2 ? step + 1 : step);
      }
      for (uint32_t w : {2u, 0u, 1u}) {
        auto pushed = PushGradient(**b, l, w, step, Gradient(**b, l, w, step));
        ASSERT_TRUE(pushed.ok()) << pushed.status();
        EXPECT_EQ(pushed->applied, w == 1);
      }
      EXPECT_EQ((*b)->layers().version(l), step + 1);
      EXPECT_EQ((*b)->layers().missing_workers(l), 3u);
    }
    ASSERT_EQ(MasterBits(*in_order), MasterBits(*shuffled)) << "after step " << step;
  }
  EXPECT_NE(MasterBits(*in_order), before) << "three steps changed nothing";
}

// The trainer's wiring (owned order, the mean, the 1-based step of the
// schedule) against the optimizer driven directly.
TEST(LayerTrainerTest, AppliesTheMeanWithTheStepsLearningRate) {
  auto store = Store(0, 3);
  auto reference = Store(0, 3);
  const OptimizerSpec spec =
      *OptimizerSpec::Parse("sgd:lr=0.5,momentum=0.9,nesterov=1,warmup_steps=3");
  auto trainer = LayerTrainer::Create(*store, spec, 2);
  ASSERT_TRUE(trainer.ok()) << trainer.status();
  const uint32_t layer = 1;
  const uint32_t tensors = static_cast<uint32_t>(store->model().layers[layer].tensors.size());
  std::vector<TensorOptimizer> optimizers;
  for (uint32_t t = 0; t < tensors; ++t) {
    optimizers.emplace_back(spec.kind(),
                            spec.HyperFor(store->model().layers[layer].tensors[t].name),
                            store->owned(layer, t).size());
  }
  for (uint64_t step = 0; step < 4; ++step) {
    const std::vector<float> g0 = Gradient(**trainer, layer, 0, step);
    const std::vector<float> g1 = Gradient(**trainer, layer, 1, step);
    ASSERT_TRUE(PushGradient(**trainer, layer, 1, step, g1).ok());
    ASSERT_TRUE(PushGradient(**trainer, layer, 0, step, g0).ok());
    uint64_t at = 0;
    for (uint32_t t = 0; t < tensors; ++t) {
      const uint64_t n = store->owned(layer, t).size();
      std::vector<float> mean(n);
      for (uint64_t i = 0; i < n; ++i) mean[i] = (g0[at + i] + g1[at + i]) / 2.0f;
      const double lr = spec.LearningRate(optimizers[t].hyper(), step + 1);
      ASSERT_TRUE(optimizers[t]
                      .Step(lr, std::span<float>(reference->mutable_master(layer, t), n), mean)
                      .ok());
      ASSERT_EQ(std::memcmp(reference->master(layer, t), store->master(layer, t), n * 4), 0)
          << "tensor " << t << " after step " << step;
      at += n;
    }
  }
}

// A live hand-over's freeze: only at a step boundary no step has passed,
// the steps before it finish, the next is refused naming the move, and
// what it reads is what the trainer holds.
TEST(LayerTrainerTest, FreezeHoldsTheStateAtAStepBoundary) {
  auto store = Store(1, 2);
  auto created = LayerTrainer::Create(*store, *OptimizerSpec::Parse(kAdamW), 2);
  ASSERT_TRUE(created.ok()) << created.status();
  LayerTrainer& trainer = **created;
  const auto layers = static_cast<uint32_t>(store->model().layers.size());
  const auto push = [&](uint32_t layer, uint32_t worker, uint64_t step) {
    return PushGradient(trainer, layer, worker, step, Gradient(trainer, layer, worker, step))
        .status();
  };
  for (uint32_t l = 0; l < layers; ++l) {
    ASSERT_TRUE(push(l, 0, 0).ok());
    ASSERT_TRUE(push(l, 1, 0).ok());
  }
  // Worker 0 has begun step 1 of layer 0: a freeze at 1 would cut it.
  ASSERT_TRUE(push(0, 0, 1).ok());
  const absl::Status past = trainer.hand_over().Freeze(1);
  EXPECT_EQ(past.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(past.message(), HasSubstr("hand over at version 2 or later"));
  EXPECT_FALSE(trainer.hand_over().frozen_at().has_value());

  ASSERT_TRUE(trainer.hand_over().Freeze(2).ok());
  EXPECT_FALSE(trainer.hand_over().AtFrozenBoundary());
  const ElementRange owned = store->owned(1, 0);
  std::vector<float> values(owned.size() - 1);
  const ElementRange tail{owned.begin + 1, owned.end};
  EXPECT_EQ(trainer.hand_over().ReadFrozen(1, 0, "", tail, values).code(),
            absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(push(0, 1, 1).ok());
  for (uint32_t l = 1; l < layers; ++l) {
    ASSERT_TRUE(push(l, 0, 1).ok());
    ASSERT_TRUE(push(l, 1, 1).ok());
  }
  EXPECT_TRUE(trainer.hand_over().AtFrozenBoundary());
  const absl::Status refused = push(0, 0, 2);
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(refused.message(), HasSubstr("reconnect to the new set's addresses"));
  EXPECT_EQ(trainer.hand_over().Freeze(3).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(trainer.checkpoint().TrainingHeader().layer_versions, std::vector<uint64_t>(layers, 2));

  ASSERT_TRUE(trainer.hand_over().ReadFrozen(1, 0, "", tail, values).ok());
  EXPECT_EQ(std::memcmp(values.data(), store->master(1, 0) + 1, values.size() * 4), 0);
  ASSERT_TRUE(trainer.hand_over().ReadFrozen(1, 0, "exp_avg", tail, values).ok());
  // What a checkpoint would write of the same buffer.
  const std::string name = OptimizerStateName("exp_avg", store->model().layers[1].tensors[0].name);
  std::vector<float> saved;
  ASSERT_TRUE(
      trainer.checkpoint()
          .WriteWithState(
              [&](uint64_t, const CheckpointExtras& extras) -> absl::StatusOr<CheckpointInfo> {
                for (const auto& [tensor, data] : extras.tensors) {
                  if (tensor == name) saved.assign(data.begin(), data.end());
                }
                return CheckpointInfo{};
              })
          .ok());
  ASSERT_EQ(saved.size(), owned.size());
  EXPECT_EQ(std::memcmp(values.data(), saved.data() + 1, values.size() * 4), 0);
  EXPECT_EQ(
      trainer.hand_over().ReadFrozen(1, 0, "exp_avg", {owned.begin, owned.end + 1}, values).code(),
      absl::StatusCode::kOutOfRange);
  EXPECT_EQ(trainer.hand_over().ReadFrozen(1, 0, "momentum_buffer", tail, values).code(),
            absl::StatusCode::kNotFound);

  trainer.hand_over().Unfreeze();
  EXPECT_TRUE(push(0, 0, 2).ok());
}

// A step advances its layer in the gate, and gives the step's reservation
// back to the budget as it applies: one reservation per step, taken by
// whoever opens it, covering every worker's push.
TEST(LayerTrainerTest, AStepAdvancesItsLayerAndReturnsItsReservation) {
  auto store = Store(1, 2);
  boost::asio::io_context io;
  VersionGate gate(io.get_executor(), 4);
  gate.SetLayers(static_cast<uint32_t>(store->model().layers.size()));
  MemoryBudget budget(std::nullopt, 0, io.get_executor());
  auto trainer = LayerTrainer::Create(*store, *OptimizerSpec::Parse("sgd:lr=0.1"), 2,
                                      {.gate = &gate, .budget = &budget});
  ASSERT_TRUE(trainer.ok()) << trainer.status();
  const uint32_t layer = 1;
  EXPECT_EQ((*trainer)->layers().version(layer), 4u) << "layers start at the gate's versions";
  const uint64_t step_bytes = (*trainer)->staging().StepBytes(layer);
  EXPECT_EQ(step_bytes, 2 * (*trainer)->staging().StagingBytes(layer));
  constexpr auto kNever = std::chrono::steady_clock::time_point::max();
  int ready = 0;
  const auto count = [&ready](bool granted) { ready += granted ? 1 : 100; };
  // Stages `gradient` into the ticket's buffer and hands it over.
  const auto stage_and_push = [](LayerTrainer::PushTicket& ticket,
                                 const std::vector<float>& gradient) {
    absl::StatusOr<std::span<float>> staged = ticket.Stage();
    EXPECT_TRUE(staged.ok() && staged->size() == gradient.size());
    if (staged.ok()) std::copy(gradient.begin(), gradient.end(), staged->begin());
    return ticket.Push();
  };
  absl::StatusOr<LayerTrainer::PushTicket> first = (*trainer)->AdmitPush(layer, 0, 4);
  absl::StatusOr<LayerTrainer::PushTicket> second = (*trainer)->AdmitPush(layer, 1, 4);
  ASSERT_TRUE(first.ok() && second.ok()) << first.status() << second.status();
  EXPECT_NE(first->Reserve(kNever, count), 0u) << "the budget answers later";
  EXPECT_NE(second->Reserve(kNever, count), 0u) << "waits for the same grant";
  EXPECT_EQ(ready, 0);
  io.restart();
  io.poll();
  EXPECT_EQ(ready, 2) << "one grant serves every push of the step";
  EXPECT_EQ(budget.in_use(), step_bytes) << "reserved once, for both workers";
  EXPECT_EQ(first->Reserve(kNever, count), 0u) << "reserved: at once";
  EXPECT_EQ(ready, 3);
  auto pushed = stage_and_push(*first, Gradient(**trainer, layer, 0, 4));
  ASSERT_TRUE(pushed.ok()) << pushed.status();
  EXPECT_FALSE(pushed->applied);
  EXPECT_EQ((*trainer)->layers().OldestOpenStep().missing_workers, 1u);
  EXPECT_EQ(PushGradient(**trainer, layer, 0, 4, Gradient(**trainer, layer, 0, 4)).status().code(),
            absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(budget.in_use(), step_bytes);
  pushed = stage_and_push(*second, Gradient(**trainer, layer, 1, 4));
  ASSERT_TRUE(pushed.ok()) << pushed.status();
  EXPECT_TRUE(pushed->applied);
  EXPECT_EQ(pushed->layer_version, 5u);
  EXPECT_EQ(budget.in_use(), step_bytes) << "applied: the staging is pooled, still charged";
  EXPECT_EQ(gate.version(layer), 5u);
  EXPECT_EQ(gate.version(0), 4u);
  absl::StatusOr<LayerTrainer::PushTicket> next = (*trainer)->AdmitPush(layer, 0, 5);
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_EQ(next->Reserve(kNever, count), 0u)
      << "the next step's reservation is the pooled staging, at once";
  EXPECT_EQ(ready, 4);
  EXPECT_EQ(budget.in_use(), step_bytes);
  EXPECT_EQ((*trainer)->layers().OldestOpenStep().missing_workers, 0u);
  // A step of the other layer, another size, asks the budget; draining the
  // pool (the budget's reclaimer) returns what it holds.
  ASSERT_NE((*trainer)->staging().StagingBytes(0), (*trainer)->staging().StagingBytes(layer));
  absl::StatusOr<LayerTrainer::PushTicket> other = (*trainer)->AdmitPush(0, 0, 4);
  ASSERT_TRUE(other.ok()) << other.status();
  EXPECT_NE(other->Reserve(kNever, count), 0u);
  io.restart();
  io.poll();
  EXPECT_EQ(ready, 5);
  EXPECT_EQ(budget.in_use(), step_bytes + (*trainer)->staging().StepBytes(0));
  const std::shared_ptr<StagingPool> pool = (*trainer)->staging().spare_staging().lock();
  ASSERT_NE(pool, nullptr);
  EXPECT_EQ(pool->bytes(), 0u) << "layer 1's step claimed what was pooled";
  pushed = stage_and_push(*next, Gradient(**trainer, layer, 0, 5));
  ASSERT_TRUE(pushed.ok()) << pushed.status();
  pushed = PushGradient(**trainer, layer, 1, 5, Gradient(**trainer, layer, 1, 5));
  ASSERT_TRUE(pushed.ok() && pushed->applied) << pushed.status();
  EXPECT_EQ(pool->bytes(), step_bytes);
  pool->Drain();
  EXPECT_EQ(budget.in_use(), (*trainer)->staging().StepBytes(0))
      << "drained: only layer 0's step holds any";
}

// With clip=, a layer whose pushes are in waits, reduced to its mean, for
// the scale; the scale is applied to every layer once, as torch's
// clip_grad_norm_ multiplies every gradient before the optimizer steps.
TEST(LayerTrainerTest, AClippedStepWaitsForEveryLayerAndItsScale) {
  auto store = Store(0, 2);
  auto reference = Store(0, 2);
  const OptimizerSpec spec = *OptimizerSpec::Parse("sgd:lr=0.5,clip=1");
  auto trainer = LayerTrainer::Create(*store, spec, 2);
  ASSERT_TRUE(trainer.ok()) << trainer.status();
  const auto layers = static_cast<uint32_t>(store->model().layers.size());
  double expected_sum = 0;
  std::vector<std::vector<float>> means;
  for (uint32_t l = 0; l < layers; ++l) {
    const std::vector<float> g0 = Gradient(**trainer, l, 0, 0), g1 = Gradient(**trainer, l, 1, 0);
    ASSERT_TRUE(PushGradient(**trainer, l, 1, 0, g1).ok());
    EXPECT_FALSE((*trainer)->clip().NormOfStep(0).ready);
    auto pushed = PushGradient(**trainer, l, 0, 0, g0);
    ASSERT_TRUE(pushed.ok()) << pushed.status();
    EXPECT_FALSE(pushed->applied) << "a clipped step waits for the scale";
    EXPECT_EQ(PushGradient(**trainer, l, 1, 0, g1).status().code(),
              absl::StatusCode::kAlreadyExists);
    std::vector<float> mean(g0.size());
    for (size_t i = 0; i < mean.size(); ++i) {
      mean[i] = (g0[i] + g1[i]) / 2.0f;
      expected_sum += static_cast<double>(mean[i]) * mean[i];
    }
    means.push_back(mean);
  }
  const LayerTrainer::StepNorm norm = (*trainer)->clip().NormOfStep(0);
  ASSERT_TRUE(norm.ready);
  EXPECT_DOUBLE_EQ(norm.max_norm, 1.0);
  EXPECT_NEAR(norm.sum_of_squares, expected_sum, 1e-9 * expected_sum);
  EXPECT_EQ(MasterBits(*store), MasterBits(*reference)) << "nothing applied before the scale";
  EXPECT_EQ((*trainer)->clip().ApplyClippedStep(0, std::nanf("")).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*trainer)->clip().ApplyClippedStep(1, 0.5f).status().code(),
            absl::StatusCode::kFailedPrecondition);
  const float scale = 0.25f;
  ASSERT_EQ((*trainer)->clip().ApplyClippedStep(0, scale).value_or(0), 1u);
  ASSERT_EQ((*trainer)->clip().ApplyClippedStep(0, scale).value_or(0), 1u) << "applied once";
  // Another scale for the applied step (a restarted worker 0 computing it
  // afresh) changes nothing: the step keeps, and reports, its first.
  ASSERT_EQ((*trainer)->clip().ApplyClippedStep(0, 0.75f).value_or(0), 1u);
  EXPECT_EQ((*trainer)->clip().NormOfStep(0).applied_scale.value_or(0), scale);
  // And a checkpoint carries it, for a restarted shard to report.
  std::map<std::string, std::string> saved;
  ASSERT_TRUE(
      (*trainer)
          ->checkpoint()
          .WriteWithState(
              [&](uint64_t, const CheckpointExtras& extras) -> absl::StatusOr<CheckpointInfo> {
                saved = extras.metadata;
                return CheckpointInfo{};
              })
          .ok());
  EXPECT_EQ(saved["last_clip"], absl::StrCat("0,", std::bit_cast<uint32_t>(scale)));
  for (uint32_t l = 0; l < layers; ++l) {
    EXPECT_EQ((*trainer)->layers().version(l), 1u);
    uint64_t at = 0;
    for (uint32_t t = 0; t < store->model().layers[l].tensors.size(); ++t) {
      const uint64_t n = store->owned(l, t).size();
      TensorOptimizer optimizer(spec.kind(),
                                spec.HyperFor(store->model().layers[l].tensors[t].name), n);
      std::vector<float> clipped(means[l].begin() + at, means[l].begin() + at + n);
      for (float& value : clipped) value *= scale;
      ASSERT_TRUE(optimizer.Step(0.5, {reference->mutable_master(l, t), n}, clipped).ok());
      EXPECT_EQ(std::memcmp(reference->master(l, t), store->master(l, t), n * 4), 0);
      at += n;
    }
  }
}

TEST(LayerTrainerTest, EveryBadPushIsRefusedAndChangesNothing) {
  auto store = Store(0, 2);
  auto trainer = LayerTrainer::Create(*store, *OptimizerSpec::Parse(kAdamW), 2);
  ASSERT_TRUE(trainer.ok()) << trainer.status();
  LayerTrainer& t = **trainer;
  ASSERT_TRUE(PushGradient(t, 0, 0, 0, Gradient(t, 0, 0, 0)).ok());
  ASSERT_TRUE(PushGradient(t, 0, 1, 0, Gradient(t, 0, 1, 0)).ok());  // layer 0 at version 1
  ASSERT_TRUE(PushGradient(t, 0, 1, 1, Gradient(t, 0, 1, 1)).ok());  // worker 1 staged for step 1
  const std::vector<uint32_t> before = MasterBits(*store);
  struct Case {
    const char* what;
    uint32_t layer, worker;
    uint64_t step;
    absl::StatusCode code;
    const char* says;
  };
  const uint64_t n = t.layers().owned_elements(0);
  for (const Case& c : {
           Case{"retry of an applied step", 0, 0, 0, absl::StatusCode::kAlreadyExists,
                "was applied already"},
           Case{"duplicate in the open step", 0, 1, 1, absl::StatusCode::kAlreadyExists,
                "counts once"},
           Case{"a step ahead", 0, 0, 5, absl::StatusCode::kFailedPrecondition,
                "a gradient for step 5 of layer 0, which is at version 1"},
           Case{"no such worker", 0, 2, 1, absl::StatusCode::kInvalidArgument,
                "worker 2 is out of range"},
           Case{"no such layer", 99, 0, 0, absl::StatusCode::kNotFound, "does not exist"},
       }) {
    auto pushed = PushGradient(t, c.layer, c.worker, c.step, std::vector<float>(n, 1.0f));
    EXPECT_EQ(pushed.status().code(), c.code) << c.what << ": " << pushed.status();
    EXPECT_THAT(std::string(pushed.status().message()), HasSubstr(c.says)) << c.what;
  }
  EXPECT_EQ(MasterBits(*store), before);
  EXPECT_EQ(t.layers().version(0), 1u);
  EXPECT_EQ(t.layers().missing_workers(0), 1u) << "worker 1's staged push survived the refusals";
}

// One stream per push at a time: a second stream of the same (step,
// worker, layer) would stage the slice again outside the step's
// reservation.
TEST(LayerTrainerTest, OnePushStreamOfAPushAtATime) {
  auto store = Store(0, 2);
  auto trainer = LayerTrainer::Create(*store, *OptimizerSpec::Parse(kAdamW), 2);
  ASSERT_TRUE(trainer.ok()) << trainer.status();
  LayerTrainer& t = **trainer;
  std::optional<absl::StatusOr<LayerTrainer::PushTicket>> first(t.AdmitPush(0, 0, 0));
  ASSERT_TRUE(first->ok()) << first->status();
  const absl::Status second = t.AdmitPush(0, 0, 0).status();
  EXPECT_EQ(second.code(), absl::StatusCode::kAborted) << second;
  EXPECT_THAT(std::string(second.message()), HasSubstr("already in flight"));
  absl::StatusOr<LayerTrainer::PushTicket> other_worker = t.AdmitPush(0, 1, 0);
  EXPECT_TRUE(other_worker.ok()) << "another worker's push is another push";
  absl::StatusOr<LayerTrainer::PushTicket> other_layer = t.AdmitPush(1, 0, 0);
  EXPECT_TRUE(other_layer.ok()) << "so is another layer's";
  first.reset();  // the first stream failed: a retry is admitted
  ASSERT_TRUE(PushGradient(t, 0, 0, 0, Gradient(t, 0, 0, 0)).ok());
  EXPECT_EQ(t.AdmitPush(0, 0, 0).status().code(), absl::StatusCode::kAlreadyExists) << "it counted";
}

// AdmitPush's ticket is the push in flight: it stages and hands over the
// push, and going ends it, so a retry is admitted.
TEST(LayerTrainerTest, APushTicketHoldsItsPushInFlightUntilItGoes) {
  auto store = Store(0, 2);
  auto trainer = LayerTrainer::Create(*store, *OptimizerSpec::Parse(kAdamW), 2);
  ASSERT_TRUE(trainer.ok()) << trainer.status();
  LayerTrainer& t = **trainer;
  {
    absl::StatusOr<LayerTrainer::PushTicket> first = t.AdmitPush(0, 0, 0);
    ASSERT_TRUE(first.ok()) << first.status();
    EXPECT_EQ(t.AdmitPush(0, 0, 0).status().code(), absl::StatusCode::kAborted);
  }
  absl::StatusOr<LayerTrainer::PushTicket> ticket = t.AdmitPush(0, 0, 0);
  ASSERT_TRUE(ticket.ok()) << "the first ticket ended its push when it went";
  bool reserved = false;
  ticket->Reserve(std::chrono::steady_clock::time_point::max(),
                  [&](bool granted) { reserved = granted; });
  EXPECT_TRUE(reserved) << "no budget linked: reserved at once";
  absl::StatusOr<std::span<float>> staging = ticket->Stage();
  ASSERT_TRUE(staging.ok());
  const std::vector<float> gradient = Gradient(t, 0, 0, 0);
  ASSERT_EQ(staging->size(), gradient.size());
  std::copy(gradient.begin(), gradient.end(), staging->begin());
  absl::StatusOr<LayerTrainer::Pushed> pushed = ticket->Push();
  ASSERT_TRUE(pushed.ok()) << pushed.status();
  EXPECT_FALSE(pushed->applied) << "worker 1's push is still missing";
  EXPECT_EQ(t.layers().missing_workers(0), 1u);
}

TEST(LayerTrainerTest, RefusesWhatItCannotDo) {
  auto store = Store(0, 1);
  EXPECT_EQ(LayerTrainer::Create(*store, *OptimizerSpec::Parse("sgd:lr=1"), 0).status().code(),
            absl::StatusCode::kInvalidArgument);
  auto unclipped = LayerTrainer::Create(*store, *OptimizerSpec::Parse("sgd:lr=1"), 1);
  ASSERT_TRUE(unclipped.ok());
  EXPECT_EQ((*unclipped)->clip().ApplyClippedStep(0, 0.5f).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ((*unclipped)->clip().NormOfStep(0).max_norm, 0.0);
  // AdamW keeps two floats of state per owned element, SGD with momentum one.
  EXPECT_EQ(LayerTrainer::StateBytes(*store, *OptimizerSpec::Parse("adamw:lr=1")),
            2 * store->master_bytes());
  EXPECT_EQ(LayerTrainer::StateBytes(*store, *OptimizerSpec::Parse("sgd:lr=1,momentum=0.9")),
            store->master_bytes());
  EXPECT_EQ(LayerTrainer::StateBytes(*store, *OptimizerSpec::Parse("sgd:lr=1")), 0u);
}

// W workers pushing every layer at once from their own threads, as gRPC
// would: the same master as pushing one by one.
TEST(LayerTrainerConcurrencyTest, ConcurrentPushesGiveTheSequentialResult) {
  constexpr uint32_t kWorkers = 4;
  constexpr uint64_t kSteps = 3;
  auto sequential = Store(0, 2), concurrent = Store(0, 2);
  auto a = LayerTrainer::Create(*sequential, *OptimizerSpec::Parse(kAdamW), kWorkers);
  auto b = LayerTrainer::Create(*concurrent, *OptimizerSpec::Parse(kAdamW), kWorkers);
  ASSERT_TRUE(a.ok() && b.ok());
  const uint32_t layers = static_cast<uint32_t>(sequential->model().layers.size());
  for (uint64_t step = 0; step < kSteps; ++step) {
    for (uint32_t l = 0; l < layers; ++l) {
      for (uint32_t w = 0; w < kWorkers; ++w) {
        ASSERT_TRUE(PushGradient(**a, l, w, step, Gradient(**a, l, w, step)).ok());
      }
    }
  }
  std::vector<std::thread> workers;
  for (uint32_t w = 0; w < kWorkers; ++w) {
    workers.emplace_back([&, w] {
      for (uint64_t step = 0; step < kSteps; ++step) {
        for (uint32_t l = 0; l < layers; ++l) {
          // A worker's next step starts when the layer has applied this one.
          const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(30);
          while ((*b)->layers().version(l) < step && std::chrono::steady_clock::now() < give_up) {
            std::this_thread::yield();
          }
          EXPECT_TRUE(PushGradient(**b, l, w, step, Gradient(**b, l, w, step)).ok());
        }
      }
    });
  }
  for (std::thread& t : workers) t.join();
  EXPECT_EQ(MasterBits(*sequential), MasterBits(*concurrent));
  for (uint32_t l = 0; l < layers; ++l) EXPECT_EQ((*b)->layers().version(l), kSteps);
}

}  // namespace
}  // namespace layercast::server
