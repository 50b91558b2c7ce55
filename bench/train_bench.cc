// A training step through real training shards on 127.0.0.1, against a
// gather-only step measured in the same run (one worker, W = 1, so each
// layer's update applies as soon as its gradient is in):
//   (a) gather-only step: every layer gathered forward, then backward;
//   (b) training step: the same gathers, and each layer's gradient pushed
//       as soon as its backward gather is done, the shards averaging and
//       stepping the optimizer while the worker gathers the layers below;
//   (c) the pushes alone, against (f) one forward pass of gathers: the same
//       bytes each way (gradients go in the compute dtype; the bench's
//       policy has no 8-bit floats, whose gradients are wider). Measured on a
//       second shard set with two data-parallel workers, where (c) is one
//       worker's pushes, taken and staged, with no step applying: the
//       push's own cost, not the optimizer's (the other worker's pushes
//       then complete the step, untimed).
//   (u) the pushes with their update: (c) on the first set, where each
//       push completes its layer's step (the optimizer is on the shards'
//       cores too, on this machine the worker's).
// It reports time per parameter of (b) against (a) (goal <= 1.8), the push
// against the gather of the same bytes (goal: no more), and how much of the
// pushes and the optimizer's time (the shards' own
// layercast_optimizer_step_seconds) the training step hides behind its
// gathers:
//   hidden = ((a) + (u) + update - (b)) / ((u) + update)
// and the optimizer's step on the slowest shard against AdamW alone on the
// same slices in this process (TensorOptimizer::Step, no shard around it,
// a thread per shard stepping at once as the shards do; goal <= 1.5): what
// the shard's bookkeeping (the change log that serves delta pulls and
// pinned reads) and the worker's gathers beside it add to the update.
//
// And (j), the training step (b) again on shards that journal every push
// (--push-journal), against (b): what not losing an acknowledged push to a
// shard's death costs a step; once for each --journal-sync policy (none:
// the page cache; every-push: a sync before each answer; grouped: pushes
// share a sync, at most one per 10 ms), so the price of surviving a power
// loss as well is printed beside it, each against the same (b).
//
// Usage: train_bench [--num-shards N] [--synthetic SPEC] [--rounds R]
//                    [--optimizer SPEC] [--shard-flags "FLAG VALUE ..."]
// --shard-flags are added to every shard's command line (split at spaces).
// This bench's worker pulls no deltas, so by default the shards record
// nothing; "--change-recording-idle-ms 0" records every step, as a shard
// does while a mirror pulls deltas.

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <future>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "bench/process_probes.h"
#include "client/gradient_sink.h"
#include "client/shard_set.h"
#include "core/layout.h"
#include "core/optimizer.h"
#include "core/optimizer_spec.h"
#include "platform/byte_size.h"
#include "platform/status_macros.h"
#include "tools/cli_flags.h"
#include "tools/local_shard_set.h"
#include "tools/synthetic_gradient.h"

