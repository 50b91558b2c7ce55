// Publishing and delta pulls on real read-only shards on 127.0.0.1, each
// figure against a baseline from the same run:
//   - a trainer in this process keeps the fp32 model and a torch-exact AdamW
//     (tools::SyntheticTrainer), steps it on Gaussian gradients (sigma 1e-3) at
//     lr 1e-5, 1e-4 and 1e-3, and publishes every step (WeightPublisher);
//   - the share of bf16 values each step changed (the shards count them);
//   - the bytes a mirror's delta update received, against the goal
//     1.2 x (changed elements x 2 bytes) + 1/8 byte per element, and against
//     a full pull's bytes;
//   - the time to bring W = 8 mirrors from v to v+1 at once, against one
//     (goal: at most 1.3x): the shards cast each delta chunk once for all;
//     and the shards' CPU seconds for it, against one's (on this machine
//     the eight mirrors share the shards' two cores, so the wall-clock
//     figure counts their receiving too; the CPU figure is the shards'
//     own cost of the fan-out);
//   - a mirror's cold pull (ModelMirror::Create) against plain gathers of
//     every layer, kept until the model is whole, alternating (goal: no
//     slower);
//   - the coding of the changed positions: publishes that change exactly
//     0.1%, 1%, 5% and 30% of the values, each pulled as a delta twice, the
//     positions as a bitmap only (as older workers ask) and in the smaller
//     of the bitmap and the gaps (LEB128), in bytes per parameter (goals:
//     <= 0.035 at 1%, <= 0.006 at 0.1%, never above the bitmap's + 1%).
// The first step at each lr is AdamW's sign-like first step in the
// optimizer's life, or the jump from the lr before: not counted.
//
// With --fp8, the bytes of fp8 deltas instead (bench/fp8_deltas.h).
//
// Usage: delta_bench [--num-shards N] [--synthetic SPEC] [--steps S] [--fp8]

#include <sys/stat.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <thread>

#include "absl/strings/str_cat.h"
#include "bench/fp8_deltas.h"
#include "bench/process_probes.h"
#include "client/model_mirror.h"
#include "client/shard_set.h"
#include "client/weight_publisher.h"
#include "platform/byte_size.h"
#include "platform/status_macros.h"
#include "tools/cli_flags.h"
#include "tools/local_shard_set.h"
#include "tools/synthetic_trainer.h"

