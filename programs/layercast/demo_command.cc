#include <cstdio>
#include <cstring>
#include <memory>

#include "absl/strings/str_cat.h"
#include "core/cast.h"
#include "core/safetensors_source.h"
#include "core/synthetic_model.h"
#include "platform/byte_size.h"
#include "platform/status_macros.h"
#include "programs/layercast/commands.h"
#include "programs/layercast/connect.h"
#include "programs/layercast/layer_walk.h"
#include "tools/local_shard_set.h"

namespace layercast::cli {
namespace {

// About 1.6 GiB of fp32: big enough to show the memory story, small enough to
// walk in seconds on two cores.
constexpr char kDefaultModel[] = "llama:layers=6,hidden=2048,ffn=5632,vocab=32000,seed=1";
constexpr char kDefaultPolicy[] = "params=float32,compute=bfloat16,output=float32;*norm*=float32";
constexpr uint64_t kSamplesPerTensor = 16;

// Checks sampled elements of every tensor of `layer` against the worker's own
// reading of the model, cast by the core kernels: the demo proves exactness
// as it goes instead of trusting it.
absl::Status VerifySamples(const ParameterSource& source, const Policy& policy,
                           const client::Layer& layer, uint64_t* verified) {
  for (uint32_t t = 0; t < layer.num_tensors(); ++t) {
    const client::Layer::TensorView view = layer.tensor(t);
    const size_t size = DTypeSize(view.dtype);
    for (uint64_t s = 0; s < kSamplesPerTensor && s < view.num_elements; ++s) {
      const uint64_t i = s * (view.num_elements / kSamplesPerTensor);
      float master = 0;
      RETURN_IF_ERROR(source.Read(layer.index(), t, ElementRange{i, i + 1}, {&master, 1}));
      uint8_t expected[4];
      RETURN_IF_ERROR(CastFromF32(&master, expected, 1, view.dtype, policy.overflow()));
      if (std::memcmp(expected, view.bytes.data() + i * size, size) != 0) {
        return absl::DataLossError(absl::StrCat("tensor ", view.name, " element ", i,
                                                " differs from the cast of its fp32 master"));
      }
      ++*verified;
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status RunDemo(const std::vector<std::string>& args) {
  ASSIGN_OR_RETURN(
      tools::CliFlags flags,
      tools::CliFlags::Parse(args,
                             {"num-shards", "synthetic", "model", "policy", "steps", "shard-binary",
                              "budget-layers", "optimizer", "mirrors", "lr"},
                             {"train", "publish"}));
  if (flags.Has("train") && flags.Has("publish")) {
    return absl::InvalidArgumentError("give --train or --publish, not both");
  }
  if (flags.Has("train")) return RunTrainDemo(flags);
  if (flags.Has("publish")) return RunPublishDemo(flags);
  if (flags.Has("mirrors") || flags.Has("lr")) {
    return absl::InvalidArgumentError("--mirrors and --lr need --publish");
  }
  if (flags.Has("optimizer")) return absl::InvalidArgumentError("--optimizer needs --train");
  ASSIGN_OR_RETURN(uint64_t num_shards, flags.GetUint("num-shards", 2));
  ASSIGN_OR_RETURN(uint64_t steps, flags.GetUint("steps", 1));
  if (num_shards == 0 || num_shards > 64) {
    return absl::InvalidArgumentError("--num-shards must be 1-64 for a local demo");
  }
  if (flags.Has("model") && flags.Has("synthetic")) {
    return absl::InvalidArgumentError("give --model or --synthetic, not both");
  }
  const std::string policy_text = flags.Get("policy", kDefaultPolicy);
  ASSIGN_OR_RETURN(Policy policy, Policy::Parse(policy_text));

  std::unique_ptr<ParameterSource> source;
  std::vector<std::string> model_flags;
  if (flags.Has("model")) {
    ASSIGN_OR_RETURN(source, SafetensorsSource::Open(flags.Get("model"), ""));
    model_flags = {"--model", flags.Get("model")};
  } else {
    ASSIGN_OR_RETURN(source, SyntheticModel::Create(flags.Get("synthetic", kDefaultModel)));
    model_flags = {"--synthetic", flags.Get("synthetic", kDefaultModel)};
  }

  tools::LocalShardSet::Options options;
  options.shard_binary = flags.Get("shard-binary", tools::DefaultShardBinary());
  options.num_shards = static_cast<uint32_t>(num_shards);
  options.extra_flags = model_flags;
  options.extra_flags.insert(options.extra_flags.end(), {"--policy", policy_text});
  std::fprintf(stderr, "layercast demo: starting %llu shard servers on 127.0.0.1 (%s)\n",
               static_cast<unsigned long long>(num_shards), options.shard_binary.c_str());
  ASSIGN_OR_RETURN(auto shards, tools::LocalShardSet::Start(options));
  std::string shard_list;
  for (const std::string& address : shards->addresses()) {
    absl::StrAppend(&shard_list, shard_list.empty() ? "" : ",", address);
  }
  client::ShardSetOptions connect;
  connect.connect_timeout = std::chrono::minutes(5);
  ASSIGN_OR_RETURN(auto set, client::ShardSet::Connect(shards->addresses(), connect));
  const uint32_t num_layers = static_cast<uint32_t>(set->model().layers.size());
  std::fprintf(stderr, "layercast demo: shards %s ready: %s, %u layers, policy %s\n",
               shard_list.c_str(), set->model().model_id.c_str(), num_layers,
               set->view().policy.ToString().c_str());

  std::vector<uint32_t> order;
  for (uint64_t s = 0; s < steps; ++s) {
    const std::vector<uint32_t> step = client::ForwardBackwardOrder(num_layers);
    order.insert(order.end(), step.begin(), step.end());
  }
  ASSIGN_OR_RETURN(uint64_t budget_layers, flags.GetUint("budget-layers", 3));
  const uint64_t budget = LayersBudget(*set, budget_layers);
  uint64_t verified = 0, largest_layer = 0;
  ASSIGN_OR_RETURN(WalkStats stats,
                   WalkLayers(
                       *set, order, budget,
                       [&](size_t step) {
                         return step % (2 * num_layers) < num_layers ? "forward" : "backward";
                       },
                       [&](const client::Layer& layer) {
                         largest_layer = std::max<uint64_t>(largest_layer, layer.bytes().size());
                         return VerifySamples(*source, policy, layer, &verified);
                       }));

  std::vector<uint64_t> shard_peaks;
  for (uint32_t i = 0; i < num_shards; ++i) shard_peaks.push_back(shards->PeakRssBytes(i));
  const absl::Status stopped = shards->Stop();

  std::printf("layercast demo summary\n");
  std::printf("  model             %s (%s of fp32 master)\n", set->model().model_id.c_str(),
              FormatBytes(TotalElements(set->model()) * 4).c_str());
  std::printf("  shards            %llu on 127.0.0.1, policy %s\n",
              static_cast<unsigned long long>(num_shards), set->view().policy.ToString().c_str());
  std::printf("  layers walked     %u (%llu step(s) forward then backward)\n", stats.layers,
              static_cast<unsigned long long>(steps));
  std::printf("  bytes on the wire %s in compute dtypes\n", FormatBytes(stats.wire_bytes).c_str());
  std::printf("  an fp32 gather    %s (%.2fx the bytes)\n", FormatBytes(stats.fp32_bytes).c_str(),
              static_cast<double>(stats.fp32_bytes) / stats.wire_bytes);
  std::printf("  time              %.2f s, %.2f GB/s\n", stats.seconds,
              stats.wire_bytes / stats.seconds / 1e9);
  std::printf(
      "  prefetch          budget %s (%llu largest layers), peak held %s, %llu/%llu "
      "layers ready when asked, %.2f s waited\n",
      FormatBytes(budget).c_str(), static_cast<unsigned long long>(budget_layers),
      FormatBytes(stats.stream.peak_bytes).c_str(),
      static_cast<unsigned long long>(stats.stream.hits),
      static_cast<unsigned long long>(stats.stream.layers), stats.stream.wait_seconds);
  std::printf("  verified          %llu sampled values bit-exact against the core cast\n",
              static_cast<unsigned long long>(verified));
  for (uint32_t i = 0; i < num_shards; ++i) {
    const uint64_t master = [&] {
      uint64_t elements = 0;
      for (const LayerSpec& layer : set->model().layers) {
        for (const TensorSpec& tensor : layer.tensors) {
          elements +=
              ShardElementRange(tensor.num_elements, i, static_cast<uint32_t>(num_shards)).size();
        }
      }
      return elements * 4;
    }();
    std::printf("  shard %u peak RSS  %s (its fp32 slice: %s)\n", i,
                FormatBytes(shard_peaks[i]).c_str(), FormatBytes(master).c_str());
  }
  std::printf("  worker peak RSS   %s (largest assembled layer: %s)\n",
              FormatBytes(tools::PeakRssBytes()).c_str(), FormatBytes(largest_layer).c_str());
  std::printf("  shards stopped    %s\n",
              stopped.ok() ? "cleanly (exit 0)" : std::string(stopped.message()).c_str());
  return stopped;
}

}  // namespace layercast::cli
