// A simulated training step over real shard servers on 127.0.0.1: the worker
// "computes" for a fixed time per layer, forward then backward. Measured in
// one run, against baselines from the same run:
//   - time the caller waited for layers, prefetching vs fetching on demand;
//   - the worker's peak memory against its budget and against gathering the
//     whole model first (the naive way);
//   - each server's peak RSS against its fp32 shard size.
//
// Usage: layer_stream_bench [--num-shards N] [--synthetic SPEC]
//                           [--compute-ms MS] [--budget-layers K]

#include <fstream>
#include <thread>

#include "absl/strings/str_cat.h"
#include "client/layer_stream.h"
#include "client/shard_set.h"
#include "platform/byte_size.h"
#include "platform/status_macros.h"
#include "tools/cli_flags.h"
#include "tools/local_shard_set.h"

namespace layercast {
namespace {

struct Args {
  uint32_t num_shards = 2;
  std::string synthetic = "llama:layers=8,hidden=1024,ffn=2816,vocab=32000,seed=2";
  int compute_ms = 30;
  uint64_t budget_layers = 3;
};

absl::StatusOr<Args> ParseArgs(int argc, char** argv) {
  ASSIGN_OR_RETURN(
      tools::CliFlags flags,
      tools::CliFlags::Parse(std::vector<std::string>(argv + 1, argv + argc),
                             {"num-shards", "synthetic", "compute-ms", "budget-layers"}));
  Args args;
  ASSIGN_OR_RETURN(uint64_t num_shards, flags.GetUint("num-shards", args.num_shards));
  ASSIGN_OR_RETURN(uint64_t compute_ms, flags.GetUint("compute-ms", args.compute_ms));
  ASSIGN_OR_RETURN(args.budget_layers, flags.GetUint("budget-layers", args.budget_layers));
  if (num_shards == 0 || num_shards > 1024 || compute_ms > 60000 || args.budget_layers == 0) {
    return absl::InvalidArgumentError(
        "--num-shards must be in 1..1024, --compute-ms at most 60000, --budget-layers at least 1");
  }
  args.num_shards = static_cast<uint32_t>(num_shards);
  args.compute_ms = static_cast<int>(compute_ms);
  args.synthetic = flags.Get("synthetic", args.synthetic);
  return args;
}

// Linux resets VmHWM to the current RSS on "5" in clear_refs, so each phase's
// peak is its own.
void ResetPeakRss() { std::ofstream("/proc/self/clear_refs") << "5"; }

struct Walk {
  double seconds = 0;
  double waited = 0;
  uint64_t hits = 0, misses = 0;
  uint64_t peak_tracked = 0;
  uint64_t peak_rss = 0;
};

absl::StatusOr<Walk> StreamWalk(const client::ShardSet& set, uint64_t budget, uint32_t lookahead,
                                int compute_ms) {
  ResetPeakRss();
  client::LayerStreamOptions options;
  options.order = client::ForwardBackwardOrder(static_cast<uint32_t>(set.model().layers.size()));
  options.budget_bytes = budget;
  options.max_lookahead = lookahead;
  auto stream = client::LayerStream::Create(set, options);
  if (!stream.ok()) return stream.status();
  const auto start = std::chrono::steady_clock::now();
  for (size_t i = 0; i < options.order.size(); ++i) {
    absl::StatusOr<client::Layer> layer = (*stream)->Next();
    if (!layer.ok()) return layer.status();
    std::this_thread::sleep_for(std::chrono::milliseconds(compute_ms));
  }
  Walk walk;
  walk.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const client::LayerStreamStats stats = (*stream)->stats();
  walk.waited = stats.wait_seconds;
  walk.hits = stats.hits;
  walk.misses = stats.misses;
  walk.peak_tracked = stats.peak_bytes;
  walk.peak_rss = tools::PeakRssBytes();
  return walk;
}

// The naive way: gather every layer first, keep them all for the step.
absl::StatusOr<Walk> NaiveWalk(const client::ShardSet& set, int compute_ms) {
  ResetPeakRss();
  const auto start = std::chrono::steady_clock::now();
  std::vector<client::Layer> all;
  Walk walk;
  for (uint32_t l = 0; l < set.model().layers.size(); ++l) {
    absl::StatusOr<client::Layer> layer = set.Gather(l);
    if (!layer.ok()) return layer.status();
    walk.peak_tracked += layer->bytes().size();
    all.push_back(*std::move(layer));
  }
  walk.waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::this_thread::sleep_for(std::chrono::milliseconds(compute_ms) * 2 * all.size());
  walk.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  walk.peak_rss = tools::PeakRssBytes();
  return walk;
}

int Run(const Args& args) {
  tools::LocalShardSet::Options options;
  options.shard_binary = LAYERCAST_SHARD_BINARY;
  options.num_shards = args.num_shards;
  options.extra_flags = {"--synthetic", args.synthetic};
  options.log_dir = "/tmp";
  auto shards = tools::LocalShardSet::Start(options);
  if (!shards.ok()) {
    std::fprintf(stderr, "%s\n", std::string(shards.status().message()).c_str());
    return 1;
  }
  client::ShardSetOptions connect;
  connect.connect_timeout = std::chrono::minutes(2);
  auto set = client::ShardSet::Connect((*shards)->addresses(), connect);
  if (!set.ok()) {
    std::fprintf(stderr, "%s\n", std::string(set.status().message()).c_str());
    return 1;
  }
  uint64_t largest = 0, total = 0;
  for (const auto& layout : (*set)->view().layouts) {
    largest = std::max(largest, layout.total_bytes());
    total += layout.total_bytes();
  }
  const uint64_t budget = args.budget_layers * largest;
  std::printf(
      "model %s, %u shards, %zu layers (largest %s, all %s assembled), compute %d ms/layer\n",
      (*set)->model().model_id.c_str(), args.num_shards, (*set)->model().layers.size(),
      FormatBytes(largest).c_str(), FormatBytes(total).c_str(), args.compute_ms);

  absl::StatusOr<Walk> on_demand = StreamWalk(**set, budget, 0, args.compute_ms);
  absl::StatusOr<Walk> prefetch = StreamWalk(**set, budget, UINT32_MAX, args.compute_ms);
  absl::StatusOr<Walk> naive = NaiveWalk(**set, args.compute_ms);
  if (!on_demand.ok() || !prefetch.ok() || !naive.ok()) {
    std::fprintf(stderr, "walk failed\n");
    return 1;
  }
  std::printf("\n%-22s %10s %10s %8s %14s %14s\n", "mode", "step s", "waited s", "hits",
              "peak tracked", "peak RSS");
  const auto row = [](const char* name, const Walk& w) {
    std::printf("%-22s %10.3f %10.3f %4llu/%-3llu %14s %14s\n", name, w.seconds, w.waited,
                static_cast<unsigned long long>(w.hits),
                static_cast<unsigned long long>(w.hits + w.misses),
                FormatBytes(w.peak_tracked).c_str(), FormatBytes(w.peak_rss).c_str());
  };
  row("on demand", *on_demand);
  row("prefetch (budget)", *prefetch);
  row("naive (whole model)", *naive);
  std::printf("\nwait with prefetch / on demand:        %.3f\n",
              prefetch->waited / std::max(1e-9, on_demand->waited));
  std::printf("worker peak tracked / budget (%s):   %.3f\n", FormatBytes(budget).c_str(),
              static_cast<double>(prefetch->peak_tracked) / budget);
  std::printf("worker peak tracked / naive:           %.3f\n",
              static_cast<double>(prefetch->peak_tracked) / naive->peak_tracked);
  std::printf("worker peak RSS / naive peak RSS:      %.3f\n",
              static_cast<double>(prefetch->peak_rss) / naive->peak_rss);
  for (uint32_t i = 0; i < args.num_shards; ++i) {
    uint64_t slice = 0;
    for (const LayerSpec& layer : (*set)->model().layers) {
      for (const TensorSpec& tensor : layer.tensors) {
        slice += ShardElementRange(tensor.num_elements, i, args.num_shards).size() * 4;
      }
    }
    const uint64_t peak = (*shards)->PeakRssBytes(i);
    std::printf("server %u peak RSS / fp32 shard:        %.3f (%s / %s)\n", i,
                static_cast<double>(peak) / slice, FormatBytes(peak).c_str(),
                FormatBytes(slice).c_str());
  }
  return (*shards)->Stop().ok() ? 0 : 1;
}

}  // namespace
}  // namespace layercast

int main(int argc, char** argv) {
  const absl::StatusOr<layercast::Args> args = layercast::ParseArgs(argc, argv);
  if (!args.ok()) {
    std::fprintf(stderr, "layer_stream_bench: %s\n", std::string(args.status().message()).c_str());
    return 2;
  }
  return layercast::Run(*args);
}