namespace layercast {
namespace {

using Clock = std::chrono::steady_clock;

struct Args {
  uint32_t num_shards = 2;
  std::string synthetic = "llama:layers=4,hidden=1024,ffn=2816,vocab=8000,seed=3";
  uint64_t rounds = 4;
  std::string optimizer = "adamw:lr=1e-4,weight_decay=0.1;*norm*:weight_decay=0";
  std::vector<std::string> shard_flags;
};

absl::StatusOr<Args> ParseArgs(int argc, char** argv) {
  ASSIGN_OR_RETURN(
      tools::CliFlags flags,
      tools::CliFlags::Parse(std::vector<std::string>(argv + 1, argv + argc),
                             {"num-shards", "synthetic", "rounds", "optimizer", "shard-flags"}));
  Args args;
  ASSIGN_OR_RETURN(uint64_t num_shards, flags.GetUint("num-shards", args.num_shards));
  ASSIGN_OR_RETURN(args.rounds, flags.GetUint("rounds", args.rounds));
  if (num_shards == 0 || num_shards > 16 || args.rounds == 0 || args.rounds > 1000) {
    return absl::InvalidArgumentError("--num-shards must be 1-16 and --rounds 1-1000");
  }
  args.num_shards = static_cast<uint32_t>(num_shards);
  args.synthetic = flags.Get("synthetic", args.synthetic);
  args.optimizer = flags.Get("optimizer", args.optimizer);
  args.shard_flags = absl::StrSplit(flags.Get("shard-flags", ""), ' ', absl::SkipEmpty());
  return args;
}

double Seconds(Clock::time_point since) {
  return std::chrono::duration<double>(Clock::now() - since).count();
}

// Every layer's synthetic gradient for `step`, ready to hand over: made
// before the timed part, as a backward pass would have made it.
absl::StatusOr<std::vector<client::LayerBuffer>> Gradients(const client::ShardSet& set,
                                                           uint64_t step) {
  std::vector<client::LayerBuffer> gradients;
  const std::vector<AssembledLayout>& layouts = set.view().gradient_layouts;
  for (uint32_t l = 0; l < layouts.size(); ++l) {
    ASSIGN_OR_RETURN(client::LayerBuffer buffer,
                     client::LayerBuffer::Allocate(layouts[l].total_bytes()));
    RETURN_IF_ERROR(
        tools::FillSyntheticGradient(layouts[l], 0, step, l, {buffer.data(), buffer.size()}));
    gradients.push_back(std::move(buffer));
  }
  return gradients;
}

class Worker {
 public:
  Worker(const client::ShardSet& set, client::GradientSink& sink) : set_(set), sink_(sink) {}

  uint64_t version() const { return version_; }

  absl::Status GatherPass(bool backward) {
    client::GatherOptions options;
    options.min_version = version_;
    const auto layers = static_cast<uint32_t>(set_.view().layouts.size());
    for (uint32_t i = 0; i < layers; ++i) {
      ASSIGN_OR_RETURN(client::Layer layer, set_.Gather(backward ? layers - 1 - i : i, options));
    }
    return absl::OkStatus();
  }

  // Backward gathers with each layer's push right after it, or (gather =
  // false) the pushes alone; then the step is finished.
  absl::Status BackwardPushes(std::vector<client::LayerBuffer> gradients, bool gather) {
    client::GatherOptions options;
    options.min_version = version_;
    const auto layers = static_cast<uint32_t>(set_.view().layouts.size());
    for (uint32_t l = layers; l-- > 0;) {
      if (gather) {
        ASSIGN_OR_RETURN(client::Layer layer, set_.Gather(l, options));
      }
      ASSIGN_OR_RETURN(auto pushed, sink_.Push(l, version_, std::move(gradients[l])));
    }
    RETURN_IF_ERROR(sink_.FinishStep(version_).status());
    ++version_;
    return absl::OkStatus();
  }

