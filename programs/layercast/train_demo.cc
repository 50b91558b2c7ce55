#include <algorithm>
#include <chrono>
#include <cstdio>
#include <future>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "client/gradient_sink.h"
#include "core/cast.h"
#include "core/dtype.h"
#include "core/layout.h"
#include "platform/byte_size.h"
#include "platform/status_macros.h"
#include "programs/layercast/commands.h"
#include "tools/local_shard_set.h"
#include "tools/synthetic_gradient.h"

namespace layercast::cli {
namespace {

// Small enough to step in a second or two on two cores.
constexpr char kDefaultTrainModel[] = "llama:layers=4,hidden=1024,ffn=2816,vocab=8000,seed=1";
constexpr char kDefaultOptimizer[] =
    "adamw:lr=1e-4,beta1=0.9,beta2=0.95,eps=1e-8,weight_decay=0.1,warmup_steps=2,clip=1.0;"
    "*norm*:weight_decay=0";

// The demo's loss: 0.5 * sum(w^2) over every weight, the pull weight decay
// alone would give, whose gradient is w itself. Fills `gradient` (the
// layer's gradient layout) from the gathered layer and returns the layer's
// loss; nullopt for a layer with 8-bit floats (no plain values to square),
// whose gradient is the synthetic one.
absl::StatusOr<std::optional<double>> QuadraticLoss(const client::Layer& layer,
                                                    const AssembledLayout& gradient_layout,
                                                    uint64_t step, std::span<uint8_t> gradient) {
  for (size_t t = 0; t < layer.num_tensors(); ++t) {
    if (IsFloat8(layer.tensor(t).dtype)) {
      RETURN_IF_ERROR(
          tools::FillSyntheticGradient(gradient_layout, 0, step, layer.index(), gradient));
      return std::nullopt;
    }
  }
  std::fill(gradient.begin(), gradient.end(), 0);
  double loss = 0;
  std::vector<float> values;
  for (size_t t = 0; t < layer.num_tensors(); ++t) {
    const client::Layer::TensorView tensor = layer.tensor(t);
    values.resize(tensor.num_elements);
    CastToF32(tensor.bytes.data(), tensor.dtype, values.data(), values.size());
    for (const float w : values) loss += 0.5 * static_cast<double>(w) * w;
    const AssembledTensor& placed = gradient_layout.tensors()[t];
    RETURN_IF_ERROR(CastFromF32(values.data(), gradient.data() + placed.byte_offset, values.size(),
                                placed.compute_dtype, Fp16Overflow::kInfinity));
  }
  return loss;
}

}  // namespace

absl::Status RunTrainDemo(const tools::CliFlags& flags) {
  ASSIGN_OR_RETURN(uint64_t num_shards, flags.GetUint("num-shards", 2));
  ASSIGN_OR_RETURN(uint64_t steps, flags.GetUint("steps", 5));
  if (num_shards == 0 || num_shards > 64) {
    return absl::InvalidArgumentError("--num-shards must be 1-64 for a local demo");
  }
  if (steps == 0 || steps > 10000) {
    return absl::InvalidArgumentError("--steps must be 1-10000 for a local demo");
  }
  const std::string optimizer = flags.Get("optimizer", kDefaultOptimizer);
  tools::LocalShardSet::Options options;
  options.shard_binary = flags.Get("shard-binary", tools::DefaultShardBinary());
  options.num_shards = static_cast<uint32_t>(num_shards);
  options.extra_flags = {"--optimizer", optimizer, "--data-parallel-workers", "1"};
  if (flags.Has("model")) {
    options.extra_flags.insert(options.extra_flags.end(), {"--model", flags.Get("model")});
  } else {
    options.extra_flags.insert(options.extra_flags.end(),
                               {"--synthetic", flags.Get("synthetic", kDefaultTrainModel)});
  }
  if (flags.Has("policy")) {
    options.extra_flags.insert(options.extra_flags.end(), {"--policy", flags.Get("policy")});
  }
  std::fprintf(stderr, "layercast demo --train: starting %llu training shards on 127.0.0.1\n",
               static_cast<unsigned long long>(num_shards));
  ASSIGN_OR_RETURN(auto shards, tools::LocalShardSet::Start(options));
  client::ShardSetOptions connect;
  connect.connect_timeout = std::chrono::minutes(5);
  ASSIGN_OR_RETURN(auto set, client::ShardSet::Connect(shards->addresses(), connect));
  ASSIGN_OR_RETURN(auto sink, client::GradientSink::Create(*set, {}));
  const auto num_layers = static_cast<uint32_t>(set->model().layers.size());
  std::fprintf(stderr, "layercast demo --train: %s, %u layers, policy %s, optimizer %s\n",
               set->model().model_id.c_str(), num_layers, set->view().policy.ToString().c_str(),
               optimizer.c_str());

  uint64_t total_in = 0, total_out = 0;
  const auto start = std::chrono::steady_clock::now();
  for (uint64_t step = 0; step < steps; ++step) {
    const auto step_start = std::chrono::steady_clock::now();
    client::GatherOptions gather;
    gather.min_version = step;
    uint64_t gathered = 0;
    for (uint32_t l = 0; l < num_layers; ++l) {  // forward
      ASSIGN_OR_RETURN(client::Layer layer, set->Gather(l, gather));
      gathered += layer.bytes().size();
    }
    const uint64_t pushed_before = sink->bytes_pushed();
    double loss = 0;
    std::vector<std::shared_future<absl::StatusOr<client::PushResult>>> pushes;
    for (uint32_t l = num_layers; l-- > 0;) {  // backward: gather, compute, push
      ASSIGN_OR_RETURN(client::Layer layer, set->Gather(l, gather));
      gathered += layer.bytes().size();
      const AssembledLayout& gradient_layout = set->view().gradient_layouts[l];
      ASSIGN_OR_RETURN(client::LayerBuffer gradient,
                       client::LayerBuffer::Allocate(gradient_layout.total_bytes()));
      ASSIGN_OR_RETURN(const std::optional<double> layer_loss,
                       QuadraticLoss(layer, gradient_layout, step,
                                     std::span<uint8_t>(gradient.data(), gradient.size())));
      if (layer_loss) loss += *layer_loss;
      ASSIGN_OR_RETURN(auto pushed, sink->Push(l, step, std::move(gradient)));
      pushes.push_back(std::move(pushed));
    }
    // The only worker is worker 0: with clip= it completes the step.
    ASSIGN_OR_RETURN(const client::GradientSink::StepEnd end, sink->FinishStep(step));
    uint64_t version = UINT64_MAX;
    for (auto& pushed : pushes) version = std::min(version, pushed.get()->layer_version);
    if (end.clipped) version = step + 1;
    const uint64_t pushed = sink->bytes_pushed() - pushed_before;
    total_in += gathered;
    total_out += pushed;
    const std::string clip = end.clipped ? absl::StrFormat("  grad norm %.3g, clip scale %.3g",
                                                           end.total_norm, end.scale)
                                         : "";
    std::printf(
        "  step %3llu  %6.2f s  loss %.6g  gathered %10s  pushed %10s  version %llu -> %llu%s\n",
        static_cast<unsigned long long>(step),
        std::chrono::duration<double>(std::chrono::steady_clock::now() - step_start).count(), loss,
        FormatBytes(gathered).c_str(), FormatBytes(pushed).c_str(),
        static_cast<unsigned long long>(step), static_cast<unsigned long long>(version),
        clip.c_str());
    std::fflush(stdout);
    if (version != step + 1) {
      return absl::InternalError(absl::StrCat("after step ", step, " the model is at version ",
                                              version, ", not ", step + 1));
    }
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  // The worker's side is closed while the shards still answer.
  sink.reset();
  set.reset();
  const absl::Status stopped = shards->Stop();
  std::printf("layercast demo --train summary\n");
  std::printf("  steps             %llu of forward gather, backward gather and gradient push\n",
              static_cast<unsigned long long>(steps));
  std::printf("  gathered          %s (%.2f GB/s)\n", FormatBytes(total_in).c_str(),
              total_in / seconds / 1e9);
  std::printf("  pushed            %s of gradients (%.2f GB/s)\n", FormatBytes(total_out).c_str(),
              total_out / seconds / 1e9);
  std::printf("  time              %.2f s, %.2f s per step\n", seconds, seconds / steps);
  std::printf("  shards stopped    %s\n",
              stopped.ok() ? "cleanly (exit 0)" : std::string(stopped.message()).c_str());
  return stopped;
}

}  // namespace layercast::cli
