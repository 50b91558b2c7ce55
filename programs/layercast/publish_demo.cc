#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <random>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "client/model_mirror.h"
#include "client/weight_publisher.h"
#include "platform/byte_size.h"
#include "platform/status_macros.h"
#include "programs/layercast/commands.h"
#include "tools/local_shard_set.h"
#include "tools/synthetic_trainer.h"

namespace layercast::cli {
namespace {

// Small enough for a step and its publish in well under a second on two
// cores.
constexpr char kDefaultPublishModel[] = "llama:layers=4,hidden=512,ffn=1408,vocab=4096,seed=1";

// A fresh random admin token in a file only this user may read (the shards
// refuse any other).
absl::StatusOr<std::string> WriteDemoToken(const std::filesystem::path& dir, std::string* token) {
  std::random_device random;
  token->clear();
  for (int i = 0; i < 4; ++i) absl::StrAppend(token, absl::Hex(random(), absl::kZeroPad8));
  const std::string path = (dir / "admin-token").string();
  std::ofstream(path) << *token << "\n";
  if (::chmod(path.c_str(), 0600) != 0) {
    return absl::InternalError(absl::StrCat("cannot chmod ", path, ": ", std::strerror(errno)));
  }
  return path;
}

// What the mirrors report, printed as it comes from their threads.
class FleetReport {
 public:
  explicit FleetReport(uint32_t mirrors) : max_lag_(mirrors, 0), updates_(mirrors, 0) {}

  void Published(uint64_t version) {
    absl::MutexLock lock(&mu_);
    published_ = version;
  }
  void Updated(uint32_t mirror, const client::MirrorUpdate& update) {
    absl::MutexLock lock(&mu_);
    const uint64_t lag = published_ - std::min(published_, update.version);
    max_lag_[mirror] = std::max(max_lag_[mirror], lag);
    ++updates_[mirror];
    bytes_ += update.bytes;
    std::printf("    mirror %u  at version %3llu  lag %llu  received %9s in %6.1f ms\n", mirror,
                static_cast<unsigned long long>(update.version),
                static_cast<unsigned long long>(lag), FormatBytes(update.bytes).c_str(),
                std::chrono::duration<double, std::milli>(update.duration).count());
    std::fflush(stdout);
  }
  uint64_t max_lag(uint32_t mirror) const {
    absl::MutexLock lock(&mu_);
    return max_lag_[mirror];
  }
  uint64_t updates(uint32_t mirror) const {
    absl::MutexLock lock(&mu_);
    return updates_[mirror];
  }
  uint64_t bytes() const {
    absl::MutexLock lock(&mu_);
    return bytes_;
  }