namespace layercast {
namespace {

using Clock = std::chrono::steady_clock;

constexpr char kToken[] = "delta-bench-token-0123456789abcdef";
constexpr uint32_t kFleet = 8;

struct Args {
  uint32_t num_shards = 2;
  std::string synthetic = "llama:layers=4,hidden=512,ffn=1408,vocab=4096,seed=5";
  uint64_t steps = 4;  // counted steps per lr, alternating W = 1 and W = 8
  bool fp8 = false;    // bench/fp8_deltas.h instead
};

absl::StatusOr<Args> ParseArgs(int argc, char** argv) {
  ASSIGN_OR_RETURN(tools::CliFlags flags,
                   tools::CliFlags::Parse(std::vector<std::string>(argv + 1, argv + argc),
                                          {"num-shards", "synthetic", "steps"}, {"fp8"}));
  Args args;
  ASSIGN_OR_RETURN(uint64_t num_shards, flags.GetUint("num-shards", args.num_shards));
  ASSIGN_OR_RETURN(args.steps, flags.GetUint("steps", args.steps));
  if (num_shards == 0 || num_shards > 16 || args.steps < 2 || args.steps > 100) {
    return absl::InvalidArgumentError("--num-shards must be 1-16 and --steps 2-100");
  }
  args.num_shards = static_cast<uint32_t>(num_shards);
  args.synthetic = flags.Get("synthetic", args.synthetic);
  args.fp8 = flags.Has("fp8");
  return args;
}

double Seconds(Clock::duration duration) { return std::chrono::duration<double>(duration).count(); }

client::TensorValues View(const tools::SyntheticTrainer& trainer) {
  client::TensorValues view;
  for (const auto& [name, values] : trainer.values()) view.emplace(name, values);
  return view;
}

// Updates `mirrors` at once; the seconds until the last is done.
absl::StatusOr<double> UpdateAtOnce(std::span<const std::unique_ptr<client::ModelMirror>> mirrors,
                                    uint64_t version, std::vector<client::MirrorUpdate>* updates) {
  std::vector<absl::StatusOr<client::MirrorUpdate>> results(mirrors.size());
  const auto start = Clock::now();
  std::vector<std::thread> threads;
  for (size_t i = 0; i < mirrors.size(); ++i) {
    threads.emplace_back([&, i] { results[i] = mirrors[i]->Update(version); });
  }
  for (std::thread& thread : threads) thread.join();
  const double seconds = Seconds(Clock::now() - start);
  for (auto& result : results) {
    RETURN_IF_ERROR(result.status());
    if (updates != nullptr) updates->push_back(*result);
  }
  return seconds;
}

std::string WriteToken(const std::string& dir) {
  const std::string path = dir + "/token";
  std::ofstream(path) << kToken << "\n";
  ::chmod(path.c_str(), 0600);
  return path;
}

struct LrFigures {
  double lr = 0;
  double changed_share = 0;       // changed bf16 values / all
  double delta_over_goal = 0;     // delta bytes / (1.2 x changed x 2 + n / 8)
  double delta_over_full = 0;     // delta bytes / full pull bytes
  double fleet_over_one = 0;      // W = 8 seconds / W = 1 seconds
  double fleet_cpu_over_one = 0;  // the shards' CPU seconds, W = 8 / W = 1
  double one_seconds = 0;
};

absl::StatusOr<LrFigures> MeasureLr(double lr, const Args& args, tools::SyntheticTrainer& trainer,
                                    client::WeightPublisher& publisher,
                                    std::span<const std::unique_ptr<client::ModelMirror>> mirrors,
                                    uint64_t full_bytes, const std::vector<pid_t>& shard_pids) {
  LrFigures figures{.lr = lr};
  double one = 0, fleet = 0, delta_bytes = 0, goal_bytes = 0, changed = 0;
  double one_cpu = 0, fleet_cpu = 0;
  for (uint64_t step = 0; step <= args.steps; ++step) {
    RETURN_IF_ERROR(trainer.Step(lr));
    ASSIGN_OR_RETURN(const client::PublishResult published, publisher.Publish(View(trainer)));
    // Even steps time one mirror, odd steps eight; the rest follow untimed,
    // so every mirror stays one version behind for the next step.
    const size_t timed = step % 2 == 0 ? 1 : kFleet;
    std::vector<client::MirrorUpdate> updates;
    const double cpu_before = bench::ProcessesCpuSeconds(shard_pids);
    ASSIGN_OR_RETURN(const double seconds,
                     UpdateAtOnce(mirrors.first(timed), published.version, &updates));
    const double cpu = bench::ProcessesCpuSeconds(shard_pids) - cpu_before;
    ASSIGN_OR_RETURN(const double ignored,
                     UpdateAtOnce(mirrors.subspan(timed), published.version, nullptr));
    (void)ignored;
    if (step == 0) continue;  // the jump to this lr
    (timed == 1 ? one : fleet) += seconds;
    (timed == 1 ? one_cpu : fleet_cpu) += cpu;
    delta_bytes += static_cast<double>(updates[0].bytes);
    changed += static_cast<double>(published.changed_elements);
    goal_bytes += 1.2 * static_cast<double>(published.changed_elements) * 2 +
                  static_cast<double>(trainer.elements()) / 8;
  }
  const double counted = static_cast<double>(args.steps);
  figures.changed_share = changed / counted / static_cast<double>(trainer.elements());
  figures.delta_over_goal = delta_bytes / goal_bytes;
  figures.delta_over_full = delta_bytes / counted / static_cast<double>(full_bytes);
  const double ones = std::ceil(counted / 2), fleets = std::floor(counted / 2);
  figures.one_seconds = one / ones;
  figures.fleet_over_one = (fleet / fleets) / (one / ones);
  figures.fleet_cpu_over_one = (fleet_cpu / fleets) / (one_cpu / ones);
  return figures;
}

struct SparseFigures {
  double share = 0;           // of the values changed
  double bitmap_bytes = 0;    // per parameter, positions as a bitmap
  double adaptive_bytes = 0;  // per parameter, the smaller form per chunk
};

// Publishes `values` with `share` of them changed, then pulls every layer
// as a delta from the version before, in each form; checks each against a
// full pull.
absl::StatusOr<SparseFigures> MeasureSparse(double share, const client::ShardSet& set,
                                            client::WeightPublisher& publisher,
                                            std::map<std::string, std::vector<float>>& values,
                                            uint64_t elements) {
  const auto layers = static_cast<uint32_t>(set.view().layouts.size());
  std::vector<std::vector<uint8_t>> before(layers);
  uint64_t base = 0;
  for (uint32_t l = 0; l < layers; ++l) {
    before[l].resize(set.view().layouts[l].total_bytes());
    ASSIGN_OR_RETURN(base, set.GatherInto(l, {}, before[l]));
  }
  std::mt19937 random(static_cast<uint32_t>(share * 1e6));
  std::bernoulli_distribution pick(share);
  for (auto& [name, tensor] : values) {
    // Negated, a value changes in bf16 too (zero becomes one).
    for (float& value : tensor) {
      if (pick(random)) value = value == 0 ? 1 : -value;
    }
  }
  client::TensorValues view;
  for (const auto& [name, tensor] : values) view.emplace(name, tensor);
  ASSIGN_OR_RETURN(const client::PublishResult published, publisher.Publish(view, base));
  SparseFigures figures{.share = share};
  for (const bool gaps : {false, true}) {
    uint64_t received = 0;
    for (uint32_t l = 0; l < layers; ++l) {
      std::vector<uint8_t> copy = before[l];
      client::GatherOptions options;
      options.base_version = base;
      options.changed_gaps = gaps;
      options.on_chunk = [&received](uint64_t bytes) { received += bytes; };
      ASSIGN_OR_RETURN(const uint64_t version, set.GatherInto(l, options, copy));
      std::vector<uint8_t> full(copy.size());
      ASSIGN_OR_RETURN(const uint64_t full_version, set.GatherInto(l, {}, full));
      if (version != published.version || full_version != version || copy != full) {
        return absl::InternalError(
            absl::StrCat("the delta of layer ", l, " at ", share, " changed is not the full pull"));
      }
    }
    (gaps ? figures.adaptive_bytes : figures.bitmap_bytes) =
        static_cast<double>(received) / static_cast<double>(elements);
  }
  return figures;
}

absl::Status Run(const Args& args) {
  std::error_code ignored;
  const std::filesystem::path dir = std::filesystem::temp_directory_path(ignored) / "delta_bench";
  std::filesystem::create_directories(dir / "logs", ignored);
  if (args.fp8) {
    return bench::RunFp8Deltas(args.num_shards, args.synthetic, args.steps, kToken,
                               WriteToken(dir.string()));
  }
  tools::LocalShardSet::Options options;
  options.shard_binary = LAYERCAST_SHARD_BINARY;
  options.num_shards = args.num_shards;
  options.log_dir = (dir / "logs").string();
  options.extra_flags = {"--synthetic",  args.synthetic,       "--policy",
                         "p=f32,c=bf16", "--admin-token-file", WriteToken(dir.string())};
  ASSIGN_OR_RETURN(std::unique_ptr<tools::LocalShardSet> shards,
                   tools::LocalShardSet::Start(options));
  ASSIGN_OR_RETURN(std::unique_ptr<client::ShardSet> set,
                   client::ShardSet::Connect(shards->addresses()));
  uint64_t full_bytes = 0;
  for (const AssembledLayout& layout : set->view().layouts) full_bytes += layout.total_bytes();
  ASSIGN_OR_RETURN(tools::SyntheticTrainer trainer,
                   tools::SyntheticTrainer::Create(args.synthetic));

  // Cold pulls against plain gathers of every layer, alternating, after one
  // of each to warm up. The gathers keep every layer until the model is
  // whole, as any holder of a whole model does (first touch of fresh memory
  // included): what is compared is the mirror's own overhead.
  double cold = 0, gather = 0, checked = 0, first_checked = 0;
  constexpr int kColdRounds = 3;
  // Each mirror on a connection of its own, as inference workers on their
  // own machines are: the shards tell readers apart by connection, and
  // share cast chunks only among different readers. (Declared first: the
  // mirrors go before their connections.)
  std::vector<std::unique_ptr<client::ShardSet>> connections;
  std::vector<std::unique_ptr<client::ModelMirror>> mirrors;
  for (int round = 0; round <= kColdRounds; ++round) {
    auto start = Clock::now();
    {
      std::vector<client::Layer> model;
      for (uint32_t l = 0; l < set->view().layouts.size(); ++l) {
        ASSIGN_OR_RETURN(client::Layer layer, set->Gather(l));
        model.push_back(std::move(layer));
      }
    }
    if (round > 0) gather += Seconds(Clock::now() - start);
    start = Clock::now();
    ASSIGN_OR_RETURN(std::unique_ptr<client::ModelMirror> mirror,
                     client::ModelMirror::Create(*set));
    if (round > 0) cold += Seconds(Clock::now() - start);
    // The same pull with every layer checked against the shards' digests
    // (MirrorOptions::verify_with): the first makes the shards compute
    // them, the rest find them kept.
    start = Clock::now();
    ASSIGN_OR_RETURN(std::unique_ptr<client::ModelMirror> checked_mirror,
                     client::ModelMirror::Create(*set, {.verify_with = set.get()}));
    (round > 0 ? checked : first_checked) += Seconds(Clock::now() - start);
  }
  for (uint32_t i = 0; i < kFleet; ++i) {
    ASSIGN_OR_RETURN(std::unique_ptr<client::ShardSet> connection,
                     client::ShardSet::Connect(shards->addresses()));
    ASSIGN_OR_RETURN(std::unique_ptr<client::ModelMirror> mirror,
                     client::ModelMirror::Create(*connection));
    connections.push_back(std::move(connection));
    mirrors.push_back(std::move(mirror));
  }

  client::WeightPublisher publisher(*set, {.admin_token = kToken, .insecure = true});
  std::vector<pid_t> pids;
  for (uint32_t i = 0; i < args.num_shards; ++i) pids.push_back(shards->pid(i));
  std::vector<LrFigures> table;
  for (const double lr : {1e-5, 1e-4, 1e-3}) {
    ASSIGN_OR_RETURN(LrFigures figures,
                     MeasureLr(lr, args, trainer, publisher, mirrors, full_bytes, pids));
    table.push_back(figures);
  }
  std::map<std::string, std::vector<float>> values(trainer.values().begin(),
                                                   trainer.values().end());
  std::vector<SparseFigures> sparse;
  for (const double share : {0.001, 0.01, 0.05, 0.3}) {
    ASSIGN_OR_RETURN(SparseFigures figures,
                     MeasureSparse(share, *set, publisher, values, trainer.elements()));
    sparse.push_back(figures);
  }
  RETURN_IF_ERROR(shards->Stop());

  std::printf(
      "delta_bench: %s, %u read-only shards, policy p=f32,c=bf16, %llu counted steps per lr\n"
      "machine: 2 cores shared by shards, trainer and mirrors: compare within this run\n\n",
      args.synthetic.c_str(), args.num_shards, static_cast<unsigned long long>(args.steps));
  std::printf("model: %.1f M parameters, %s per full pull\n\n",
              static_cast<double>(trainer.elements()) / 1e6, FormatBytes(full_bytes).c_str());
  std::printf("%-8s %12s %12s %12s %12s %11s %13s\n", "lr", "changed", "delta/goal", "delta/full",
              "W=1 update", "W=8 / W=1", "shard CPU 8/1");
  bool met = true;
  for (const LrFigures& f : table) {
    std::printf("%-8.0e %11.2f%% %12.3f %12.3f %9.1f ms %11.2f %13.2f\n", f.lr,
                100 * f.changed_share, f.delta_over_goal, f.delta_over_full, 1e3 * f.one_seconds,
                f.fleet_over_one, f.fleet_cpu_over_one);
    met = met && f.delta_over_goal <= 1.0 && f.fleet_over_one <= 1.3;
  }
  std::printf("\n%-8s %16s %16s %16s\n", "changed", "bitmap B/param", "adaptive B/param",
              "adaptive/bitmap");
  for (const SparseFigures& f : sparse) {
    std::printf("%7.1f%% %16.4f %16.4f %16.3f\n", 100 * f.share, f.bitmap_bytes, f.adaptive_bytes,
                f.adaptive_bytes / f.bitmap_bytes);
    met = met && f.adaptive_bytes <= 1.01 * f.bitmap_bytes;
    if (f.share == 0.01) met = met && f.adaptive_bytes <= 0.035;
    if (f.share == 0.001) met = met && f.adaptive_bytes <= 0.006;
  }
  const double cold_ratio = cold / gather;
  met = met && cold_ratio <= 1.0;
  std::printf(
      "\ncold pull checked against the shards' digests / unchecked: %.3f (the shards' digests "
      "kept), %.3f (the first, the shards computing them)\n",
      checked / cold, first_checked / (cold / kColdRounds));
  std::printf(
      "cold pull (ModelMirror::Create) / plain gathers of every layer: %.3f (goal <= 1.0)\n"
      "delta/goal: delta bytes / (1.2 x changed x 2 B + n/8 B), goal <= 1.0; "
      "W=8 / W=1 goal <= 1.3\n"
      "shard CPU 8/1: the shards' CPU seconds to bring 8 mirrors up against one (8.0 would be "
      "no sharing at all)\n"
      "B/param: delta bytes received over parameters, positions as a bitmap or the smaller of "
      "bitmap and gaps per chunk; goals <= 0.035 at 1%%, <= 0.006 at 0.1%%, adaptive <= "
      "1.01 x bitmap\n"
      "all goals %s\n",
      cold_ratio, met ? "met" : "NOT met");
  return absl::OkStatus();
}

}  // namespace
}  // namespace layercast

int main(int argc, char** argv) {
  absl::StatusOr<layercast::Args> args = layercast::ParseArgs(argc, argv);
  if (!args.ok()) {
    std::fprintf(stderr, "delta_bench: %s\n", args.status().ToString().c_str());
    return 2;
  }
  if (absl::Status status = layercast::Run(*args); !status.ok()) {
    std::fprintf(stderr, "delta_bench: %s\n", status.ToString().c_str());
    return 1;
  }
  return 0;
}
