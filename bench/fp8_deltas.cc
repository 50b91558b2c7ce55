#include "bench/fp8_deltas.h"

#include <bit>
#include <cstdio>
#include <filesystem>
#include <map>
#include <memory>
#include <random>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/shard_set.h"
#include "client/weight_publisher.h"
#include "core/fp8.h"
#include "platform/status_macros.h"
#include "tools/local_shard_set.h"
#include "tools/synthetic_trainer.h"

namespace layercast::bench {
namespace {

using Values = std::map<std::string, std::vector<float>>;

// What a delta of one update must carry at least, counted from the values.
struct Ideal {
  uint64_t codes = 0, scales = 0;  // changed
  uint64_t elements = 0, blocks = 0;
  double bytes = 0;
};

// Bytes of the positions of `changed` (sorted) among `n`: the smaller of a
// bitmap and LEB128 gaps, as a delta chunk codes them.
uint64_t PositionBytes(const std::vector<uint64_t>& changed, uint64_t n) {
  uint64_t gaps = 0, next = 0;
  for (const uint64_t i : changed) {
    for (uint64_t gap = i - next;; gap >>= 7) {
      ++gaps;
      if (gap < 0x80) break;
    }
    next = i + 1;
  }
  return std::min(gaps, (n + 7) / 8);
}

// The ideal of the update from `before` to `after`, every tensor in
// `format` with blocks of `block`: both quantized, and the codes and scales
// that differ counted with their positions.
Ideal IdealOf(const Values& before, const Values& after, Fp8Format format, uint32_t block) {
  Ideal ideal;
  for (const auto& [name, was] : before) {
    const std::vector<float>& now = after.at(name);
    const size_t blocks = Fp8BlockCount(was.size(), block);
    std::vector<uint8_t> codes[2] = {std::vector<uint8_t>(was.size()),
                                     std::vector<uint8_t>(was.size())};
    std::vector<float> scales[2] = {std::vector<float>(blocks), std::vector<float>(blocks)};
    QuantizeFp8(was, block, format, codes[0], scales[0]);
    QuantizeFp8(now, block, format, codes[1], scales[1]);
    std::vector<uint64_t> changed_codes, changed_scales;
    for (uint64_t i = 0; i < was.size(); ++i) {
      if (codes[0][i] != codes[1][i]) changed_codes.push_back(i);
    }
    for (uint64_t b = 0; b < blocks; ++b) {
      if (std::bit_cast<uint32_t>(scales[0][b]) != std::bit_cast<uint32_t>(scales[1][b])) {
        changed_scales.push_back(b);
      }
    }
    ideal.codes += changed_codes.size();
    ideal.scales += changed_scales.size();
    ideal.elements += was.size();
    ideal.blocks += blocks;
    ideal.bytes += static_cast<double>(changed_codes.size() + 4 * changed_scales.size() +
                                       PositionBytes(changed_codes, was.size()) +
                                       PositionBytes(changed_scales, blocks));
  }
  return ideal;
}

// One shard set (fp8 or bf16), a publisher, and the layers a reader holds.
struct Set {
  std::unique_ptr<tools::LocalShardSet> shards;
  std::unique_ptr<client::ShardSet> set;
  std::unique_ptr<client::WeightPublisher> publisher;
  std::vector<std::vector<uint8_t>> held;  // per layer, at `version`
  uint64_t version = 0;
};

absl::StatusOr<Set> StartSet(uint32_t num_shards, const std::string& synthetic,
                             const std::string& policy, const std::string& token_file,
                             const std::string& token, const std::string& log_dir) {
  tools::LocalShardSet::Options options;
  options.shard_binary = LAYERCAST_SHARD_BINARY;
  options.num_shards = num_shards;
  options.log_dir = log_dir;
  options.extra_flags = {"--synthetic",        synthetic, "--policy", policy,
                         "--admin-token-file", token_file};
  Set set;
  ASSIGN_OR_RETURN(set.shards, tools::LocalShardSet::Start(options));
  ASSIGN_OR_RETURN(set.set, client::ShardSet::Connect(set.shards->addresses()));
  set.publisher = std::make_unique<client::WeightPublisher>(
      *set.set, client::PublishOptions{.admin_token = token, .insecure = true});
  return set;
}

// Publishes `values` to `set` and pulls every layer as a delta from the
// version held (in full the first time), checked against a full pull.
// Returns the delta's bytes; `*full` gets a full pull's.
absl::StatusOr<uint64_t> PublishAndPull(Set& set, const Values& values, uint64_t* full) {
  client::TensorValues view;
  for (const auto& [name, tensor] : values) view.emplace(name, tensor);
  ASSIGN_OR_RETURN(const client::PublishResult published, set.publisher->Publish(view));
  const auto layers = static_cast<uint32_t>(set.set->view().layouts.size());
  uint64_t received = 0, full_bytes = 0;
  const bool first = set.held.empty();
  set.held.resize(layers);
  for (uint32_t l = 0; l < layers; ++l) {
    std::vector<uint8_t> whole(set.set->view().layouts[l].total_bytes());
    client::GatherOptions full_pull;
    full_pull.on_chunk = [&full_bytes](uint64_t bytes) { full_bytes += bytes; };
    ASSIGN_OR_RETURN(const uint64_t at, set.set->GatherInto(l, full_pull, whole));
    if (first) {
      set.held[l] = std::move(whole);
      continue;
    }
    client::GatherOptions delta;
    delta.base_version = set.version;
    delta.on_chunk = [&received](uint64_t bytes) { received += bytes; };
    ASSIGN_OR_RETURN(const uint64_t version, set.set->GatherInto(l, delta, set.held[l]));
    if (version != published.version || at != version || set.held[l] != whole) {
      return absl::InternalError(absl::StrCat("the delta of layer ", l, " to version ",
                                              published.version, " is not the full pull"));
    }
  }
  set.version = published.version;
  if (full != nullptr) *full = full_bytes;
  return received;
}

struct Row {
  std::string update;
  bool step = false;  // an optimizer step (the 0.15 x full goal)
  Ideal ideal;
  uint64_t fp8 = 0, full = 0, bf16 = 0;  // bytes
};

}  // namespace

absl::Status RunFp8Deltas(uint32_t num_shards, const std::string& synthetic, uint64_t steps,
                          const std::string& token, const std::string& token_file) {
  std::error_code ignored;
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path(ignored) / "delta_bench_fp8";
  std::filesystem::create_directories(dir / "fp8", ignored);
  std::filesystem::create_directories(dir / "bf16", ignored);
  constexpr char kFp8Policy[] = "p=f32,c=float8_e4m3fn";
  ASSIGN_OR_RETURN(Set fp8, StartSet(num_shards, synthetic, kFp8Policy, token_file, token,
                                     (dir / "fp8").string()));
  ASSIGN_OR_RETURN(Set bf16, StartSet(num_shards, synthetic, "p=f32,c=bf16", token_file, token,
                                      (dir / "bf16").string()));
  const uint32_t block = fp8.set->view().policy.fp8_block();
  ASSIGN_OR_RETURN(tools::SyntheticTrainer trainer, tools::SyntheticTrainer::Create(synthetic));
  Values values = trainer.values();
  RETURN_IF_ERROR(PublishAndPull(fp8, values, nullptr).status());
  RETURN_IF_ERROR(PublishAndPull(bf16, values, nullptr).status());

  std::vector<Row> rows;
  const auto measure = [&](const std::string& name, bool step, const Values& next) -> absl::Status {
    Row row{
        .update = name, .step = step, .ideal = IdealOf(values, next, Fp8Format::kE4M3FN, block)};
    ASSIGN_OR_RETURN(row.fp8, PublishAndPull(fp8, next, &row.full));
    ASSIGN_OR_RETURN(row.bf16, PublishAndPull(bf16, next, nullptr));
    values = next;
    rows.push_back(row);
    return absl::OkStatus();
  };
  for (const double lr : {1e-5, 1e-4}) {
    // The first step at an lr is AdamW's sign-like first step, or the jump
    // from the lr before: published, not counted.
    RETURN_IF_ERROR(trainer.Step(lr));
    RETURN_IF_ERROR(measure("", true, trainer.values()));
    rows.pop_back();
    for (uint64_t s = 0; s < steps; ++s) {
      RETURN_IF_ERROR(trainer.Step(lr));
      RETURN_IF_ERROR(measure(absl::StrCat("AdamW step, lr ", lr), true, trainer.values()));
    }
  }
  std::mt19937 random(17);
  for (const double share : {0.01, 0.05}) {
    std::bernoulli_distribution pick(share);
    Values next = values;
    for (auto& [name, tensor] : next) {
      for (float& x : tensor) {
        if (pick(random)) x = x * 1.1f + 1e-3f;
      }
    }
    RETURN_IF_ERROR(measure(absl::StrCat(share * 100, "% of values moved"), false, next));
  }
  RETURN_IF_ERROR(fp8.shards->Stop());
  RETURN_IF_ERROR(bf16.shards->Stop());

  std::printf(
      "delta_bench --fp8: %s, %u read-only shards, policy %s (blocks of %u) beside p=f32,c=bf16\n"
      "machine: 2 cores; bytes are what the worker received, so the machine's noise does not "
      "enter\n\n",
      synthetic.c_str(), num_shards, kFp8Policy, block);
  std::printf("%-24s %8s %8s %10s %10s %12s %12s %12s\n", "update", "codes", "scales", "fp8 delta",
              "ideal", "delta/ideal", "delta/full", "delta/bf16");
  bool met = true;
  for (const Row& row : rows) {
    const double over_ideal = static_cast<double>(row.fp8) / row.ideal.bytes;
    const double over_full = static_cast<double>(row.fp8) / static_cast<double>(row.full);
    std::printf(
        "%-24s %7.2f%% %7.2f%% %8.2f MB %7.2f MB %12.3f %12.3f %12.3f\n", row.update.c_str(),
        100.0 * static_cast<double>(row.ideal.codes) / static_cast<double>(row.ideal.elements),
        100.0 * static_cast<double>(row.ideal.scales) / static_cast<double>(row.ideal.blocks),
        static_cast<double>(row.fp8) / 1e6, row.ideal.bytes / 1e6, over_ideal, over_full,
        static_cast<double>(row.fp8) / static_cast<double>(row.bf16));
    met = met && over_ideal <= 1.2 && (!row.step || over_full <= 0.15);
  }
  std::printf(
      "\ncodes, scales: the shares that changed; ideal: changed codes x 1 B + changed scales x "
      "4 B + their positions (each the smaller of a bitmap and LEB128 gaps, per tensor)\n"
      "delta/full: against a full fp8 pull; delta/bf16: against the bf16 delta of the same "
      "update\n"
      "goals: delta/ideal <= 1.2; delta/full <= 0.15 for an AdamW step; all goals %s\n",
      met ? "met" : "NOT met");
  return absl::OkStatus();
}

}  // namespace layercast::bench