 private:
  mutable absl::Mutex mu_;
  uint64_t published_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<uint64_t> max_lag_ ABSL_GUARDED_BY(mu_);
  std::vector<uint64_t> updates_ ABSL_GUARDED_BY(mu_);
  uint64_t bytes_ ABSL_GUARDED_BY(mu_) = 0;
};

// Whether every mirror holds what a full pull of every layer gives now.
absl::Status CheckMirrors(const client::ShardSet& set,
                          const std::vector<std::unique_ptr<client::ModelMirror>>& mirrors) {
  for (uint32_t l = 0; l < set.view().layouts.size(); ++l) {
    ASSIGN_OR_RETURN(const client::Layer full, set.Gather(l));
    for (uint32_t m = 0; m < mirrors.size(); ++m) {
      auto reading = mirrors[m]->Read();
      RETURN_IF_ERROR(reading.status());
      // Tensor by tensor: the padding between them is never sent.
      const client::Layer& held = reading.layer(l);
      for (size_t t = 0; t < held.num_tensors(); ++t) {
        const std::span<const uint8_t> mine = held.tensor(t).bytes;
        const std::span<const uint8_t> theirs = full.tensor(t).bytes;
        if (held.version() != full.version() || mine.size() != theirs.size() ||
            std::memcmp(mine.data(), theirs.data(), mine.size()) != 0) {
          return absl::DataLossError(absl::StrCat("mirror ", m, "'s ", held.tensor(t).name,
                                                  " differs from a full pull at version ",
                                                  full.version()));
        }
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status RunPublishDemo(const tools::CliFlags& flags) {
  ASSIGN_OR_RETURN(uint64_t num_shards, flags.GetUint("num-shards", 2));
  ASSIGN_OR_RETURN(uint64_t steps, flags.GetUint("steps", 10));
  ASSIGN_OR_RETURN(uint64_t num_mirrors, flags.GetUint("mirrors", 4));
  if (num_shards == 0 || num_shards > 64 || steps == 0 || steps > 10000 || num_mirrors == 0 ||
      num_mirrors > 64) {
    return absl::InvalidArgumentError(
        "--num-shards must be 1-64, --steps 1-10000 and --mirrors 1-64 for a local demo");
  }
  double lr = 1e-4;
  if (flags.Has("lr") &&
      (!absl::SimpleAtod(flags.Get("lr"), &lr) || !(lr > 0) || !std::isfinite(lr))) {
    return absl::InvalidArgumentError(
        absl::StrCat("--lr must be a positive number, not \"", flags.Get("lr"), "\""));
  }
  const std::string spec = flags.Get("synthetic", kDefaultPublishModel);
  std::error_code ignored;
  const std::filesystem::path dir = std::filesystem::temp_directory_path(ignored) /
                                    absl::StrCat("layercast-publish-demo-", ::getpid());
  std::filesystem::create_directories(dir, ignored);
  std::string token;
  ASSIGN_OR_RETURN(const std::string token_file, WriteDemoToken(dir, &token));

  tools::LocalShardSet::Options options;
  options.shard_binary = flags.Get("shard-binary", tools::DefaultShardBinary());
  options.num_shards = static_cast<uint32_t>(num_shards);
  options.extra_flags = {"--synthetic",        spec,
                         "--policy",           flags.Get("policy", "p=f32,c=bf16"),
                         "--admin-token-file", token_file};
  std::fprintf(stderr, "layercast demo --publish: starting %llu read-only shards on 127.0.0.1\n",
               static_cast<unsigned long long>(num_shards));
  ASSIGN_OR_RETURN(auto shards, tools::LocalShardSet::Start(options));
  client::ShardSetOptions connect;
  connect.connect_timeout = std::chrono::minutes(5);
  ASSIGN_OR_RETURN(auto set, client::ShardSet::Connect(shards->addresses(), connect));
  ASSIGN_OR_RETURN(tools::SyntheticTrainer trainer, tools::SyntheticTrainer::Create(spec));
  uint64_t full_bytes = 0;
  for (const AssembledLayout& layout : set->view().layouts) full_bytes += layout.total_bytes();

  // Each mirror on a connection of its own, as inference workers are: the
  // shards cast each delta chunk once for all of them.
  std::vector<std::unique_ptr<client::ShardSet>> connections;
  std::vector<std::unique_ptr<client::ModelMirror>> mirrors;
  for (uint64_t m = 0; m < num_mirrors; ++m) {
    ASSIGN_OR_RETURN(auto connection, client::ShardSet::Connect(shards->addresses(), connect));
    ASSIGN_OR_RETURN(auto mirror, client::ModelMirror::Create(*connection));
    connections.push_back(std::move(connection));
    mirrors.push_back(std::move(mirror));
  }
  std::printf(
      "layercast demo --publish: %s (%.1f M parameters, %s per full pull), %llu mirrors\n"
      "  a trainer steps AdamW at lr %g and publishes every step; each mirror follows by delta "
      "pulls\n",
      set->model().model_id.c_str(), static_cast<double>(trainer.elements()) / 1e6,
      FormatBytes(full_bytes).c_str(), static_cast<unsigned long long>(num_mirrors), lr);
  FleetReport report(static_cast<uint32_t>(num_mirrors));
  for (uint32_t m = 0; m < mirrors.size(); ++m) {
    mirrors[m]->Follow(
        [&report, m](const client::MirrorUpdate& update) { report.Updated(m, update); });
  }

  // Loopback: the demo's shards listen on 127.0.0.1 only.
  client::WeightPublisher publisher(*set, {.admin_token = token, .insecure = true});
  const auto start = std::chrono::steady_clock::now();
  uint64_t version = 0, changed = 0;
  for (uint64_t step = 0; step < steps; ++step) {
    RETURN_IF_ERROR(trainer.Step(lr));
    client::TensorValues values;
    for (const auto& [name, tensor] : trainer.values()) values.emplace(name, tensor);
    const auto publish_start = std::chrono::steady_clock::now();
    ASSIGN_OR_RETURN(const client::PublishResult published, publisher.Publish(values));
    version = published.version;
    changed += published.changed_elements;
    report.Published(version);
    std::printf(
        "  step %3llu  published version %llu in %6.1f ms: %5.2f%% of bf16 values changed\n",
        static_cast<unsigned long long>(step), static_cast<unsigned long long>(version),
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - publish_start)
            .count(),
        100.0 * static_cast<double>(published.changed_elements) /
            static_cast<double>(trainer.elements()));
    std::fflush(stdout);
  }
  for (const auto& mirror : mirrors) {
    if (!mirror->WaitForVersion(version, std::chrono::seconds(60))) {
      return absl::DeadlineExceededError(
          absl::StrCat("a mirror did not reach version ", version, " within 60 s"));
    }
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  for (const auto& mirror : mirrors) mirror->StopFollowing();
  const absl::Status matched = CheckMirrors(*set, mirrors);
  const absl::Status stopped = shards->Stop();
  std::filesystem::remove_all(dir, ignored);

  std::printf("layercast demo --publish summary\n");
  std::printf(
      "  published         %llu versions in %.2f s; %.2f%% of bf16 values changed per step\n",
      static_cast<unsigned long long>(version), seconds,
      100.0 * static_cast<double>(changed) /
          static_cast<double>(trainer.elements() * std::max<uint64_t>(version, 1)));
  for (uint32_t m = 0; m < mirrors.size(); ++m) {
    std::printf("  mirror %u          %llu updates, at most %llu versions behind\n", m,
                static_cast<unsigned long long>(report.updates(m)),
                static_cast<unsigned long long>(report.max_lag(m)));
  }
  std::printf("  received          %s by the mirrors, against %s for full pulls of each version\n",
              FormatBytes(report.bytes()).c_str(),
              FormatBytes(full_bytes * num_mirrors * version).c_str());
  std::printf("  mirrors           %s\n", matched.ok()
                                              ? "bit-identical to a full pull of every layer"
                                              : std::string(matched.message()).c_str());
  std::printf("  shards stopped    %s\n",
              stopped.ok() ? "cleanly (exit 0)" : std::string(stopped.message()).c_str());
  RETURN_IF_ERROR(matched);
  return stopped;
}

}  // namespace layercast::cli