 private:
  const client::ShardSet& set_;
  client::GradientSink& sink_;
  uint64_t version_ = 0;
};

absl::StatusOr<std::unique_ptr<tools::LocalShardSet>> StartShards(
    const Args& args, const std::string& logs, uint32_t workers,
    const std::vector<std::string>& more_flags = {}) {
  tools::LocalShardSet::Options options;
  options.shard_binary = LAYERCAST_SHARD_BINARY;
  options.num_shards = args.num_shards;
  options.log_dir = logs;
  options.extra_flags = {"--synthetic",
                         args.synthetic,
                         "--optimizer",
                         args.optimizer,
                         "--metrics-listen",
                         "127.0.0.1:0",
                         "--policy",
                         "p=f32,c=bf16;*norm*=f32",
                         "--data-parallel-workers",
                         std::to_string(workers)};
  options.extra_flags.insert(options.extra_flags.end(), args.shard_flags.begin(),
                             args.shard_flags.end());
  options.extra_flags.insert(options.extra_flags.end(), more_flags.begin(), more_flags.end());
  return tools::LocalShardSet::Start(options);
}

// (f) and (c) on a shard set with two workers: seconds per round of a
// forward pass of gathers, and of worker 0's pushes of every layer until
// every shard has staged them.
struct StagedPushes {
  double forward = 0;
  double pushes = 0;
};
absl::StatusOr<StagedPushes> MeasureStagedPushes(const Args& args, const std::string& logs) {
  ASSIGN_OR_RETURN(std::unique_ptr<tools::LocalShardSet> shards, StartShards(args, logs, 2));
  ASSIGN_OR_RETURN(std::unique_ptr<client::ShardSet> set,
                   client::ShardSet::Connect(shards->addresses()));
  std::vector<std::unique_ptr<client::GradientSink>> sinks;
  for (uint32_t w = 0; w < 2; ++w) {
    ASSIGN_OR_RETURN(auto sink, client::GradientSink::Create(*set, {.worker = w}));
    sinks.push_back(std::move(sink));
  }
  const auto layers = static_cast<uint32_t>(set->view().layouts.size());
  StagedPushes measured;
  for (uint64_t round = 0; round <= args.rounds; ++round) {  // round 0: a warm-up
    auto start = Clock::now();
    client::GatherOptions options;
    options.min_version = round;
    for (uint32_t l = 0; l < layers; ++l) {
      ASSIGN_OR_RETURN(client::Layer layer, set->Gather(l, options));
    }
    if (round > 0) measured.forward += Seconds(start);
    for (uint32_t w = 0; w < 2; ++w) {
      ASSIGN_OR_RETURN(std::vector<client::LayerBuffer> gradients, Gradients(*set, round));
      start = Clock::now();
      for (uint32_t l = layers; l-- > 0;) {
        ASSIGN_OR_RETURN(auto pushed, sinks[w]->Push(l, round, std::move(gradients[l])));
      }
      RETURN_IF_ERROR(sinks[w]->Flush());
      if (w == 0 && round > 0) measured.pushes += Seconds(start);
    }
  }
  measured.forward /= static_cast<double>(args.rounds);
  measured.pushes /= static_cast<double>(args.rounds);
  RETURN_IF_ERROR(shards->Stop());
  return measured;
}

// Seconds per step of the optimizer alone on each shard's slice of `model`
// (every tensor's), the slowest of them: one thread per shard, all stepping
// at once as the shards do, on the same cores, in this process. The floor
// the shards' step is set against.
absl::StatusOr<double> MeasureOptimizerAlone(const Args& args, const ModelSpec& model) {
  ASSIGN_OR_RETURN(const OptimizerSpec spec, OptimizerSpec::Parse(args.optimizer));
  struct Slice {
    TensorOptimizer optimizer;
    std::vector<float> param, grad;
  };
  std::vector<std::vector<Slice>> shards(args.num_shards);
  for (uint32_t s = 0; s < args.num_shards; ++s) {
    for (const LayerSpec& layer : model.layers) {
      for (const TensorSpec& tensor : layer.tensors) {
        const uint64_t n = ShardElementRange(tensor.num_elements, s, args.num_shards).size();
        Slice& slice = shards[s].emplace_back(
            Slice{TensorOptimizer(spec.kind(), spec.HyperFor(tensor.name), n),
                  std::vector<float>(n, 0.02f), std::vector<float>(n, 1e-3f)});
        for (uint64_t i = 0; i < n; ++i) slice.param[i] += 1e-6f * static_cast<float>(i % 1024);
      }
    }
  }
  const auto step_all = [&](std::vector<Slice>& slices) {
    double seconds = 0;
    for (uint64_t round = 0; round <= args.rounds; ++round) {  // round 0: a warm-up
      const auto start = Clock::now();
      for (Slice& slice : slices) {
        const double lr = spec.LearningRate(slice.optimizer.hyper(), round + 1);
        if (!slice.optimizer.Step(lr, slice.param, slice.grad).ok()) return -1.0;
      }
      if (round > 0) seconds += Seconds(start);
    }
    return seconds / static_cast<double>(args.rounds);
  };
  std::vector<std::future<double>> stepping;
  for (auto& slices : shards) {
    stepping.push_back(std::async(std::launch::async, step_all, std::ref(slices)));
  }
  double slowest = 0;
  bool refused = false;
  for (auto& future : stepping) {
    const double seconds = future.get();
    refused |= seconds < 0;
    slowest = std::max(slowest, seconds);
  }
  if (refused) return absl::InternalError("the optimizer refused its own slice");
  return slowest;
}

// (a), (b) and (u) on a shard set with one worker, started with
// `more_flags`, per round; the model's sizes with them.
struct Steps {
  double gather_step = 0, train_step = 0, pushes = 0, update = 0;
  ModelSpec model;
  uint64_t params = 0, bytes = 0, gradient_bytes = 0;
};

absl::StatusOr<Steps> MeasureSteps(const Args& args, const std::string& logs,
                                   const std::vector<std::string>& more_flags = {}) {
  ASSIGN_OR_RETURN(std::unique_ptr<tools::LocalShardSet> shards,
                   StartShards(args, logs, 1, more_flags));
  const std::vector<int> ports = bench::MetricsPorts(logs, args.num_shards);
  ASSIGN_OR_RETURN(std::unique_ptr<client::ShardSet> set,
                   client::ShardSet::Connect(shards->addresses()));
  ASSIGN_OR_RETURN(std::unique_ptr<client::GradientSink> sink,
                   client::GradientSink::Create(*set, {}));
  Worker worker(*set, *sink);
  Steps steps;
  steps.model = set->model();
  for (const LayerSpec& layer : set->model().layers) {
    for (const TensorSpec& tensor : layer.tensors) steps.params += tensor.num_elements;
  }
  for (const AssembledLayout& layout : set->view().layouts) steps.bytes += layout.total_bytes();
  // Wider than the gathers' only for 8-bit floats.
  for (const AssembledLayout& layout : set->view().gradient_layouts) {
    steps.gradient_bytes += layout.total_bytes();
  }
  // A warm-up round first (connections, page faults), not counted.
  for (uint64_t round = 0; round <= args.rounds; ++round) {
    const bool counted = round > 0;
    auto start = Clock::now();
    RETURN_IF_ERROR(worker.GatherPass(false));
    RETURN_IF_ERROR(worker.GatherPass(true));
    if (counted) steps.gather_step += Seconds(start);

    ASSIGN_OR_RETURN(auto gradients, Gradients(*set, worker.version()));
    const double optimizer_before = bench::ScrapeShards(ports).optimizer_seconds_max;
    start = Clock::now();
    RETURN_IF_ERROR(worker.GatherPass(false));
    RETURN_IF_ERROR(worker.BackwardPushes(std::move(gradients), true));
    if (counted) steps.train_step += Seconds(start);
    const double optimizer_after = bench::ScrapeShards(ports).optimizer_seconds_max;
    if (counted) steps.update += optimizer_after - optimizer_before;

    ASSIGN_OR_RETURN(gradients, Gradients(*set, worker.version()));
    start = Clock::now();
    RETURN_IF_ERROR(worker.BackwardPushes(std::move(gradients), false));
    if (counted) steps.pushes += Seconds(start);
  }
  const double n = static_cast<double>(args.rounds);
  steps.gather_step /= n, steps.train_step /= n, steps.pushes /= n, steps.update /= n;
  RETURN_IF_ERROR(shards->Stop());
  return steps;
}

int Run(const Args& args) {
  std::error_code ignored;
  const std::string logs =
      (std::filesystem::temp_directory_path(ignored) / "train_bench_logs").string();
  std::filesystem::create_directories(logs, ignored);
  const auto fail = [](const absl::Status& status) {
    std::fprintf(stderr, "train_bench: %s\n", status.ToString().c_str());
    return 1;
  };
  const absl::StatusOr<Steps> plain = MeasureSteps(args, logs);
  if (!plain.ok()) return fail(plain.status());
  const auto [gather_step, train_step, pushes, update, model, params, bytes, gradient_bytes] =
      *plain;
  const double hidden = (gather_step + pushes + update - train_step) / (pushes + update);
  // The same steps on shards that journal every push (--push-journal, on
  // with --checkpoint-dir), in a fresh directory, so that a shard killed
  // between checkpoints loses no acknowledged push: what that costs a step,
  // under each sync policy (the first is the default's).
  const std::string journal_dir = logs + "/journal";
  struct Journaled {
    const char* sync;
    const char* says;
    double train_step = 0;
  };
  std::vector<Journaled> journaled = {
      {"none", "page cache: a process's death loses nothing"},
      {"every-push", "a sync before each answer: a power loss neither"},
      {"grouped", "pushes share a sync, <= 1 per 10 ms: as every-push"}};
  for (Journaled& policy : journaled) {
    std::filesystem::remove_all(journal_dir, ignored);
    std::filesystem::create_directories(journal_dir, ignored);
    const absl::StatusOr<Steps> steps =
        MeasureSteps(args, logs,
                     {"--checkpoint-dir", journal_dir, "--push-journal", "true",
                      "--checkpoint-on-sigterm", "false", "--journal-sync", policy.sync});
    std::filesystem::remove_all(journal_dir, ignored);
    if (!steps.ok()) return fail(steps.status());
    policy.train_step = steps->train_step;
  }
  const absl::StatusOr<StagedPushes> staged = MeasureStagedPushes(args, logs);
  if (!staged.ok()) return fail(staged.status());
  const double forward = staged->forward;
  const absl::StatusOr<double> alone = MeasureOptimizerAlone(args, model);
  if (!alone.ok()) return fail(alone.status());
  std::printf(
      "train_bench: %s, %u shards, optimizer %s, %llu rounds after a warm-up\n"
      "machine: 2 cores shared by shards and worker: compare within this run\n\n",
      args.synthetic.c_str(), args.num_shards, args.optimizer.c_str(),
      static_cast<unsigned long long>(args.rounds));
  std::printf("model: %.1f M parameters, %s per pass in compute dtypes\n", params / 1e6,
              FormatBytes(bytes).c_str());
  std::printf("(a) gather-only step (forward + backward)  %8.3f s  %6.2f ns/param\n", gather_step,
              gather_step / params * 1e9);
  std::printf("(b) training step (+ push, update)         %8.3f s  %6.2f ns/param\n", train_step,
              train_step / params * 1e9);
  std::printf("(f) one forward pass of gathers            %8.3f s  %6.2f GB/s\n", forward,
              bytes / forward / 1e9);
  std::printf("(c) the pushes alone (same bytes), staged %8.3f s  %6.2f GB/s\n", staged->pushes,
              gradient_bytes / staged->pushes / 1e9);
  std::printf("(u) the pushes, each completing its step   %8.3f s  %6.2f GB/s\n", pushes,
              gradient_bytes / pushes / 1e9);
  std::printf("    optimizer on the slowest shard         %8.3f s per step\n", update);
  std::printf("    the optimizer alone on the slices      %8.3f s per step (a thread a shard)\n",
              *alone);
  std::printf("\nb/a %.3f (training step per parameter against a gather-only step; goal <= 1.8)\n",
              train_step / gather_step);
  std::printf(
      "step/alone %.3f (the shards' optimizer step against the optimizer alone; goal <= "
      "1.5)\n",
      update / *alone);
  std::printf("c/f %.3f (a push against the gather of the same bytes; goal <= 1)\n",
              staged->pushes / forward);
  std::printf("u/f %.3f (the same with the optimizer's update, on the same cores)\n",
              pushes / forward);
  std::printf("hidden %.0f%% of push + update time overlapped with the gathers\n",
              100 * std::clamp(hidden, 0.0, 1.0));
  std::printf("\n(j) training step, every push journaled, by --journal-sync (j/b: against (b)):\n");
  for (const Journaled& policy : journaled) {
    std::printf("    %-10s  %8.3f s  %6.2f ns/param  j/b %.3f  (%s)\n", policy.sync,
                policy.train_step, policy.train_step / params * 1e9, policy.train_step / train_step,
                policy.says);
  }
  return 0;
}

}  // namespace
}  // namespace layercast

int main(int argc, char** argv) {
  absl::StatusOr<layercast::Args> args = layercast::ParseArgs(argc, argv);
  if (!args.ok()) {
    std::fprintf(stderr, "train_bench: %s\n", std::string(args.status().message()).c_str());
    return 2;
  }
  return layercast::Run(*args);
}
